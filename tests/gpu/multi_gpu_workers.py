"""Workers for the multi-GPU tests: each rank trains graphed and eager on its own batches."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddpgraph import TrainStep
from ddpgraph.demo.models import build_model
from ddpgraph.step.optim import make_graph_safe

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


def _mixed_run(graph: str, policy: str, steps: int) -> dict:
    """Ranks meet new batch sizes at different steps, so in one step some ranks replay a graph,
    some capture a new one and some run eagerly; DDP's all-reduces must still pair up."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_model("mlp").cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if graph == "never":
        make_graph_safe(opt, torch.device("cuda"))
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), graph=graph, on_new_shape=policy)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    losses = []
    for i in range(steps):
        # rank r sees a new size at steps 20 + 7r, 40 + 3r, ...: never the same step everywhere
        size = 32 if i < 20 + 7 * rank else (24 if i < 40 + 3 * rank else 16 + (i + rank) % 3)
        x = torch.randn((size, 64), device="cuda", generator=gen)
        y = torch.randint(10, (size,), device="cuda", generator=gen)
        losses.append(step(x, y).clone())
    torch.cuda.synchronize()
    return {
        "losses": torch.stack(losses).cpu(),
        "state": {k: v.cpu() for k, v in model.state_dict().items()},
        "report": str(step.report()),
    }


def mixed_graphed_and_eager_steps(steps: int) -> dict:
    return {
        "capture": _mixed_run("always", "capture", steps),
        "eager_new_shapes": _mixed_run("always", "eager", steps),
        "eager": _mixed_run("never", "eager", steps),
    }
