"""``TrainStep``: the whole DDP training step, captured once as a CUDA graph and replayed.

One call runs zero_grad, forward, loss, backward (with DDP's gradient all-reduce), optional
clipping and the optimizer step. The first calls are ordinary eager steps on the user's batches
(the warm-up); then the step is captured and every later call with the same input signature
copies the batch into static buffers and replays the graph. Without CUDA the same object runs
the same step eagerly, so one training loop serves both.

Facts this module is built on (measured on an H200, torch 2.11, NCCL 2.28; see REFERENCES.md):

* DDP must be *constructed* on the side stream that captures, or backward fails with "operation
  would make the legacy stream depend on a capturing blocking stream".
* DDP records CUDA-event timers in forwards whose prior iteration count n is 1..10 or a multiple
  of 100; such a forward cannot be captured. Capture therefore happens at a count n >= 11 with
  n % 100 != 0. Forwards under ``no_sync`` do not count, and replays do not advance the count.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._log import get_logger
from .errors import CaptureError, ConfigError, DeviceConflictError, explain
from .facts import DEFAULT_WARMUP, ddp_count_allows_capture
from .optim import GraphSafeOptimizer, make_graph_safe

__all__ = ["StepReport", "TrainStep"]

GraphMode = Literal["auto", "always", "never"]
NewShapePolicy = Literal["eager", "capture", "error"]
Signature = tuple[tuple[torch.Size, torch.dtype, torch.device], ...]


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


@dataclass
class CaptureRecord:
    signature: Signature
    at_step: int
    seconds: float


@dataclass
class StepReport:
    """What a :class:`TrainStep` did: ``str(report)`` is a readable summary."""

    mode: str
    steps: int = 0
    eager_steps: int = 0
    replays: int = 0
    warmup_steps: int = 0
    captures: list[CaptureRecord] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    optimizer_changes: list[str] = field(default_factory=list)
    time_to_first_replay: float | None = None  # seconds from construction to the first replay

    def __str__(self) -> str:
        lines = [
            f"mode={self.mode} steps={self.steps} eager={self.eager_steps} "
            f"replays={self.replays} warm-up={self.warmup_steps}"
        ]
        lines += [
            f"captured {_describe(c.signature)} at step {c.at_step} in {c.seconds * 1e3:.0f} ms"
            for c in self.captures
        ]
        if self.optimizer_changes:
            lines.append("optimizer made graph-safe: " + ", ".join(self.optimizer_changes))
        lines += [f"fallback: {reason}" for reason in self.fallbacks]
        return "\n".join(lines)


def _describe(signature: Signature) -> str:
    return ", ".join(
        f"{tuple(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype, _ in signature
    )


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_batch: tuple[torch.Tensor, ...]
    static_loss: torch.Tensor


class TrainStep:
    """The whole training step as one callable: ``loss = step(x, y)``.

    ``step(*batch)``: the last element is the target passed to ``loss_fn(output, target)``; the
    others are the model's inputs. Call it on every rank, the same number of times.

    The returned loss is owned by the graph once the step is captured: the next call overwrites
    it in place. ``loss.clone()`` (or ``float(loss)``, a host sync) keeps a value.

    Options (keyword-only, validated here):
        graph: "auto" captures where CUDA is available and falls back to eager with a warning that
            explains why; "always" raises :class:`CaptureError` instead; "never" stays eager.
        amp: None or "bf16" (autocast around forward and loss).
        accumulate: k micro-batches per step (the batch is split along dim 0); gradients are
            all-reduced once, on the last.
        clip_grad_norm: max total gradient norm, clipped on the device without a host sync.
        on_new_shape: for a batch whose shapes/dtypes/devices differ from every captured one:
            "eager" runs that step eagerly, "capture" records another graph sharing the memory pool,
            "error" raises ``ValueError``.
        warmup: eager steps before capture (default 12); raised as needed so that DDP's forward at
            capture is not one it times (>= 11 earlier forwards, not a multiple of 100).
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
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
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
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn={loss_fn!r} is not callable.")
        self.device = _model_device(model)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self._amp_dtype = torch.bfloat16 if amp == "bf16" else None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self._module = model
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._compile_pending = bool(compile)  # compiled, but not yet past its first forward
        self.model = self._wrap(_compiled(model, compile) if compile else model)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._graphs: dict[Signature, _Graph] = {}
        self._pool: Any = None
        self._sync_forwards = 0  # DDP forwards that advanced its iteration counter
        self._start = time.perf_counter()
        self._warmup = self._planned_warmup()
        self._optimizer_plan: GraphSafeOptimizer | None = None
        self._report = StepReport(mode="eager")
        self._graph_enabled = self._graphs_possible()
        self._report.mode = self.mode
        if self._optimizer_plan is not None:
            self._report.optimizer_changes = list(self._optimizer_plan.changes)
        self._guard: _ReplayGuard | None = None
        self._captured: _Graph | None = None
        self._graph_planned = self._graph_enabled
        self._first_capture_tried = False
        self._pending_failure: str | None = None
        self._uncapturable: set[Signature] = set()

    # ----------------------------------------------------------------- public
    @property
    def mode(self) -> str:
        """ "graphed" once a graph exists, "warmup" while heading for one, else "eager"."""
        if getattr(self, "_graphs", None):
            return "graphed"
        return "warmup" if getattr(self, "_graph_enabled", False) else "eager"

    def report(self) -> StepReport:
        """Warm-up steps, captures (with time), replays, eager steps and every fallback's reason."""
        self._report.mode = self.mode
        return self._report

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        signature = self._signature(batch)
        self._report.steps += 1
        if self._at_first_capture():
            self._first_capture_tried = True
            if self._agree("capture"):
                loss = self._capture_and_replay(signature, batch)
                if loss is not None:
                    return loss
        elif self._graph_enabled and self._graphs:
            captured = self._graphs.get(signature)
            if captured is not None:
                return self._replay(captured, batch)
            if self._should_capture_new_shape(signature):
                loss = self._capture_and_replay(signature, batch)
                if loss is not None:
                    return loss
        return self._eager(batch, check_syncs=self._is_sync_check_step())

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
        if self._guard is not None:
            self._guard = _ReplayGuard(self._params, self.optimizer)

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
            return DistributedDataParallel(model, **kwargs)

    def _planned_warmup(self) -> int:
        steps = self.options.warmup or DEFAULT_WARMUP
        # one more step whose syncs are checked, then capture at a count DDP does not time
        while not (ddp_count_allows_capture(steps) and ddp_count_allows_capture(steps - 1)):
            steps += 1
        return steps

    def _graphs_possible(self) -> bool:
        graph = self.options.graph
        if graph == "never":
            return False
        reason = None
        if self._stream is None:
            reason = f"the model is on {self.device}, not CUDA"
        else:
            try:
                self._optimizer_plan = make_graph_safe(self.optimizer, self.device)
            except CaptureError as exc:
                reason = str(exc)
        if reason is None:
            return True
        if graph == "always":
            raise CaptureError(f"TrainStep(graph='always') cannot capture: {reason}.")
        if self._stream is not None:
            warnings.warn(f"TrainStep runs eagerly: {reason}", stacklevel=3)
        self._report.fallbacks.append(reason)
        return False

    # ------------------------------------------------------------ per step
    def _signature(self, batch: tuple[torch.Tensor, ...]) -> Signature:
        if len(batch) < 2:
            raise ValueError(
                f"TrainStep got {len(batch)} tensor(s); call step(*inputs, target), e.g. step(x, y)."
            )
        for i, item in enumerate(batch):
            if not isinstance(item, torch.Tensor):
                raise TypeError(f"batch element {i} is a {type(item).__name__}, not a tensor.")
        return tuple((t.shape, t.dtype, t.device) for t in batch)

    def _at_first_capture(self) -> bool:
        # Every rank that planned a graph reaches this call, even one that has given up since
        # (it must still take part in the agreement).
        return (
            self._graph_planned
            and not self._first_capture_tried
            and self._report.eager_steps >= self._warmup
        )

    def _should_capture_new_shape(self, signature: Signature) -> bool:
        policy = self.options.on_new_shape
        if policy == "error":
            known = "; ".join(_describe(s) for s in self._graphs)
            raise ValueError(
                f"TrainStep(on_new_shape='error') got a batch of {_describe(signature)}, but "
                f"its graph was captured for {known}; pad batches to one shape (drop_last=True), "
                "or pass on_new_shape='eager' or 'capture'."
            )
        return policy == "capture" and signature not in self._uncapturable and self._ddp_ready()

    def _ddp_ready(self) -> bool:
        if not isinstance(self.model, DistributedDataParallel):
            return True
        return ddp_count_allows_capture(self._sync_forwards)

    def _is_sync_check_step(self) -> bool:
        return (
            self._graph_enabled
            and not self._graphs
            and self._report.eager_steps == self._warmup - 1
        )

    def _eager(self, batch: tuple[torch.Tensor, ...], *, check_syncs: bool = False) -> torch.Tensor:
        self._report.eager_steps += 1
        if not self._graphs and self._graph_enabled:
            self._report.warmup_steps += 1
        with self._on_side_stream():
            batch = tuple(self._to_device(t) for t in batch)
            if self._optimizer_plan is not None:
                self._optimizer_plan.sync_lr()
            if self._compile_pending:
                loss = self._first_compiled_step(batch)
            elif check_syncs:
                syncs = _record_host_syncs(lambda: self._body(batch))
                loss = syncs.result
                if syncs.found:
                    self._note_failure(syncs.describe())
            else:
                loss = self._body(batch)
        self._sync_forwards += 1
        return loss

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device, non_blocking=True)
        if self.options.channels_last and tensor.dim() == 4:
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    def _first_compiled_step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
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

    def _body(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """zero_grad, k x (forward, loss, backward), clip, optimizer step. Returns the mean loss.

        Runs eagerly or under capture; it must not touch the LR (a fill_ captured here would
        reset the LR on every replay), so callers sync the LR tensors before it.
        """
        # set_to_none=False: the graph reads and writes the same .grad tensors on every replay
        self.optimizer.zero_grad(set_to_none=not self._graph_enabled)
        k = self.options.accumulate
        micro_batches = _split(batch, k)
        total: torch.Tensor | None = None
        for i, micro in enumerate(micro_batches):
            with self._no_sync_unless(i == k - 1), self._autocast():
                output = self.model(*micro[:-1])
                loss = self.loss_fn(output, micro[-1])
            _check_scalar_loss(loss)
            (loss / k).backward()
            part = loss.detach().float() / k
            total = part if total is None else total + part
        if self.options.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.options.clip_grad_norm, foreach=True)
        self.optimizer.step()
        assert total is not None
        return total

    def _replay(self, captured: _Graph, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        assert self._guard is not None and self._optimizer_plan is not None
        self._guard.check()
        self._optimizer_plan.sync_lr()
        for static, tensor in zip(captured.static_batch, batch):
            static.copy_(tensor, non_blocking=True)
        captured.graph.replay()
        self._report.replays += 1
        return captured.static_loss

    # -------------------------------------------------------------- capture
    def _capture_and_replay(
        self, signature: Signature, batch: tuple[torch.Tensor, ...]
    ) -> torch.Tensor | None:
        """Capture the step for ``signature`` and replay it once (capture itself runs nothing).

        Returns None, after a warning, if "auto" mode fell back to eager; the caller then runs the
        step eagerly. Model and optimizer state are untouched by a failed capture.
        """
        assert self._stream is not None
        static_batch = tuple(self._to_device(t).clone() for t in batch)
        started = time.perf_counter()
        assert self._optimizer_plan is not None
        self._optimizer_plan.sync_lr()
        error = self._try_capture(static_batch)
        self._sync_forwards += 1  # DDP's host code ran once during capture
        if error is not None and self._graphs:
            # A later shape: keep the graphs that work, run this shape eagerly from now on.
            self._uncapturable.add(signature)
            self._warn_or_raise(f"the batch of {_describe(signature)} runs eagerly: {error}")
            return None
        if error is not None:
            self._note_failure(error)
        if not self._graphs and not self._agree("capture its step"):
            self._captured = None
            return None
        assert self._captured is not None
        self._graphs[signature] = self._captured
        self._captured = None
        seconds = time.perf_counter() - started
        self._report.captures.append(CaptureRecord(signature, self._report.steps, seconds))
        self._guard = _ReplayGuard(self._params, self.optimizer)
        get_logger().info("TrainStep captured %s in %.0f ms", _describe(signature), seconds * 1e3)
        loss = self._replay(self._graphs[signature], batch)
        if self._report.time_to_first_replay is None:
            self._report.time_to_first_replay = time.perf_counter() - self._start
        return loss

    def _try_capture(self, static_batch: tuple[torch.Tensor, ...]) -> str | None:
        assert self._stream is not None
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        try:
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
            ):
                static_loss = self._body(static_batch)
        except Exception as exc:
            torch.cuda.synchronize(self.device)
            _release_rng_from_failed_capture(self._stream)
            return _first_capture_error(exc)
        self._captured = _Graph(graph, static_batch, static_loss)
        return None

    def _give_up_graphs(self, reason: str) -> None:
        self._graph_enabled = False
        self._warn_or_raise(f"whole-step capture is off: {reason}")

    def _warn_or_raise(self, message: str) -> None:
        if self.options.graph == "always":
            raise CaptureError(message)
        warnings.warn(f"TrainStep continues eagerly; {message}", stacklevel=4)
        self._report.fallbacks.append(message)

    def _note_failure(self, reason: str) -> None:
        """Stop graphing on this rank; warn or raise at the next agreement, with the others."""
        self._graph_enabled = False
        self._pending_failure = reason

    def _agree(self, what: str) -> bool:
        """Before the first capture and after it: every rank captures, or none does.

        Ranks that disagreed (one found a host sync, one's capture failed) would otherwise pair
        a graph's all-reduces with eager ones and hang; and with graph="always" every rank raises,
        not only the one that failed. Ranks reach these two points at the same call, since the
        warm-up length is the same everywhere. Costs one tiny all-reduce, twice per run.
        """
        all_ok = self._graph_enabled
        if isinstance(self.model, DistributedDataParallel):
            flag = torch.tensor([int(all_ok)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            all_ok = bool(flag.item())
        if not all_ok:
            reason = (
                self._pending_failure or f"another rank could not {what} (its warning says why)"
            )
            self._pending_failure = None
            self._give_up_graphs(reason)
        return all_ok

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


@contextlib.contextmanager
def _side_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    # The side stream waits for the caller's work (e.g. the batch's H2D copy) and the caller's
    # stream waits for the step, so the user's loop needs no synchronisation of its own.
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(stream.device).wait_stream(stream)


class _ReplayGuard:
    """Detects parameters or optimizer state replaced since capture (the graph reads the old ones).

    Runs before every replay, so it compares flat lists of data pointers: a few microseconds for
    hundreds of tensors.
    """

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        self._params = params
        self._pointers = [p.data_ptr() for p in params]
        self._optimizer = optimizer
        self._state = optimizer.state
        self._slots = [
            (state, key)
            for state in optimizer.state.values()
            for key, value in state.items()
            if isinstance(value, torch.Tensor)
        ]
        self._state_pointers = self._current_state_pointers()

    def _current_state_pointers(self) -> list[int]:
        return [state[key].data_ptr() for state, key in self._slots]

    def check(self) -> None:
        if [p.data_ptr() for p in self._params] != self._pointers:
            self._raise_for_parameter()
        if (
            self._optimizer.state is not self._state
            or self._current_state_pointers() != self._state_pointers
        ):
            raise CaptureError(
                "the optimizer's state tensors were replaced since capture (e.g. by "
                "optimizer.load_state_dict), so the graph would update the old ones; use "
                "step.load_state_dict(), which copies in place."
            )

    def _raise_for_parameter(self) -> None:
        for i, (param, pointer) in enumerate(zip(self._params, self._pointers)):
            if param.data_ptr() != pointer:
                raise CaptureError(
                    f"parameter {i} (shape {tuple(param.shape)}) was replaced since capture, so "
                    "the graph would train the old tensor; change parameters in place "
                    "(param.data.copy_(new)) or load checkpoints with step.load_state_dict()."
                )


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


def _split(batch: Sequence[torch.Tensor], k: int) -> list[tuple[torch.Tensor, ...]]:
    if k == 1:
        return [tuple(batch)]
    size = batch[0].shape[0] if batch[0].dim() else 0
    for t in batch:
        if t.dim() == 0 or t.shape[0] != size or size % k:
            raise ValueError(
                f"accumulate={k} splits every batch tensor along dim 0 into {k} equal parts, "
                f"but got shapes {[tuple(x.shape) for x in batch]}; use a batch size divisible by {k}."
            )
    return list(zip(*(t.chunk(k) for t in batch)))


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
    """The innermost stack frame outside torch and ddpgraph: the user's line that synced."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or "/ddpgraph/" in path or "warnings.py" in path:
            continue
        return f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
    return "an unknown line"


def _release_rng_from_failed_capture(stream: torch.cuda.Stream) -> None:
    """Take the default CUDA generator out of capture mode after a failed capture.

    torch ends a generator's capture mode only when a capture *succeeds*; after a failed one every
    later random op (dropout, Inductor's compilation) raises "Offset increment outside graph
    capture encountered unexpectedly". A trivial capture that succeeds ends it.
    """
    scratch = torch.zeros(1, device=stream.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        scratch.add_(1)
    del graph


def _first_capture_error(exc: BaseException) -> str:
    """The first CUDA error of a failed capture, not the 'previous error' that follows it."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    first = chain[-1]
    text = str(first).strip().splitlines()[0] if str(first).strip() else type(first).__name__
    known = explain(f"{type(first).__name__}: {first}")
    explained = f"\nddpgraph explains: {known.render()}" if known is not None else ""
    return f"capture failed: {type(first).__name__}: {text}{explained}"
