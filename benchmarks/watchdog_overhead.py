"""Watchdog overhead: the MLP graphed TrainStep with the watchdog on vs off, in one process.

One TrainStep (``ddpgraph bench``'s MLP 8x1024 b64 config) is warmed up and captured once; then
blocks of steps alternate between the watchdog off (no thread, ``watchdog.active()`` is None)
and on (thread running, every step entered/left and its replay's CUDA event recorded), so that
drift on the machine falls on both equally. Each block is timed from a synchronize to a
synchronize; the overhead is the median block's step time on vs off.

    python benchmarks/watchdog_overhead.py                  # one GPU (or CPU), world size 1
    torchrun --nproc-per-node=2 benchmarks/watchdog_overhead.py
    python benchmarks/watchdog_overhead.py --quick          # CPU smoke test, seconds

Until TrainStep calls the watchdog itself, the script makes the calls TrainStep will make around
each step (``--hooks auto`` finds out which: it wraps unless ``ddpgraph.step`` imports the
watchdog). Writes JSON to ``benchmarks/results/`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ddpgraph
from ddpgraph import bench
from ddpgraph.distributed import watchdog
from ddpgraph.step import runner as step_runner

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (CPU smoke)")
    parser.add_argument("--rounds", type=int, default=None, help="on/off block pairs")
    parser.add_argument("--steps", type=int, default=None, help="steps per block")
    parser.add_argument("--hooks", choices=("auto", "wrap", "trainstep"), default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 15)
    steps = args.steps or (10 if args.quick else 200)

    runtime = ddpgraph.init(timeout=600)
    cfg = bench.QUICK if args.quick else bench.CONFIGS["mlp"]
    batches = bench._batches(cfg, runtime.device)
    train_step, _ = bench._train_step(cfg, runtime.device, batches)
    wrap = args.hooks == "wrap" or (args.hooks == "auto" and not _trainstep_is_wired())
    one_step = (
        _with_hooks(train_step, batches, runtime.device) if wrap else _plain(train_step, batches)
    )
    for _ in range(bench.WARMUP_STEPS + 2):  # warm-up and capture, watchdog on
        one_step()
    on: list[float] = []
    off: list[float] = []
    for _ in range(rounds):
        watchdog.stop()
        off.append(_block_ms(one_step, steps, runtime.device))
        _start_watchdog(runtime)
        on.append(_block_ms(one_step, steps, runtime.device))
    results = {
        "benchmark": "watchdog_overhead",
        "config": cfg.name,
        "mode": train_step.mode,
        "hooks": "wrapped by this script" if wrap else "called by TrainStep",
        "world_size": runtime.world_size,
        "device": str(runtime.device),
        "rounds": rounds,
        "steps_per_block": steps,
        "step_ms_off": _stats(off),
        "step_ms_on": _stats(on),
        "overhead_pct": 100.0 * (statistics.median(on) / statistics.median(off) - 1.0),
        "hot_path_us": _hot_path_us(2000 if args.quick else 20000),
        "target_pct": 2.0,
        "environment": bench.environment(),
    }
    if runtime.rank == 0:
        out = args.out or ROOT / "benchmarks" / "results" / _default_name(args.quick, runtime)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps({k: results[k] for k in ("config", "mode", "overhead_pct")}))
        print(f"wrote {out}")
    del train_step, one_step
    ddpgraph.shutdown()
    return results


def _trainstep_is_wired() -> bool:
    return hasattr(step_runner, "watchdog")


def _hot_path_us(calls: int = 20000) -> float:
    """Microseconds one watched call's ``enter``/``leave`` costs on the host (the watchdog's
    per-step price, measured here rather than asserted in a unit test: wall time on a loaded
    CI machine says nothing)."""
    dog = watchdog.active()
    assert dog is not None
    start = time.perf_counter()
    for step in range(calls):
        dog.enter("replay", step)
        dog.leave()
    return (time.perf_counter() - start) / calls * 1e6


def _plain(train_step: Any, batches: list) -> Callable[[], Any]:
    index = [0]

    def one_step() -> Any:
        index[0] += 1
        return train_step(*batches[index[0] % len(batches)])

    return one_step


def _with_hooks(train_step: Any, batches: list, device: torch.device) -> Callable[[], Any]:
    """The calls TrainStep makes per step: enter/leave, and one event after each replay."""
    index = [0]
    on_cuda = device.type == "cuda"

    def one_step() -> Any:
        index[0] += 1
        n = index[0]
        dog = watchdog.active()
        if dog is None:
            return train_step(*batches[n % len(batches)])
        dog.enter("replay", n)
        try:
            loss = train_step(*batches[n % len(batches)])
        finally:
            dog.leave()
        if on_cuda:
            dog.after_replay(torch.cuda.current_stream(device), n)
        return loss

    return one_step


def _start_watchdog(runtime: ddpgraph.Runtime) -> None:
    store = dist.distributed_c10d._get_default_store()
    watchdog.start(
        dist.PrefixStore(f"bench-watchdog/{time.monotonic_ns()}", store),
        rank=runtime.rank,
        world_size=runtime.world_size,
        timeout=timedelta(seconds=600),
        stall_warning=None,
        store_host="",
    )


def _block_ms(one_step: Callable[[], Any], steps: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / steps


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def _default_name(quick: bool, runtime: ddpgraph.Runtime) -> str:
    where = "cpu" if runtime.device.type == "cpu" else "cuda"
    return f"watchdog-overhead-{where}{'-quick' if quick else ''}-ws{runtime.world_size}.json"


if __name__ == "__main__":
    main(sys.argv[1:])
