"""Object collectives: ddpgraph against torch.distributed in the same run.

Times ``ddpgraph.all_gather_object`` (data codec, and pickle codec) against
``torch.distributed.all_gather_object`` and one raw tensor all-gather of the same number of bytes,
and ``gather_object`` / ``broadcast_object`` against torch's ``gather_object`` /
``broadcast_object_list`` (root 0), for objects of about 100 B, 10 KB, 1 MB and 64 MB. Every call is preceded by a barrier (not
timed) and the methods take turns call by call; each rank takes the median of its calls and
the slowest rank's median is reported.

    python benchmarks/objects.py                       # gloo, 2 local ranks (spawned here)
    torchrun --nproc-per-node=2 benchmarks/objects.py --backend nccl   # on a GPU machine

Writes JSON (torch version, git commit, medians, ratios) to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ddpgraph as dg
from ddpgraph.bench import git_commit
from ddpgraph.distributed.codec import encode

ROOT = Path(__file__).resolve().parent.parent
# name, timed iterations (see make_object for the objects)
CASES: list[tuple[str, int]] = [("100B", 300), ("10KB", 200), ("1MB", 60), ("64MB", 15)]
WARMUP = 3
# torch 2.13 renamed all_gather_into_tensor (the old name warns)
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def make_object(case: str, rank: int) -> Any:
    gen = torch.Generator().manual_seed(rank)
    if case == "100B":  # a typical per-step metrics dict
        return {"rank": rank, "loss": 0.25 + rank, "step": 1000, "lr": 3e-4, "tag": "train/ep3"}
    if case == "10KB":
        return {"rank": rank, "losses": torch.rand(1100, generator=gen).tolist()}
    numel = (1 << 20) // 4 if case == "1MB" else (64 << 20) // 4
    return {"rank": rank, "weights": torch.randn(numel, generator=gen)}


def _timed(methods: dict[str, Callable[[], Any]], iters: int, sync: Callable[[], None]) -> dict:
    """Median seconds per call of each method, interleaved call by call (in rotating order) so
    that load from elsewhere on the machine falls on all methods alike."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for i in range(WARMUP + iters):
        # rotate the order too: the call that follows another method's pays for its leftovers
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fn = methods[name]
            dist.barrier()
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def measure(backend: str, quick: bool) -> dict[str, Any] | None:
    """Run on every rank; rank 0 returns the results."""
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    results = []
    for case, iters in CASES:
        iters = max(2, iters // 10) if quick else iters
        obj = make_object(case, rank)
        data_bytes = len(encode(obj))
        raw_in = torch.zeros(data_bytes, dtype=torch.uint8, device=device)
        raw_out = torch.empty(world * data_bytes, dtype=torch.uint8, device=device)
        out: list[Any] = [None] * world
        methods: dict[str, Callable[[], Any]] = {
            "torch": lambda obj=obj, out=out: dist.all_gather_object(out, obj),
            "ddpgraph": lambda obj=obj: dg.all_gather_object(obj),
            "ddpgraph_pickle": lambda obj=obj: dg.all_gather_object(obj, codec="pickle"),
            "raw_all_gather": lambda i=raw_in, o=raw_out: _ALL_GATHER(o, i),
            "torch_gather": lambda obj=obj, out=out: dist.gather_object(
                obj, out if rank == 0 else None, dst=0
            ),
            "ddpgraph_gather": lambda obj=obj: dg.gather_object(obj, dst=0),
            # a fresh list each call: torch overwrites it in place on the receivers
            "torch_broadcast": lambda obj=obj: dist.broadcast_object_list([obj], src=0),
            "ddpgraph_broadcast": lambda obj=obj: dg.broadcast_object(obj, src=0),
        }
        medians = _timed(methods, iters, sync)
        # the slowest rank's median: the job waits for it
        per_rank = dg.all_gather_object(medians)
        worst = {name: max(m[name] for m in per_rank) for name in medians}
        results.append(
            {
                "case": case,
                "iterations": iters,
                "payload_bytes": {"data": data_bytes, "pickle": len(pickle.dumps(obj))},
                "median_s": worst,
                "ddpgraph_vs_torch": worst["ddpgraph"] / worst["torch"],
                "ddpgraph_pickle_vs_torch": worst["ddpgraph_pickle"] / worst["torch"],
                "ddpgraph_vs_raw": worst["ddpgraph"] / worst["raw_all_gather"],
                "gather_vs_torch": worst["ddpgraph_gather"] / worst["torch_gather"],
                "broadcast_vs_torch": worst["ddpgraph_broadcast"] / worst["torch_broadcast"],
            }
        )
    if rank != 0:
        return None
    return {
        "benchmark": "object collectives: all_gather_object, gather_object, broadcast_object",
        "backend": backend,
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "results": results,
    }


def _worker(backend: str, quick: bool) -> dict[str, Any] | None:
    return measure(backend, quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (not torchrun)")
    parser.add_argument("--quick", action="store_true", help="a tenth of the iterations")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args()

    if "RANK" in os.environ:  # under torchrun: this process is one rank
        with dg.init(backend=args.backend):
            report = measure(args.backend, args.quick)
    else:
        from ddpgraph.testing import run_distributed

        report = run_distributed(
            _worker, args.world_size, backend=args.backend, args=(args.backend, args.quick),
            timeout=1800,
        )[0]  # fmt: skip
    if report is None:
        return
    report["git_commit"] = git_commit()
    report["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    kind = "cuda" if args.backend == "nccl" else "cpu"
    out = args.out or ROOT / "benchmarks" / "results" / f"objects-{kind}-{args.backend}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{'case':>6} {'torch':>10} {'ddpgraph':>10} {'pickle':>10} {'raw':>10}  "
        "all_gather  gather  broadcast (x torch)"
    )
    for r in report["results"]:
        m = r["median_s"]
        print(
            f"{r['case']:>6} {m['torch'] * 1e3:9.3f}ms {m['ddpgraph'] * 1e3:9.3f}ms "
            f"{m['ddpgraph_pickle'] * 1e3:9.3f}ms {m['raw_all_gather'] * 1e3:9.3f}ms  "
            f"{r['ddpgraph_vs_torch']:10.2f}  {r['gather_vs_torch']:6.2f}  "
            f"{r['broadcast_vs_torch']:9.2f}"
        )
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
