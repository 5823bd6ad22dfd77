"""The CPU stand-in graph engine: the real TrainStep policy without CUDA, for CI and dry runs.

``TrainStep(..., engine=CpuGraphs(fail=...))`` (also ``ddpgraph.testing.CpuGraphs``) gives the
step :class:`FakeGraphs`: capturing records the body (running nothing, like a real capture) and
replaying copies the batch into the static inputs and runs the body. So warm-up, capture,
every-rank agreement, replay, fallback, new shapes, modes, the replay guard and close run on the
CPU, and ``fail`` makes chosen captures fail (on chosen ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .batch import Batch, GraphKey
from .graphs import (
    CapturedGraph,
    CaptureFailure,
    Graphs,
    Parameters,
    Replayed,
    ReplayGuard,
)
from .optim import GraphSafeOptimizer, graph_safety_problem

__all__ = ["CpuGraphs", "FakeGraphs"]

FailWhen = Callable[[GraphKey], bool]


class _NoLR(GraphSafeOptimizer):
    """The CPU run keeps the optimizer as it is: there is no LR tensor to sync."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, [], [])

    def sync_lr(self) -> None:
        pass


class CpuGraphs:
    """The engine: :class:`FakeGraphs` for an optimizer that CUDA could graph, else the reason.

    ``fail(key)`` makes the capture of that :class:`~ddpgraph.step.batch.GraphKey` fail (e.g.
    ``lambda key: rank == 1`` fails every capture on rank 1).
    """

    def __init__(self, fail: FailWhen = lambda key: False) -> None:
        self.fail = fail

    def build(
        self,
        parameters: Parameters,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        fp16: bool,
    ) -> Graphs | str:
        problem = graph_safety_problem(optimizer)
        if problem is not None:
            return problem
        return FakeGraphs(parameters, optimizer, self.fail)


class FakeGraphs(Graphs):
    """Graphs whose "graph" is the recorded body, replayed by running it."""

    def __init__(
        self, parameters: Parameters, optimizer: torch.optim.Optimizer, fail: FailWhen
    ) -> None:
        super().__init__(None, parameters, _NoLR(optimizer))
        self._fail = fail
        self._bodies: dict[GraphKey, Callable[[Batch], Any]] = {}
        self.captured_keys: list[GraphKey] = []  # every capture, in order (tests read it)

    def capture(
        self, key: GraphKey, batch: Batch, body: Callable[[Batch], Any]
    ) -> CapturedGraph | CaptureFailure:
        if self._fail(key):
            self.uncapturable.add(key)
            return CaptureFailure(f"capture failed: FakeCaptureError: injected for {key!r}")
        static = batch.with_tensors([t.clone() for t in batch.tensors])
        captured = CapturedGraph(None, static.tensors, None)
        self._graphs[key] = captured
        self._bodies[key] = body
        self.captured_keys.append(key)
        if self.guard is None:
            self.guard = ReplayGuard(self.watched(), self.plan.optimizer)
        return captured

    def replay(self, key: GraphKey, batch: Batch) -> Replayed:
        findings = self.check()
        captured = self._graphs.get(key)
        if captured is None:
            return Replayed(None, findings)
        for static, tensor in zip(captured.static_inputs, batch.tensors):
            static.copy_(tensor)
        output = self._bodies[key](batch.with_tensors(captured.static_inputs))
        return Replayed(output, findings, replayed=True)

    def make_optimizer_safe_again(self) -> None:
        pass  # the CPU run keeps the optimizer as the script built it

    def drop(self, role: Any) -> int:
        dropped = super().drop(role)
        self._bodies = {k: v for k, v in self._bodies.items() if k in self._graphs}
        return dropped

    def close(self) -> None:
        self._graphs.clear()
        self._bodies.clear()
        self.guard = None
