"""Accelerate's ``Accelerator`` with a graphed :class:`~ddpgraph.TrainStep`:
:func:`from_accelerator` (also ``TrainStep.from_accelerator``).

The Accelerator keeps the data loader (device placement, sharding, the sampler's epoch) and the
LR scheduler; the TrainStep owns model, optimizer and DDP (Accelerate would build its DDP on the
default stream, where its backward cannot be captured). A loop keeps
``with accelerator.accumulate(model):`` so that a prepared scheduler steps on the optimizer steps
only, as it did.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import ConfigError

__all__ = ["accelerator_options", "amp_of"]

_AMP = {"no": None, "bf16": "bf16", "fp16": "fp16"}
_DDP_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU")  # where Accelerate itself would use DDP or nothing


def accelerator_options(
    accelerator: Any, model: nn.Module, optimizer: Any, options: dict[str, Any]
) -> dict[str, Any]:
    """``TrainStep.from_accelerator``'s work: the TrainStep options ``accelerator`` says: ``mixed_precision`` as ``amp``,
    ``gradient_accumulation_steps`` as ``accumulate_calls``, its ``DistributedDataParallelKwargs``
    as ``ddp_kwargs``, the model moved to ``accelerator.device``.

    Pass the model and optimizer as built, not prepared (prepare the data loader and the
    scheduler only). Call on every rank. Accumulation windows run on across epochs (Accelerate's
    ``sync_with_dataloader`` is turned off): a graphed step takes exactly
    ``gradient_accumulation_steps`` micro-batches per update.
    """
    _check_not_prepared(accelerator, model, optimizer)
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in _DDP_TYPES:
        raise ConfigError(
            f"TrainStep.from_accelerator runs data-parallel training with DDP, but the "
            f"Accelerator is set up for {kind}; use accelerate's DDP (multi-GPU) configuration."
        )
    for name in ("amp", "accumulate_calls"):
        if name in options:
            raise ConfigError(
                f"TrainStep.from_accelerator(..., {name}=...) is set by the Accelerator "
                "(mixed_precision, gradient_accumulation_steps); set it there."
            )
    handler = getattr(accelerator, "ddp_handler", None)
    ddp_kwargs = dict(handler.to_kwargs()) if handler is not None else {}
    ddp_kwargs.update(options.pop("ddp_kwargs", None) or {})
    state = accelerator.gradient_state
    state.plugin_kwargs["sync_with_dataloader"] = False  # a window never ends early
    model.to(accelerator.device)
    return {
        "amp": amp_of(accelerator.mixed_precision),
        "accumulate_calls": accelerator.gradient_accumulation_steps,
        "ddp_kwargs": ddp_kwargs,
        **options,
    }


def amp_of(mixed_precision: str) -> str | None:
    """Accelerate's ``mixed_precision`` as TrainStep's ``amp``."""
    value = str(getattr(mixed_precision, "value", mixed_precision))
    if value not in _AMP:
        raise ConfigError(
            f"mixed_precision={value!r} has no graphed equivalent; use 'bf16', 'fp16' or 'no'."
        )
    return _AMP[value]


def _check_not_prepared(accelerator: Any, model: object, optimizer: object) -> None:
    fix = (
        "pass the model and optimizer as built and prepare only the data loader and scheduler: "
        "loader, scheduler = accelerator.prepare(loader, scheduler); the TrainStep wraps the "
        "model in DDP itself, on the stream it captures with."
    )
    if type(optimizer).__name__ == "AcceleratedOptimizer":
        raise ConfigError(
            f"TrainStep.from_accelerator got an optimizer accelerator.prepare() wrapped; {fix}"
        )
    prepared = getattr(accelerator, "_models", [])
    inner = getattr(model, "module", None)
    if any(m is model for m in prepared) or (
        isinstance(inner, nn.Module) and type(model).__name__ == "DistributedDataParallel"
    ):
        raise ConfigError(
            f"TrainStep.from_accelerator got a model accelerator.prepare() already set up "
            f"({type(model).__name__}); {fix}"
        )
