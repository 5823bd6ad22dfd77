"""Host time ddpgraph adds to a bare replay on the CPU engine, per replayed ``step(x, y)``.

Set-up as ``callpath_probe.py`` (one gloo rank, DDP, SGD, ``warmup=2``, 30 calls). Then blocks
of N replayed calls with the recorded program's replay
(:meth:`ddpgraph.step.recording.Program.replay`, the engine's own work) made a no-op, so that what
is timed is only what ddpgraph runs around it (the body's own time and noise, 0.7 ms at 2 layers
and 30-60 ms at 50 on a loaded 2-core host, would drown a few µs):

  added_us      ``step(x, y)`` with the program a no-op: the guard, the policy, the copies into
                the static inputs, the loss returned as a copy
  added_cpu_us  the same in this thread's CPU time (``time.thread_time``): on a machine
                whose other load takes the cores away, the time this process was not running
                is left out
  bare_us       a bare replay timed in its own loop: the inputs copied into the static tensors,
                then the recorded program replayed
  clone_us      ``loss.clone()`` alone (the copy of the loss a replay returns; inside added_us)
  data_added_us the same model fed by a ``DeviceData`` (``step(data)``, one step per replay),
                its program a no-op: what ddpgraph runs around a replay that gathers its batch

Medians over REPS blocks (minima too). One thread, one process: compare figures within one run
(the machine's other load moves them all). From the review of turn 7 (``call-path-turn7/host_time.py``).

    python benchmarks/probes/cpu_host_time.py [LAYERS ...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from typing import Any

import torch
from torch import nn

N, REPS = int(os.environ.get("N", "300")), int(os.environ.get("REPS", "7"))


def build(layers: int) -> nn.Module:
    blocks = [m for _ in range(layers) for m in (nn.Linear(8, 8), nn.ReLU())]
    return nn.Sequential(*blocks, nn.Linear(8, 4))


def _engine(step: Any) -> Any:
    """The CPU engine of a TrainStep, wherever this version keeps it."""
    for path in (("_runner", "engine"), ("_runner", "graphs"), ("_policy", "graphs"), ("_engine",)):
        obj = step
        try:
            for name in path:
                obj = getattr(obj, name)
            return obj
        except AttributeError:
            continue
    raise SystemExit("no engine found on the TrainStep: adapt _engine()")


def _warmed(layers: int, chosen: dict[str, Any], *args: Any) -> tuple[Any, Any, Any]:
    """A TrainStep on the CPU engine called 30 times on ``args``: it, its recorded training
    program and that graph's static inputs."""
    import ddpgraph as dg
    from ddpgraph.testing import CpuGraphs

    torch.manual_seed(0)
    model = build(layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = dg.TrainStep(
            model, opt, nn.CrossEntropyLoss(), engine=CpuGraphs(), warmup=2, **chosen
        )
        for _ in range(30):
            step(*args)
    engine = _engine(step)
    (key,) = [k for k in engine.captured if k.role == "train"]
    # the recorded program: the graph of its entry (before 2026-12-06, a dict of its own)
    programs = getattr(engine, "_programs", None)
    program = engine.captured[key].graph if programs is None else programs[key]
    return step, program, engine.captured[key].static_inputs


def measure(layers: int, guard: str = "default") -> dict[str, Any]:
    torch.set_num_threads(1)
    chosen = {} if guard == "default" else {"guard": guard}  # the tree's own default
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    step, program, static = _warmed(layers, chosen, x, y)
    inner = program.replay
    rows: dict[str, list[float]] = {"added": [], "added_cpu": [], "bare": [], "clone": []}
    loss = step(x, y)
    for _ in range(REPS):
        program.replay = lambda: None  # type: ignore[method-assign]
        t, cpu = time.perf_counter(), time.thread_time()
        for _ in range(N):
            step(x, y)
        rows["added"].append((time.perf_counter() - t) / N)
        rows["added_cpu"].append((time.thread_time() - cpu) / N)
        program.replay = inner  # type: ignore[method-assign]
        t = time.perf_counter()
        for _ in range(max(1, N // 10)):
            for s, v in zip(static, (x, y)):
                s.copy_(v)
            inner()
        rows["bare"].append((time.perf_counter() - t) / max(1, N // 10))
        t = time.perf_counter()
        for _ in range(N):
            loss.clone()
        rows["clone"].append((time.perf_counter() - t) / N)
    rows["data_added"] = _data_added(layers, chosen)
    out: dict[str, Any] = {
        "layers": layers,
        "guard": guard,
        "parameters": len(list(step.model.parameters())),
    }
    for name, values in rows.items():
        out[name + "_us"] = round(statistics.median(values) * 1e6, 1)
        out[name + "_us_min"] = round(min(values) * 1e6, 1)
    return out


def _data_added(layers: int, chosen: dict[str, Any]) -> list[float]:
    """Seconds per ``step(data)`` call with its recorded program a no-op, per block."""
    import ddpgraph as dg

    data = dg.DeviceData(
        torch.randn(4 * 50, 8), torch.randint(0, 4, (4 * 50,)), batch_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    step, program, _ = _warmed(layers, chosen, data)
    inner, blocks = program.replay, []
    program.replay = lambda: None  # type: ignore[method-assign]
    for _ in range(REPS):
        t = time.perf_counter()
        for _ in range(N):
            step(data)
        blocks.append((time.perf_counter() - t) / N)
    program.replay = inner  # type: ignore[method-assign]
    return blocks


def _worker(layers: list[int], guard: str) -> list[dict[str, Any]]:
    return [measure(n, guard) for n in layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layers", nargs="*", type=int, default=[2, 50])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--guard", default="default", choices=["default", "full", "events"])
    args = parser.parse_args()
    from ddpgraph.testing import run_distributed

    (results,) = run_distributed(_worker, 1, args=(args.layers, args.guard), timeout=900)
    for row in results:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
