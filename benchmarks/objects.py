"""Object collectives: ddpgraph against torch.distributed in the same processes.

For each world size, object kind and size, times in the same processes, taking turns call by call
(in rotating order, a barrier before each call, not timed):

* ``ddpgraph``: ``ddpgraph.all_gather_object(obj)``, the same call repeated, as in a loop (with
  its own size history of the group: after two calls the slot fits the object and each call is
  one collective; the warm-up calls are not timed);
* ``ddpgraph_cold``: the same call with a fresh size history each time, so an object over 16 KiB
  takes two collectives (a call whose size the group has not seen before);
* ``torch``: ``torch.distributed.all_gather_object(out, obj)`` (pickle; always two collectives);
* ``raw``: one all-gather of a tensor of the (largest rank's) encoded size, already in place on the device: the
  floor for moving the bytes (no encoding, no host copies);
* ``raw_host`` (NCCL only): the same bytes from a host buffer to the device, all-gathered, and
  back to the host: the floor for any object collective whose objects live in host memory.

With ``--ops all_gather,gather,broadcast`` it also times ``gather_object`` / ``broadcast_object``
against torch's ``gather_object`` / ``broadcast_object_list`` (root 0).

Kinds (every rank's object has the rank in it and about SIZE bytes of): ``bytes`` (one bytes
value), ``floats`` (a dict of str -> float), ``ints`` (a list of ints), ``tensor`` (a float32 CPU
tensor) and ``numpy`` (a float32 array). Sizes 100B, 10KB, 100KB, 1MB, 10MB and 100MB, except
where memory and time on a 2-core machine forbid (``LIMITS``, also in the JSON): 100MB only at
world size 2 for bytes/tensor/numpy; 10MB at 4 ranks only for those, and not at 8 ranks. Each
case runs ``--runs`` times (3) in the same processes; every run reports each rank's median, the
slowest rank's median counts, and the JSON keeps the median of the runs and their spread.
Iterations shrink with size (``ITERATIONS``). The whole gloo sweep takes about 15 minutes on 2
cores (2 ranks ~5, 4 ranks ~4, 8 ranks ~5); ``--world-sizes``, ``--kinds`` and ``--sizes`` pick
a part of it.

    python benchmarks/objects.py                           # gloo, 2, 4 and 8 local ranks
    python benchmarks/objects.py --world-sizes 2 --quick   # a smoke run
    python benchmarks/objects.py --backend nccl --world-sizes 1,2   # GPUs, one rank per GPU
    torchrun --nproc-per-node=8 benchmarks/objects.py --backend nccl   # one world size

Writes JSON (torch version, git commit, per case medians, ratios, spread) to
``benchmarks/results/objects-<cpu|cuda>-<backend>.json``; ``benchmarks/render.py --objects``
draws the docs' chart and table from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ddpgraph as dg
from ddpgraph.bench import git_commit
from ddpgraph.distributed import _object_exchange as exchange
from ddpgraph.distributed import objects
from ddpgraph.distributed.codec import encode_parts

ROOT = Path(__file__).resolve().parent.parent
KINDS = ["bytes", "floats", "ints", "tensor", "numpy"]
# the evaluation sweep (--sweep eval): what an evaluation gathers, sized in items (samples)
EVAL_KINDS = ["labels", "scores", "records", "scores_tensor"]
SIZES = {
    "100B": 100,
    "10KB": 10_000,
    "100KB": 100_000,
    "1MB": 1_000_000,
    "10MB": 10_000_000,
    "100MB": 100_000_000,
}
ITEMS = {"1e3": 10**3, "1e4": 10**4, "1e5": 10**5, "1e6": 10**6}
# timed calls per method and run, by size, after WARMUP untimed ones (each run warms up again;
# two calls are enough for the learned slot, three steady the small sizes' caches)
ITERATIONS = {"100B": 15, "10KB": 15, "100KB": 11, "1MB": 7, "10MB": 3, "100MB": 1}
ITERATIONS |= {"1e3": 11, "1e4": 9, "1e5": 5, "1e6": 3}
WARMUP = {"100B": 3, "10KB": 3, "100KB": 3, "1MB": 3, "10MB": 2, "100MB": 2}
WARMUP |= {"1e3": 3, "1e4": 3, "1e5": 3, "1e6": 2}
LIMITS = (
    "100MB only at world size 2 and only for bytes, tensor and numpy, without ddpgraph_cold (over "
    "the 64 MiB learned-slot cap every call is cold); 10MB at world size 4 only for bytes, tensor "
    "and numpy (floats and ints: a rank decodes world_size x 10 MB of Python objects per call) and "
    "not at 8 ranks (2.5 s a call on 2 cores: the sweep would take half an hour)"
)
# torch 2.13 renamed all_gather_into_tensor (the old name warns)
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


EVAL_LIMITS = (
    "1e6 items of labels and scores only up to 4 ranks, records from 1e5 items only up to 4 ranks "
    "and at 1e6 only at 2 (each rank decodes world_size x the items as Python objects a call for "
    "each of torch and ddpgraph: ranks were killed for memory at 4 ranks x 1e6 records and at 8 "
    "ranks after 1e5 records, on a 23 GB machine shared with other work)"
)


def runs_case(kind: str, size: str, world: int) -> bool:
    """Whether a case is in the sweep (see ``LIMITS`` and ``EVAL_LIMITS``)."""
    if size in ITEMS:
        if kind == "records" and size == "1e5":
            return world <= 4
        if size != "1e6" or kind == "scores_tensor":
            return True
        return world <= (2 if kind == "records" else 4)
    if size == "100MB":
        return world <= 2 and kind in ("bytes", "tensor", "numpy")
    if size == "10MB":
        return world <= 2 or (world <= 4 and kind in ("bytes", "tensor", "numpy"))
    return True


def make_object(kind: str, nbytes: int, rank: int) -> Any:
    """About ``nbytes`` of ``kind`` (encoded), different on every rank; for the evaluation
    kinds, ``nbytes`` items (samples): one per sample."""
    rnd = random.Random(rank)
    if kind == "labels":  # predicted classes of 1000
        return [rnd.randrange(1000) for _ in range(nbytes)]
    if kind == "scores":
        return [rnd.random() for _ in range(nbytes)]
    if kind == "records":
        first = rank * nbytes
        return [
            {"id": first + i, "pred": rnd.randrange(10), "score": rnd.random()}
            for i in range(nbytes)
        ]
    if kind == "scores_tensor":
        return torch.rand(nbytes, generator=torch.Generator().manual_seed(rank))
    if kind == "bytes":
        return {"rank": rank, "blob": bytes([rank % 256]) * nbytes}
    if kind == "floats":  # ~9 bytes a value + ~7 a key
        return {"rank": rank, "values": {f"k{i}": rank + i / 7 for i in range(nbytes // 16 + 1)}}
    if kind == "ints":  # ints of 3-5 bytes encoded, as sample ids are
        return {"rank": rank, "ids": list(range(rank * 10**6, rank * 10**6 + nbytes // 5 + 1))}
    numel = max(nbytes // 4, 1)
    if kind == "tensor":
        return {"rank": rank, "t": torch.full((numel,), float(rank))}
    if kind == "numpy":
        return {"rank": rank, "a": np.full(numel, rank, dtype=np.float32)}
    raise ValueError(f"unknown kind {kind!r}")


def _own_history(fn: Callable[[], Any], *, keep: bool = True) -> Callable[[], Any]:
    """``fn`` run with its own size history of the group (``keep=False``: a fresh one each call).

    The methods take turns, so with one shared history each would predict the next method's
    size; in a real loop the same call repeats. Every rank swaps at the same point in the same
    order, so the guesses stay equal on every rank (as they must).
    """
    saved: list[Any] = []
    if not hasattr(objects, "_SlotPredictor"):  # a ddpgraph from before the learned slot
        return fn

    def run() -> Any:
        group = dist.group.WORLD
        assert group is not None
        state = exchange._group_state(group)
        mine = saved.pop() if saved and keep else exchange._SlotPredictor()
        shared, state.predictor = state.predictor, mine
        try:
            return fn()
        finally:
            if keep:
                saved.append(state.predictor)
            state.predictor = shared

    return run


def methods_for(
    obj: Any, nbytes: int, ops: list[str], device: torch.device, on_gpu: bool
) -> dict[str, Callable[[], Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    raw_in = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    raw_out = torch.empty(world * nbytes, dtype=torch.uint8, device=device)
    out: list[Any] = [None] * world
    methods: dict[str, Callable[[], Any]] = {}
    if "all_gather" in ops:
        methods |= {
            "torch": lambda: dist.all_gather_object(out, obj),
            "ddpgraph": _own_history(lambda: dg.all_gather_object(obj)),
            "ddpgraph_cold": _own_history(lambda: dg.all_gather_object(obj), keep=False),
            "raw": lambda: _ALL_GATHER(raw_out, raw_in),
        }
        if on_gpu:
            host_in = torch.zeros(nbytes, dtype=torch.uint8)

            def raw_host() -> torch.Tensor:
                gathered = torch.empty(world * nbytes, dtype=torch.uint8, device=device)
                _ALL_GATHER(gathered, host_in.to(device))
                return gathered.cpu()

            methods["raw_host"] = raw_host
    if "gather" in ops:
        methods |= {
            "torch_gather": lambda: dist.gather_object(obj, out if rank == 0 else None, dst=0),
            "ddpgraph_gather": _own_history(lambda: dg.gather_object(obj, dst=0)),
        }
    if "broadcast" in ops:
        methods |= {
            # a fresh list each call: torch overwrites it in place on the receivers
            "torch_broadcast": lambda: dist.broadcast_object_list([obj], src=0),
            "ddpgraph_broadcast": _own_history(lambda: dg.broadcast_object(obj, src=0)),
        }
    return methods


def _timed(
    methods: dict[str, Callable[[], Any]], warmup: int, iters: int, sync: Callable[[], None]
) -> dict[str, dict[str, float]]:
    """Median seconds per call of each method on this rank, interleaved call by call in rotating
    order, so that load from elsewhere on the machine falls on all methods alike: ``wall`` (what
    the job waits) and ``cpu`` (this process's CPU time: the work done, which a loaded machine
    delays but does not inflate as much)."""
    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for i in range(warmup + iters):
        # rotate the order too: the call that follows another method's pays for its leftovers
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fn = methods[name]
            dist.barrier()
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            if i >= warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    return {
        "wall": {name: statistics.median(values) for name, values in wall.items()},
        "cpu": {name: statistics.median(values) for name, values in cpu.items()},
    }


def _ratios(median: dict[str, float]) -> dict[str, float]:
    pairs = {
        "ddpgraph_vs_torch": ("ddpgraph", "torch"),
        "cold_vs_torch": ("ddpgraph_cold", "torch"),
        "ddpgraph_vs_raw": ("ddpgraph", "raw"),
        "ddpgraph_vs_raw_host": ("ddpgraph", "raw_host"),
        "gather_vs_torch": ("ddpgraph_gather", "torch_gather"),
        "broadcast_vs_torch": ("ddpgraph_broadcast", "torch_broadcast"),
    }
    return {k: median[a] / median[b] for k, (a, b) in pairs.items() if a in median and b in median}


def measure(
    backend: str, kinds: list[str], sizes: list[str], ops: list[str], runs: int, quick: bool
) -> list[dict[str, Any]] | None:
    """One world size, run on every rank; rank 0 returns the cases."""
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    cases = []
    for size in sizes:
        for kind in kinds:
            if not runs_case(kind, size, world):
                continue
            started = time.perf_counter()
            obj = make_object(kind, ITEMS.get(size) or SIZES[size], rank)
            # the raw floor moves the largest rank's encoded size from every rank
            nbytes = max(dg.all_gather_object(sum(len(p) for p in encode_parts(obj))))
            iters = max(2, ITERATIONS[size] // 3) if quick else ITERATIONS[size]
            methods = methods_for(obj, nbytes, ops, device, on_gpu)
            if size == "100MB":  # over the learned-slot cap: every call is cold
                methods.pop("ddpgraph_cold", None)
            per_run, cpu_per_run = [], []
            for _ in range(runs):
                medians = _timed(methods, WARMUP[size], iters, sync)
                per_rank = dg.all_gather_object(medians)
                # the slowest rank's median: the job waits for it
                per_run.append({n: max(m["wall"][n] for m in per_rank) for n in methods})
                # CPU time: every rank's work, summed
                cpu_per_run.append({n: sum(m["cpu"][n] for m in per_rank) for n in methods})
            median = {n: statistics.median(r[n] for r in per_run) for n in methods}
            cpu = {n: statistics.median(r[n] for r in cpu_per_run) for n in methods}
            ratios_per_run = [_ratios(r) for r in per_run]
            case = {
                "world_size": world,
                "kind": kind,
                "size": size,
                "encoded_bytes": nbytes,
                "iterations": iters,
                "warmup": WARMUP[size],
                "runs": runs,
                "median_s": median,
                "runs_s": per_run,
                "ratios": _ratios(median),
                "cpu_s": cpu,  # median over the runs of the CPU seconds of all ranks together
                "cpu_ratios": _ratios(cpu),
                # each ratio's lowest and highest over the runs (same processes, one run each)
                "ratio_spread": {
                    k: [min(r[k] for r in ratios_per_run), max(r[k] for r in ratios_per_run)]
                    for k in ratios_per_run[0]
                },
            }
            cases.append(case)
            del obj, methods
            if rank == 0:
                ratio = case["ratios"].get("ddpgraph_vs_torch")
                shown = "" if ratio is None else f" ddpgraph/torch {ratio:.2f}"
                cpu_ratio = case["cpu_ratios"].get("ddpgraph_vs_torch")
                shown += "" if cpu_ratio is None else f" (CPU time {cpu_ratio:.2f})"
                print(
                    f"  ws={world} {kind:>6} {size:>5}: ddpgraph "
                    f"{median.get('ddpgraph', float('nan')) * 1e3:8.3f} ms, torch "
                    f"{median.get('torch', float('nan')) * 1e3:8.3f} ms{shown} "
                    f"({time.perf_counter() - started:.1f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    return cases if rank == 0 else None


def _worker(*args: Any) -> list[dict[str, Any]] | None:
    return measure(*args)


def _load_note() -> str:
    """The machine's load when the sweep ended: on a shared machine the numbers are noisy."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument(
        "--world-sizes", type=_csv, default=None, help="comma-separated (default 2,4,8 on gloo)"
    )
    parser.add_argument("--world-size", type=int, help="one world size (as --world-sizes N)")
    parser.add_argument(
        "--sweep",
        choices=["bytes", "eval"],
        default="bytes",
        help="bytes: kinds x encoded sizes; eval: labels/scores/records/tensor x 1e3..1e6 items",
    )
    parser.add_argument("--kinds", type=_csv, default=None)
    parser.add_argument("--sizes", type=_csv, default=None)
    parser.add_argument(
        "--ops", type=_csv, default=["all_gather"], help="all_gather,gather,broadcast"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per case, same processes")
    parser.add_argument("--quick", action="store_true", help="a third of the iterations")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per world size")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args()
    kinds, sizes = (EVAL_KINDS, list(ITEMS)) if args.sweep == "eval" else (KINDS, list(SIZES))
    args.kinds, args.sizes = args.kinds or kinds, args.sizes or sizes
    unknown = sorted(set(args.kinds) - set(kinds)) + sorted(set(args.sizes) - set(sizes))
    if unknown:
        parser.error(f"unknown kinds/sizes {unknown}; kinds {kinds}, sizes {sizes}")
    work = (args.backend, args.kinds, args.sizes, args.ops, args.runs, args.quick)

    cases: list[dict[str, Any]] = []
    if "RANK" in os.environ:  # under torchrun: this process is one rank of one world size
        with dg.init(backend=args.backend):
            found = measure(*work)
        if found is None:
            return
        cases += found
    else:
        from ddpgraph.testing import run_distributed

        default = "2,4,8" if args.backend == "gloo" else "1"
        sizes = args.world_sizes or _csv(str(args.world_size or default))
        for world in (int(w) for w in sizes):
            print(f"world size {world} ({args.backend}):", file=sys.stderr, flush=True)
            found = run_distributed(
                _worker, world, backend=args.backend, args=work, timeout=args.timeout
            )[0]
            cases += found
    on_gpu = args.backend == "nccl"
    report = {
        "benchmark": "object collectives against torch's own calls, same processes",
        "backend": args.backend,
        "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "git_commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "limits": EVAL_LIMITS if args.sweep == "eval" else LIMITS,
        "sweep": args.sweep,
        "load": _load_note(),
        "cases": cases,
    }
    kind = "cuda" if on_gpu else "cpu"
    stem = f"objects-{'eval-' if args.sweep == 'eval' else ''}{kind}-{args.backend}"
    out = args.out or ROOT / "benchmarks" / "results" / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'ws':>3} {'kind':>6} {'size':>5} {'torch ms':>10} {'ddpgraph':>10} {'cold':>10} "
          f"{'raw':>9}  ×torch [spread]   cold×torch")  # fmt: skip
    for c in cases:
        m, r = c["median_s"], c["ratios"]
        lo, hi = c["ratio_spread"].get("ddpgraph_vs_torch", [float("nan")] * 2)
        print(
            f"{c['world_size']:>3} {c['kind']:>6} {c['size']:>5} "
            f"{m.get('torch', float('nan')) * 1e3:10.3f} {m.get('ddpgraph', float('nan')) * 1e3:10.3f} "
            f"{m.get('ddpgraph_cold', float('nan')) * 1e3:10.3f} {m.get('raw', float('nan')) * 1e3:9.3f}  "
            f"{r.get('ddpgraph_vs_torch', float('nan')):5.2f} [{lo:.2f}-{hi:.2f}]  "
            f"{r.get('cold_vs_torch', float('nan')):5.2f}"
        )
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
