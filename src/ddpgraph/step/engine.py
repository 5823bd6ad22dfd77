"""The graph engine behind a TrainStep: what the step uses of its graph set, and what a capture
and a replay hand back.

An engine (``TrainStep(..., engine=...)``) builds one :class:`GraphSet` per step over its
optimizer made graph-safe: :class:`~.graphs.CudaGraphSet` (real CUDA graphs, the default on
CUDA) or :class:`~.cpu_graphs.CpuGraphSet` (the CPU stand-in, ``ddpgraph.testing.CpuGraphs()``).
Both keep their graphs by key in a :class:`~.graph_table.GraphTable`; what differs is the
capture, the replay and the memory behind them. Which engine a step gets, or why it has none,
is decided once at construction (:func:`~.assembly.build_graphs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .batch import Batch, GraphKey, Role

if TYPE_CHECKING:
    from .optim import GraphSafeOptimizer

__all__ = ["CaptureFailure", "CapturedGraph", "GraphEngine", "GraphSet", "ReplayHook", "Replayable"]

ReplayHook = Callable[[torch.cuda.Stream], None]


class Replayable(Protocol):
    """What a captured graph is to its set: something to replay (a ``torch.cuda.CUDAGraph``, or
    the CPU stand-in's recorded :class:`~.recording.Program`)."""

    def replay(self) -> None: ...


@dataclass
class CapturedGraph:
    """A graph, the buffers it reads its inputs from, and what it returns (graph-owned)."""

    graph: Replayable
    static_inputs: tuple[torch.Tensor, ...]
    output: Any


@dataclass
class CaptureFailure:
    """Why a capture failed (the first CUDA error, not the 'previous error' after it)."""

    reason: str


class GraphSet(Protocol):
    """The graphs of one TrainStep by key, as its runner uses them.

    ``captured`` and ``uncapturable`` are read on every call (``graphs.captured.get(key)``: no
    frame; the graph found is what :meth:`replay` takes); ``plan`` is the optimizer made
    graph-safe (its LR tensors, which the graphs read).
    """

    @property
    def engine(self) -> str:
        """What ``report().engine`` names ("cuda-graphs", "cpu-recorded")."""
        ...

    @property
    def plan(self) -> GraphSafeOptimizer: ...

    @property
    def captured(self) -> Mapping[GraphKey, CapturedGraph]: ...

    @property
    def uncapturable(self) -> AbstractSet[GraphKey]:
        """The keys whose capture failed (not tried again until their role's graphs go)."""
        ...

    def keys_of(self, role: Role) -> list[GraphKey]:
        """The keys of ``role`` ("train", "micro", "sync", "update" or "eval"), oldest first."""
        ...

    def capture(
        self, key: GraphKey, batch: Batch, body: Callable[[Batch], Any]
    ) -> CapturedGraph | CaptureFailure:
        """Capture ``body`` on a copy of ``batch`` (its static inputs), running nothing, and keep
        the graph under ``key``; a failure adds ``key`` to :attr:`uncapturable`."""
        ...

    def replay(self, captured: CapturedGraph, batch: Batch) -> Any:
        """Replay ``captured`` (one of :attr:`captured`'s values, looked up once by the caller)
        on ``batch``, the LR the script set since picked up; its output, graph-owned."""
        ...

    def drop_training(self) -> int:
        """Drop every training graph (every role but "eval"); how many went."""
        ...

    def drop_all(self) -> int:
        """Drop every graph, evaluation's too; how many went."""
        ...

    def bare_graph(self) -> torch.cuda.CUDAGraph | None:
        """The first training graph of a batch of tensors, for benchmarks; None if none."""
        ...

    def register_replay_hook(self, hook: ReplayHook) -> None:
        """Call ``hook(stream)`` after every replay (the watchdog records an event there)."""
        ...

    def make_optimizer_safe_again(self) -> None:
        """After a reload: a loaded param group may say capturable=False or foreach SGD."""
        ...

    def close(self) -> None:
        """Free every graph and its memory. The caller makes sure no replay is in flight."""
        ...


class GraphEngine(Protocol):
    """Builds the :class:`GraphSet` of one TrainStep over its optimizer made graph-safe (on
    ``device``). An engine may say ``sees_inductor = False``: it cannot record torch.compile's
    Inductor kernels, and a step compiled with Inductor then runs eagerly."""

    def build(self, plan: GraphSafeOptimizer, device: torch.device) -> GraphSet: ...
