"""Module-level workers for TrainStep's multi-process tests."""

from __future__ import annotations

import torch
from torch import nn

from ddpgraph import TrainStep


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(n: int, size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 8, generator=gen), torch.randint(4, (size,), generator=gen))
        for _ in range(n)
    ]


def ddp_train(steps: int) -> dict:
    """Each rank trains on its half of every global batch; returns its parameters."""
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(model, opt, nn.CrossEntropyLoss())
    losses = []
    for x, y in batches(steps, 8):
        shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
        losses.append(float(step(x[shard], y[shard])))
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "is_ddp": type(step.model).__name__,
        "losses": losses,
    }
