"""Module-level workers for the FSDP2 tests (run by run_distributed on gloo, CPU)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import ddpgraph
from ddpgraph import TrainStep
from ddpgraph.testing import CpuGraphs

from .step_workers import as_the_step_steps


class Net(nn.Module):
    """Embedding layer, a ModuleList of blocks, a head: the shape shard_blocks expects."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(2)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def make_model(seed: int = 0, width: int = 16) -> Net:
    torch.manual_seed(seed)
    return Net(width)


def shard(model: nn.Module, **kwargs: Any) -> nn.Module:
    """The script's own policy: each block, then the root."""
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def batches(n: int, size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank; each rank trains on its slice."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(n):
        x, y = torch.randn(size, 8, generator=gen), torch.randint(4, (size,), generator=gen)
        part = slice(rank * size // world, (rank + 1) * size // world)
        out.append((x[part], y[part]))
    return out


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole (a collective: every rank calls it)."""
    return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[operator]


def plain_loop(
    steps: int,
    calls: int = 1,
    split: int = 1,
    clip: float | None = None,
    sync_every_call: bool = False,
) -> dict:
    """The FSDP2 loop a script writes: ``calls`` micro-batches per optimizer step (no gradient
    sync on all but the last, or with ``sync_every_call`` a sync on every backward, as a script
    that never calls set_requires_gradient_sync), or one batch split in ``split``; AdamW;
    clipping. Every test compares it with a CpuGraphs run: its AdamW steps as the graphed step's
    does (capturable, the LR in a tensor), as tests/gpu's references do."""
    model = shard(make_model())
    opt = as_the_step_steps(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    opt.zero_grad(set_to_none=False)
    for i, (x, y) in enumerate(batches(steps * calls)):
        last_call = i % calls == calls - 1
        total = torch.zeros(())
        for j, (xs, ys) in enumerate(zip(x.chunk(split), y.chunk(split))):
            sync = (last_call or sync_every_call) and j == split - 1
            model.set_requires_gradient_sync(sync)
            loss = loss_fn(model(xs), ys)
            (loss / (split * calls)).backward()
            total = total + loss.detach() / split
        model.set_requires_gradient_sync(True)
        losses.append(float(total))
        if last_call:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.grad is not None], clip, foreach=True
                )
            opt.step()
            opt.zero_grad(set_to_none=False)
    return {"losses": losses, "params": full_params(model)}


def train_step_run(
    steps: int,
    calls: int = 1,
    split: int = 1,
    clip: float | None = None,
    engine: bool = True,
    user_sharded: bool = True,
    fail_rank: int | None = None,
    warmup: int = 3,
    sync_every_call: bool = False,
) -> dict:
    """The same training through TrainStep: a user-sharded model, or parallel='fsdp2'."""
    rank = dist.get_rank()
    model = shard(make_model()) if user_sharded else make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fail = (lambda key: rank == fail_rank) if fail_rank is not None else (lambda key: False)
    step = TrainStep(
        model,
        opt,
        nn.CrossEntropyLoss(),
        accumulate_calls=calls,
        accumulate=split,
        clip_grad_norm=clip,
        warmup=warmup,
        engine=CpuGraphs(fail=fail) if engine else None,
        parallel="auto" if user_sharded else "fsdp2",
        sync_every_call=sync_every_call,
    )
    losses = [float(step(x, y)) for x, y in batches(steps * calls)]
    report = step.report()
    return {
        "losses": losses,
        "params": full_params(model),
        "phase": step.phase.value,
        "replays": report.replays,
        "fallbacks": list(report.fallbacks),
        "wrapper": type(step._body.parallel).__name__,
        "model_is_root": step.model is model,
        "sharded": sorted(
            n for n, m in model.named_modules() if type(m).__name__.startswith("FSDP")
        ),
    }


def grad_norm_and_eval() -> dict:
    """TrainStep's grad norm over DTensor gradients and its evaluation forward, vs plain FSDP2."""
    model = shard(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), warmup=2, engine=CpuGraphs())
    x, y = batches(1)[0]
    for _ in range(4):
        step(x, y)
    evaluated = [step.evaluate(x).clone() for _ in range(4)]  # eager twice, then "captured"
    with torch.no_grad():
        model.eval()
        expected = model(x)
        model.train()
    nn.CrossEntropyLoss()(model(x), y).backward()
    norm = step._body.parallel.grad_norm()
    reference = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], foreach=True)
    return {
        "evaluated": evaluated,
        "expected": expected,
        "norm": norm,
        "norm_is_plain": type(norm) is torch.Tensor,
        "reference": reference.full_tensor(),  # type: ignore[attr-defined]
        "eval_replays": step.report().eval_replays,
    }


# ---------------------------------------------------------------------- refusals
def refuse(case: str) -> None:
    """Build a TrainStep that must be refused; raises on every rank."""
    model = make_model()
    if case == "sgd":
        shard(model)
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        TrainStep(model, opt, nn.CrossEntropyLoss(), graph="always", engine=CpuGraphs())
    elif case == "accumulate_calls_3":
        shard(model)
        opt = torch.optim.AdamW(model.parameters())
        TrainStep(model, opt, graph="always", accumulate_calls=3, engine=CpuGraphs())
    elif case == "fp16":
        shard(model)
        opt = torch.optim.AdamW(model.parameters())
        TrainStep(model, opt, graph="always", amp="fp16", engine=CpuGraphs())
    elif case == "offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        # fully_shard(offload_policy=CPUOffloadPolicy()) needs CUDA (the GPU tests shard with
        # it): here the policy is set where FSDP2 keeps it, on each parameter group
        shard(model)
        for module in model.modules():
            if hasattr(module, "_get_fsdp_state"):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    group.offload_policy = CPUOffloadPolicy()
        opt = torch.optim.AdamW(model.parameters())
        TrainStep(model, opt, nn.CrossEntropyLoss(), graph="always", engine=CpuGraphs())
    elif case == "ddp_on_sharded":
        shard(model)
        TrainStep(model, torch.optim.AdamW(model.parameters()), parallel="ddp")
    elif case == "root_not_sharded":
        for block in model.blocks:
            fully_shard(block)
        TrainStep(model, torch.optim.AdamW(model.parameters()))
    elif case == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        TrainStep(wrapped, torch.optim.AdamW(wrapped.parameters()))
    elif case == "ddp_inside_sharded":
        inner = nn.parallel.DistributedDataParallel(model.blocks[0])
        model.blocks[0] = inner
        fully_shard(model)
        TrainStep(model, torch.optim.AdamW(model.parameters()))
    else:
        raise AssertionError(case)


# ---------------------------------------------------------------------- checkpoints
def checkpoint_run(directory: str, first: int, then: int, save: bool, seed_batches: int) -> dict:
    """Train ``first`` steps (saving a checkpoint) or load it, then ``then`` more steps."""
    model = shard(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), warmup=2, engine=CpuGraphs())
    data = batches(first + then, seed=seed_batches)
    if save:
        for x, y in data[:first]:
            step(x, y)
        ddpgraph.save_checkpoint(directory, step=first, train_step=step)
    else:
        ddpgraph.load_checkpoint(directory, train_step=step)
    losses = [float(step(x, y)) for x, y in data[first:]]
    return {"losses": losses, "params": full_params(model), "steps": step.report().steps}


def load_params(directory: str) -> dict:
    """Load a checkpoint saved at another world size; the whole parameters and Adam's state."""
    model = shard(make_model(seed=5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), warmup=2, engine=CpuGraphs())
    ddpgraph.load_checkpoint(directory, train_step=step, reshard=True)
    first = next(iter(model.parameters()))
    exp_avg = opt.state[first]["exp_avg"].full_tensor()  # type: ignore[attr-defined]
    loaded = full_params(model)
    x, y = batches(1, size=12)[0]
    step(x, y)  # trains on: the resharded optimizer state steps
    return {
        "loaded": loaded,
        "params": full_params(model),
        "exp_avg": exp_avg,
        "steps": step.report().steps,
    }


def capture_while_unsharding(steps: int = 6) -> dict:
    """An all-gather left pending by the script (``unshard(async_op=True)``, not waited for)
    before every step, the capture's included: TrainStep waits for it and reshards, so each
    step starts from FSDP2's idle state; the plain FSDP2 loop doing the same waits for it in its
    forward. Both models' whole parameters at the end."""
    data = batches(steps)
    model = shard(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), warmup=3, engine=CpuGraphs())
    for x, y in data:
        model.unshard(async_op=True)  # type: ignore[operator]
        step(x, y)
    plain = shard(make_model())
    # the optimizer the graphed step steps (capturable, the LR in a tensor)
    plain_opt = as_the_step_steps(torch.optim.AdamW(plain.parameters(), lr=1e-2))
    for x, y in data:
        plain.unshard(async_op=True)  # type: ignore[operator]
        nn.CrossEntropyLoss()(plain(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    report = step.report()
    return {
        "ours": full_params(model),
        "theirs": full_params(plain),
        "mode": report.mode,
        "replays": report.replays,
    }


def prefetch_and_sync_flag(steps: int, calls: int, warmup: int = 3) -> dict:
    """The GPU test's habits on the CPU stand-in (issue 42, item 3): ``model.unshard()`` before
    every call (explicit prefetch) and the script's own ``set_requires_gradient_sync`` kept
    around ``step()`` with ``accumulate_calls=calls``; which calls replayed, and the numbers."""
    model = shard(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainStep(
        model,
        opt,
        nn.CrossEntropyLoss(),
        accumulate_calls=calls,
        clip_grad_norm=1.0,
        warmup=warmup,
        engine=CpuGraphs(),
    )
    losses, not_replayed = [], []
    for i, (x, y) in enumerate(batches(steps * calls)):
        model.unshard()  # type: ignore[operator]
        model.set_requires_gradient_sync(i % calls == calls - 1)  # type: ignore[operator]
        before = step.report().replays
        losses.append(float(step(x, y)))
        if step.report().replays == before:
            not_replayed.append(i)
    report = step.report()
    return {
        "losses": losses,
        "params": full_params(model),
        "not_replayed": not_replayed,
        "replays": report.replays,
        "report": str(report),
    }
