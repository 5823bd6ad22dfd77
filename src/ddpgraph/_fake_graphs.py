"""A stand-in for :class:`ddpgraph._graphs.Graphs` that runs on the CPU, for CI.

``with fake_graphs(fail=...):`` makes every TrainStep built inside it use :class:`FakeGraphs`:
capturing records the body (running nothing, like a real capture) and replaying copies the
batch into the static inputs and runs the body. So the real TrainStep policy — warm-up,
capture, every-rank agreement, replay, fallback, new shapes, modes, the replay guard, close —
runs without CUDA, and ``fail`` makes chosen captures fail (on chosen ranks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from . import step as _step
from ._batch import Batch
from ._graphs import CapturedGraph, CaptureFailure, Graphs, ReplayGuard

__all__ = ["FakeGraphs", "fake_graphs"]

FailWhen = Callable[[Hashable], bool]


class _NoLR:
    """The CPU run keeps the optimizer as it is: there is no LR tensor to sync."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def sync_lr(self) -> None:
        pass


class FakeGraphs(Graphs):
    """Graphs whose "graph" is the recorded body, replayed by running it."""

    def __init__(
        self, params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer, fail: FailWhen
    ) -> None:
        super().__init__(None, params, _NoLR(optimizer))  # type: ignore[arg-type]
        self._fail = fail
        self._bodies: dict[Hashable, Callable[[Batch], Any]] = {}
        self.captured_keys: list[Hashable] = []  # every capture, in order (tests read it)

    def capture(
        self, key: Hashable, batch: Batch, body: Callable[[Batch], Any]
    ) -> CapturedGraph | CaptureFailure:
        if self._fail(key):
            self.uncapturable.add(key)
            return CaptureFailure(f"capture failed: FakeCaptureError: injected for {key!r}")
        static = batch.with_tensors([t.clone() for t in batch.tensors])
        captured = CapturedGraph(None, static.tensors, None)  # type: ignore[arg-type]
        self._graphs[key] = captured
        self._bodies[key] = body
        self.captured_keys.append(key)
        if self.guard is None:
            self.guard = ReplayGuard(self.params, self.plan.optimizer)
        return captured

    def replay(self, key: Hashable, batch: Batch) -> Any:
        captured = self._graphs[key]
        for static, tensor in zip(captured.static_inputs, batch.tensors):
            static.copy_(tensor)
        return self._bodies[key](batch.with_tensors(captured.static_inputs))

    def drop(self, kind: str) -> int:
        dropped = super().drop(kind)
        self._bodies = {k: v for k, v in self._bodies.items() if k in self._graphs}
        return dropped

    def close(self) -> None:
        self._graphs.clear()
        self._bodies.clear()
        self.guard = None


@contextlib.contextmanager
def fake_graphs(fail: FailWhen = lambda key: False) -> Iterator[None]:
    """TrainSteps built inside use :class:`FakeGraphs` (CPU); ``fail(key)`` fails a capture."""

    def factory(params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer) -> Graphs:
        return FakeGraphs(params, optimizer, fail)

    previous = _step._ENGINE
    _step._ENGINE = factory
    try:
        yield
    finally:
        _step._ENGINE = previous
