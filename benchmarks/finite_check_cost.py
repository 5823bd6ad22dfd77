"""The finite check's cost per replayed step: a graphed TrainStep with check_finite on vs off.

Two TrainSteps of ``ddpgraph bench``'s configs (the MLP and the transformer) are captured; blocks
of replays alternate between them so that drift on the machine falls on both equally; each block
is timed from a synchronize to a synchronize. Prints the median step time of each and the
relative cost (target: under 1 %). Needs CUDA.

    python benchmarks/finite_check_cost.py [--blocks 20] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import ddpgraph
from ddpgraph.demo.models import build_model

SHAPES = {"mlp": (64, (64,)), "transformer": (32, (16, 32))}


def _step(name: str, check: bool) -> tuple[ddpgraph.TrainStep, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(name).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = ddpgraph.TrainStep(model, opt, nn.CrossEntropyLoss(), check_finite=check)
    batch, shape = SHAPES[name]
    x = torch.randn(batch, *shape, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")
    for _ in range(20):  # warm-up and capture
        step(x, y)
    assert step.mode == "graphed", step.report()
    return step, (x, y)


def _block(step: ddpgraph.TrainStep, batch: tuple[torch.Tensor, ...], n: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step(*batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    results = {}
    with ddpgraph.init():
        for name in SHAPES:
            steps = {check: _step(name, check) for check in (False, True)}
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.blocks):
                for check, (step, batch) in steps.items():
                    times[check].append(_block(step, batch, args.steps))
            off, on = statistics.median(times[False]), statistics.median(times[True])
            results[name] = {"off_ms": off, "on_ms": on, "cost": on / off - 1}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
