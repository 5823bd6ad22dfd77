"""transformers' ``Trainer`` with its training step as one graphed :class:`~ddpgraph.TrainStep`.

``GraphTrainer`` takes what ``transformers.Trainer`` takes. The Trainer keeps its data loading,
LR scheduler, logging, evaluation, callbacks and checkpoints; the step (forward and the loss as
``Trainer.compute_loss`` computes it, with ``num_items_in_batch``; backward;
``gradient_accumulation_steps`` micro-batches, ``max_grad_norm`` clipping, the optimizer update)
is a TrainStep, which owns DDP. How it is wired, and why each piece:

* ``_wrap_model`` returns a handle instead of the model, so Accelerate does not wrap the model in
  a DDP of its own (built on the default stream, its backward cannot be captured).
* The Trainer's own FSDP2 (``fsdp=True``, version 2): ``_wrap_model`` returns the model so that
  Accelerate shards it and points the optimizer at the shards as in the Trainer's run; the loop
  then gets the handle (its ``no_sync`` left to the step), the TrainStep graphs the FSDP2 step,
  and checkpoints are Accelerate's FSDP2 save and load.
* The Trainer's optimizer becomes a view (:class:`OptimizerView`): ``step()`` and
  ``zero_grad()`` do nothing (the graph updates and zeroes), and the scheduler drives the view's
  param groups, whose LR (a Python float) is handed to the real optimizer before every step.
  The LR reaches the graph as a device tensor, and the Trainer logs the float: no host sync.
* ``num_items_in_batch`` (the window's token count, summed over ranks) enters the graph as a
  batch entry, a static input copied in at every replay, never a constant of the capture.
* ``logging_nan_inf_filter`` is applied on the device (``torch.where``) instead of the
  Trainer's ``isnan(loss) or isinf(loss)``, a host sync per micro-batch.
* The grad norm the Trainer logs is ``step.grad_norm`` (measured inside the graph).
* TRL's SFTTrainer: its loss on TRL's fixed-shape path, its metrics taken out of the graph and
  logged from the step's outputs (:mod:`._trl`); packed batches at a fixed capacity
  (:mod:`._packing`).
* fp16: an overflowed update is skipped on the device, and the Trainer's LR scheduler advances
  or waits as in its own run: Accelerate reports a skip (the Trainer then holds the scheduler
  back) only for an optimizer whose step GradScaler skips, never for a fused one such as the
  default ``adamw_torch_fused``, whose schedule advances through overflows.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

try:
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ddpgraph.integrations.transformers needs transformers; install it with "
        "pip install 'ddpgraph[transformers]'."
    ) from exc

from ..errors import ConfigError
from ..step import StepReport, TrainStep
from ._optim import OptimizerView, scaler_reports_skips
from ._packing import MAX_LENGTHS, fixed_capacity, is_packed
from ._trl import SFTMetrics, fixed_shape_loss, is_sft_trainer
from .accelerate import wrapping_as_prepared

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(
        f"ddpgraph.integrations.transformers needs transformers >= 5 (its Trainer's "
        f"_clip_grad_norm and training_step hooks), found {transformers.__version__}; "
        "pip install 'ddpgraph[transformers]'."
    )

__all__ = ["GraphTrainer", "TrainerReport", "graphed"]

NUM_ITEMS = "num_items_in_batch"  # the batch entry that carries the Trainer's token count
WINDOW = "ddpgraph_window_micro_batches"  # the entry that carries this window's micro-batches
METRICS = "ddpgraph_metrics"  # the step output's entry with a TRL trainer's metric tensors
REAL_TOKENS = "ddpgraph_packed_tokens"  # a packed batch's tokens before its fixed-capacity padding

# TrainStep options that TrainingArguments already set: taking them twice would let them differ
_FROM_ARGS = {
    "amp": "bf16 / fp16",
    "accumulate_calls": "gradient_accumulation_steps",
    "clip_grad_norm": "max_grad_norm",
    "grad_norm": "max_grad_norm",
    "scheduler": "lr_scheduler_type (or optimizers=(optimizer, scheduler))",
    "ddp_kwargs": "ddp_find_unused_parameters / ddp_bucket_cap_mb / ddp_broadcast_buffers",
}


@dataclass
class TrainerReport:
    """:meth:`GraphTrainer.report`: the TrainStep's report and the host syncs the Trainer's own
    loop still makes (none per micro-batch, none per step apart from logging)."""

    step: StepReport | None
    host_syncs: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = "no training step yet" if self.step is None else str(self.step)
        return "\n".join([head, *(f"host sync left: {s}" for s in self.host_syncs)])


class GraphTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose training step is one graphed :class:`~ddpgraph.TrainStep`.

    Same constructor and ``TrainingArguments`` as the Trainer; ``step_options`` passes further
    TrainStep options (``graph``, ``warmup``, ``on_new_shape``, ``compile``, ``engine``); what
    ``TrainingArguments`` sets (precision, accumulation, clipping, the scheduler, DDP's
    arguments) comes from there. The TrainStep is built at the first training step (after a
    checkpoint was loaded into model, optimizer and scheduler) and kept as :attr:`train_step`.

    Variable lengths replay by default: a data collator that pads to the longest row
    (``pad_to_multiple_of=None``: DataCollatorWithPadding, DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq, TRL's collators) pads training batches to a multiple of
    :attr:`pad_to_multiple_of` tokens, and each new length is captured once
    (``on_new_shape="capture"``, unless ``step_options`` says otherwise): the plain Trainer
    with that collator's ``pad_to_multiple_of`` set the same trains the same.
    """

    #: Training batches are padded to a multiple of this many tokens where the collator pads to
    #: the longest row (64, or a divisor of the model's maximum length); None keeps the
    #: collator's padding.
    pad_to_multiple_of: int | None = 64

    def __init__(
        self, *args: Any, step_options: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if step_options is None:  # a subclass listing another Trainer first took them
            step_options = self.__dict__.pop("_step_options_given", None)
        _check_not_sharded(kwargs.get("model", args[0] if args else None))
        options = dict(step_options or {})
        taken = sorted(set(options) & set(_FROM_ARGS))
        if taken:
            raise ConfigError(
                f"GraphTrainer(step_options=...) got {taken}, which the TrainingArguments set "
                f"({', '.join(_FROM_ARGS[k] for k in taken)}); set them there."
            )
        super().__init__(*args, **kwargs)
        _check_sharding_engine(self)
        if self.args.torch_compile and "compile" in options:
            raise ConfigError(
                f"GraphTrainer got TrainingArguments(torch_compile=True) and step_options="
                f"{{'compile': {options['compile']!r}}}; set it in one place (the "
                "TrainingArguments' torch_compile_backend / torch_compile_mode map to it)."
            )
        self.step_options = options
        self.train_step: TrainStep | None = None
        self._handle: _StepHandle | None = None
        self._view: OptimizerView | None = None
        self._filter_nan_inf = False
        self._accelerated_optimizer: Any = None
        self._reports_skips = False  # Accelerate's verdict for this optimizer: see create_scheduler
        # TRL's SFTTrainer: its metrics come from the step's outputs, not from inside the graph
        self._sft_metrics = SFTMetrics(self) if is_sft_trainer(self) else None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that lists another Trainer before GraphTrainer (``class T(SFTTrainer,
        GraphTrainer)``) runs that Trainer's ``__init__`` first, which does not know
        ``step_options``: take them off there and hand them to ``GraphTrainer.__init__``."""
        super().__init_subclass__(**kwargs)
        cls._log_after_flushing()
        init = cls.__init__
        if "step_options" in inspect.signature(init, follow_wrapped=False).parameters:
            return  # GraphTrainer's own __init__ (or one that takes them) comes first

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, step_options: Any = None, **kw: Any) -> None:
            self.__dict__["_step_options_given"] = step_options
            init(self, *args, **kw)

        cls.__init__ = __init__  # type: ignore[method-assign]

    @classmethod
    def _log_after_flushing(cls) -> None:
        """A Trainer listed before GraphTrainer with a ``log`` of its own (``class T(SFTTrainer,
        GraphTrainer)``) reads its metrics there: flush the step's metrics before it runs."""
        log = cls.log
        if log is GraphTrainer.log or getattr(log, "_flushes_first", False):
            return

        @functools.wraps(log)
        def flushing_log(self: Any, *args: Any, **kwargs: Any) -> Any:
            self._flush_step_metrics()
            return log(self, *args, **kwargs)

        flushing_log._flushes_first = True  # type: ignore[attr-defined]
        cls.log = flushing_log  # type: ignore[method-assign]

    # ----------------------------------------------------------------- the Trainer's hooks
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``logging_nan_inf_filter`` is applied on the device meanwhile."""
        with self._nan_inf_filter_on_device():
            return super().train(*args, **kwargs)

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> nn.Module:
        if not training:  # evaluation and prediction: the Trainer's own, eager
            return super()._wrap_model(model, training=False, dataloader=dataloader)
        if self._fsdp2:
            # the Trainer's FSDP2: Accelerate's prepare(model, optimizer) shards the model as in
            # the Trainer's own run; the handle comes after (_prepare_for_training)
            return self._model()
        if self.args.n_gpu > 1:
            raise ConfigError(
                f"GraphTrainer runs one process per GPU, but this process sees n_gpu="
                f"{self.args.n_gpu} (torch.nn.DataParallel); launch with torchrun "
                "--nproc-per-node=N (or ddpgraph launch) so each rank has one GPU."
            )
        self._prepare_model_once()
        if self._handle is None or self._handle.module is not self._model():
            self._handle = _StepHandle(self._model())
        return self._handle

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's preparation; with its FSDP2, the loop gets the handle of the model
        Accelerate sharded (the Trainer keeps the sharded model as ``model``, and saves and
        loads it and the optimizer with Accelerate's FSDP2 checkpoint functions)."""
        prepare = super()._prepare_for_training
        model, loader = prepare(*args, **kwargs)  # type: ignore[no-untyped-call]
        if not self._fsdp2:
            return model, loader
        if self._handle is None or self._handle.module is not self._model():
            self._handle = _StepHandle(self._model())
        return self._handle, loader

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        """The Trainer's load; under FSDP2 the real optimizer's state is created first, as the
        Trainer's own run creates it: torch's ``get/set_optimizer_state_dict`` (Accelerate's
        FSDP2 load) step an optimizer without state once at LR 0 with zero gradients to build
        the template the checkpoint is read into, and the view's ``step()`` does nothing (with
        no state there, the moments would not be loaded)."""
        if checkpoint is not None and self._fsdp2 and self._view is not None:
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(self._view.optimizer)
        super()._load_optimizer_and_scheduler(checkpoint)

    def get_train_dataloader(self) -> Any:
        """The Trainer's training loader, its collator padding to length buckets, and packed
        batches to a fixed capacity."""
        collator = self.data_collator
        self.data_collator = _FixedCapacity(
            _bucketed(collator, self._bucket_multiple()), self._packed_max_length, self.args
        )
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = collator

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        # called once the optimizer is final (after accelerator.prepare): the Trainer keeps the
        # view from here on, and a scheduler built here drives the view's param groups
        if type(self.optimizer).__name__ == "AcceleratedOptimizer":
            self._accelerated_optimizer = self.optimizer  # its step_was_skipped: fp16
        real = _real_optimizer(self.optimizer)
        # asked before the TrainStep exists: it switches an fp16 optimizer to a fused kernel
        self._reports_skips = scaler_reports_skips(real)
        if self._view is None or self._view.optimizer is not real:
            self._view = OptimizerView(real, own_lr=True)
        self.optimizer = self._view
        return super().create_scheduler(
            num_training_steps, self._view if optimizer is None else optimizer
        )

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """One micro-batch through the TrainStep (the update runs inside the window's last one,
        a short last window of an epoch included); the loss as the Trainer's ``training_step``
        returns it, computed on the device."""
        step = self._step()
        self._model().train()
        inputs = self._prepare_inputs(inputs)
        # a packed batch's max lengths, fixed by _FixedCapacity: constants of the graph
        constants = {key: inputs.pop(key) for key in MAX_LENGTHS if key in inputs}
        if constants:
            self._check_fixed(constants)
        batch = _tensor_batch(inputs)
        if num_items_in_batch is not None:
            batch[NUM_ITEMS] = torch.as_tensor(num_items_in_batch, device=self.args.device)
        # the Trainer divides by the micro-batches of this window (fewer in an epoch's last
        # one): a graph input, so one graph serves full and short windows
        batch[WINDOW] = torch.tensor(
            float(self.current_gradient_accumulation_steps), device=self.args.device
        )
        assert self._view is not None
        self._view.push_lr()  # the LR the scheduler set since the last update
        # the Trainer sets sync_gradients on the window's last micro-batch (the epoch's end too)
        ends = bool(self.accelerator.sync_gradients)
        loss = step(batch, last=ends)
        if self._sft_metrics is not None:
            self._sft_metrics.after_step(step.output[METRICS])
        if ends:
            self._report_skipped_update(step)
        if self._filter_nan_inf:
            # the Trainer's filter, on the device: a non-finite loss counts as the mean so far
            mean = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            loss = torch.where(torch.isfinite(loss), loss, mean)
        return loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log``, after the step's metrics (TRL's SFTTrainer) reached the Trainer."""
        self._flush_step_metrics()
        super().log(logs, *args, **kwargs)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor | None:
        return self._latest_grad_norm()  # clipped inside the graph

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> torch.Tensor | None:
        return self._latest_grad_norm() if grad_norm is None else grad_norm

    # ----------------------------------------------------------------- public
    def report(self) -> TrainerReport:
        """The TrainStep's report (warm-up, captures, replays, fallbacks) and the host syncs the
        Trainer's loop still makes."""
        syncs = [
            f"every logging_steps={self.args.logging_steps}: loss, grad_norm .item() "
            "(the Trainer's logging)"
        ]
        if self.args.include_num_input_tokens_seen not in ("no", False, None):
            syncs.append("include_num_input_tokens_seen: a gather and .item() per micro-batch")
        if self.args.eval_strategy != "no":
            syncs.append("evaluation: the Trainer's eager evaluation loop")
        if self._reports_skips and self._amp() == "fp16":
            syncs.append(
                "fp16 with a non-fused optimizer: found_inf .item() per update (whether the "
                "Trainer steps its LR scheduler, as GradScaler reads it in the Trainer's run)"
            )
        step = None if self.train_step is None else self.train_step.report()
        return TrainerReport(step, syncs)

    # ----------------------------------------------------------------- helpers
    def _step(self) -> TrainStep:
        """The TrainStep, built at the first training step: the checkpoint (if any) is loaded by
        then, so the optimizer is made graph-safe with its final state."""
        assert self._handle is not None and self._view is not None
        real = self._view.optimizer
        if self.train_step is not None and self.train_step.optimizer is real:
            self.train_step.scheduler = self.lr_scheduler  # a new train() builds a new one
            return self.train_step
        args = self.args
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        self.train_step = TrainStep(
            _TrainerLoss(self._model(), self),
            real,
            amp=self._amp(),
            accumulate_calls=args.gradient_accumulation_steps,
            clip_grad_norm=clip,
            grad_norm=clip is None,
            scheduler=self.lr_scheduler,
            **self._wrapping(),
            **self._compile_options(),
            **{"on_new_shape": "capture", **self.step_options},
        )
        return self.train_step

    def _wrapping(self) -> dict[str, Any]:
        """DDP with the Trainer's arguments where its Accelerator's ``prepare`` wraps the model
        (several processes), the model unwrapped where it does not (one process), FSDP2's own
        set-up as the Trainer made it."""
        if self._fsdp2:
            return {}
        return wrapping_as_prepared(self.accelerator, _ddp_kwargs(self.args), self.step_options)

    @property
    def _fsdp2(self) -> bool:
        """Whether the Trainer shards the model with its own FSDP2 set-up (``fsdp=True``)."""
        return bool(getattr(self, "is_fsdp_enabled", False))

    def _model(self) -> nn.Module:
        assert isinstance(self.model, nn.Module), "the Trainer was built without a model"
        return self.model

    @property
    def _packed_max_length(self) -> int | None:
        """The longest document of a packed batch (``max_length``, as TRL's packing keeps it)."""
        return getattr(self.args, "max_length", None)

    def _check_fixed(self, constants: dict[str, Any]) -> None:
        fixed = self._packed_max_length
        if any(value != fixed for value in constants.values()):
            raise ConfigError(
                f"GraphTrainer got a packed batch with {constants}, not padded to its fixed "
                f"capacity (max lengths {fixed}); it pads the batches of its own training "
                "loader: do not replace get_train_dataloader's collator after it is built."
            )

    def _bucket_multiple(self) -> int | None:
        """:attr:`pad_to_multiple_of`, made a divisor of the model's maximum length (a batch
        padded past it would index positions the model does not have)."""
        multiple = self.pad_to_multiple_of
        config = getattr(self.model, "config", None)
        limit = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        if multiple is None or not isinstance(limit, int) or limit <= 0:
            return multiple
        return math.gcd(multiple, limit)

    def _amp(self) -> str | None:
        """The precision the Trainer's Accelerator trains in: bf16 / fp16 where it autocasts
        (``native_amp``); none where it does not (fp16 on the CPU trains in fp32 there)."""
        precision = str(self.accelerator.mixed_precision)
        if self._fsdp2:  # FSDP2's MixedPrecisionPolicy casts, as in the Trainer's FSDP2 run
            return None
        if not self.accelerator.native_amp or precision not in ("bf16", "fp16"):
            return None
        return precision

    def _compile_options(self) -> dict[str, Any]:
        """``TrainingArguments(torch_compile=True)``: the TrainStep compiles the model with the
        arguments the Trainer's Accelerator compiles it with (backend, mode, ...)."""
        if not self.args.torch_compile:
            return {}
        plugin = self.accelerator.state.dynamo_plugin
        return {"compile": plugin.to_kwargs()}

    def _prepare_model_once(self) -> None:
        """Let Accelerate prepare the model as the Trainer's evaluation loop would (device
        placement; under bf16/fp16 the autocast ``forward`` the Trainer's own run trains with),
        once and before the TrainStep exists: a preparation in the middle of training would move
        or re-wrap what the step's graphs hold."""
        model = self._model()
        if model in self.accelerator._models:
            return
        plugin = self.accelerator.state.dynamo_plugin
        backend = plugin.backend
        plugin.backend = type(backend)("NO")  # the TrainStep compiles (compile=...), not this
        try:
            self.accelerator.prepare_model(model, evaluation_mode=True)
        finally:
            plugin.backend = backend

    def _report_skipped_update(self, step: TrainStep) -> None:
        """fp16: tell the Trainer whether this update counts as skipped where Accelerate would
        say so in the Trainer's own run (``AcceleratedOptimizer.step_was_skipped``, which the
        Trainer reads before stepping the LR scheduler): only for an optimizer whose step
        GradScaler skips, never for a fused one (:func:`scaler_reports_skips`)."""
        accelerated = self._accelerated_optimizer
        if accelerated is None or step.loss_scale is None or not self._reports_skips:
            return
        accelerated._is_overflow = step.update_skipped  # a host read, as GradScaler's own

    def _loss_scaled_for_ga(self, num_items: Any) -> bool:
        """The Trainer's rule (``training_step``): a loss normalised by ``num_items_in_batch``
        (by the model or ``compute_loss_func``) is not divided by the accumulation steps."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return bool(
            (self.model_accepts_loss_kwargs and num_items is not None)
            or self.compute_loss_func is not None
        )

    @contextlib.contextmanager
    def _graphable(self, real_tokens: torch.Tensor | None) -> Iterator[list[torch.Tensor] | None]:
        """Around ``compute_loss`` inside the step: TRL's loss on its fixed-shape path; for
        SFTTrainer, yields the list that takes its metric tensors (None for other Trainers);
        ``real_tokens``: a packed batch's token count before its padding."""
        with fixed_shape_loss():
            if self._sft_metrics is None:
                yield None
                return
            with self._sft_metrics.taken(real_tokens) as taken:
                yield taken

    def _flush_step_metrics(self) -> None:
        metrics = self.__dict__.get("_sft_metrics")  # log() may come before __init__ ends
        if metrics is not None:
            metrics.flush()

    def _latest_grad_norm(self) -> torch.Tensor | None:
        norm = None if self.train_step is None else self.train_step.grad_norm
        # graph-owned: the next replay overwrites it, the Trainer may log it later
        return None if norm is None else norm.clone()

    @contextlib.contextmanager
    def _nan_inf_filter_on_device(self) -> Iterator[None]:
        self._filter_nan_inf = bool(self.args.logging_nan_inf_filter)
        self.args.logging_nan_inf_filter = False  # the Trainer's own test syncs the host
        try:
            yield
        finally:
            self.args.logging_nan_inf_filter = self._filter_nan_inf


class _StepHandle(nn.Module):
    """What the Trainer holds as its wrapped model while the TrainStep trains: the model's
    parameters (the Trainer counts them), a ``zero_grad`` that leaves the gradients to the graph
    (it reads and writes the same ``.grad`` tensors on every replay), no forward of its own."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "GraphTrainer's training model is run by its TrainStep; call trainer.model(...) "
            "for a forward of your own."
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """The Trainer's ``accelerator.no_sync`` under FSDP2: the TrainStep turns FSDP2's
        gradient sync off for a window's micro-batches itself (``accumulate_calls``, the
        window's end from ``accelerator.sync_gradients``)."""


class _TrainerLoss(nn.Module):
    """The module the TrainStep wraps in DDP (under the Trainer's FSDP2, the parameter-free
    module around FSDP2's root): ``forward(**batch)`` is the loss as the Trainer's
    ``training_step`` backpropagates it, through ``Trainer.compute_loss`` (for SFTTrainer, a
    mapping with the loss and the metric tensors TRL gathers, outputs of the graph)."""

    def __init__(self, model: nn.Module, trainer: GraphTrainer) -> None:
        super().__init__()
        self.module = model
        self.__dict__["_trainer"] = trainer  # not a submodule: no state, no parameters

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor | dict[str, Any]:
        trainer: GraphTrainer = self.__dict__["_trainer"]
        num_items = inputs.pop(NUM_ITEMS, None)
        window = inputs.pop(WINDOW)
        real_tokens = inputs.pop(REAL_TOKENS, None)
        if real_tokens is not None:  # a packed batch: its fixed max lengths, as collated
            inputs.update(dict.fromkeys(MAX_LENGTHS, trainer._packed_max_length))  # type: ignore[arg-type]
        # autocast as in the Trainer's run: inside the model's forward only (Accelerate wrapped
        # it), not around the rest of compute_loss (label smoothing, a custom loss)
        no_autocast = torch.autocast(window.device.type, enabled=False)
        graphable = trainer._graphable(real_tokens)
        with no_autocast, trainer.compute_loss_context_manager(), graphable as taken:
            loss = trainer.compute_loss(self.module, inputs, num_items_in_batch=num_items)
        assert isinstance(loss, torch.Tensor)  # return_outputs=False: the loss alone
        if not trainer._loss_scaled_for_ga(num_items):
            loss = loss / window  # the Trainer's loss / current_gradient_accumulation_steps
        k = trainer.args.gradient_accumulation_steps
        if k > 1:
            # TrainStep divides each micro-batch's loss by k; this loss is the Trainer's, so
            # its gradient is taken back to the Trainer's exactly
            loss = _UndoDivision.apply(loss, k)  # type: ignore[no-untyped-call, unused-ignore]
        if taken is None:
            return loss
        # the metrics' local tensors leave the graph as outputs: each replay refreshes them
        return {"loss": loss, METRICS: tuple(taken)}


class _UndoDivision(torch.autograd.Function):
    """Identity forward; backward divides by ``fl(1/k)``, undoing a later ``loss / k``
    bit for bit (``fl(fl(1/k) * k)`` is not 1.0 for every k; ``x / x`` is; an fp16 loss scale,
    a power of two, passes through exactly)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, k: int) -> torch.Tensor:
        ctx.k = k
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # ones_like / k: kernels, no host-to-device copy (capture-safe)
        return grad / (torch.ones_like(grad) / ctx.k), None


def _real_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` and our view."""
    while (
        not isinstance(optimizer, torch.optim.Optimizer)
        or isinstance(optimizer, OptimizerView)
        or type(optimizer).__name__ == "AcceleratedOptimizer"
    ):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"GraphTrainer needs a torch.optim.Optimizer, got {type(optimizer).__name__}; use "
            "TrainingArguments(optim='adamw_torch') or pass optimizers=(torch.optim.AdamW(...), "
            "None)."
        )
    return optimizer


def _bucketed(collator: Any, multiple: int | None) -> Any:
    """``collator`` padding to a multiple of ``multiple`` where it pads to the longest row (a
    copy; the Trainer's evaluation keeps the original)."""
    if multiple is None or getattr(collator, "pad_to_multiple_of", 0) is not None:
        return collator
    if getattr(collator, "padding_free", False):  # packed: padded to a fixed capacity instead
        return collator
    bucketed = copy.copy(collator)
    bucketed.pad_to_multiple_of = multiple
    return bucketed


def _check_not_sharded(model: Any) -> None:
    """Refuse a model the script sharded with ``fully_shard`` (not run by GraphTrainer yet)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ConfigError(
            f"GraphTrainer got a model sharded with fully_shard ({type(model).__name__}); it "
            "graphs the FSDP2 step of the Trainer's own set-up: pass the model unsharded with "
            "TrainingArguments(fsdp=True, fsdp_config={'version': 2}), or train the sharded "
            "model with ddpgraph.TrainStep in your own loop, which graphs the FSDP2 step."
        )


def _check_sharding_engine(trainer: Any) -> None:
    """The Trainer's own sharding set-ups GraphTrainer runs (FSDP2: ``fsdp=True``, version 2)
    and those it refuses before Accelerate meets them: FSDP1, FSDP on XLA, DeepSpeed (their
    engines own the step), fp16 loss scaling over FSDP2's shards."""
    args = trainer.args
    if args.fsdp and (args.fsdp_config or {}).get("xla"):
        raise ConfigError(
            f"GraphTrainer does not run the Trainer's FSDP on XLA (fsdp={args.fsdp!r}, "
            "fsdp_config xla=True): it graphs CUDA (and CPU) steps. Train this run with "
            "transformers.Trainer."
        )
    # Accelerate turns FSDP on only where it shards (GPUs and other accelerators; on the CPU
    # the Trainer trains with DDP despite fsdp=...): follow what it chose
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if getattr(trainer, "is_fsdp_enabled", False) and plugin is not None:
        version = getattr(plugin, "fsdp_version", 1)
        if version != 2:
            raise ConfigError(
                f"GraphTrainer runs the Trainer's FSDP2 only, but fsdp_config sets version "
                f"{version} (FSDP1's FullyShardedDataParallel, whose flat parameters cannot be "
                "captured); set fsdp_config={'version': 2} (FSDP2, the Trainer's default)."
            )
        if trainer.accelerator.scaler is not None:
            raise ConfigError(
                "GraphTrainer with the Trainer's FSDP2 and fp16=True: fp16's loss scaling needs "
                "an inf/NaN check agreed over the gradient shards of every rank, which the "
                "graphed step does not do yet; use bf16=True (FSDP2's MixedPrecisionPolicy, no "
                "loss scaling), or train this run with transformers.Trainer."
            )
    if args.deepspeed:
        raise ConfigError(
            f"GraphTrainer does not run DeepSpeed (deepspeed={args.deepspeed!r}): its engine "
            "owns the step. Train this run with transformers.Trainer, or drop deepspeed= and "
            "let GraphTrainer's DDP step (or the Trainer's FSDP2: fsdp=True) train it."
        )


class _FixedCapacity:
    """The training collator, its packed (padding-free) batches padded to a fixed capacity:
    ``per_device_train_batch_size × max_length`` tokens (:func:`~._packing.fixed_capacity`),
    with the real token count as a batch entry (TRL's ``num_tokens`` counts it)."""

    def __init__(self, collator: Any, max_length: int | None, args: Any) -> None:
        self.collator = collator
        self.max_length = max_length
        self.batch_size = args.per_device_train_batch_size

    def __call__(self, examples: Any) -> Any:
        batch = self.collator(examples)
        if not (isinstance(batch, Mapping) and is_packed(batch)):
            return batch
        if self.max_length is None:
            raise ConfigError(
                "GraphTrainer pads packed (padding-free) batches to per_device_train_batch_size "
                "x max_length tokens, but the training arguments set no max_length; set "
                "SFTConfig(max_length=...)."
            )
        pad = getattr(self.collator, "pad_token_id", None)
        tokens = batch["input_ids"].shape[1]
        capacity = self.batch_size * self.max_length
        padded = fixed_capacity(batch, capacity, self.max_length, 0 if pad is None else pad)
        padded[REAL_TOKENS] = torch.tensor(tokens)
        return padded


def _tensor_batch(inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    others = {k: type(v).__name__ for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    if others:
        raise ConfigError(
            f"GraphTrainer's graphed step takes tensors only, but the batch has {others}; let "
            "the data collator return tensors (or drop those columns: remove_unused_columns)."
        )
    return dict(inputs)


def _ddp_kwargs(args: Any) -> dict[str, Any]:
    """DDP's arguments as the Trainer passes them, except ``find_unused_parameters``: False
    unless set (the Trainer's default True traverses the autograd graph on the host at every
    forward; the gradients are the same for a model whose parameters are all used)."""
    kwargs: dict[str, Any] = {"find_unused_parameters": bool(args.ddp_find_unused_parameters)}
    if args.ddp_bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = args.ddp_bucket_cap_mb
    if args.ddp_broadcast_buffers is not None:
        kwargs["broadcast_buffers"] = args.ddp_broadcast_buffers
    if args.ddp_static_graph is not None:
        kwargs["static_graph"] = args.ddp_static_graph
    return kwargs


def graphed(trainer_class: type[transformers.Trainer]) -> type[GraphTrainer]:
    """A Trainer subclass (TRL's ``SFTTrainer``, ``DPOTrainer``, your own) with its training step
    graphed: ``graphed(SFTTrainer)(model=..., args=..., step_options={...})``. The same as
    ``class GraphedSFTTrainer(GraphTrainer, SFTTrainer): pass``; the subclass keeps its own
    ``compute_loss``, logging and data preparation."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise ConfigError(
            f"graphed() takes a transformers.Trainer subclass, got {trainer_class!r}; pass the "
            "class itself, e.g. graphed(SFTTrainer)."
        )
    if issubclass(trainer_class, GraphTrainer):
        return trainer_class
    name = f"Graphed{trainer_class.__name__}"
    return type(name, (GraphTrainer, trainer_class), {"__module__": trainer_class.__module__})
