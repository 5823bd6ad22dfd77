"""The CPU graph engine: a CUDA graph's semantics without CUDA, for CI and dry runs.

``TrainStep(..., engine=CpuGraphs())`` (also ``ddpgraph.testing.CpuGraphs``) gives the step
:class:`CpuGraphSet`: a capture records the tensor operations of the captured call
(:mod:`~ddpgraph.step.recording`: forward, autograd's backward, the optimizer, the collectives)
and refuses what CUDA capture refuses, with CUDA's error; a replay runs only those operations on
the same tensors. The Python of the body, autograd, hooks and host reads run at capture only, as
on the GPU. The optimizer takes its CUDA path (``capturable=True``, the LR in a tensor, fused SGD):
torch gates ``capturable`` on the CPU only by a device list, which making an optimizer graph-safe
on the CPU extends for the process (:func:`~ddpgraph.step.optim.make_graph_safe`). ``fail(key)``
makes chosen captures fail (on chosen ranks) before recording, for tests of the fallback and of
every rank's agreement. Its keys are kept by :class:`~.graph_table.GraphTable`, as the CUDA
engine's (:mod:`.graphs`, which this module does not import).
"""

from __future__ import annotations

from collections.abc import Callable
from operator import is_
from typing import Any

import torch

from .batch import Batch, GraphKey, named
from .capture_errors import first_capture_error
from .engine import CapturedGraph, CaptureFailure, GraphSet, ReplayHook
from .graph_table import GraphTable
from .optim import GraphSafeOptimizer, lr_of
from .recording import record

__all__ = ["CpuGraphSet", "CpuGraphs"]

FailWhen = Callable[[GraphKey], bool]


class CpuGraphs:
    """The engine: :class:`CpuGraphSet` over the optimizer made graph-safe as on CUDA.

    ``fail(key)`` makes the capture of that :class:`~ddpgraph.step.batch.GraphKey` fail (e.g.
    ``lambda key: rank == 1`` fails every capture on rank 1).
    """

    name = "cpu-recorded"
    # Inductor's generated kernels run below the dispatcher: a recording would miss them
    sees_inductor = False

    def __init__(self, fail: FailWhen = lambda key: False) -> None:
        self.fail = fail

    def build(self, plan: GraphSafeOptimizer, device: torch.device) -> GraphSet:
        return CpuGraphSet(plan, self.fail)


class CpuGraphSet(GraphTable):
    """Graphs whose graph is a recorded :class:`~ddpgraph.step.recording.Program` (replayed as
    a CUDA graph is: ``captured.graph.replay()``)."""

    engine = CpuGraphs.name

    def __init__(self, plan: GraphSafeOptimizer, fail: FailWhen) -> None:
        super().__init__(plan, torch.device("cpu"))
        self._fail = fail

    def register_replay_hook(self, hook: ReplayHook) -> None:
        """Ignored: a replay hook records on a CUDA stream (the watchdog's event), and the CPU
        engine has none (TrainStep registers one only on CUDA)."""

    def capture(
        self, key: GraphKey, batch: Batch, body: Callable[[Batch], Any]
    ) -> CapturedGraph | CaptureFailure:
        if self._fail(key._replace(signature=named(key.signature))):  # leaves[0].shape
            self.uncapturable.add(key)
            return CaptureFailure(f"capture failed: FakeCaptureError: injected for {key!r}")
        static = batch.with_tensors([t.clone() for t in batch.tensors])
        self.plan.sync_lr()  # as on CUDA: the LR is read from its tensor, never filled inside
        try:
            output, program = record(lambda: body(static))
        except Exception as exc:
            self.uncapturable.add(key)
            return CaptureFailure(first_capture_error(exc))
        captured = CapturedGraph(program, static.tensors, output)
        self.captured[key] = captured
        return captured

    def replay(self, captured: CapturedGraph, batch: Batch) -> Any:
        plan = self.plan
        if not all(map(is_, map(lr_of, plan.optimizer.param_groups), plan.lr_tensors)):
            plan.sync_lr()  # as CudaGraphSet.replay: the LR the script set since
        if batch.tensors:  # as CudaGraphSet.replay: every input in one foreach copy
            torch._foreach_copy_(captured.static_inputs, batch.tensors)
        captured.graph.replay()
        return captured.output

    def bare_graph(self) -> torch.cuda.CUDAGraph | None:
        """None: a recorded program is no CUDA graph to time."""
        return None

    def close(self) -> None:
        self.captured.clear()
