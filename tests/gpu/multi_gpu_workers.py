"""Workers for the multi-GPU tests: each rank trains graphed and eager on its own batches."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddpgraph import TrainStep
from ddpgraph.demo.models import build_model
from ddpgraph.optim import make_graph_safe

SHAPES = {"mlp": (64,), "resnet": (3, 16, 16), "transformer": (16, 32)}


def _train(model_name: str, graph: str, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_model(model_name).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if graph == "never":
        make_graph_safe(opt, torch.device("cuda"))
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), graph=graph)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)  # per-rank batches
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn((32, *SHAPES[model_name]), device="cuda", generator=gen)
        y = torch.randint(10, (32,), device="cuda", generator=gen)
        losses.append(step(x, y).clone())
    torch.cuda.synchronize()
    return {
        "losses": torch.stack(losses).cpu(),
        "state": {k: v.cpu() for k, v in model.state_dict().items()},
        "opt": [v.cpu() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)],
        "mode": step.mode,
        "replays": step.report().replays,
    }


def graphed_and_eager(model_name: str, steps: int) -> dict:
    return {
        "graphed": _train(model_name, "always", steps),
        "eager": _train(model_name, "never", steps),
    }
