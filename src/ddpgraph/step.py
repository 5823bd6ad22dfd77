"""``TrainStep``: the whole DDP training step, captured once as a CUDA graph and replayed.

One call runs zero_grad, forward, loss, backward (with DDP's gradient all-reduce), optional
clipping and the optimizer step. The first calls are ordinary eager steps on the user's batches
(the warm-up); then the step is captured and every later call with the same input signature
copies the batch into static buffers and replays the graph. Without CUDA the same object runs
the same step eagerly, so one training loop serves both.

Facts this module is built on (measured on an H200, torch 2.11, NCCL 2.28; see REFERENCES.md):

* DDP must be *constructed* on the side stream that captures, or backward fails with "operation
  would make the legacy stream depend on a capturing blocking stream".
* DDP times its iterations 1..10 and every 100th with CUDA events that a capture cannot hold
  (``ddpgraph.facts``). TrainStep turns the every-100th sampling off (a private DDP setter;
  where it is missing, captures keep to the counts the rule allows), so the first capture comes
  after 11 eager forwards. Forwards under ``no_sync`` do not count; replays do not advance it.
"""

from __future__ import annotations

import contextlib
import enum
import linecache
import math
import numbers
import time
import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import watchdog
from ._amp import LossScaler, amp_dtype, check_scaler_options, skips_on_device
from ._batch import (
    Batch,
    Signature,
    data_batch,
    describe,
    differences,
    gathered_batch,
    make_batch,
)
from ._frames import PACKAGE_DIR, frame_outside, in_directories
from ._graphs import SKIPPED_DIRS, CapturedGraph, CaptureFailure, Graphs
from ._log import get_logger
from ._schedule import StepwiseLR
from .device_data import DeviceData
from .errors import CaptureError, ConfigError, DeviceConflictError, first_line
from .facts import DDP_STATS_SAMPLE_RATE, DEFAULT_WARMUP, ddp_count_allows_capture
from .optim import (
    GraphSafeOptimizer,
    graph_safety_problem,
    make_graph_safe,
    restore_identities,
    tensor_slots,
)

__all__ = ["Phase", "StepReport", "TrainStep", "model_loss"]

GraphMode = Literal["auto", "always", "never"]
NewShapePolicy = Literal["eager", "capture", "error"]


@dataclass(frozen=True)
class StepOptions:
    """TrainStep's options, validated when the TrainStep is built."""

    graph: GraphMode = "auto"
    amp: Any = None  # normalised to "bf16", "fp16" or None
    accumulate: int = 1
    clip_grad_norm: float | None = None
    on_new_shape: NewShapePolicy = "eager"
    warmup: int | None = None
    compile: bool | Mapping[str, Any] = False
    channels_last: bool = False
    grad_scaler: Mapping[str, float] | None = None
    accumulate_calls: int = 1
    steps_per_replay: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.accumulate_calls) or self.accumulate_calls < 1:
            raise ConfigError(
                f"accumulate_calls={self.accumulate_calls!r} must be an integer >= 1."
            )
        if not _is_int(self.steps_per_replay) or self.steps_per_replay < 1:
            raise ConfigError(
                f"steps_per_replay={self.steps_per_replay!r} must be an integer >= 1 (e.g. 8: "
                "eight training steps per graph replay, fed by a ddpgraph.DeviceData)."
            )
        if self.steps_per_replay > 1 and self.accumulate_calls > 1:
            raise ConfigError(
                f"steps_per_replay={self.steps_per_replay} and accumulate_calls="
                f"{self.accumulate_calls}: a multi-step replay takes whole steps from a "
                "DeviceData; accumulate within each step with accumulate=k instead."
            )
        if self.accumulate_calls > 1 and self.accumulate != 1:
            raise ConfigError(
                f"accumulate={self.accumulate} and accumulate_calls={self.accumulate_calls} both "
                "accumulate gradients; use accumulate=k to split one batch per call, or "
                "accumulate_calls=k to take one micro-batch per call."
            )
        dtype = amp_dtype(self.amp)
        name = None if dtype is None else {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        object.__setattr__(self, "amp", name)
        if self.grad_scaler is not None and self.amp != "fp16":
            raise ConfigError(
                f"grad_scaler={dict(self.grad_scaler)!r} scales fp16 losses, but amp={self.amp!r}; "
                "pass amp='fp16' or drop grad_scaler (bf16 needs no loss scaling)."
            )
        object.__setattr__(self, "grad_scaler", check_scaler_options(self.grad_scaler))
        _check_compile(self.compile)
        _check_choice("graph", self.graph, ("auto", "always", "never"))
        _check_choice("on_new_shape", self.on_new_shape, ("eager", "capture", "error"))
        if not _is_int(self.accumulate) or self.accumulate < 1:
            raise ConfigError(f"accumulate={self.accumulate!r} must be an integer >= 1.")
        if self.clip_grad_norm is not None and not (
            _is_number(self.clip_grad_norm) and 0 < self.clip_grad_norm < math.inf
        ):
            raise ConfigError(
                f"clip_grad_norm={self.clip_grad_norm!r} must be a positive, finite number or None."
            )
        if self.warmup is not None and (not _is_int(self.warmup) or self.warmup < 1):
            raise ConfigError(f"warmup={self.warmup!r} must be an integer >= 1 or None.")
        if not isinstance(self.channels_last, bool):
            raise ConfigError(f"channels_last={self.channels_last!r} must be True or False.")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy too


def _check_compile(value: object) -> None:
    if isinstance(value, bool):
        return
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"compile={value!r} must be True, False or a dict of torch.compile arguments."
        )
    mode = value.get("mode")
    options = value.get("options") or {}
    if mode in ("reduce-overhead", "max-autotune") or options.get("triton.cudagraphs"):
        raise ConfigError(
            f"compile={dict(value)!r} asks Inductor for CUDA graphs of its own, but TrainStep "
            "captures the whole step as one graph; use mode='default' or "
            "'max-autotune-no-cudagraphs'."
        )


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} must be one of {', '.join(map(repr, choices))}.")


class Phase(enum.Enum):
    """Where a TrainStep is: heading for a capture, replaying graphs, or eager for a reason."""

    WARMUP = "warmup"
    GRAPHED = "graphed"
    EAGER = "eager"
    CLOSED = "closed"


@dataclass
class CaptureRecord:
    signature: Signature
    at_step: int
    seconds: float
    kind: str = "train"  # "train" or "eval"


@dataclass
class StepReport:
    """What a :class:`TrainStep` did: ``str(report)`` is a readable summary."""

    mode: str
    steps: int = 0
    eager_steps: int = 0
    replays: int = 0
    warmup_steps: int = 0
    evaluations: int = 0
    eval_replays: int = 0
    captures: list[CaptureRecord] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    optimizer_changes: list[str] = field(default_factory=list)
    recaptures: list[str] = field(default_factory=list)  # why training graphs were re-captured
    steps_per_replay: int = 1  # training steps in one replay (step(data) with steps_per_replay)
    skipped_steps: int | None = None  # fp16: optimizer steps skipped for inf/NaN gradients
    time_to_first_replay: float | None = None  # seconds from construction to the first replay

    def __str__(self) -> str:
        lines = [
            f"mode={self.mode} steps={self.steps} eager={self.eager_steps} "
            f"replays={self.replays} warm-up={self.warmup_steps}"
        ]
        if self.steps_per_replay > 1:
            lines[0] += f" steps/replay={self.steps_per_replay}"
        if self.evaluations:
            lines[0] += f" evaluations={self.evaluations} (replayed {self.eval_replays})"
        if self.skipped_steps is not None:
            lines[0] += f" skipped (fp16 overflow)={self.skipped_steps}"
        lines += [
            f"captured {c.kind} {describe(c.signature)} at step {c.at_step} in "
            f"{c.seconds * 1e3:.0f} ms"
            for c in self.captures
        ]
        if self.optimizer_changes:
            lines.append("optimizer made graph-safe: " + ", ".join(self.optimizer_changes))
        lines += [f"re-captured: {reason}" for reason in self.recaptures]
        lines += [f"fallback: {reason}" for reason in self.fallbacks]
        return "\n".join(lines)


LossFn = Callable[[Any, Any], torch.Tensor]


class TrainStep:
    """The whole training step as one callable: ``loss = step(x, y)`` or ``loss = step(batch)``.

    Batches (call it on every rank, the same number of times):
        ``step(*inputs, target)``: ``loss_fn(model(*inputs), target)``.
        ``step(*inputs)`` with ``loss_fn=None``: ``model(*inputs)`` computes its own loss, as
            scripts call it (nanoGPT's ``logits, loss = model(X, Y)`` becomes ``step(X, Y)``).
        ``step(batch)`` with one mapping (dict, HF ``BatchEncoding``): ``model(**batch)``; with a
            ``loss_fn`` the loss is ``loss_fn(output, batch)``.
        ``step(data)`` with a :class:`~ddpgraph.DeviceData`: ``steps_per_replay`` whole training
            steps, each on the next batch gathered on the device inside the step (no host work
            per batch); returns their losses as one tensor of that length. The TrainStep then
            steps its ``scheduler=`` once per training step (each step of a replay gets its own
            LR): the loop must not call ``scheduler.step()``. ``step(data, steps=n)`` runs
            ``n <= steps_per_replay`` steps (a run's last few; a count without a graph of its own
            runs eagerly). A graph reads the DeviceData it was captured with; another one is
            a new input (``on_new_shape``). A call that raises leaves the data position, the
            scheduler and the step count as they were.
        With ``loss_fn=None`` the loss is the output itself when it is a scalar tensor,
        ``output.loss``, ``output["loss"]``, or the one 0-dim floating tensor of a tuple or list
        output (``(logits, loss)``); anything else is a ``ValueError`` naming what was found.

    The returned loss and :attr:`output` (the model's output of the latest step, for train-time
    metrics) are owned by the graph once the step is captured: the next call overwrites them in
    place. ``loss.clone()`` (or ``float(loss)``, a host sync) keeps a value.

    Modes follow the model, as in eager PyTorch: a step taken after ``model.eval()`` (or with only
    some submodules in eval mode, e.g. frozen BatchNorm) runs and captures its own graph, keyed by
    the modules' modes; no graph replays in a mode other than the one it was captured in.

    Phases (:attr:`phase`): ``WARMUP`` runs eager steps (DDP needs 11 before it can be captured);
    then every rank captures the step and agrees that all succeeded, and ``GRAPHED`` replays it,
    capturing one more graph per new input signature (``on_new_shape="capture"``) or mode.
    A host sync seen in the last warm-up step does not stop the capture (libraries such as
    transformers >= 5 skip their checks while capturing); only a capture that fails falls back,
    naming the line found in warm-up as the likely cause. ``EAGER`` runs eagerly, for the reason
    in ``report().fallbacks``; ``CLOSED`` after :meth:`close`. :meth:`evaluate` runs the forward
    only, graphed after its own warm-up, in the same memory pool.

    Changes a script makes between steps are detected before the next replay:
    ``optimizer.load_state_dict(...)`` (values copied into the tensors the graph reads), a
    param-group value or a parameter's ``requires_grad`` (the training graphs are captured
    again, with a warning); a replaced parameter raises :class:`CaptureError`.

    Options (keyword-only, validated here):
        graph: "auto" captures where CUDA is available and falls back to eager with a warning that
            explains why; "always" raises :class:`CaptureError` instead; "never" stays eager.
        amp: None, bf16 (``"bf16"``, ``"bfloat16"``, ``torch.bfloat16``) or fp16 (``"fp16"``,
            ``"float16"``, ``torch.float16``): autocast around forward and loss. fp16 adds dynamic
            loss scaling inside the graph, op for op as ``torch.amp.GradScaler`` with a fused
            optimizer (Adam/AdamW/SGD are switched to their fused kernel on CUDA): an overflowed
            step is skipped on the device, :attr:`loss_scale` is the scale, ``report()`` counts
            skipped steps, checkpoints keep the scale.
        grad_scaler: fp16 only: ``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``, as ``torch.amp.GradScaler`` takes them (and its defaults).
        accumulate: k micro-batches per step (every batch tensor is split along dim 0); gradients
            are all-reduced once, on the last; :attr:`output` is the last micro-batch's.
        clip_grad_norm: max total gradient norm, clipped on the device without a host sync.
        on_new_shape: for a batch whose shapes/dtypes/devices differ from every captured one:
            "eager" runs that step eagerly, "capture" records another graph sharing the memory pool
            (pad batches to a few shapes with :func:`ddpgraph.pad_batch`), "error" raises
            ``ValueError`` naming the entry that changed (on CPU too, against the step that would
            have been captured).
        warmup: eager steps before capture (default 12); raised as needed so that DDP's forward at
            capture is not one it times.
        ddp_kwargs: extra ``DistributedDataParallel`` arguments (``gradient_as_bucket_view=True``
            is the default: it made graphed steps 2-7% faster).
        scheduler: an LR scheduler to include in :meth:`state_dict`; with ``step(data)`` also
            stepped by the TrainStep, once per training step (ReduceLROnPlateau excepted: the
            script steps it on its metric).
        steps_per_replay: training steps per call of ``step(data)`` (a :class:`DeviceData`),
            captured as one graph on CUDA: K forwards, backwards with their all-reduces, and
            optimizer updates per replay, bitwise equal to K calls of one step. Checkpoints and
            :meth:`evaluate` come between calls, so at multiples of K steps.

    With a process group the model is wrapped in DDP (``step.model``); without one, it is used
    as is. Pass the bare module, not a DDP: on CUDA the wrapping must happen on the capture stream.
    With DDP's ``broadcast_buffers`` (the default) each step ends by broadcasting rank 0's buffers
    (what DDP's next forward would do), so :meth:`evaluate` sees on every rank what DDP's own
    eval forward would, without a collective of its own.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None,
        *,
        graph: GraphMode = "auto",
        amp: str | torch.dtype | None = None,
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        on_new_shape: NewShapePolicy = "eager",
        warmup: int | None = None,
        ddp_kwargs: Mapping[str, Any] | None = None,
        scheduler: Any = None,
        compile: bool | Mapping[str, Any] = False,
        channels_last: bool = False,
        grad_scaler: Mapping[str, float] | None = None,
        accumulate_calls: int = 1,
        steps_per_replay: int = 1,
    ) -> None:
        self.options = StepOptions(
            graph,
            amp,
            accumulate,
            clip_grad_norm,
            on_new_shape,
            warmup,
            compile,
            channels_last,
            grad_scaler,
            accumulate_calls,
            steps_per_replay,
        )
        _check_model(model)
        _check_optimizer(optimizer, model)
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(f"loss_fn={loss_fn!r} is not callable.")
        self.device = _model_device(model)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self._amp_dtype = amp_dtype(self.options.amp)
        self._scaler = (
            LossScaler(self.device, self.options.grad_scaler or {})
            if self.options.amp == "fp16"
            else None
        )
        self._stream = _capture_stream(self.device) if self.device.type == "cuda" else None
        if channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self._module = model
        self._submodules = list(model.modules())  # their modes key the graphs
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._ddp_sample_rate = DDP_STATS_SAMPLE_RATE
        self._sync_buffers = False  # DDP broadcasts rank 0's buffers (set when wrapping)
        self._compile_pending = bool(compile)  # compiled, but not yet past its first forward
        self.model = self._wrap(_compiled(model, compile) if compile else model)
        self._sync_forwards = 0  # DDP forwards that advanced its iteration counter
        self._start = time.perf_counter()
        self._warmup = self._planned_warmup()
        self._report = StepReport(mode="eager", steps_per_replay=steps_per_replay)
        self._eval_calls: Counter[Hashable] = Counter()
        self._sync_hint: str | None = None  # a host sync seen in warm-up: named if capture fails
        self._reference: Signature | None = None  # the signature on_new_shape compares against
        self._eager_before_capture = 0  # eager steps DDP needs before the next capture
        self._signatures: set[Signature] = set()  # every training signature ever captured
        self.output: Any = None
        self._call_in_group = 0  # accumulate_calls: micro-batches taken since the last update
        self._zeroed = False  # accumulate_calls: gradients zeroed before the first group
        self._call_steps = 1  # training steps in the current call (step(data): up to K)
        self._stepwise: StepwiseLR | None = None  # step(data): the scheduler, stepped per step
        self._sources: dict[int, DeviceData] = {}  # step(data)'s data, by token
        self._phase = Phase.WARMUP
        plan, reason = self._make_optimizer_graph_safe()
        self._graphs = self._new_graphs(plan, reason)
        if self._graphs is not None and self._stream is not None:
            self._graphs.register_replay_hook(self._watch_replay)
        if reason is not None:
            self._enter_eager(reason, warn=self._stream is not None)
        self._report.mode = self.mode

    # ----------------------------------------------------------------- public
    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def mode(self) -> str:
        """ "graphed" once a graph exists, "warmup" while heading for one, else "eager"."""
        return self._phase.value

    def report(self) -> StepReport:
        """Warm-up steps, captures (with time), replays, eager steps and every fallback's reason;
        with fp16 the steps skipped for inf/NaN gradients (read from the device: a sync)."""
        self._report.mode = self.mode
        if self._scaler is not None:
            self._report.skipped_steps = int(self._scaler.skipped.item())
        return self._report

    def __call__(self, *args: Any, steps: int | None = None) -> torch.Tensor:
        self._check_open("step()")
        if len(args) == 1 and isinstance(args[0], DeviceData):
            return self._run_data(args[0], self._steps_for(args[0], steps))
        self._check_batch_call(args, steps)
        batch = make_batch(args, min_positional=1 if self.loss_fn is None else 2)
        self._call_steps = 1
        self._report.steps += 1
        self._check_shape_policy(batch)
        loss: torch.Tensor = self._run_watched(self._watch_phase(), self._step, batch)
        self._call_in_group = (self._call_in_group + 1) % self.options.accumulate_calls
        return loss

    def _run_data(self, data: DeviceData, steps: int) -> torch.Tensor:
        """``steps`` training steps on batches gathered from ``data`` on the device."""
        batch = data_batch(data, steps)
        stepwise = self._stepwise_lr()
        stepwise.check()  # before anything is counted or stepped
        # a short call (a run's last steps) is the same data: not a new shape to refuse
        self._check_shape_policy(data_batch(data, self.options.steps_per_replay))
        self._sources[data.token] = data  # alive while graphs that read its tensors may exist
        self._call_steps = steps
        self._report.steps += steps
        before = stepwise.snapshot()
        try:
            stepwise.prepare(steps)
            losses: torch.Tensor = self._run_watched(self._watch_phase(), self._step, batch)
        except BaseException:
            # as if the call never happened: no batch or LR skipped by the next one
            stepwise.restore(before)
            data.rewind()
            self._report.steps -= steps
            raise
        finally:
            stepwise.finish()
        data.advance(steps)
        return losses

    def _steps_for(self, data: DeviceData, steps: int | None) -> int:
        """Check a ``step(data)`` call; the number of training steps it runs."""
        k = self.options.steps_per_replay
        if self.options.accumulate_calls > 1:
            raise ConfigError(
                "step(data) runs whole training steps, but accumulate_calls="
                f"{self.options.accumulate_calls} takes one micro-batch per call; use accumulate=k."
            )
        if data.device != self.device:
            raise ConfigError(
                f"the DeviceData is on {data.device} but the model is on {self.device}; build it "
                "with DeviceData(..., device=runtime.device)."
            )
        n = k if steps is None else steps
        if not _is_int(n) or not 1 <= n <= k:
            raise ConfigError(
                f"step(data, steps={steps!r}): steps must be an integer from 1 to "
                f"steps_per_replay={k}."
            )
        if n > len(data):
            raise ConfigError(
                f"step(data) runs {n} steps per call but the DeviceData has {len(data)} batches "
                f"per epoch on this rank; use steps_per_replay <= {len(data)} or a smaller "
                "batch_size."
            )
        return n

    def _check_batch_call(self, args: tuple[Any, ...], steps: int | None) -> None:
        if steps is not None:
            raise ConfigError(
                f"step(..., steps={steps!r}) takes a ddpgraph.DeviceData as its one argument; "
                "a batch of tensors is one training step."
            )
        if self.options.steps_per_replay > 1:
            raise ConfigError(
                f"TrainStep(steps_per_replay={self.options.steps_per_replay}) replays several "
                "steps on batches it gathers itself: call step(data) with a ddpgraph.DeviceData "
                "(DeviceData(x, y, batch_size=...)), or leave steps_per_replay at 1 for step(x, y)."
            )

    def _stepwise_lr(self) -> StepwiseLR:
        if self._stepwise is None:
            plan = self._graphs.plan if self._graphs is not None else None
            lr_tensors = getattr(plan, "lr_tensors", None)
            self._stepwise = StepwiseLR(
                self.optimizer, self.scheduler, lr_tensors, self.options.steps_per_replay
            )
        return self._stepwise

    def evaluate(self, *args: Any) -> Any:
        """The model's forward in eval mode without gradients: ``step.evaluate(x)`` or
        ``step.evaluate(batch)`` (a mapping, passed as ``model(**batch)``); no target.

        Rank-local (no collective; each rank evaluates its own batches, so uneven evaluation
        sets cannot hang). With DDP's ``broadcast_buffers`` every rank holds rank 0's buffers
        after each step, so the result is what DDP's own eval forward gives. On CUDA the forward
        is captured after two eager calls per input signature, in the training graphs' pool, and
        replayed; the output is then graph-owned like the loss (the next evaluate() of that
        signature overwrites it). Every module's own mode is restored when this returns.
        """
        self._check_open("evaluate()")
        batch = make_batch(args, min_positional=1)
        self._report.evaluations += 1
        return self._run_watched("eval", self._evaluate, batch)

    def close(self) -> None:
        """Free every captured graph and their memory pool; later calls raise.

        Call on every rank (a rank that keeps replaying would pair its graph's all-reduces with
        its peers' eager ones, which is safe, but the memory is the reason to close). Follow with
        ``torch.cuda.empty_cache()`` to hand the memory back to the driver.
        """
        if self._graphs is not None:
            self._graphs.close()
        self.output = None
        self._sources.clear()
        self._phase = Phase.CLOSED

    def bare_graph(self) -> torch.cuda.CUDAGraph | None:
        """The first training graph of a batch of tensors, for benchmarks that time a bare
        replay; None if none. (A ``step(data)`` graph is left out: it gathers at a device cursor
        that only ``step(data)`` keeps inside the data's window.)"""
        if self._graphs is None:
            return None
        keys = [
            k
            for k in self._graphs.keys_of("train")
            if not (isinstance(k, tuple) and k[2][0] == "data")
        ]
        captured = self._graphs.get(keys[0]) if keys else None
        return captured.graph if captured is not None else None

    def state_dict(self) -> dict[str, Any]:
        """Model (unwrapped), optimizer, scheduler and step count; safe to save after any call
        except between the micro-batches of ``accumulate_calls`` (refused: the partial
        gradients would be lost)."""
        if self._call_in_group:
            raise ConfigError(
                f"state_dict() after {self._call_in_group} of {self.options.accumulate_calls} "
                "micro-batches (accumulate_calls): their gradients are not in any state dict; "
                "save after the call that steps the optimizer (calls % accumulate_calls == 0)."
            )
        state: dict[str, Any] = {
            "model": _unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self._report.steps,
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self._scaler is not None:
            state["scaler"] = self._scaler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load in place (the same tensors, new values), so captured graphs stay valid.

        Call on every rank. ``optimizer.load_state_dict`` alone works too: the next replay copies
        its values into the tensors the graph reads.
        """
        missing = {"model", "optimizer"} - set(state)
        if missing:
            raise ConfigError(f"state dict lacks {sorted(missing)}; pass TrainStep.state_dict()'s.")
        kept = tensor_slots(self.optimizer)
        _unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(dict(state["optimizer"]))
        restore_identities(self.optimizer, kept)
        if self._graphs is not None:
            self._make_graph_safe_again()
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self._stepwise is not None:
            self._stepwise.sync_epoch()
        if self._scaler is not None and "scaler" in state:
            self._scaler.load_state_dict(state["scaler"])
        self._report.steps = int(state.get("steps", self._report.steps))

    # ------------------------------------------------------------ per call
    def _step(self, batch: Batch) -> torch.Tensor:
        mode = self._modes()
        if self._phase is Phase.WARMUP and self._warmup_done():
            return self._first_capture(batch, mode)
        if self._phase is Phase.GRAPHED:
            loss = self._replay_or_capture(batch, mode)
            if loss is not None:
                return loss
        return self._eager(batch)

    def _warmup_done(self) -> bool:
        """Warm-up counts optimizer steps; with accumulate_calls it ends at a group's start."""
        calls = self._warmup * self.options.accumulate_calls
        return self._report.eager_steps >= calls and self._call_in_group == 0 and self._ddp_ready()

    def _role(self) -> str:
        """ "micro" for a call that only accumulates (accumulate_calls), "train" for one that
        steps the optimizer: each has its own graph per input signature and mode."""
        last = self._call_in_group == self.options.accumulate_calls - 1
        return "train" if last else "micro"

    def _run_watched(self, phase: str, run: Callable[[Batch], Any], batch: Batch) -> Any:
        """``run(batch)`` as a watched call: a hang in it becomes the watchdog's verdict."""
        wd = watchdog.active()
        if wd is None:
            return run(batch)
        wd.enter(phase, self._report.steps)
        try:
            result = run(batch)
        except BaseException as exc:
            wd.leave()
            wd.on_error(exc)
            raise
        wd.leave()
        return result

    def _watch_phase(self) -> str:
        """The watchdog's name for this call (its heartbeat says where each rank is)."""
        if self._phase is Phase.WARMUP:
            return "capture" if self._warmup_done() else "warmup"
        return "replay" if self._phase is Phase.GRAPHED else "eager"

    def _watch_replay(self, stream: torch.cuda.Stream) -> None:
        # a graph's collectives are invisible to NCCL's watchdog: this event is what shows a hang
        wd = watchdog.active()
        if wd is not None:
            wd.after_replay(stream, self._report.steps)

    def _check_open(self, what: str) -> None:
        if self._phase is Phase.CLOSED:
            raise CaptureError(
                f"{what} on a TrainStep after close(): its graphs and their memory are gone; "
                "build a new TrainStep to keep training."
            )

    def _check_shape_policy(self, batch: Batch) -> None:
        """on_new_shape="error", on every device: the signature must stay the captured one."""
        warmup_calls = self._warmup * self.options.accumulate_calls
        if self.options.on_new_shape != "error" or self._report.steps <= warmup_calls:
            return  # before the signature is built: this runs on every call
        signature = batch.signature
        if self._reference is None:
            self._reference = signature
        elif signature != self._reference:
            raise ValueError(
                f"TrainStep(on_new_shape='error') got a batch of {describe(signature)}, but its "
                f"graph is for {describe(self._reference)} (changed: "
                f"{differences(signature, self._reference)}); pad batches to one shape "
                "(ddpgraph.pad_batch, drop_last=True), or pass on_new_shape='eager' or 'capture'."
            )

    def _modes(self) -> tuple[bool, ...]:
        """Every submodule's ``training`` flag: part of each graph's key."""
        return tuple(m.training for m in self._submodules)

    # ------------------------------------------------------------ capture policy
    def _first_capture(self, batch: Batch, mode: tuple[bool, ...]) -> torch.Tensor:
        """Capture on every rank, then agree; every rank replays, or every rank runs eagerly.

        Ranks that disagreed (one's capture failed) would otherwise carry on with a graph on some
        ranks and a failed step on others; and with graph="always" every rank raises, not only
        the one that failed. Every rank reaches this call at the same step (the warm-up length is
        the same everywhere). Costs one tiny all-reduce, once per run.
        """
        assert self._graphs is not None
        key = (self._role(), mode, batch.signature)
        started = time.perf_counter()
        result = self._capture(key, batch)
        failed = isinstance(result, CaptureFailure)
        ok, any_dirty = self._every_rank_agrees(not failed, self._reducer_dirty())
        if any_dirty:
            self._reset_reducer()  # on every rank, so DDP's bucket rebuild is collective
        if not ok:
            self._drop_training_graphs()
            reason = (
                self._explain_failure(result.reason)
                if isinstance(result, CaptureFailure)
                else "another rank could not capture its step (its warning says why)"
            )
            self._enter_eager(reason)
            return self._eager(batch)
        assert isinstance(result, CapturedGraph)
        self._phase = Phase.GRAPHED
        self._record_capture(key, started)
        loss = self._replay(key, batch)
        self._report.time_to_first_replay = time.perf_counter() - self._start
        return loss

    def _replay_or_capture(self, batch: Batch, mode: tuple[bool, ...]) -> torch.Tensor | None:
        """Replay the graph of this key, capturing it first if the policy says so.

        A later capture needs no agreement: capturing runs nothing, and a graph's all-reduces
        pair with a peer's eager ones like eager ones do (same buckets, same order).
        """
        assert self._graphs is not None
        self._apply_guard()
        key = (self._role(), mode, batch.signature)
        if key in self._graphs:
            return self._replay(key, batch)
        if not self._should_capture(key):
            return None
        started = time.perf_counter()
        result = self._capture(key, batch)
        if isinstance(result, CaptureFailure):
            self._recover_alone()
            self._warn_or_raise(
                f"the batch of {describe(batch.signature)}{_mode_words(mode)} runs eagerly: "
                f"{self._explain_failure(result.reason)}"
            )
            return None
        self._record_capture(key, started)
        return self._replay(key, batch)

    def _should_capture(self, key: tuple[str, tuple[bool, ...], Signature]) -> bool:
        assert self._graphs is not None
        if key in self._graphs.uncapturable or not self._ddp_ready():
            return False
        if self._eager_before_capture > 0:
            return False
        # a new mode of a captured shape is always captured; a new shape as the policy says
        return key[2] in self._signatures or self.options.on_new_shape == "capture"

    def _ddp_ready(self) -> bool:
        """Whether DDP allows capturing this call's forwards (one per training step)."""
        if not isinstance(self.model, DistributedDataParallel):
            return True
        first = self._sync_forwards
        return all(self._count_allows_capture(n) for n in range(first, first + self._call_steps))

    def _apply_guard(self) -> None:
        """Before a replay: what the script changed is put back in place or re-captured."""
        assert self._graphs is not None
        found = self._graphs.check()
        news = found.changes
        if found.recapture:
            self._make_graph_safe_again()
            self._graphs.params = _trainable(self.model)
            for param in self._frozen_params():
                param.grad = None  # eager zero_grad(set_to_none=True) would leave it None too
            dropped = self._drop_training_graphs()
            _warn_at_user_line(
                f"TrainStep re-captures its {dropped} training graph(s): {'; '.join(news)}."
            )
            self._report.recaptures.extend(news)
        elif news:
            self._make_graph_safe_again()
            get_logger().info("TrainStep: %s", "; ".join(news))

    def _make_graph_safe_again(self) -> None:
        """After a reload: a loaded param group may say capturable=False or foreach SGD."""
        if self._stream is not None:
            make_graph_safe(self.optimizer, self.device)

    def _frozen_params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if not p.requires_grad]

    def _drop_training_graphs(self) -> int:
        assert self._graphs is not None
        return self._graphs.drop("train") + self._graphs.drop("micro")

    def _capture(
        self, key: tuple[str, Any, Signature], batch: Batch
    ) -> CapturedGraph | CaptureFailure:
        """Capture the step for this key on the device copy of ``batch``."""
        assert self._graphs is not None
        role = key[0]
        device_batch = batch.with_tensors(self._to_device_all(batch))
        result = self._graphs.capture(key, device_batch, lambda b: self._captured_body(b, role))
        if role == "train":
            self._sync_forwards += self._call_steps  # DDP's host code ran once per step
        return result

    def _captured_body(self, batch: Batch, role: str) -> tuple[torch.Tensor, Any]:
        loss, output = self._body(batch, role)
        return loss, _detached(output)

    def _record_capture(self, key: tuple[str, Any, Signature], started: float) -> None:
        seconds = time.perf_counter() - started
        kind, mode, signature = key
        if kind in ("train", "micro"):
            self._signatures.add(signature)
        words = _mode_words(mode) if kind != "eval" else ""
        self._report.captures.append(
            CaptureRecord(signature, self._report.steps, seconds, kind + words)
        )
        get_logger().info(
            "TrainStep captured %s%s %s in %.0f ms", kind, words, describe(signature), seconds * 1e3
        )

    def _explain_failure(self, reason: str) -> str:
        if self._sync_hint is None:
            return reason
        return f"{reason}\nlikely cause, seen in warm-up: {self._sync_hint}"

    # ------------------------------------------------------------ failed captures
    def _reducer_dirty(self) -> bool:
        """Whether DDP's reducer was left mid-iteration (a capture failed inside backward)."""
        if not isinstance(self.model, DistributedDataParallel):
            return False
        try:
            self.model.reducer._check_reducer_finalized()
        except RuntimeError:
            return True
        return False

    def _reset_reducer(self) -> None:
        """Let DDP run again after a backward that never finished.

        ``_reset_state`` also makes DDP rebuild its gradient buckets at the next forward (a
        collective, and new gradient tensors): every rank does it at the same step, the training
        graphs (which read the old gradients) are dropped, and two eager steps come before the
        next capture (one records the order, the next forward rebuilds).
        """
        assert isinstance(self.model, DistributedDataParallel) and self._graphs is not None
        self.model.reducer._reset_state()
        self._drop_training_graphs()
        self._eager_before_capture = 2

    def _recover_alone(self) -> None:
        """After a later capture failed on this rank only (no agreement: peers may be replaying)."""
        if not self._reducer_dirty():
            return
        assert isinstance(self.model, DistributedDataParallel)
        if dist.get_world_size(self.model.process_group) > 1:
            raise CaptureError(
                "a capture failed inside DDP's backward on this rank while other ranks may be "
                "replaying; DDP can only recover with every rank at the same step. Pad batches "
                "to shapes captured at the start, or pass on_new_shape='eager'."
            )
        self._reset_reducer()

    # ------------------------------------------------------------------ eager & replay
    def _replay(self, key: Hashable, batch: Batch) -> torch.Tensor:
        assert self._graphs is not None
        loss, self.output = self._graphs.replay(key, batch)
        self._report.replays += 1
        return cast(torch.Tensor, loss)

    def _eager(self, batch: Batch) -> torch.Tensor:
        n = self._call_steps
        self._report.eager_steps += n
        warming_up = self._phase is Phase.WARMUP
        if warming_up:
            self._report.warmup_steps += n
        role = self._role()
        last_warmup = self._warmup * self.options.accumulate_calls
        check_syncs = (
            warming_up
            and self._report.eager_steps - n < last_warmup <= self._report.eager_steps
            and self.device.type == "cuda"
        )
        with self._on_side_stream():
            batch = batch.with_tensors(self._to_device_all(batch))
            if self._graphs is not None:
                self._graphs.plan.sync_lr()
            if self._compile_pending:
                loss, output = self._first_compiled_step(batch, role)
            elif check_syncs:
                syncs = _record_host_syncs(lambda: self._body(batch, role))
                loss, output = syncs.result
                if syncs.found:
                    self._sync_hint = syncs.describe()
            else:
                loss, output = self._body(batch, role)
        if role == "train":
            self._sync_forwards += n
        self._eager_before_capture = max(0, self._eager_before_capture - n)
        self.output = _detached(output)
        return loss

    def _to_device_all(self, batch: Batch) -> list[torch.Tensor]:
        return [self._to_device(t) for t in batch.tensors]

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device, non_blocking=True)
        if self.options.channels_last and tensor.dim() == 4:
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    def _first_compiled_step(self, batch: Batch, role: str) -> tuple[torch.Tensor, Any]:
        """Compile first, outside DDP, then agree: every rank runs compiled, or every rank plain.

        Building DDP is a collective, so a rank falling back alone would leave the ranks in
        different collectives; and inside DDP's forward a failing rank would already have joined
        the buffer broadcast. So the compiling forward runs on the compiled module itself (no
        DDP, no backward), with the RNG forked and the buffers put back: training sees no extra
        step. Then one tiny all-reduce decides, and every rank rebuilds DDP if any rank failed.
        """
        self._compile_pending = False
        failure = self._try_compile(batch)
        ok, _ = self._every_rank_agrees(failure is None, False)
        if not ok:
            reason = failure or "it failed on another rank (that rank's warning says why)"
            self._warn_or_raise(f"torch.compile failed, so the model runs uncompiled: {reason}")
            self.model = self._wrap(self._module)
            if self._graphs is not None:
                self._graphs.params = _trainable(self.model)
        return self._body(batch, role)

    def _try_compile(self, batch: Batch) -> str | None:
        """Run the compiled module's first forward (it compiles); why it failed, or None."""
        from torch._dynamo.exc import TorchDynamoException

        if batch.source is not None:  # step(data): the batch it would gather first
            batch = gathered_batch(batch.source, batch.source.peek())
        first = batch.split(self.options.accumulate)[0]
        saved = [b.detach().clone() for b in self._module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), self._autocast():
                self._forward(self._inner(), first)
        except TorchDynamoException as exc:
            root = exc.__cause__ or getattr(exc, "inner_exception", None)  # a backend's own error
            cause = f" ({first_line(root, with_type=True)})" if root is not None else ""
            return first_line(exc, with_type=True) + cause
        finally:
            with torch.no_grad():
                for buffer, value in zip(self._module.buffers(), saved):
                    buffer.copy_(value)
        return None

    def _body(self, batch: Batch, role: str = "train") -> tuple[torch.Tensor, Any]:
        """zero_grad, k x (forward, loss, backward), clip, optimizer step, buffer broadcast.

        Returns the loss (the mean over ``accumulate``'s micro-batches; with
        ``accumulate_calls``, this call's micro-batch loss, as scripts log it) and the (last
        micro-batch's) model output. With ``accumulate_calls`` a "micro" call only runs forward
        and backward without DDP's sync; the "train" call syncs, steps and zeroes the gradients
        for the next group. Runs eagerly or under capture; it must not touch the LR (a fill_
        captured here would reset the LR on every replay), so callers sync the LR tensors first.
        """
        if batch.source is not None:
            return self._steps_from(batch.source, batch.steps)
        calls = self.options.accumulate_calls
        # set_to_none=False while graphs are possible: a graph reads and writes the same .grad
        # tensors on every replay
        set_to_none = self._phase is Phase.EAGER
        if calls == 1 or not self._zeroed:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            self._zeroed = True
        k = self.options.accumulate * calls
        total: torch.Tensor | None = None
        output: Any = None
        micros = batch.split(self.options.accumulate)
        for i, micro in enumerate(micros):
            sync = role == "train" and i == len(micros) - 1
            # the previous step ended with the buffer broadcast (DDP's init synced the first):
            # DDP's own at this forward would send the same values again
            fresh = i == 0 and calls == 1
            with self._no_sync_unless(sync), self._ddp_buffer_sync(not fresh), self._autocast():
                loss, output = self._loss(micro)
            _check_scalar_loss(loss)
            backward = loss / k
            (self._scaler.scale(backward) if self._scaler is not None else backward).backward()
            part = loss.detach().float() / self.options.accumulate
            total = part if total is None else total + part
        assert total is not None
        if role == "micro":
            return total, output
        self._clip_and_step()
        self._broadcast_buffers()
        if calls > 1:
            self.optimizer.zero_grad(set_to_none=set_to_none)  # for the next group
        return total, output

    def _steps_from(self, data: DeviceData, steps: int) -> tuple[torch.Tensor, Any]:
        """``steps`` whole training steps, each on the next batch gathered from ``data`` on the
        device with its own LR; their losses as one tensor, and the last step's output. The LR
        is copied from the device table a replay re-reads (not filled with a captured value)."""
        assert self._stepwise is not None
        losses: list[torch.Tensor] = []
        output: Any = None
        for j, tensors in enumerate(data.next_batches(steps)):
            self._stepwise.apply(j)
            batch = gathered_batch(data, tensors)
            # channels_last, if asked (a no-op for data stored channels_last)
            loss, output = self._body(batch.with_tensors(self._to_device_all(batch)))
            losses.append(loss)
        return torch.stack(losses), output

    def _clip_and_step(self) -> None:
        """Clip (on unscaled gradients) and step; with fp16, skip an overflowed step on the
        device and update the scale, as GradScaler does."""
        clip = self.options.clip_grad_norm
        # GradScaler unscales before clipping, and for an optimizer that cannot take the scale
        unscale = self._scaler is not None and (
            clip is not None or not skips_on_device(self.optimizer)
        )
        if self._scaler is not None:
            grads = [
                p.grad
                for group in self.optimizer.param_groups
                for p in group["params"]
                if p.grad is not None
            ]
            self._scaler.check(grads, unscale=unscale)
        if clip is not None:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        if self._scaler is None:
            self.optimizer.step()
            return
        self._scaler.step(self.optimizer, unscaled=unscale)
        self._scaler.update()

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """fp16's current loss scale (a device tensor the graph updates); None without fp16."""
        return self._scaler.scale_tensor if self._scaler is not None else None

    def _loss(self, batch: Batch) -> tuple[torch.Tensor, Any]:
        output = self._forward(self.model, batch)
        if self.loss_fn is None:
            return model_loss(output), output
        target = batch.as_mapping() if batch.kind == "mapping" else batch.tensors[-1]
        return self.loss_fn(output, target), output

    def _forward(self, model: nn.Module, batch: Batch, *, target: bool = True) -> Any:
        """``model`` called as the batch says: ``model(**batch)``, ``model(*inputs)``, or with a
        ``loss_fn`` and ``target``, every tensor but the last (the target)."""
        if batch.kind == "mapping":
            return model(**batch.as_mapping())
        if target and self.loss_fn is not None:
            return model(*batch.tensors[:-1])
        return model(*batch.tensors)

    def _inner(self) -> nn.Module:
        """The module inside DDP (compiled, if it is): a forward with no DDP bookkeeping."""
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, moved from DDP's next forward to the end of this step:
        evaluate() then sees what DDP's own eval forward sees, with no collective of its own."""
        if self._sync_buffers and isinstance(self.model, DistributedDataParallel):
            with torch.no_grad():
                self.model._sync_module_buffers(authoritative_rank=0)

    @contextlib.contextmanager
    def _ddp_buffer_sync(self, on: bool) -> Iterator[None]:
        """DDP's start-of-forward buffer broadcast on or off for one forward."""
        if on or not self._sync_buffers or not isinstance(self.model, DistributedDataParallel):
            yield
            return
        self.model.broadcast_buffers = False
        try:
            yield
        finally:
            self.model.broadcast_buffers = True

    # -------------------------------------------------------------- evaluation
    def _evaluate(self, batch: Batch) -> Any:
        key = ("eval", self._modes_for_eval(), batch.signature)
        with self._eval_mode():
            if self._graphs is not None and key not in self._graphs and self._eval_capture_due(key):
                self._capture_eval(key, batch)
            if self._graphs is not None and key in self._graphs:
                self._apply_guard()
                self._report.eval_replays += 1
                return self._graphs.replay(key, batch)
            with self._on_side_stream():
                return self._forward_eval(batch.with_tensors(self._to_device_all(batch)))

    def _modes_for_eval(self) -> tuple[bool, ...]:
        return (False,) * len(self._submodules)

    def _eval_capture_due(self, key: Hashable) -> bool:
        assert self._graphs is not None
        if self.options.graph == "never" or key in self._graphs.uncapturable:
            return False
        self._eval_calls[key] += 1
        return self._eval_calls[key] > _EVAL_WARMUP

    def _capture_eval(self, key: tuple[str, Any, Signature], batch: Batch) -> None:
        assert self._graphs is not None
        started = time.perf_counter()
        device_batch = batch.with_tensors(self._to_device_all(batch))
        result = self._graphs.capture(key, device_batch, self._forward_eval)
        if isinstance(result, CaptureFailure):
            self._warn_or_raise(
                f"evaluation of {describe(batch.signature)} runs eagerly: {result.reason}"
            )
            return
        self._record_capture(key, started)

    def _forward_eval(self, batch: Batch) -> Any:
        # the module inside DDP: evaluation needs no gradient sync, and DDP's forward would
        # count an iteration and broadcast buffers (done at the end of each step instead)
        with torch.no_grad(), self._autocast():
            return self._forward(self._inner(), batch, target=False)

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        modes = self._modes()
        self._module.eval()
        try:
            yield
        finally:
            for module, training in zip(self._submodules, modes):
                module.training = training

    # --------------------------------------------------------------- set-up
    def _wrap(self, model: nn.Module) -> nn.Module:
        if not (dist.is_available() and dist.is_initialized()):
            return model
        kwargs: dict[str, Any] = {"gradient_as_bucket_view": True}
        if self.device.type == "cuda":
            kwargs["device_ids"] = [self.device.index]
        kwargs.update(self._ddp_kwargs)
        # DDP built on the capture stream: built on the default stream, its backward cannot be
        # captured ("operation would make the legacy stream depend on a capturing blocking stream").
        with self._on_side_stream():
            ddp = DistributedDataParallel(model, **kwargs)
        self._ddp_sample_rate = _stop_ddp_sampling(ddp)
        self._sync_buffers = ddp.will_sync_module_buffers()  # each step ends with it
        return ddp

    def _planned_warmup(self) -> int:
        steps = self.options.warmup or DEFAULT_WARMUP
        # one more step whose syncs are recorded, then capture at a count DDP does not time
        while not (self._count_allows_capture(steps) and self._count_allows_capture(steps - 1)):
            steps += 1
        return steps

    def _count_allows_capture(self, sync_forwards: int) -> bool:
        return ddp_count_allows_capture(sync_forwards, self._ddp_sample_rate)

    def _new_graphs(self, plan: GraphSafeOptimizer | None, reason: str | None) -> Graphs | None:
        """The real graphs, the CPU stand-in (tests, when no reason speaks against it), or None."""
        if reason is not None:
            return None
        if plan is None or self._stream is None:
            assert _ENGINE is not None  # _make_optimizer_graph_safe gives no reason only then
            return _ENGINE(_trainable(self.model), self.optimizer)
        return Graphs(self._stream, _trainable(self.model), plan)

    def _make_optimizer_graph_safe(self) -> tuple[GraphSafeOptimizer | None, str | None]:
        """The graph-safe optimizer plan, or why this step cannot be graphed.

        On CPU the optimizer is left as it is, but one that could not be captured is named in a
        warning, so a CPU dry run tells what the GPU run would do.
        """
        if self.options.graph == "never":
            return None, "graph='never'"
        problem = graph_safety_problem(self.optimizer)
        if self._stream is None:
            if problem is not None:
                _warn_at_user_line(f"on CUDA this TrainStep would run eagerly: {problem}")
            if _ENGINE is not None and problem is None:
                return None, None  # the CPU stand-in engine (tests) drives the graphed policy
            return None, f"the model is on {self.device}, not CUDA"
        if problem is None and self.options.amp == "fp16":
            problem = _fused_for_fp16(self.optimizer)
        if problem is not None:
            return None, problem
        plan = make_graph_safe(self.optimizer, self.device)
        if self.options.amp == "fp16" and not skips_on_device(self.optimizer):
            for group in self.optimizer.param_groups:
                group["fused"], group["foreach"] = True, False
            plan.changes.append("fused=True (fp16 skips overflowed steps on the device)")
        return plan, None

    # ------------------------------------------------------- agreement, exits
    def _every_rank_agrees(self, ok: bool, dirty: bool) -> tuple[bool, bool]:
        """(every rank's ``ok``, any rank's ``dirty``), in one tiny all-reduce."""
        if not isinstance(self.model, DistributedDataParallel):
            return ok, dirty
        flags = torch.tensor([int(ok), int(not dirty)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        every_ok, none_dirty = flags.tolist()
        return bool(every_ok), not none_dirty

    def _enter_eager(self, reason: str, *, warn: bool = True) -> None:
        """Leave the graphed path for good: raise under graph='always', else warn once."""
        self._phase = Phase.EAGER
        if self.options.graph == "never":
            return
        if self.options.graph == "always":
            raise CaptureError(f"TrainStep(graph='always') cannot capture: {reason}.")
        if warn:
            _warn_at_user_line(f"TrainStep runs eagerly: {reason}")
        self._report.fallbacks.append(reason)

    def _warn_or_raise(self, message: str) -> None:
        if self.options.graph == "always":
            raise CaptureError(message)
        _warn_at_user_line(f"TrainStep continues eagerly; {message}")
        self._report.fallbacks.append(message)

    # ------------------------------------------------------------- helpers
    def _on_side_stream(self) -> contextlib.AbstractContextManager[Any]:
        if self._stream is None:
            return contextlib.nullcontext()
        return _side_stream(self._stream)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self._amp_dtype is None:
            return contextlib.nullcontext()
        # no weight-cast cache: a cache filled during capture would point at freed memory
        return torch.autocast(self.device.type, dtype=self._amp_dtype, cache_enabled=False)

    def _no_sync_unless(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        if last or not isinstance(self.model, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}

# The graph engine for CPU tests (ddpgraph._fake_graphs.fake_graphs sets it); None: real graphs.
_ENGINE: Callable[[list[nn.Parameter], torch.optim.Optimizer], Graphs] | None = None


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device, shared by every TrainStep on it.

    cuBLAS keeps a workspace (tens of MiB) per stream for the life of the process: a stream per
    TrainStep would leave one behind for every TrainStep ever built. Steps on one stream run in
    the order they are called, as on the default stream.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return _CAPTURE_STREAMS[index]


_EVAL_WARMUP = 2  # eager evaluations per input signature before its capture (cuDNN/cuBLAS set-up)
_NEVER = 2**31 - 1  # a DDP runtime-logging sample rate that never comes round


def _stop_ddp_sampling(ddp: DistributedDataParallel) -> int:
    """Stop DDP timing every 100th iteration, so that any count after 10 can be captured.

    DDP's timers are diagnostics (``_get_ddp_logging_data``); a timed iteration inside a graph
    crashes a later eager forward ("CUDA error: invalid argument"). The setter is private, so
    where it is missing the step keeps to the counts the default rate allows.
    """
    try:
        ddp._set_ddp_runtime_logging_sample_rate(_NEVER)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return DDP_STATS_SAMPLE_RATE
    return _NEVER


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself: a scalar output, ``output.loss``, ``output["loss"]``, or
    the one 0-dim floating tensor of a tuple or list output (nanoGPT's ``(logits, loss)``)."""
    if _is_scalar(output):
        return cast(torch.Tensor, output)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and not hasattr(output, "_fields"):
        scalars = [i for i, item in enumerate(output) if _is_scalar(item)]
        if len(scalars) == 1:
            return cast(torch.Tensor, output[scalars[0]])
        if scalars:
            raise ValueError(
                f"TrainStep(loss_fn=None) cannot tell the loss in the model's output: "
                f"{_kind_of(output)} with scalar tensors at positions {scalars}; pass "
                f"loss_fn=lambda output, target: output[{scalars[-1]}] (or the right index) and "
                "call step(*inputs, target)."
            )
    raise ValueError(
        f"TrainStep(loss_fn=None) needs the model to return its loss (a scalar tensor, .loss, "
        f"['loss'], or one scalar in a tuple), but it returned {_kind_of(output)}; pass labels "
        "or targets in the batch (HF models and nanoGPT compute the loss from them) or give a "
        "loss_fn."
    )


def _is_scalar(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _kind_of(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, (tuple, list)):
        items = ", ".join(
            f"tensor{tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            for x in output
        )
        return f"a {type(output).__name__} ({items})"
    return f"a {type(output).__name__}"


def _warn_at_user_line(message: str) -> None:
    """Warn with the location of the user's call into ddpgraph, not a line of step.py."""
    _, level = frame_outside(in_directories(PACKAGE_DIR))
    warnings.warn(message, stacklevel=level)


@contextlib.contextmanager
def _side_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    # The side stream waits for the caller's work (e.g. the batch's H2D copy) and the caller's
    # stream waits for the step, so the user's loop needs no synchronisation of its own.
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(stream.device).wait_stream(stream)


def _model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        found = sorted(map(str, devices)) or ["no parameters"]
        raise ConfigError(
            f"TrainStep needs a model whose parameters are on one device, found {found}; "
            "move it with model.to(runtime.device)."
        )
    device = devices.pop()
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        raise DeviceConflictError(
            f"the model is on {device} but this rank is bound to cuda:{torch.cuda.current_device()}; "
            "call ddpgraph.init() first and move the model with model.to(runtime.device)."
        )
    return device


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and torch.compile (whose state_dict keys are prefixed)."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return getattr(module, "_orig_mod", module)


def _compiled(model: nn.Module, options: bool | Mapping[str, Any]) -> nn.Module:
    # Inductor's default mode: its kernels, no CUDA graphs of its own (TrainStep captures the
    # whole step). DDP goes around the compiled module: torch.compile(DDP(m)) compiles nothing.
    kwargs = dict(options) if isinstance(options, Mapping) else {}
    return torch.compile(model, **kwargs)  # type: ignore[return-value]


def _check_scalar_loss(loss: object) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar tensor, got {shape}; reduce it (e.g. .mean())."
        )


def _check_model(model: object) -> None:
    if isinstance(model, DistributedDataParallel):
        raise ConfigError(
            "TrainStep got a DistributedDataParallel model; pass the bare module: TrainStep "
            "wraps it in DDP itself, on the stream it captures with."
        )
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"TrainStep's model is {model!r} ({type(model).__name__}), not a torch.nn.Module; "
            "build the model first, e.g. torchvision.models.resnet50().to(runtime.device)."
        )


def _check_optimizer(optimizer: object, model: nn.Module) -> None:
    """The optimizer must update this model: none of its parameters is a silent no-op."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"TrainStep's optimizer is {optimizer!r} ({type(optimizer).__name__}), not a "
            "torch.optim.Optimizer; pass e.g. torch.optim.AdamW(model.parameters(), lr=3e-4)."
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in trainable if id(p) not in held]
    if trainable and len(missing) == len(trainable):
        raise ConfigError(
            f"the optimizer holds none of the model's {len(trainable)} trainable parameters "
            "(built over another model, or before the model was replaced or moved?); build it "
            "from this model: torch.optim.AdamW(model.parameters(), ...)."
        )
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        _warn_at_user_line(
            f"the optimizer does not hold {len(missing)} of the model's trainable parameters "
            f"({shown}): they get gradients but are never updated; add them to a param group or "
            "set requires_grad=False."
        )


def _fused_for_fp16(optimizer: torch.optim.Optimizer) -> str | None:
    if all("fused" in group for group in optimizer.param_groups):
        return None
    return (
        f"amp='fp16' inside a graph needs an optimizer with a fused kernel (Adam, AdamW, SGD) "
        f"that skips an overflowed step on the device; {type(optimizer).__name__} would need "
        "found_inf.item(), a host sync. Use one of those, or amp='bf16' (no loss scaling)."
    )


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _detached(output: Any) -> Any:
    """The model output without its autograd graph (kept as ``step.output`` after backward)."""
    try:
        from torch.utils._pytree import tree_map_only

        return tree_map_only(torch.Tensor, lambda t: t.detach(), output)
    except Exception:  # an output type pytree cannot rebuild: keep it as it is
        return output


def _mode_words(mode: tuple[bool, ...]) -> str:
    """How a graph key's modes read in a report: nothing for train mode."""
    if all(mode):
        return ""
    if not any(mode):
        return " (eval mode)"
    return f" ({mode.count(False)} of {len(mode)} modules in eval mode)"


@dataclass
class _SyncReport:
    result: Any
    found: list[tuple[str, str]]  # (message, user source line)

    def describe(self) -> str:
        message, where = self.found[0]
        return (
            f"a host sync inside the step ({message}) at {where}; the CPU cannot wait for the GPU "
            "inside a graph. Move .item(), .cpu(), printing or data-dependent shapes "
            "(nonzero, boolean masks) out of the model, loss and optimizer."
        )


def _record_host_syncs(fn: Callable[[], Any]) -> _SyncReport:
    """Run ``fn`` with CUDA sync debugging on, recording each synchronising op and its caller.

    "warn" rather than "error": the step runs to the end, so the model is never left half-updated.
    """
    found: list[tuple[str, str]] = []
    previous_mode = torch.cuda.get_sync_debug_mode()

    def record(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        if "called a synchronizing CUDA operation" in str(message):
            found.append((str(message).splitlines()[0], _user_frame()))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # type: ignore[assignment]
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
    return _SyncReport(result, found)


def _user_frame() -> str:
    """The innermost stack frame outside torch and ddpgraph: the line that synced (the user's, or
    a library's such as transformers')."""
    frame, _ = frame_outside(in_directories(*SKIPPED_DIRS))
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno} `{line}`"
