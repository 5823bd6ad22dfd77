"""Accelerate's ``Accelerator`` with a graphed :class:`~ddpgraph.TrainStep`:
:func:`from_accelerator` (also ``TrainStep.from_accelerator``).

The Accelerator keeps the data loader (device placement, sharding, the sampler's epoch) and the
LR scheduler; the TrainStep owns model, optimizer and DDP (Accelerate would build its DDP on the
default stream, where its backward cannot be captured). What Accelerate's own loop state says is
followed, as a prepared model and optimizer would:

* A loop keeps ``with accelerator.accumulate(model):``; each step call syncs and steps the
  optimizer where Accelerate's ``sync_gradients`` is True: every ``gradient_accumulation_steps``
  calls, and at the end of the data (``sync_with_dataloader``: the epoch's leftover micro-batches
  step, as Accelerate's do). A prepared scheduler steps on those calls only, as before.
* ``accelerator.save_state`` / ``load_state`` save and load the TrainStep's model and optimizer
  in Accelerate's own files and keys, loaded in place so the graphs stay
  valid; with fp16 the loss scale too (one more registered object).
* fp16: an update skipped for inf/NaN gradients counts as skipped where Accelerate's own run
  says so (``optimizer.step_was_skipped``, ``accelerator.optimizer_step_was_skipped``; a
  prepared scheduler is then held back): for an optimizer whose step GradScaler skips, not for a
  fused one (``fused=True``), whose step GradScaler always calls and whose scheduler advances.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import ConfigError
from ..step.optim import restore_identities, tensor_slots
from ._optim import OptimizerView, scaler_reports_skips

__all__ = ["accelerator_options", "amp_of", "attach"]

_AMP = {"no": None, "bf16": "bf16", "fp16": "fp16"}
_DDP_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU")  # where Accelerate itself would use DDP or nothing


def accelerator_options(
    accelerator: Any, model: nn.Module, optimizer: Any, options: dict[str, Any]
) -> dict[str, Any]:
    """``TrainStep.from_accelerator``'s work: the TrainStep options ``accelerator`` says: ``mixed_precision`` as ``amp``,
    ``gradient_accumulation_steps`` as ``accumulate_calls``, its ``DistributedDataParallelKwargs``
    as ``ddp_kwargs``, the model moved to ``accelerator.device``.

    Pass the model and optimizer as built, not prepared (prepare the data loader and the
    scheduler only). Call on every rank.
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
    model.to(accelerator.device)
    # where Accelerate itself does not autocast (fp16 on a CPU: no native AMP), neither do we
    amp = amp_of(accelerator.mixed_precision) if getattr(accelerator, "native_amp", True) else None
    return {
        "amp": amp,
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


def attach(accelerator: Any, step: Any, model: nn.Module) -> None:
    """Make ``accelerator`` treat the TrainStep's model (``model``, as built) and optimizer as
    prepared ones where its loop state and checkpoints need them: each call follows
    ``sync_gradients``; ``save_state`` / ``load_state`` take the model (with the keys Accelerate's
    own run saves) and the optimizer, in Accelerate's own files; fp16 registers the loss scale
    as well."""
    state = accelerator.gradient_state
    step.loop_syncs = lambda: bool(state.sync_gradients)
    # Accelerate keeps what went through prepare() in these lists; a scheduler prepared before
    # holds the same list of optimizers and so checks this one's step_was_skipped
    accelerator._models.append(model)  # DDP's parameters are its parameters
    accelerator._optimizers.append(StepOptimizer(step))
    if step.loss_scale is not None:
        accelerator.register_for_checkpointing(_ExtraState(step))


class StepOptimizer(OptimizerView):
    """The TrainStep's optimizer as Accelerate's prepared optimizers look to Accelerate:
    ``step`` / ``zero_grad`` do nothing (the graph updates), ``load_state_dict`` loads in place
    (a captured graph keeps its tensors), ``step_was_skipped`` says what Accelerate's
    ``AcceleratedOptimizer`` would say of the same update."""

    def __init__(self, step: Any) -> None:
        super().__init__(step.optimizer, own_lr=False)
        self.train_step = step
        # the script's optimizer decides (TrainStep's switch to a fused fp16 kernel sets only
        # the param groups' "fused", not _step_supports_amp_scaling)
        self.reports_skips = scaler_reports_skips(step.optimizer)

    @property
    def step_was_skipped(self) -> bool:
        """fp16: the latest update overflowed and Accelerate would report it (a host read)."""
        return self.reports_skips and bool(self.train_step.update_skipped)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        kept = tensor_slots(self.optimizer)
        super().load_state_dict(state_dict)
        restore_identities(self.optimizer, kept)
        self.train_step.load_extra_state({})  # the graphs re-read the LR


class _ExtraState:
    """fp16's loss scale (and the step count) for ``register_for_checkpointing``."""

    def __init__(self, step: Any) -> None:
        self.train_step = step

    def state_dict(self) -> dict[str, Any]:
        return dict(self.train_step.extra_state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_step.load_extra_state(state)
