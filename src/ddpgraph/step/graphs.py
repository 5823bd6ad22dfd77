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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import is_
from typing import Any, NamedTuple

import torch

from .._globals import Global, process_global
from .._typed_torch import cuda_stream
from .batch import Batch, GraphKey, Role
from .capture_errors import first_capture_error
from .optim import GraphSafeOptimizer, lr_of, make_graph_safe

__all__ = [
    "CaptureFailure",
    "CapturedGraph",
    "Graphs",
    "capture_stream",
    "on_stream",
]

ReplayHook = Callable[[torch.cuda.Stream], None]


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


class Replayed(NamedTuple):
    """What :meth:`Graphs.replay` did: the graph's output (None: no graph of this key). A named
    tuple: built in C on every replayed call."""

    output: Any
    replayed: bool = False


class Graphs:
    """Every graph of one TrainStep by key, their pool, static buffers, guard and replay hooks.

    ``capture(key, batch, body)`` records ``body(static_batch)`` on the capture stream (running
    nothing) and keeps the graph; ``replay(key, batch)`` syncs the LR tensors, copies the batch
    into the static inputs, replays and runs the hooks (what a script changed since the last
    call was found before, by the step's :class:`~.guard.Guard`). ``close()`` drops every graph
    and the pool, so the memory returns to PyTorch's allocator.
    """

    engine = "cuda-graphs"  # what report().engine names

    def __init__(
        self,
        stream: torch.cuda.Stream | None,
        plan: GraphSafeOptimizer,
    ) -> None:
        self._stream = stream
        self._graphs: dict[GraphKey, CapturedGraph] = {}
        self.captured = self._graphs  # read-only view for `key in graphs.captured` (no frame)
        self._pool: Any = None
        self.plan = plan
        self.uncapturable: set[GraphKey] = set()
        self._hooks: list[ReplayHook] = []

    # ------------------------------------------------------------------ lookup
    def keys_of(self, role: Role) -> list[GraphKey]:
        """The keys of ``role`` ("train", "micro" or "eval"), oldest first."""
        return [key for key in self._graphs if key.role == role]

    def bare_graph(self) -> torch.cuda.CUDAGraph | None:
        """The first training graph of a batch of tensors (a ``step(data)`` graph gathers at a
        device cursor only ``step(data)`` keeps in range), for benchmarks; None if none."""
        for key in self.keys_of("train"):
            if not key.reads_device_data:
                return self._graphs[key].graph
        return None

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
        return captured

    # ------------------------------------------------------------------ replay
    def replay(self, key: GraphKey, batch: Batch) -> Replayed:
        """Replay the graph of ``key`` on ``batch``; nothing when there is none (a re-capture
        is due). The output is graph-owned (overwritten by the next replay of this key)."""
        captured = self._graphs.get(key)
        if captured is None:
            return Replayed(None)
        self._launch(captured, batch)
        return Replayed(captured.output, replayed=True)

    def _launch(self, captured: CapturedGraph, batch: Batch) -> None:
        assert self._stream is not None and captured.graph is not None
        plan = self.plan
        if not all(map(is_, map(lr_of, plan.optimizer.param_groups), plan.lr_tensors)):
            plan.sync_lr()  # a float the script or a scheduler set since (C-level test: no call)
        for static, tensor in zip(captured.static_inputs, batch.tensors):
            static.copy_(tensor, non_blocking=True)
        captured.graph.replay()
        stream = torch.cuda.current_stream(self._stream.device)
        for hook in self._hooks:
            hook(stream)

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
        gc.collect()  # graphs captured by a failing call may sit in a traceback's cycle


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
