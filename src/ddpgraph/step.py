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
import math
import numbers
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import watchdog
from ._batch import Batch, Signature, describe, differences, make_batch
from ._graphs import CapturedGraph, GraphCache, ReplayGuard
from ._log import get_logger
from .errors import CaptureError, ConfigError, DeviceConflictError
from .facts import DDP_STATS_SAMPLE_RATE, DEFAULT_WARMUP, ddp_count_allows_capture
from .optim import GraphSafeOptimizer, make_graph_safe

__all__ = ["Phase", "StepReport", "TrainStep", "model_loss"]

GraphMode = Literal["auto", "always", "never"]
NewShapePolicy = Literal["eager", "capture", "error"]


@dataclass(frozen=True)
class StepOptions:
    """TrainStep's options, validated when the TrainStep is built."""

    graph: GraphMode = "auto"
    amp: str | None = None
    accumulate: int = 1
    clip_grad_norm: float | None = None
    on_new_shape: NewShapePolicy = "eager"
    warmup: int | None = None
    compile: bool | Mapping[str, Any] = False
    channels_last: bool = False

    def __post_init__(self) -> None:
        _check_compile(self.compile)
        _check_choice("graph", self.graph, ("auto", "always", "never"))
        _check_choice("on_new_shape", self.on_new_shape, ("eager", "capture", "error"))
        if self.amp not in (None, "bf16"):
            raise ConfigError(
                f"amp={self.amp!r} is not supported; use amp='bf16' (fp16 needs a loss scaler "
                "whose inf checks cannot be captured) or amp=None."
            )
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
    time_to_first_replay: float | None = None  # seconds from construction to the first replay

    def __str__(self) -> str:
        lines = [
            f"mode={self.mode} steps={self.steps} eager={self.eager_steps} "
            f"replays={self.replays} warm-up={self.warmup_steps}"
        ]
        if self.evaluations:
            lines[0] += f" evaluations={self.evaluations} (replayed {self.eval_replays})"
        lines += [
            f"captured {c.kind} {describe(c.signature)} at step {c.at_step} in "
            f"{c.seconds * 1e3:.0f} ms"
            for c in self.captures
        ]
        if self.optimizer_changes:
            lines.append("optimizer made graph-safe: " + ", ".join(self.optimizer_changes))
        lines += [f"fallback: {reason}" for reason in self.fallbacks]
        return "\n".join(lines)


LossFn = Callable[[Any, Any], torch.Tensor]


class TrainStep:
    """The whole training step as one callable: ``loss = step(x, y)`` or ``loss = step(batch)``.

    Batches (call it on every rank, the same number of times):
        ``step(*inputs, target)``: ``loss_fn(model(*inputs), target)``.
        ``step(*inputs)`` with ``loss_fn=None``: the model computes its loss (below).
        ``step(batch)`` with one mapping (dict, HF ``BatchEncoding``): ``model(**batch)``; with a
            ``loss_fn`` the loss is ``loss_fn(output, batch)``.
        With ``loss_fn=None`` the loss is ``output.loss``, ``output["loss"]``, or the output itself
        when it is a scalar tensor (HF models given ``labels`` compute it).

    The returned loss is owned by the graph once the step is captured: the next call overwrites
    it in place. ``loss.clone()`` (or ``float(loss)``, a host sync) keeps a value.

    Phases (:attr:`phase`): ``WARMUP`` runs eager steps (DDP needs 11 before it can be captured);
    then every rank captures the step and agrees that all succeeded, and ``GRAPHED`` replays it,
    capturing one more graph per new input signature when ``on_new_shape="capture"``; ``EAGER``
    runs eagerly, for the reason in ``report().fallbacks``. :meth:`evaluate` runs the forward
    only, graphed after its own warm-up, in the same memory pool. :meth:`close` frees the graphs.

    Options (keyword-only, validated here):
        graph: "auto" captures where CUDA is available and falls back to eager with a warning that
            explains why; "always" raises :class:`CaptureError` instead; "never" stays eager.
        amp: None or "bf16" (autocast around forward and loss).
        accumulate: k micro-batches per step (every batch tensor is split along dim 0); gradients
            are all-reduced once, on the last.
        clip_grad_norm: max total gradient norm, clipped on the device without a host sync.
        on_new_shape: for a batch whose shapes/dtypes/devices differ from every captured one:
            "eager" runs that step eagerly, "capture" records another graph sharing the memory pool
            (pad batches to a few shapes with :func:`ddpgraph.pad_batch`), "error" raises
            ``ValueError`` naming the entry that changed.
        warmup: eager steps before capture (default 12); raised as needed so that DDP's forward at
            capture is not one it times.
        ddp_kwargs: extra ``DistributedDataParallel`` arguments (``gradient_as_bucket_view=True``
            is the default: it made graphed steps 2-7% faster).
        scheduler: an LR scheduler to include in :meth:`state_dict`.

    With a process group the model is wrapped in DDP (``step.model``); without one, it is used
    as is. Pass the bare module, not a DDP: on CUDA the wrapping must happen on the capture stream.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None,
        *,
        graph: GraphMode = "auto",
        amp: str | None = None,
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        on_new_shape: NewShapePolicy = "eager",
        warmup: int | None = None,
        ddp_kwargs: Mapping[str, Any] | None = None,
        scheduler: Any = None,
        compile: bool | Mapping[str, Any] = False,
        channels_last: bool = False,
    ) -> None:
        self.options = StepOptions(
            graph, amp, accumulate, clip_grad_norm, on_new_shape, warmup, compile, channels_last
        )
        if isinstance(model, DistributedDataParallel):
            raise ConfigError(
                "TrainStep got a DistributedDataParallel model; pass the bare module: TrainStep "
                "wraps it in DDP itself, on the stream it captures with."
            )
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(f"loss_fn={loss_fn!r} is not callable.")
        self.device = _model_device(model)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self._amp_dtype = torch.bfloat16 if amp == "bf16" else None
        self._stream = _capture_stream(self.device) if self.device.type == "cuda" else None
        if channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self._module = model
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._ddp_sample_rate = DDP_STATS_SAMPLE_RATE
        self._compile_pending = bool(compile)  # compiled, but not yet past its first forward
        self.model = self._wrap(_compiled(model, compile) if compile else model)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._sync_forwards = 0  # DDP forwards that advanced its iteration counter
        self._start = time.perf_counter()
        self._warmup = self._planned_warmup()
        self._report = StepReport(mode="eager")
        self._cache = GraphCache(self._stream) if self._stream is not None else None
        self._eval_calls: Counter[Signature] = Counter()
        self._pending_failure: str | None = None  # this rank cannot capture; told at agreement
        self._optimizer_plan, reason = self._make_optimizer_graph_safe()
        self._phase = Phase.WARMUP
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
        """Warm-up steps, captures (with time), replays, eager steps and every fallback's reason."""
        self._report.mode = self.mode
        return self._report

    def __call__(self, *args: Any) -> torch.Tensor:
        batch = make_batch(args, min_positional=1 if self.loss_fn is None else 2)
        self._report.steps += 1
        loss: torch.Tensor = self._run_watched(self._watch_phase(), self._step, batch)
        return loss

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
            return "capture" if self._report.eager_steps >= self._warmup else "warmup"
        return "replay" if self._phase is Phase.GRAPHED else "eager"

    def _step(self, batch: Batch) -> torch.Tensor:
        if self._phase is Phase.WARMUP and self._report.eager_steps >= self._warmup:
            return self._first_capture(batch)
        if self._phase is Phase.GRAPHED:
            loss = self._replay_or_capture(batch)
            if loss is not None:
                return loss
        return self._eager(batch)

    def evaluate(self, *args: Any) -> Any:
        """The model's forward in eval mode without gradients: ``step.evaluate(x)`` or
        ``step.evaluate(batch)`` (a mapping, passed as ``model(**batch)``); no target.

        Rank-local (no collective; each rank evaluates its own batches). On CUDA the forward is
        captured after two eager calls per input signature, in the training graphs' pool, and
        replayed; the output is then graph-owned like the loss (the next evaluate() of that
        signature overwrites it). The model is back in train mode when this returns. Switching
        between training and evaluation never re-captures.
        """
        batch = make_batch(args, min_positional=1)
        self._report.evaluations += 1
        return self._run_watched("eval", self._evaluate, batch)

    def _evaluate(self, batch: Batch) -> Any:
        key = ("eval", batch.signature)
        captured = self._cache.get(key) if self._cache is not None else None
        with self._eval_mode():
            if captured is None and self._eval_capture_due(key):
                captured = self._capture_eval(key, batch)
            if captured is not None:
                self._check_guard()
                self._report.eval_replays += 1
                output = captured.replay(batch.tensors)
                self._watch_replay()
                return output
            with self._on_side_stream():
                return self._forward_eval(batch.with_tensors(self._to_device_all(batch)))

    def close(self) -> None:
        """Free every captured graph and their memory pool; later steps run eagerly.

        Call on every rank (a rank that keeps replaying would pair its graph's all-reduces with
        its peers' eager ones, which is safe, but the memory is the reason to close). Follow with
        ``torch.cuda.empty_cache()`` to hand the memory back to the driver.
        """
        if self._cache is not None:
            self._cache.close()
        if self._phase is not Phase.EAGER:
            self._phase = Phase.EAGER
            self._report.fallbacks.append("close() freed the graphs")

    def state_dict(self) -> dict[str, Any]:
        """Model (unwrapped), optimizer, scheduler and step count; safe to save at any step."""
        state: dict[str, Any] = {
            "model": _unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self._report.steps,
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load in place (the same tensors, new values), so captured graphs stay valid.

        Call on every rank. ``torch.optim.Optimizer.load_state_dict`` alone would replace the
        state tensors a graph reads; this copies into them instead.
        """
        missing = {"model", "optimizer"} - set(state)
        if missing:
            raise ConfigError(f"state dict lacks {sorted(missing)}; pass TrainStep.state_dict()'s.")
        _unwrap(self.model).load_state_dict(state["model"])
        _load_optimizer_in_place(self.optimizer, state["optimizer"])
        if self._optimizer_plan is not None:
            self._optimizer_plan = make_graph_safe(self.optimizer, self.device)
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self._report.steps = int(state.get("steps", self._report.steps))
        if self._cache is not None and self._cache.guard is not None:
            self._cache.guard = ReplayGuard(self._params, self.optimizer)

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
        return ddp

    def _planned_warmup(self) -> int:
        steps = self.options.warmup or DEFAULT_WARMUP
        # one more step whose syncs are checked, then capture at a count DDP does not time
        while not (self._count_allows_capture(steps) and self._count_allows_capture(steps - 1)):
            steps += 1
        return steps

    def _count_allows_capture(self, sync_forwards: int) -> bool:
        return ddp_count_allows_capture(sync_forwards, self._ddp_sample_rate)

    def _make_optimizer_graph_safe(self) -> tuple[GraphSafeOptimizer | None, str | None]:
        """The graph-safe optimizer plan, or why this step cannot be graphed."""
        if self.options.graph == "never":
            return None, "graph='never'"
        if self._stream is None:
            return None, f"the model is on {self.device}, not CUDA"
        try:
            return make_graph_safe(self.optimizer, self.device), None
        except CaptureError as exc:
            return None, str(exc)

    # ------------------------------------------------------------ per step
    def _first_capture(self, batch: Batch) -> torch.Tensor:
        """Capture on every rank, then agree; every rank replays, or every rank runs eagerly.

        Ranks that disagreed (one found a host sync, one's capture failed) would otherwise carry
        on with a graph on some ranks and a failed step on others; and with graph="always" every
        rank raises, not only the one that failed. Every rank reaches this call at the same step
        (the warm-up length is the same everywhere). Costs one tiny all-reduce, once per run.
        """
        captured: CapturedGraph | None = None
        started = time.perf_counter()
        if self._pending_failure is None:
            result = self._capture_train(batch)
            if isinstance(result, str):
                self._pending_failure = result
            else:
                captured = result
        if not self._every_rank_agrees(captured is not None):
            reason = (
                self._pending_failure
                or "another rank could not capture its step (its warning says why)"
            )
            self._pending_failure = None
            self._enter_eager(reason)
            return self._eager(batch)
        assert captured is not None
        self._phase = Phase.GRAPHED
        self._add_graph(("train", batch.signature), captured, started)
        loss = self._replay(captured, batch)
        self._report.time_to_first_replay = time.perf_counter() - self._start
        return loss

    def _replay_or_capture(self, batch: Batch) -> torch.Tensor | None:
        """Replay the graph of this signature, capturing it first if the policy says so.

        A later capture needs no agreement: capturing runs nothing, and a graph's all-reduces
        pair with a peer's eager ones like eager ones do (same buckets, same order).
        """
        assert self._cache is not None
        key = ("train", batch.signature)
        captured = self._cache.get(key)
        if captured is not None:
            return self._replay(captured, batch)
        if not self._should_capture_new_shape(batch.signature):
            return None
        started = time.perf_counter()
        result = self._capture_train(batch)
        if isinstance(result, str):
            self._cache.uncapturable.add(key)
            self._warn_or_raise(f"the batch of {describe(batch.signature)} runs eagerly: {result}")
            return None
        self._add_graph(key, result, started)
        return self._replay(result, batch)

    def _should_capture_new_shape(self, signature: Signature) -> bool:
        assert self._cache is not None
        policy = self.options.on_new_shape
        if policy == "error":
            known = self._cache.signatures("train")
            raise ValueError(
                f"TrainStep(on_new_shape='error') got a batch of {describe(signature)}, but its "
                f"graph was captured for {describe(known[0])} (changed: "
                f"{differences(signature, known[0])}); pad batches to one shape "
                "(ddpgraph.pad_batch, drop_last=True), or pass on_new_shape='eager' or 'capture'."
            )
        return (
            policy == "capture"
            and ("train", signature) not in self._cache.uncapturable
            and self._ddp_ready()
        )

    def _ddp_ready(self) -> bool:
        if not isinstance(self.model, DistributedDataParallel):
            return True
        return self._count_allows_capture(self._sync_forwards)

    def _eager(self, batch: Batch) -> torch.Tensor:
        self._report.eager_steps += 1
        warming_up = self._phase is Phase.WARMUP
        if warming_up:
            self._report.warmup_steps += 1
        check_syncs = warming_up and self._report.eager_steps == self._warmup
        with self._on_side_stream():
            batch = batch.with_tensors(self._to_device_all(batch))
            if self._optimizer_plan is not None:
                self._optimizer_plan.sync_lr()
            if self._compile_pending:
                loss = self._first_compiled_step(batch)
            elif check_syncs:
                syncs = _record_host_syncs(lambda: self._body(batch))
                loss = syncs.result
                if syncs.found:
                    self._pending_failure = syncs.describe()
            else:
                loss = self._body(batch)
        self._sync_forwards += 1
        return loss

    def _to_device_all(self, batch: Batch) -> list[torch.Tensor]:
        return [self._to_device(t) for t in batch.tensors]

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device, non_blocking=True)
        if self.options.channels_last and tensor.dim() == 4:
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    def _first_compiled_step(self, batch: Batch) -> torch.Tensor:
        """The first forward compiles; if Inductor fails, fall back to the plain module.

        Compilation happens before any kernel of the step runs, so the model is unchanged when
        it fails and the step is simply run again, uncompiled.
        """
        from torch._dynamo.exc import TorchDynamoException

        self._compile_pending = False
        try:
            return self._body(batch)
        except TorchDynamoException as exc:
            self._warn_or_raise(
                f"torch.compile failed, so the model runs uncompiled: {_first_line(exc)}"
            )
            self.model = self._wrap(self._module)
            self._params = [p for p in self.model.parameters() if p.requires_grad]
            return self._body(batch)

    def _body(self, batch: Batch) -> torch.Tensor:
        """zero_grad, k x (forward, loss, backward), clip, optimizer step. Returns the mean loss.

        Runs eagerly or under capture; it must not touch the LR (a fill_ captured here would
        reset the LR on every replay), so callers sync the LR tensors before it.
        """
        # set_to_none=False while graphs are possible: a graph reads and writes the same .grad
        # tensors on every replay
        self.optimizer.zero_grad(set_to_none=self._phase is Phase.EAGER)
        k = self.options.accumulate
        total: torch.Tensor | None = None
        for i, micro in enumerate(batch.split(k)):
            with self._no_sync_unless(i == k - 1), self._autocast():
                loss = self._loss(micro)
            _check_scalar_loss(loss)
            (loss / k).backward()
            part = loss.detach().float() / k
            total = part if total is None else total + part
        if self.options.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.options.clip_grad_norm, foreach=True)
        self.optimizer.step()
        assert total is not None
        return total

    def _loss(self, batch: Batch) -> torch.Tensor:
        if batch.kind == "mapping":
            inputs = batch.as_mapping()
            output = self.model(**inputs)
            return model_loss(output) if self.loss_fn is None else self.loss_fn(output, inputs)
        if self.loss_fn is None:
            return model_loss(self.model(*batch.tensors))
        return self.loss_fn(self.model(*batch.tensors[:-1]), batch.tensors[-1])

    def _replay(self, captured: CapturedGraph, batch: Batch) -> torch.Tensor:
        assert self._optimizer_plan is not None
        self._check_guard()
        self._optimizer_plan.sync_lr()
        loss: torch.Tensor = captured.replay(batch.tensors)
        self._report.replays += 1
        self._watch_replay()
        return loss

    def _watch_replay(self) -> None:
        # a graph's collectives are invisible to NCCL's watchdog: this event is what shows a hang
        wd = watchdog.active()
        if wd is not None:
            wd.after_replay(torch.cuda.current_stream(self.device), self._report.steps)

    def _check_guard(self) -> None:
        if self._cache is not None and self._cache.guard is not None:
            self._cache.guard.check()

    # -------------------------------------------------------------- capture
    def _capture_train(self, batch: Batch) -> CapturedGraph | str:
        """Capture the step for this batch's signature; the graph, or why it failed.

        Capture runs nothing: the caller replays the graph once to train on this batch.
        """
        assert self._cache is not None and self._optimizer_plan is not None
        static = batch.with_tensors([t.clone() for t in self._to_device_all(batch)])
        self._optimizer_plan.sync_lr()
        result = self._cache.capture(static.tensors, lambda: self._body(static))
        self._sync_forwards += 1  # DDP's host code ran once during capture
        return result

    def _add_graph(
        self, key: tuple[str, Signature], captured: CapturedGraph, started: float
    ) -> None:
        assert self._cache is not None
        self._cache.add(key, captured)
        seconds = time.perf_counter() - started
        kind, signature = key
        self._report.captures.append(CaptureRecord(signature, self._report.steps, seconds, kind))
        if self._cache.guard is None:
            self._cache.guard = ReplayGuard(self._params, self.optimizer)
        get_logger().info(
            "TrainStep captured %s %s in %.0f ms", kind, describe(signature), seconds * 1e3
        )

    def _eval_capture_due(self, key: tuple[str, Signature]) -> bool:
        if self._cache is None or self.options.graph == "never" or key in self._cache.uncapturable:
            return False
        if self._phase is Phase.EAGER and self._report.fallbacks[-1:] == [
            "close() freed the graphs"
        ]:
            return False
        self._eval_calls[key[1]] += 1
        return self._eval_calls[key[1]] > _EVAL_WARMUP

    def _capture_eval(self, key: tuple[str, Signature], batch: Batch) -> CapturedGraph | None:
        assert self._cache is not None
        started = time.perf_counter()
        static = batch.with_tensors([t.clone() for t in self._to_device_all(batch)])
        result = self._cache.capture(static.tensors, lambda: self._forward_eval(static))
        if isinstance(result, str):
            self._cache.uncapturable.add(key)
            self._warn_or_raise(f"evaluation of {describe(batch.signature)} runs eagerly: {result}")
            return None
        self._add_graph(key, result, started)
        return result

    def _forward_eval(self, batch: Batch) -> Any:
        # the module inside DDP: evaluation needs no gradient sync, and DDP's forward would
        # count an iteration and broadcast buffers
        module = (
            self.model.module if isinstance(self.model, DistributedDataParallel) else self.model
        )
        with torch.no_grad(), self._autocast():
            if batch.kind == "mapping":
                return module(**batch.as_mapping())
            return module(*batch.tensors)

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    # ------------------------------------------------------- agreement, exits
    def _every_rank_agrees(self, ok: bool) -> bool:
        if not isinstance(self.model, DistributedDataParallel):
            return ok
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

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
    """The loss a model computed itself: ``output.loss``, ``output["loss"]`` or a scalar output."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    raise ValueError(
        f"TrainStep(loss_fn=None) needs the model to return its loss (a scalar tensor, .loss or "
        f"['loss']), but it returned {_kind_of(output)}; pass labels in the batch (HF models "
        "compute the loss from them) or give a loss_fn."
    )


def _kind_of(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    return f"a {type(output).__name__}"


def _warn_at_user_line(message: str) -> None:
    """Warn with the location of the user's call into ddpgraph, not a line of step.py."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    level = 2  # 1 is this function
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        package
    ):
        frame = frame.f_back
        level += 1
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _check_scalar_loss(loss: object) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return a scalar tensor, got {shape}; reduce it (e.g. .mean())."
        )


def _load_optimizer_in_place(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    old_state = {p: dict(s) for p, s in optimizer.state.items()}
    old_lrs = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict(dict(state))
    for param, new in optimizer.state.items():
        for key, value in new.items():
            old = old_state.get(param, {}).get(key)
            if (
                isinstance(old, torch.Tensor)
                and isinstance(value, torch.Tensor)
                and old.shape == value.shape
            ):
                old.copy_(value)
                new[key] = old
    for group, old_lr in zip(optimizer.param_groups, old_lrs):
        if isinstance(old_lr, torch.Tensor):
            old_lr.fill_(float(group["lr"]))
            group["lr"] = old_lr


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
    skip = (_TORCH_DIR, _PACKAGE_DIR, os.path.dirname(warnings.__file__) + os.sep + "warnings.py")
    for frame in reversed(traceback.extract_stack()):
        if os.path.abspath(frame.filename).startswith(skip):
            continue
        return f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
    return "an unknown line"


# package directories by path, not by a "/torch/" substring: a virtual environment can be named
# torch (/opt/torch/.venv/.../transformers would be skipped)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
