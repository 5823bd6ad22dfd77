"""The call path of one replayed ``step(x, y)`` on the CPU engine: what ddpgraph runs around the
engine's recorded program.

One gloo rank (so DDP wraps the model), SGD, ``TrainStep(..., engine=CpuGraphs(), warmup=2)``
30 calls; then one more call is profiled (``sys.setprofile``). The recorded program's own replay
(:meth:`ddpgraph.step.recording.Program.replay`, the bare replay) is not counted; everything
ddpgraph runs around it is:

* ``frames``: ddpgraph frames on the stack from ``TrainStep.__call__`` down to the engine's
  ``replay`` (the first ddpgraph function named ``replay`` on the path), that one included;
* ``calls_outside``: ddpgraph functions entered outside the engine's ``replay``;
* ``calls_inside``: ddpgraph functions entered inside it, outside the recorded program's replay;
* ``modules``: the ddpgraph modules those calls live in; ``path``: the calls in order.

From the review of turn 7 (``call-path-turn7/callpath_probe.py`` and ``replay_inside.py``), one
probe for both counts. Counts are deterministic for one Python version; ``tests/test_call_path.py``
holds them to a budget.

    python benchmarks/probes/callpath_probe.py [LAYERS ...] [--feed data] [--out FILE.json]
      (LAYERS linear layers of 8x8 with ReLU between, then Linear(8, 4); default 2 and 50;
      --feed data: a step(data) call over a DeviceData of such batches, one step per replay)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

import torch
from torch import nn


def build(layers: int) -> nn.Module:
    blocks = [m for _ in range(layers) for m in (nn.Linear(8, 8), nn.ReLU())]
    return nn.Sequential(*blocks, nn.Linear(8, 4))


def probe(layers: int, guard: str = "default", feed: str = "batch") -> dict[str, Any]:
    """The counts of one replayed call (run inside ``ddpgraph.init``, one rank or more);
    ``feed="data"``: a ``step(data)`` call over a ``DeviceData`` of the same batches (one step
    per replay) instead of ``step(x, y)``."""
    import ddpgraph as dg
    from ddpgraph.step import recording
    from ddpgraph.testing import CpuGraphs

    package = os.path.dirname(dg.__file__) + os.sep
    bare = recording.Program.replay.__code__
    chosen = {} if guard == "default" else {"guard": guard}  # the tree's own default
    torch.manual_seed(0)
    model = build(layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = dg.TrainStep(
            model, opt, nn.CrossEntropyLoss(), engine=CpuGraphs(), warmup=2, **chosen
        )
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        args: tuple[Any, ...] = (x, y)
        if feed == "data":
            data = dg.DeviceData(
                torch.randn(4 * 50, 8), torch.randint(0, 4, (4 * 50,)), batch_size=4,
                device=torch.device("cpu"),
            )  # fmt: skip
            args = (data,)
        for _ in range(30):
            step(*args)
    replays_before = step.report().replays
    stack: list[bool] = []  # per frame on the stack: is it ddpgraph's
    path: list[str] = []
    where = {"engine": 0, "bare": 0}  # stack depth at which the engine's / the bare replay began
    frames: list[int] = []
    inside: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call":
            mine = code.co_filename.startswith(package)
            stack.append(mine)
            if where["bare"]:
                return
            if code is bare:
                where["bare"] = len(stack)
                return
            if not mine:
                return
            name = f"{os.path.relpath(code.co_filename, package)}:{code.co_name}"
            if where["engine"]:
                inside.append(name)
            elif code.co_name == "replay":
                where["engine"] = len(stack)
                frames.append(sum(stack))
            else:
                path.append(name)
        elif event == "return" and stack:
            stack.pop()
            depth = len(stack)
            if where["bare"] and depth < where["bare"]:
                where["bare"] = 0
            if where["engine"] and depth < where["engine"]:
                where["engine"] = 0

    sys.setprofile(profile)
    try:
        step(*args)
    finally:
        sys.setprofile(None)
    if step.report().replays != replays_before + 1:
        raise RuntimeError("the profiled call was not a replay: the probe measures nothing")
    modules = sorted({name.split(":")[0] for name in path + inside})
    return {
        "layers": layers,
        "guard": guard,
        "feed": feed,
        "parameters": len(list(model.parameters())),
        "submodules": len(list(model.modules())),
        "frames": frames[0] if frames else None,
        "calls_outside": len(path),
        "calls_inside": len(inside),
        "calls": len(path) + len(inside),
        "modules": modules,
        "path": path,
        "inside": inside,
    }


def _worker(layers: list[int], guard: str, feed: str = "batch") -> list[dict[str, Any]]:
    return [probe(n, guard, feed) for n in layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layers", nargs="*", type=int, default=[2, 50])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--guard", default="default", choices=["default", "full", "events"])
    parser.add_argument("--feed", default="batch", choices=["batch", "data"],
                        help="data: a step(data) call over a DeviceData")  # fmt: skip
    args = parser.parse_args()
    from ddpgraph.testing import run_distributed

    work = (args.layers, args.guard, args.feed)
    (results,) = run_distributed(_worker, 1, args=work, timeout=600)
    for row in results:
        print(
            f"LAYERS={row['layers']}: {row['frames']} frames to the engine's replay, "
            f"{row['calls']} ddpgraph calls ({row['calls_outside']} outside it, "
            f"{row['calls_inside']} inside), {len(row['modules'])} modules"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
