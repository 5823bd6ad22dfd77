"""The CUDA graphs of one TrainStep, and everything they read: one owner, ``capture``/``replay``.

:class:`Graphs` owns the memory pool, each graph's static inputs and outputs, the optimizer's LR
tensors (through the graph-safe plan), the replay guard and the hooks run after a replay (the
watchdog registers one). The policy keeps the rest: when to capture, what to do when a capture
fails, which key a batch has. The engine that makes a TrainStep's Graphs is passed in:
:data:`ddpgraph.step.engine.CUDA_GRAPHS` on CUDA, or the CPU stand-in (:class:`ddpgraph.step.cpu_graphs.CpuGraphs`)
that drives the real policy in CI.

Training and evaluation graphs share the pool (as Megatron does): the step never runs two of them
at once (they replay on one stream) and every graph's outputs stay allocated while the graph
lives, so a later capture can only reuse memory that earlier graphs use as scratch.
"""

from __future__ import annotations

import contextlib
import gc
import os
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, is_
from typing import Any

import torch
from torch import nn

from .._frames import PACKAGE_DIR
from .._globals import Global, process_global
from .._typed_torch import cuda_stream
from ..errors import explain_exception
from .batch import Batch, GraphKey, Role
from .optim import (
    GraphSafeOptimizer,
    describe_group_changes,
    hyperparameters,
    make_graph_safe,
    restore_identities,
    tensor_slots,
)
from .watch import address

__all__ = [
    "CaptureFailure",
    "CapturedGraph",
    "Graphs",
    "GuardFindings",
    "ReplayGuard",
    "capture_stream",
    "first_capture_error",
    "on_stream",
]

ReplayHook = Callable[[torch.cuda.Stream], None]
Parameters = Callable[[], Iterable[nn.Parameter]]


_CAPTURE_STREAMS: Global[dict[int, torch.cuda.Stream]] = process_global(
    "graphs.capture_streams", dict, reset_at_shutdown=False
)


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device, shared by every TrainStep on it.

    cuBLAS keeps a workspace (tens of MiB) per stream for the life of the process: a stream per
    TrainStep would leave one behind for every TrainStep ever built. Steps on one stream run in
    the order they are called, as on the default stream.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _CAPTURE_STREAMS.value
    if index not in streams:
        streams[index] = cuda_stream(index)
    return streams[index]


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
    """Run on the capture stream (CUDA), or where the caller is (CPU: ``stream`` is None)."""
    return contextlib.nullcontext() if stream is None else _side_stream(stream)


@contextlib.contextmanager
def _side_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    # The side stream waits for the caller's work (e.g. the batch's H2D copy) and the caller's
    # stream waits for the step, so the user's loop needs no synchronisation of its own.
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(stream.device).wait_stream(stream)


@dataclass
class CapturedGraph:
    """A graph, the buffers it reads its inputs from, and what it returns (graph-owned)."""

    graph: torch.cuda.CUDAGraph | None  # None: the CPU stand-in's
    static_inputs: tuple[torch.Tensor, ...]
    output: Any


@dataclass
class CaptureFailure:
    """Why a capture failed (the first CUDA error, not the 'previous error' after it)."""

    reason: str


@dataclass
class Replayed:
    """What :meth:`Graphs.replay` did: the graph's output (None: no graph of this key to replay,
    or the guard dropped the training graphs), and what the guard found before it."""

    output: Any
    findings: GuardFindings
    replayed: bool = False


class Graphs:
    """Every graph of one TrainStep by key, their pool, static buffers, guard and replay hooks.

    ``capture(key, batch, body)`` records ``body(static_batch)`` on the capture stream (running
    nothing) and keeps the graph; ``replay(key, batch)`` checks the guard (one call per step:
    what the script changed is put back in place, or the training graphs are dropped for a
    re-capture), syncs the LR tensors, copies the batch into the static inputs, replays and runs
    the hooks. ``close()`` drops every graph and the pool, so the memory returns to PyTorch's
    allocator. ``parameters()`` gives the wrapped model's parameters (the trainable ones are
    the graphs' to guard; a re-capture reads them again).
    """

    engine = "cuda-graphs"  # what report().engine names

    def __init__(
        self,
        stream: torch.cuda.Stream | None,
        parameters: Parameters,
        plan: GraphSafeOptimizer,
    ) -> None:
        self._stream = stream
        self._graphs: dict[GraphKey, CapturedGraph] = {}
        self._pool: Any = None
        self.plan = plan
        self._parameters = parameters
        self.params = _trainable(parameters())
        self.uncapturable: set[GraphKey] = set()
        self.events_only = False  # guard="events" (StepOptions.guard): the replay guard's reads
        self.guard: ReplayGuard | None = None
        self._hooks: list[ReplayHook] = []

    # ------------------------------------------------------------------ lookup
    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._graphs

    def __iter__(self) -> Iterator[GraphKey]:
        return iter(self._graphs)

    def keys_of(self, role: Role) -> list[GraphKey]:
        """The keys of ``role`` ("train", "micro" or "eval"), oldest first."""
        return [key for key in self._graphs if key.role == role]

    def get(self, key: GraphKey) -> CapturedGraph | None:
        return self._graphs.get(key)

    def bare_graph(self) -> torch.cuda.CUDAGraph | None:
        """The first training graph of a batch of tensors (a ``step(data)`` graph gathers at a
        device cursor only ``step(data)`` keeps in range), for benchmarks; None if none."""
        for key in self.keys_of("train"):
            if not key.reads_device_data:
                return self._graphs[key].graph
        return None

    def parameters_changed(self) -> None:
        """The wrapped model was rebuilt (e.g. compile fell back): guard its parameters."""
        self.params = _trainable(self._parameters())

    def watched(self) -> list[nn.Parameter]:
        """What the replay guard watches: every parameter, frozen ones too (a graph reads them
        in the forward, and unfreezing one must re-capture as freezing does)."""
        return list(self._parameters())

    def register_replay_hook(self, hook: ReplayHook) -> None:
        """Call ``hook(stream)`` after every replay (the watchdog records an event there)."""
        self._hooks.append(hook)

    # ----------------------------------------------------------------- capture
    def capture(
        self, key: GraphKey, batch: Batch, body: Callable[[Batch], Any]
    ) -> CapturedGraph | CaptureFailure:
        """Capture ``body`` on a copy of ``batch`` (its static inputs) and keep it under ``key``.

        Capturing runs no kernel, so a failed capture leaves parameters, optimizer state and
        BatchNorm buffers as they were; the caller restores what runs on the host (DDP's reducer).
        The caller replays the graph once to train on ``batch``.
        """
        assert self._stream is not None
        static = batch.with_tensors([t.clone() for t in batch.tensors])
        self.plan.sync_lr()  # the LR is read from its tensor; a fill_ inside would be frozen
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self._stream.device)
        try:
            # thread_local: a capture must not forbid CUDA calls of other threads (the watchdog's
            # event queries, a DataLoader's pinning thread)
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
            ):
                output = body(static)
        except Exception as exc:
            torch.cuda.synchronize(self._stream.device)
            _release_rng_from_failed_capture(self._stream)
            self.uncapturable.add(key)
            return CaptureFailure(first_capture_error(exc))
        captured = CapturedGraph(graph, static.tensors, output)
        self._graphs[key] = captured
        if self.guard is None:
            self.guard = ReplayGuard(
                self.watched(), self.plan.optimizer, events_only=self.events_only
            )
        return captured

    # ------------------------------------------------------------------ replay
    def replay(self, key: GraphKey, batch: Batch) -> Replayed:
        """Check the guard, then replay the graph of ``key`` on ``batch``.

        The output is graph-owned (overwritten by the next replay of this key). Nothing is
        replayed when no graph of ``key`` exists or the guard dropped the training graphs (a
        re-capture is due); ``findings`` says what the guard found either way.
        """
        self.plan.sync_lr()  # before the guard: betas a scheduler rewrote become tensors here
        findings = self.check()
        captured = self._graphs.get(key)
        if captured is None:
            return Replayed(None, findings)
        self._launch(captured, batch)
        return Replayed(captured.output, findings, replayed=True)

    def _launch(self, captured: CapturedGraph, batch: Batch) -> None:
        assert self._stream is not None and captured.graph is not None
        self.plan.sync_lr()
        for static, tensor in zip(captured.static_inputs, batch.tensors):
            static.copy_(tensor, non_blocking=True)
        captured.graph.replay()
        stream = torch.cuda.current_stream(self._stream.device)
        for hook in self._hooks:
            hook(stream)

    def check(self) -> GuardFindings:
        """What changed since capture, handled: optimizer reloads put back in place; a changed
        ``requires_grad`` or param-group value drops the training graphs (a re-capture)."""
        if self.guard is None:
            return GuardFindings()
        found = self.guard.check()
        if found.changes:
            self.make_optimizer_safe_again()
        if found.recapture:
            self.params = _trainable(self._parameters())
            for param in self._parameters():
                if not param.requires_grad:
                    param.grad = None  # eager zero_grad(set_to_none=True) would leave it None
            found.dropped = self.drop_training()
        return found

    def make_optimizer_safe_again(self) -> None:
        """After a reload: a loaded param group may say capturable=False or foreach SGD."""
        make_graph_safe(self.plan.optimizer, self._stream_device())

    def _stream_device(self) -> torch.device:
        # the CPU engine has no stream: its graphs and optimizer live on the CPU
        return torch.device("cpu") if self._stream is None else self._stream.device

    # ----------------------------------------------------------------- dropping
    def drop(self, role: Role) -> int:
        """Drop the graphs of ``role`` (e.g. every training graph before a re-capture)."""
        keys = self.keys_of(role)
        for key in keys:
            del self._graphs[key]
        if not self._graphs:
            # torch frees a private pool when its last graph goes: capture into a new one
            self._pool = None
        self.uncapturable = {k for k in self.uncapturable if k.role != role}
        if role == "train":
            self.guard = None
        return len(keys)

    def drop_training(self) -> int:
        """Drop every training graph (every role but "eval"): they read what changed."""
        return sum(self.drop(role) for role in ("train", "micro", "sync", "update"))

    def drop_all(self) -> int:
        """Drop every graph, evaluation's too (the model's memory or forward changed)."""
        return self.drop_training() + self.drop("eval")

    def close(self) -> None:
        """Free every graph and the pool. The caller makes sure no replay is in flight."""
        if self._graphs:
            torch.cuda.synchronize(self._stream_device())
        self._graphs.clear()
        self._pool = None
        self.guard = None
        gc.collect()  # graphs captured by a failing call may sit in a traceback's cycle


_requires_grad = attrgetter("requires_grad")


_data_ptr = torch.Tensor.data_ptr


def _trainable(parameters: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in parameters if p.requires_grad]


@dataclass
class GuardFindings:
    """What one :meth:`ReplayGuard.check` found and handled; empty when nothing changed."""

    changes: list[str] = field(default_factory=list)
    recapture: bool = False  # the graphs read something that changed: capture them again
    dropped: int = 0  # training graphs dropped for that re-capture
    trainable_changed: bool = False  # a parameter's requires_grad: the wrapper follows it


class ReplayGuard:
    """Detects what changed in the optimizer and the trainable set since capture that a replay
    would silently get wrong (what moved in the model is :class:`~.watch.ModelWatch`'s, checked
    on every call before this).

    Runs before every replay, so it compares flat lists, one C-level pass each: the
    ``requires_grad`` flags of the parameters, the identity of the optimizer's state dict, its
    state tensors' data pointers and the param groups' plain values (by identity; by value only
    when an object differs). With ``events_only`` (``guard="events"``) only the state dict's
    identity and the param groups are read: a reload replaces the state dict.

    * optimizer state replaced (``optimizer.load_state_dict``): the new values are copied into
      the tensors the graphs read (:func:`ddpgraph.optim.restore_identities`), never a new
      baseline; a slot that cannot be restored asks for a re-capture;
    * a param-group value changed (weight decay, betas), or a parameter's ``requires_grad``:
      re-capture (the graph baked the old value in).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        *,
        events_only: bool = False,
    ) -> None:
        self.params = params
        self.optimizer = optimizer
        # guard="events": requires_grad and the state tensors are not read; a reload
        # (load_state_dict, DCP's set_state_dict) replaces the state dict, which is compared
        self._events_only = events_only
        self._params_seen = self._current_params()
        self._kept = tensor_slots(self.optimizer)  # what the graphs read: never re-baselined
        self._groups = hyperparameters(self.optimizer)
        self._index_groups()
        self._index_slots()

    def _current_params(self) -> list[bool]:
        return list(map(_requires_grad, self.params))

    def _index_slots(self) -> None:
        self._state = self.optimizer.state
        self._slots = [
            (state, key)
            for state in self._state.values()
            for key, value in state.items()
            if isinstance(value, torch.Tensor)
        ]
        self._slot_dicts = [state for state, _ in self._slots]
        self._slot_keys = [key for _, key in self._slots]
        self._plain = not any(hasattr(state[key], "_local_tensor") for state, key in self._slots)
        self._slot_pointers = self._current_slot_pointers()

    def _index_groups(self) -> None:
        """The param groups' plain values as flat lists, compared by identity on every call (the
        values themselves only when an object differs: :func:`hyperparameters`)."""
        groups = self.optimizer.param_groups
        self._group_list = groups
        self._group_dicts = list(groups)
        self._group_sizes = list(map(len, groups))
        items = [(g, k, v) for g in groups for k, v in g.items() if k not in ("params", "lr")]
        self._value_dicts = [g for g, _, _ in items]
        self._value_keys = [k for _, k, _ in items]
        self._values = [v for _, _, v in items]

    def _current_slot_pointers(self) -> list[int]:
        if self._plain:
            try:  # one C-level pass: no Python frame per state tensor
                return list(
                    map(_data_ptr, map(dict.__getitem__, self._slot_dicts, self._slot_keys))
                )
            except (KeyError, TypeError):
                pass  # a slot deleted or no longer a tensor: the slow path below names it
        return [address(state[key]) if key in state else -1 for state, key in self._slots]

    def _groups_unchanged(self) -> bool:
        groups = self.optimizer.param_groups
        return (
            groups is self._group_list
            and all(map(is_, groups, self._group_dicts))
            and list(map(len, groups)) == self._group_sizes
            and all(map(is_, map(dict.get, self._value_dicts, self._value_keys), self._values))
        )

    def check(self) -> GuardFindings:
        found = GuardFindings()
        if self._events_only:
            if self.optimizer.state is not self._state:
                self._restore_optimizer(found)
            self._check_groups(found)
            return found
        params = self._current_params()
        if params != self._params_seen:
            found.changes.append("a parameter's requires_grad changed")
            found.recapture = True
            found.trainable_changed = True
        if (
            self.optimizer.state is not self._state
            or self._current_slot_pointers() != self._slot_pointers
        ):
            self._restore_optimizer(found)
        self._check_groups(found)
        return found

    def _check_groups(self, found: GuardFindings) -> None:
        if not self._groups_unchanged():
            groups = hyperparameters(self.optimizer)
            if groups != self._groups:
                found.changes.append(describe_group_changes(self.optimizer, self._groups, groups))
                found.recapture = True
            else:  # new objects of equal values (a scheduler writing momentum): the new baseline
                self._index_groups()

    def _restore_optimizer(self, found: GuardFindings) -> None:
        lost = restore_identities(self.optimizer, self._kept)
        self._index_slots()
        kept = {address(t) for t in self._kept.values()}
        if lost:
            found.changes.append(f"the optimizer's state was replaced ({', '.join(lost[:3])} lost)")
            found.recapture = True
        elif any(pointer not in kept for pointer in self._slot_pointers):
            found.changes.append("the optimizer holds state tensors the graphs never saw")
            found.recapture = True
        else:
            found.changes.append("optimizer state loaded: values copied into the captured tensors")


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


def first_capture_error(exc: BaseException) -> str:
    """The first CUDA error of a failed capture, not the 'previous error' that follows it."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    first = chain[-1]
    text = str(first).strip().splitlines()[0] if str(first).strip() else type(first).__name__
    frames = traceback.extract_tb(first.__traceback__)
    # the script's or a library's line; where torch's own code raised (FSDP2's hooks), its line
    where = library_frame(frames) or (
        f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    )
    at = f" at {where}" if where is not None else ""
    known = explain_exception(first)
    explained = f"\nddpgraph explains: {known.render()}" if known is not None else ""
    return f"capture failed: {type(first).__name__}: {text}{at}{explained}"


def library_frame(frames: Sequence[traceback.FrameSummary]) -> str | None:
    """The innermost frame of a traceback outside torch and ddpgraph: the line that did it (the
    user's, or a library's such as transformers'), as ``file:line `code```."""
    for frame in reversed(frames):
        if not os.path.abspath(frame.filename).startswith(SKIPPED_DIRS):
            return f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
    return None


# torch's and ddpgraph's directories by path (a virtual environment can be named torch), and
# the warnings module, through which a sync report arrives
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
SKIPPED_DIRS = (
    TORCH_DIR,
    PACKAGE_DIR,
    os.path.dirname(os.path.abspath(warnings.__file__)) + os.sep + "warnings.py",
)
