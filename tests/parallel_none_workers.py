"""Workers of tests/test_parallel_none.py: ``TrainStep(parallel="none")`` on gloo ranks, and
``from_accelerator`` beside Accelerate's own ``prepare`` (which wraps the model in DDP only on
several processes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpgraph import TrainStep
from ddpgraph.testing import CpuGraphs


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def refuse(case: str) -> None:
    model, optimizer = _model_and_optimizer()
    if case == "ddp_kwargs":
        TrainStep(model, optimizer, nn.MSELoss(), parallel="none", ddp_kwargs={"bucket_cap_mb": 1})
    elif case == "sharded":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)  # its parameters become DTensors: the optimizer is built after
        TrainStep(model, torch.optim.AdamW(model.parameters()), nn.MSELoss(), parallel="none")
    else:  # "ranks": on a group of more than one
        TrainStep(model, optimizer, nn.MSELoss(), parallel="none")


def train(parallel: str, steps: int = 8) -> dict[str, Any]:
    """``steps`` calls of a step wrapped as ``parallel`` says, replaying on the CPU engine."""
    model, optimizer = _model_and_optimizer()
    step = TrainStep(
        model, optimizer, nn.MSELoss(), parallel=parallel, engine=CpuGraphs(), warmup=1
    )
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator)
        losses.append(step(x, y).item())
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "ddp": isinstance(step.model, DistributedDataParallel),
        "replays": step.report().replays,
    }


def wrapped_as_prepare() -> dict[str, Any]:
    """Whether ``accelerator.prepare`` wraps a model in DDP here, and whether the step
    ``from_accelerator`` builds does (it must where prepare does, and only there)."""
    from accelerate import Accelerator

    from ddpgraph.integrations.accelerate import from_accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = _model_and_optimizer()
    step = from_accelerator(accelerator, model, optimizer, nn.MSELoss(), engine=CpuGraphs())
    step(torch.randn(4, 8), torch.randn(4, 2))
    other, _ = _model_and_optimizer()
    prepared = accelerator.prepare(other)
    return {
        "kind": accelerator.distributed_type.name,
        "prepare": isinstance(prepared, DistributedDataParallel),
        "step": isinstance(step.model, DistributedDataParallel),
    }
