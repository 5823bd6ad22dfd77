"""Training runs fed by a DeviceData, and the plain loop they must equal; run in-process or by
``run_distributed`` (module-level, so spawned ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from ddpgraph import ConfigError, DeviceData, TrainStep
from ddpgraph.testing import CpuGraphs

from .step_workers import float_lr_step_as_the_step

SAMPLES, BATCH, SEED = 100, 8, 3


def data_set() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 8, generator=gen), torch.randint(3, (SAMPLES,), generator=gen)


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=50)
    return model, optimizer, scheduler


def device_data_run(k: int, total: int, fake: bool) -> dict[str, Any]:
    """``total`` steps through ``step(data)``, ``k`` per call (the last call takes the rest)."""
    model, optimizer, scheduler = model_and_optimizer()
    data = DeviceData(*data_set(), batch_size=BATCH, seed=SEED)
    step = TrainStep(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        scheduler=scheduler,
        steps_per_replay=k,
        engine=CpuGraphs() if fake else None,
    )
    losses, done = [], 0
    while done < total:
        n = min(k, total - done)
        out = step(data, steps=n)
        assert out.shape == (n,)
        losses.append(out.clone())
        done += n
    report = step.report()
    return {
        "losses": torch.cat(losses),
        "params": [p.detach().clone() for p in model.parameters()],
        "mode": report.mode,
        "replays": report.replays,
        "steps": report.steps,
        "epoch": (data.epoch, data.position),
        "lr": scheduler.get_last_lr(),
    }


def plain_loop(total: int, make_scheduler: Any = None, graph_safe: bool = False) -> dict[str, Any]:
    """The eager loop a script writes: DataLoader over DistributedSampler, DDP, scheduler.step().

    ``graph_safe``: its optimizer steps as a graphed step's does (fused SGD), the reference a
    CpuGraphs run is compared with bit for bit (as tests/gpu do), its LR in a float32 tensor
    filled before each step from the schedule computed on floats, as step(data) does."""
    model, optimizer, scheduler = model_and_optimizer()
    optimizer_step = float_lr_step_as_the_step(optimizer) if graph_safe else optimizer.step
    if make_scheduler is not None:
        scheduler = make_scheduler(optimizer)
    grouped = dist.is_initialized()
    net = DistributedDataParallel(model) if grouped else model
    data = TensorDataset(*data_set())
    sampler: DistributedSampler[Any] = DistributedSampler(
        data,
        num_replicas=dist.get_world_size() if grouped else 1,
        rank=dist.get_rank() if grouped else 0,
        shuffle=True,
        seed=SEED,
        drop_last=True,
    )
    loader = DataLoader(data, sampler=BatchSampler(sampler, BATCH, drop_last=True), batch_size=None)
    loss_fn = nn.CrossEntropyLoss()
    losses: list[torch.Tensor] = []
    epoch = 0
    while len(losses) < total:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            if len(losses) == total:
                break
            optimizer.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            optimizer_step()
            scheduler.step()
            losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def k_vs_one_vs_plain(k: int, total: int, fake: bool) -> dict[str, Any]:
    return {
        "k": device_data_run(k, total, fake),
        "one": device_data_run(1, total, fake),
        "plain": plain_loop(total, graph_safe=fake),
    }


def scheduler_stepped_outside() -> str:
    model, optimizer, scheduler = model_and_optimizer()
    data = DeviceData(*data_set(), batch_size=BATCH, seed=SEED)
    step = TrainStep(
        model, optimizer, nn.CrossEntropyLoss(), scheduler=scheduler, steps_per_replay=2
    )
    step(data)
    scheduler.step()  # the habit of a step(x, y) loop
    try:
        step(data)
    except ConfigError as exc:
        return str(exc)
    return "no error"
