"""The CUDA engine: the CUDA graphs of one TrainStep, and everything they read.

:class:`CudaGraphSet` (built by :data:`CUDA_GRAPHS`, the default engine on CUDA) implements
:class:`~.engine.GraphSet`: it owns the memory pool, each graph's static inputs and outputs, the
optimizer's LR tensors (through the graph-safe plan) and the hooks run after a replay (the
watchdog registers one); its keys are kept by :class:`~.graph_table.GraphTable`, as the CPU
stand-in's (:class:`ddpgraph.step.cpu_graphs.CpuGraphs`, which drives the real policy in CI).
The runner keeps the rest: when to capture, what to do when a capture fails, which key a batch
has. The capture stream each step runs on is :mod:`.streams`'s.

Training and evaluation graphs share the pool (as Megatron does): the step never runs two of them
at once (they replay on one stream) and every graph's outputs stay allocated while the graph
lives, so a later capture can only reuse memory that earlier graphs use as scratch.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from operator import is_
from typing import Any, cast

import torch

from .._globals import Global, process_global
from .batch import Batch, GraphKey
from .capture_errors import first_capture_error
from .engine import CapturedGraph, CaptureFailure, GraphSet, ReplayHook
from .graph_table import GraphTable
from .optim import GraphSafeOptimizer, lr_of
from .streams import capture_stream

__all__ = ["CUDA_GRAPHS", "CudaGraphEngine", "CudaGraphSet"]


class CudaGraphEngine:
    """Real CUDA graphs on the device's capture stream (the default engine on CUDA)."""

    def build(self, plan: GraphSafeOptimizer, device: torch.device) -> GraphSet:
        return CudaGraphSet(capture_stream(device), plan)


CUDA_GRAPHS = CudaGraphEngine()


class CudaGraphSet(GraphTable):
    """Every CUDA graph of one TrainStep by key, their pool, static buffers and replay hooks.

    ``capture(key, batch, body)`` records ``body(static_batch)`` on the capture stream (running
    nothing) and keeps the graph; ``replay(captured, batch)`` syncs the LR tensors, copies the batch
    into the static inputs, replays and runs the hooks (what a script changed since the last
    call was found before, by the step's :class:`~.guard.Guard`). ``close()`` drops every graph
    and the pool, so the memory returns to PyTorch's allocator.
    """

    engine = "cuda-graphs"  # what report().engine names

    def __init__(self, stream: torch.cuda.Stream, plan: GraphSafeOptimizer) -> None:
        super().__init__(plan, stream.device)
        self._stream = stream
        self._index: int = stream.device.index  # a capture stream's device has its index
        self._pool: Any = None
        self._hooks: list[ReplayHook] = []

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
        self.captured[key] = captured
        return captured

    # ------------------------------------------------------------------ replay
    def replay(self, captured: CapturedGraph, batch: Batch) -> Any:
        """Replay ``captured`` (looked up by the caller) on ``batch``; its output, graph-owned
        (overwritten by the next replay of this graph)."""
        plan = self.plan
        if not all(map(is_, map(lr_of, plan.optimizer.param_groups), plan.lr_tensors)):
            plan.sync_lr()  # a float the script or a scheduler set since (C-level test: no call)
        if batch.tensors:  # step(data) copies nothing: its graph gathers on the device
            # one dispatch for every input: each copy_ call is one more on the replayed path
            torch._foreach_copy_(captured.static_inputs, batch.tensors, non_blocking=True)
        captured.graph.replay()
        hooks = self._hooks
        if hooks:
            stream = _current_stream(self._index)  # where the replay ran: the caller's stream
            for hook in hooks:
                hook(stream)
        return captured.output

    def bare_graph(self) -> torch.cuda.CUDAGraph | None:
        """The first training graph of a batch of tensors (a ``step(data)`` graph gathers at a
        device cursor only ``step(data)`` keeps in range), for benchmarks; None if none."""
        for key in self.keys_of("train"):
            if not key.reads_device_data:
                return cast(torch.cuda.CUDAGraph, self.captured[key].graph)
        return None

    # ----------------------------------------------------------------- dropping
    def _forget(self, keys: Sequence[GraphKey]) -> None:
        if not self.captured:
            # torch frees a private pool when its last graph goes: capture into a new one
            self._pool = None

    def close(self) -> None:
        """Free every graph and the pool. The caller makes sure no replay is in flight."""
        if self.captured:
            torch.cuda.synchronize(self._stream.device)
        self.captured.clear()
        self._pool = None
        gc.collect()  # graphs captured by a failing call may sit in a traceback's cycle


# per device: torch's current stream's ids, and the Stream object built for them
_CURRENT_STREAMS: Global[dict[int, tuple[tuple[int, int, int], torch.cuda.Stream]]] = (
    process_global("graphs.current_streams", dict, reset_at_shutdown=False)
)


def _current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)`` for a replayed call: torch builds a new Stream object
    at each call (about 4 us of host time on an H100's host,
    ``benchmarks/probes/cuda_op_host_time.py``); this reads only the stream's ids and builds one
    when they changed. A Stream object is its ids: an equal one records on the same stream."""
    ids = torch._C._cuda_getCurrentStream(index)
    seen = _CURRENT_STREAMS.value.get(index)
    if seen is not None and seen[0] == ids:
        return seen[1]
    stream = torch.cuda.current_stream(index)
    _CURRENT_STREAMS.value[index] = (ids, stream)
    return stream


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
