"""Accelerate's ``Accelerator`` with a graphed :class:`~ddpgraph.TrainStep`:
:func:`from_accelerator`.

The Accelerator keeps the data loader (device placement, sharding, the sampler's epoch) and the
LR scheduler; the TrainStep owns model, optimizer and DDP (Accelerate would build its DDP on the
default stream, where its backward cannot be captured). What Accelerate's own loop state says is
followed, as a prepared model and optimizer would:

* A loop keeps ``with accelerator.accumulate(model):``; each step call syncs and steps the
  optimizer where Accelerate's ``sync_gradients`` is True: every ``gradient_accumulation_steps``
  calls, and at the end of the data (``sync_with_dataloader``: the epoch's leftover micro-batches
  step, as Accelerate's do). A prepared scheduler steps on those calls only, as before. A step
  called outside any ``accumulate()`` block while ``gradient_accumulation_steps > 1`` follows
  the script's own window where the script says where it ends (its DDP's ``no_sync()`` on
  ``train_step.model``, or ``last=``: Accelerate's
  ``gradient_accumulation_for_autoregressive_models.py``), else is refused naming the line
  (Accelerate would step on every call with the loss divided).
* A script that accumulates by hand on a plain ``Accelerator()`` (``if step % k == 0 or last:
  optimizer.step()``, as transformers' ``run_glue_no_trainer.py``) passes ``accumulate_calls=k``
  and ``last=`` its own condition; its micro-batches sync their gradients as the script's
  prepared DDP did (``sync_every_call``), so the run is the script's bit for bit.
* The script's own ``optimizer.step()`` left in the loop is refused naming its line: the
  update runs inside the step.
* The model's forward runs under Accelerate's autocast with float32 outputs, as a prepared
  model's does (bf16/fp16): the script's evaluation through ``step.model`` is Accelerate's.
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

import torch
from torch import nn

from .._frames import PACKAGE_DIR, line_outside
from ..errors import ConfigError
from ..step.body import LossFn
from ..step.optim import restore_identities, tensor_slots
from ..step.train_step import TrainStep
from ..step.window import WindowEnds
from ._forward import forward_under
from ._optim import OptimizerView, refuse_script_steps, scaler_reports_skips

__all__ = ["accelerator_options", "amp_of", "attach", "from_accelerator", "window_ends"]

_AMP = {"no": None, "bf16": "bf16", "fp16": "fp16"}
_DDP_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU")  # where Accelerate itself would use DDP or nothing


def from_accelerator(
    accelerator: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn | None = None,
    **options: Any,
) -> TrainStep:
    """A TrainStep set up as an Accelerate ``Accelerator`` says (mixed_precision as amp,
    gradient_accumulation_steps as accumulate_calls), whose windows end where Accelerate's
    ``sync_gradients`` says (an epoch's leftover micro-batches step the optimizer, as
    Accelerate's do) and whose model and optimizer ``accelerator.save_state`` /
    ``load_state`` save and load. A loop that accumulates by hand on a plain
    ``Accelerator()`` passes ``accumulate_calls=k`` and ``last=`` its own condition (each
    micro-batch then syncs, as its prepared DDP did). ``options`` are TrainStep's; call on
    every rank with the model and optimizer as built (not prepared)."""
    if not hasattr(accelerator, "distributed_type"):
        raise TypeError(
            f"from_accelerator(accelerator, model, optimizer, ...): the first argument is the "
            f"script's accelerate.Accelerator, got {type(accelerator).__name__}; pass "
            "from_accelerator(accelerator, model, optimizer)."
        )
    said = "accumulate_calls" in options  # else a script accumulating by hand is refused
    chosen = accelerator_options(accelerator, model, optimizer, options)
    ends = window_ends(accelerator, window_said=said)
    # before the step is built: it captures the forward it is given (one wrapped after would be
    # a change outside it, followed with a warning)
    _autocast_forward(accelerator, model)
    step = TrainStep(model, optimizer, loss_fn, window_ends=ends, **chosen)
    attach(accelerator, step, model, ends)
    return step


def window_ends(accelerator: Any, *, window_said: bool) -> WindowEnds | None:
    """Where the Accelerator's loop says a TrainStep's window ends (its ``window_ends=``):
    its ``accumulate()`` blocks where ``gradient_accumulation_steps > 1``
    (:class:`AccumulateBlocks`); on a plain ``Accelerator()`` whose script said no
    ``accumulate_calls`` (``window_said``), every call, checked against the script's
    scheduler (:class:`SchedulerSteps`); else None: ``sync_gradients`` is True on every call
    and the window counts its calls (the ``accumulate_calls`` the script passed) and ends at
    ``last=True``."""
    if accelerator.gradient_accumulation_steps > 1:
        return AccumulateBlocks(accelerator)
    return None if window_said else SchedulerSteps(accelerator)


def accelerator_options(
    accelerator: Any, model: nn.Module, optimizer: Any, options: dict[str, Any]
) -> dict[str, Any]:
    """:func:`from_accelerator`'s work: the TrainStep options ``accelerator`` says: ``mixed_precision`` as ``amp``,
    ``gradient_accumulation_steps`` as ``accumulate_calls``, its ``DistributedDataParallelKwargs``
    as ``ddp_kwargs`` and (fp16) ``GradScalerKwargs`` as ``grad_scaler``, the model moved to ``accelerator.device``. Where the Accelerator does not
    accumulate (``gradient_accumulation_steps`` 1), ``accumulate_calls=k`` is the script's own
    accumulation, with ``sync_every_call=True`` unless given.

    Pass the model and optimizer as built, not prepared (prepare the data loader and the
    scheduler only). Call on every rank.
    """
    _check_not_prepared(accelerator, model, optimizer)
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in _DDP_TYPES:
        raise ConfigError(
            f"from_accelerator runs data-parallel training with DDP, but the "
            f"Accelerator is set up for {kind}; use accelerate's DDP (multi-GPU) configuration."
        )
    if "amp" in options:
        raise ConfigError(
            "from_accelerator(..., amp=...) is set by the Accelerator "
            "(mixed_precision); set it there."
        )
    k = accelerator.gradient_accumulation_steps
    if "accumulate_calls" in options and k != 1:
        raise ConfigError(
            f"from_accelerator(..., accumulate_calls={options['accumulate_calls']!r}) "
            f"with Accelerator(gradient_accumulation_steps={k}): Accelerate owns the "
            "accumulation; drop accumulate_calls (the step follows accelerator.accumulate()), or "
            "keep the script's own accumulation with Accelerator(gradient_accumulation_steps=1), "
            "accumulate_calls=k and step(batch, last=<the script's optimizer.step() condition>)."
        )
    # the script's own accumulation on a prepared DDP that never entered no_sync: every
    # micro-batch's backward synced its gradients, and so do the step's
    by_hand = {"sync_every_call": True} if options.get("accumulate_calls", 1) > 1 else {}
    handler = getattr(accelerator, "ddp_handler", None)
    ddp_kwargs = dict(handler.to_kwargs()) if handler is not None else {}
    said = options.pop("ddp_kwargs", None)
    ddp_kwargs.update(said or {})
    wrapping = wrapping_as_prepared(accelerator, ddp_kwargs, options, ddp_kwargs_said=bool(said))
    model.to(accelerator.device)
    # where Accelerate itself does not autocast (fp16 on a CPU: no native AMP), neither do we
    amp = amp_of(accelerator.mixed_precision) if getattr(accelerator, "native_amp", True) else None
    scaler = _scaler_options(accelerator, options) if amp == "fp16" else {}
    return {
        "amp": amp,
        "accumulate_calls": k,
        **wrapping,
        **scaler,
        **by_hand,
        **options,
    }


def wrapping_as_prepared(
    accelerator: Any,
    ddp_kwargs: dict[str, Any],
    options: dict[str, Any],
    *,
    ddp_kwargs_said: bool = False,
) -> dict[str, Any]:
    """TrainStep's wrapper options as ``accelerator.prepare`` wraps the model: ``ddp_kwargs``
    (the framework's, and the script's own where ``ddp_kwargs_said``) where it wraps it in DDP;
    ``parallel="none"`` where it leaves it unwrapped (one process: no DDP bucket copies or
    one-rank all-reduce; the framework's DDP arguments unused, as Accelerate leaves them).
    A script's own ``parallel`` wins: with ``"none"`` the framework's DDP arguments are dropped
    (the step refuses the script's own)."""
    chosen = options.get("parallel")
    if chosen == "none":
        return {"ddp_kwargs": ddp_kwargs} if ddp_kwargs_said else {}
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if chosen is not None or ddp_kwargs_said or _prepares_ddp(accelerator, kind):
        return {"ddp_kwargs": ddp_kwargs}
    return {"parallel": "none"}


def _prepares_ddp(accelerator: Any, kind: str) -> bool:
    """Whether ``accelerator.prepare(model)`` wraps the model in DDP: on several processes
    (Accelerate's ``multi_device``), and always on ``MULTI_CPU``; not when this process is the
    only one, even where a process group of one rank exists (``torchrun --nproc-per-node 1``)."""
    if kind == "MULTI_CPU":
        return True
    grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if grouped else 1
    # a group of several ranks where Accelerate saw one process: DDP, as before (never unsynced)
    return (kind == "MULTI_GPU" and accelerator.num_processes > 1) or world > 1


def _scaler_options(accelerator: Any, options: dict[str, Any]) -> dict[str, Any]:
    """fp16: the loss scaler Accelerate builds from its ``GradScalerKwargs`` (init_scale,
    growth_factor, backoff_factor, growth_interval) as TrainStep's ``grad_scaler``, so the
    scale, and with it every skipped update, follows Accelerate's own run."""
    handler = getattr(accelerator, "scaler_handler", None)
    kwargs = dict(handler.to_kwargs()) if handler is not None else {}
    if "grad_scaler" in options:
        raise ConfigError(
            f"from_accelerator(..., grad_scaler={options['grad_scaler']!r}): the "
            "Accelerator sets fp16's loss scaling; pass accelerate.utils.GradScalerKwargs("
            "init_scale=..., ...) in Accelerator(kwargs_handlers=[...]) instead."
        )
    if kwargs.pop("enabled", True) is False:
        raise ConfigError(
            "GradScalerKwargs(enabled=False) trains fp16 without loss scaling, which TrainStep "
            "does not do (small gradients would flush to zero); drop enabled=False or use "
            "mixed_precision='bf16'."
        )
    return {"grad_scaler": kwargs} if kwargs else {}


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
        raise ConfigError(f"from_accelerator got an optimizer accelerator.prepare() wrapped; {fix}")
    prepared = getattr(accelerator, "_models", [])
    inner = getattr(model, "module", None)
    if any(m is model for m in prepared) or (
        isinstance(inner, nn.Module) and type(model).__name__ == "DistributedDataParallel"
    ):
        raise ConfigError(
            f"from_accelerator got a model accelerator.prepare() already set up "
            f"({type(model).__name__}); {fix}"
        )


def attach(
    accelerator: Any, step: TrainStep, model: nn.Module, ends: WindowEnds | None = None
) -> None:
    """Make ``accelerator`` treat the TrainStep's model (``model``, as built) and optimizer as
    prepared ones where its loop state and checkpoints need them: ``ends`` (the step's
    ``window_ends``, from :func:`window_ends`) starts counting the loop's ``accumulate()``
    blocks; ``save_state`` / ``load_state`` take the model (with the keys Accelerate's own run
    saves) and the optimizer, in Accelerate's own files; fp16 registers the loss scale as
    well. The model's forward runs under Accelerate's autocast where a prepared model's would:
    :func:`from_accelerator` wraps it before building the step."""
    if isinstance(ends, AccumulateBlocks):
        ends.count_blocks(accelerator)  # from here: a step that failed to build patches nothing
    refuse_script_steps(step.optimizer, "the TrainStep built by from_accelerator")
    # Accelerate keeps what went through prepare() in these lists; a scheduler prepared before
    # holds the same list of optimizers and so checks this one's step_was_skipped
    accelerator._models.append(model)  # DDP's parameters are its parameters
    accelerator._optimizers.append(StepOptimizer(step))
    if step.loss_scale is not None:
        accelerator.register_for_checkpointing(_ExtraState(step))


def _autocast_forward(accelerator: Any, model: nn.Module) -> None:
    """The model's forward under Accelerate's autocast with float32 outputs, as
    ``accelerator.prepare(model)`` makes it (``native_amp``: bf16, or fp16 on CUDA): the
    script's evaluation through ``step.model`` then runs in the precision it ran in before."""
    if not getattr(accelerator, "native_amp", False):
        return
    from accelerate.utils import convert_to_fp32, get_mixed_precision_context_manager

    native, handler = accelerator.native_amp, getattr(accelerator, "autocast_handler", None)
    forward_under(
        model, lambda: get_mixed_precision_context_manager(native, handler), convert_to_fp32
    )


class AccumulateBlocks:
    """Accelerate's ``sync_gradients`` at each step call inside an
    ``accelerator.accumulate(model)`` block: Accelerate counts its window in those blocks
    (``_do_sync``). A script that never enters one accumulates by hand, where
    ``gradient_accumulation_steps`` is only ``accelerator.backward``'s loss divisor (Accelerate's
    ``gradient_accumulation_for_autoregressive_models.py``: ``model.no_sync`` on every
    micro-batch but a window's last, then ``optimizer.step()``): its window is followed where it
    says where each window ends, by its DDP's ``no_sync()`` on ``train_step.model`` or by
    ``last=`` on its calls (each micro-batch still divides its loss by k, as
    ``accelerator.backward`` did). Outside any block with neither, Accelerate would step on every
    call with the loss divided by k, which a script meaning to accumulate would not: refused."""

    def __init__(self, accelerator: Any) -> None:
        self.state = accelerator.gradient_state
        self.steps = accelerator.gradient_accumulation_steps
        self.blocks = 0  # accumulate() blocks entered since count_blocks

    def count_blocks(self, accelerator: Any) -> None:
        """Count the ``accumulate()`` blocks the loop enters from now on."""
        do_sync = getattr(accelerator, "_do_sync", None)  # private: accelerate 1.x's
        if do_sync is None:  # another accelerate: sync_gradients alone, unchecked
            self.blocks = 1
            return

        def counted() -> None:
            self.blocks += 1
            do_sync()

        accelerator._do_sync = counted

    def __call__(self, script_says: bool) -> bool | None:
        if self.blocks:
            return bool(self.state.sync_gradients)
        if script_says:  # the script's own window: the step counts it, as Accelerate did not
            return None
        raise ConfigError(
            f"Accelerator(gradient_accumulation_steps={self.steps}), but the TrainStep was "
            f"called outside any `with accelerator.accumulate(model):` block, at "
            f"{line_outside(PACKAGE_DIR)}, and the script says nowhere where its accumulation "
            f"window ends: Accelerate would step the optimizer on every call with the loss "
            f"divided by {self.steps}, the step every {self.steps} calls. Put the call inside "
            "`with accelerator.accumulate(model):`; or, for a loop that accumulates by hand, "
            "pass last=<the loop's optimizer.step() condition> to each call (train_step(batch, "
            "last=...); on several processes, with its DDP's no_sync() on train_step.model "
            "around the other "
            "micro-batches, as Accelerate's gradient_accumulation_for_autoregressive_models.py "
            "has, the sync coming back on ends the window too)."
        )


class SchedulerSteps:
    """A script that accumulates by hand on a plain ``Accelerator()`` but whose port did not say
    so (no ``accumulate_calls``): refused at the first call after its pattern shows, instead of
    an update on every micro-batch.

    The signal is the script's prepared LR scheduler (``accelerator.prepare(scheduler)``): such
    a script steps it under the same condition as its ``optimizer.step()`` (run_glue_no_trainer.py's
    ``if step % k == 0 or step == len(train_dataloader) - 1``), so inside one pass over a
    prepared data loader it steps after some calls and not after others. A script that updates
    on every call steps it after every call, or only at the end of an epoch (the calls after a
    loader's last batch are not compared). Calls to each prepared scheduler's ``step()`` are
    counted (not its internal count, which fp16's skipped updates hold back). A script with
    no prepared scheduler gives no signal (documented). Every rank counts the same calls, so
    every rank raises at the same call."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.state = accelerator.gradient_state
        self.calls = 0  # step calls so far
        self.counted: dict[int, list[int]] = {}  # id(scheduler) -> [its step() calls]
        self.previous: tuple[int, bool] | None = None  # (scheduler steps, ended its loader)
        self.after: dict[bool, int] = {}  # stepped after a call or not -> the first such call

    def __call__(self, script_says: bool) -> bool | None:
        self.calls += 1
        steps = self._scheduler_steps()
        in_loader = bool(self.state.in_dataloader)
        previous, self.previous = self.previous, (steps, bool(self.state.end_of_dataloader))
        if previous is None or not in_loader or previous[1]:
            return True
        stepped = steps != previous[0]
        self.after.setdefault(stepped, self.calls - 1)
        if len(self.after) == 2:
            self._refuse()
        return True

    def _scheduler_steps(self) -> int:
        for scheduler in getattr(self.accelerator, "_schedulers", []):
            if id(scheduler) not in self.counted:
                self.counted[id(scheduler)] = self._count(scheduler)
        return sum(count[0] for count in self.counted.values())

    @staticmethod
    def _count(scheduler: Any) -> list[int]:
        count = [0]
        step = scheduler.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return step(*args, **kwargs)

        scheduler.step = counted
        return count

    def _refuse(self) -> None:
        stepped, held = self.after[True], self.after[False]
        raise ConfigError(
            f"the script steps its LR scheduler after some TrainStep calls and not after others "
            f"within one pass over its data (after call {stepped}, not after call {held}): it "
            "updates only on some calls, accumulating by hand (run_glue_no_trainer.py's `if step "
            "% args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:`), "
            "but the TrainStep built by from_accelerator without accumulate_calls updates the "
            f"model on every call (it did so on calls 1 to {self.calls - 1}). Pass "
            "accumulate_calls=k to from_accelerator and last=<that condition> to each "
            f"call (train_step(batch, last=...)), at {line_outside(PACKAGE_DIR)}; or, if the "
            "script does update on every call and steps its scheduler on only some, pass "
            "accumulate_calls=1."
        )


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
