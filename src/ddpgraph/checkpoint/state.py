"""What a checkpoint holds: the parts it covers, their live state, RNG, and the data position."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..step import TrainStep

from .layout import Stateful


class ResumableLoader:
    """Iterates a data loader epoch by epoch and remembers how far training got, for exact resume.

    ``iter(loader)`` runs one epoch: it calls ``sampler.set_epoch(epoch)`` (a
    ``DistributedSampler``'s shuffle depends on it) and yields the loader's batches, counting
    them. After a :func:`load_checkpoint`, the next epoch starts at the saved epoch and skips the
    batches already trained on, so a resumed run sees exactly the batches an uninterrupted one
    would. Skipped batches are drawn and dropped (they cost loading time, not training).

    Wrap the loader outermost (around any prefetching), so that what is counted is what the
    training step consumed, and save checkpoints after the step that used the batch.
    ``sampler`` defaults to ``loader.sampler``.
    """

    def __init__(self, loader: Iterable[Any], *, sampler: Any = None) -> None:
        self.loader = loader
        self.sampler = sampler if sampler is not None else getattr(loader, "sampler", None)
        self.epoch = 0
        self.batches = 0  # batches of `epoch` handed out so far

    def __iter__(self) -> Iterator[Any]:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self.epoch)
        skip = self.batches
        for i, batch in enumerate(self.loader):
            if i < skip:
                continue
            self.batches = i + 1
            yield batch
        self.epoch += 1
        self.batches = 0

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.batches = int(state["batches"])


@dataclass
class _Parts:
    """The objects one checkpoint covers, resolved from the arguments."""

    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    scheduler: Stateful | None
    train_step: TrainStep | None
    loader: Stateful | None


def _resolve(
    caller: str,
    train_step: TrainStep | None,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Stateful | None,
    loader: Stateful | None,
) -> _Parts:
    if train_step is not None:
        if model is not None or optimizer is not None:
            raise ConfigError(
                f"{caller}: pass train_step= or model=/optimizer=, not both; the TrainStep "
                "already holds its model and optimizer."
            )
        if scheduler is not None and train_step.scheduler not in (None, scheduler):
            raise ConfigError(
                f"{caller}: scheduler= differs from the TrainStep's own scheduler; pass one."
            )
        model, optimizer = train_step.model, train_step.optimizer
        scheduler = scheduler if scheduler is not None else train_step.scheduler
    if model is None:
        raise ConfigError(
            f"{caller}: nothing to checkpoint; pass train_step=step, or model= (and optimizer=)."
        )
    if optimizer is None and scheduler is not None:
        raise ConfigError(f"{caller}: scheduler= needs the optimizer it drives; pass optimizer=.")
    for name, obj in (("loader", loader), ("scheduler", scheduler)):
        if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(
                f"{caller}: {name}={type(obj).__name__} has no state_dict()/load_state_dict(); "
                + (
                    "wrap the data loader in ddpgraph.ResumableLoader."
                    if name == "loader"
                    else "pass a torch.optim.lr_scheduler scheduler."
                )
            )
    return _Parts(model, optimizer, scheduler, train_step, loader)


def _live_state(parts: _Parts, rank: int) -> dict[str, Any]:
    """The checkpoint's state dict; its tensors *are* the live ones, so DCP loads in place.

    Model and optimizer come from torch's ``get_state_dict`` (keys are parameter names, DDP and
    torch.compile prefixes removed). Per-rank entries (RNG, data position) are keyed by rank:
    DCP keeps one copy of a key that every rank saves, which is right only for replicated state.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    assert parts.model is not None
    optimizers = () if parts.optimizer is None else (parts.optimizer,)
    if parts.optimizer is not None:
        _create_optimizer_state(parts.optimizer)
    model_state, optimizer_state = get_state_dict(parts.model, optimizers)
    state: dict[str, Any] = {"model": model_state}
    if parts.optimizer is not None:
        # hyperparameters as one value: whether "lr" is a float or a tensor must not matter
        groups = _Opaque(optimizer_state["param_groups"])
        state["optimizer"] = {**optimizer_state, "param_groups": groups}
    if parts.scheduler is not None:
        # its _last_lr holds floats until the first step with a tensor LR, tensors after it
        state["scheduler"] = _Opaque(parts.scheduler.state_dict())
    if parts.train_step is not None:
        state["train_step"] = _Opaque(_train_step_counters(parts.train_step))
    state["rng"] = {f"rank{rank}": _Opaque(_rng_state())}  # whole: with or without CUDA
    if parts.loader is not None:
        state["loader"] = {f"rank{rank}": _Opaque(parts.loader.state_dict())}
    return state


class _Opaque:
    """A value DCP stores whole (pickled) instead of flattening it key by key.

    DCP loads a flattened entry only where the live object has the same structure; the
    scheduler's or a loader's state changes shape during training (a float becomes a tensor, a
    list grows), which a resumed process has not seen yet. Tensors inside go to the CPU: DCP
    writes replicated values from rank 0, and a CUDA tensor would load onto rank 0's GPU.
    """

    def __init__(self, value: Any) -> None:
        self.value = _on_cpu(value)


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def _opened(value: Any) -> Any:
    return value.value if isinstance(value, _Opaque) else value


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped yet its state tensors, to be saved or loaded into.

    torch's ``get_state_dict`` does this itself with one step of zero gradients at LR 0, but it
    sets a tensor LR to a new *CPU* tensor for that step, which a graph-safe optimizer on CUDA
    (LR on the device, fused or capturable kernels) may refuse. Here the LR tensor is zeroed in
    place instead. The parameters do not change: the gradients and the LR are zero.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not params or any(p.grad is not None for p in params):
        return  # as torch's rule: gradients mean a step is under way; leave the optimizer be
    saved = []
    for group in optimizer.param_groups:
        lr = group["lr"]
        saved.append(lr.clone() if isinstance(lr, torch.Tensor) else lr)
        if isinstance(lr, torch.Tensor):
            lr.zero_()
        else:
            group["lr"] = 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved):
        if isinstance(lr, torch.Tensor):
            group["lr"].copy_(lr)
        else:
            group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call, unused-ignore]
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())


def _train_step_counters(train_step: Any) -> dict[str, Any]:
    """What a TrainStep holds besides model and optimizer: its step count, fp16's scale."""
    return dict(train_step.extra_state())
