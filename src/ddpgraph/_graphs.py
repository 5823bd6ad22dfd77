"""The CUDA graphs of one TrainStep: captured per input signature, one memory pool, one guard.

Training and evaluation graphs share the pool (as Megatron does): the step never runs two of them
at once (they replay on one stream) and every graph's outputs stay allocated while the graph
lives, so a later capture can only reuse memory that earlier graphs use as scratch.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import CaptureError, explain_exception

__all__ = ["CapturedGraph", "GraphCache", "ReplayGuard"]


@dataclass
class CapturedGraph:
    """A graph, the buffers it reads its inputs from, and what it returns (graph-owned)."""

    graph: torch.cuda.CUDAGraph
    static_inputs: tuple[torch.Tensor, ...]
    output: Any

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        for static, tensor in zip(self.static_inputs, inputs):
            static.copy_(tensor, non_blocking=True)
        self.graph.replay()
        return self.output


class GraphCache:
    """Graphs by key (a phase and an input signature), their shared pool and the replay guard.

    ``close()`` drops every graph and the pool, so the memory returns to PyTorch's allocator
    (``torch.cuda.empty_cache()`` then hands it back to the driver).
    """

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream
        self._graphs: dict[Hashable, CapturedGraph] = {}
        self._pool: Any = None
        self.uncapturable: set[Hashable] = set()
        self.guard: ReplayGuard | None = None

    def __len__(self) -> int:
        return len(self._graphs)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._graphs)

    def get(self, key: Hashable) -> CapturedGraph | None:
        return self._graphs.get(key)

    def signatures(self, kind: str) -> list[Any]:
        """The input signatures captured for ``kind`` ("train" or "eval"), oldest first."""
        return [key[1] for key in self._graphs if isinstance(key, tuple) and key[0] == kind]

    def capture(
        self, static_inputs: tuple[torch.Tensor, ...], body: Callable[[], Any]
    ) -> CapturedGraph | str:
        """Capture ``body`` on the step's stream; the graph, or the first error's text.

        A capture runs no kernel, so a failed one leaves model and optimizer untouched.
        """
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
                output = body()
        except Exception as exc:
            torch.cuda.synchronize(self._stream.device)
            _release_rng_from_failed_capture(self._stream)
            return first_capture_error(exc)
        return CapturedGraph(graph, static_inputs, output)

    def add(self, key: Hashable, captured: CapturedGraph) -> None:
        self._graphs[key] = captured

    def close(self) -> None:
        """Free every graph and the pool. The caller makes sure no replay is in flight."""
        if self._graphs:
            torch.cuda.synchronize(self._stream.device)
        self._graphs.clear()
        self._pool = None
        self.guard = None
        gc.collect()  # graphs captured by a failing call may sit in a traceback's cycle


class ReplayGuard:
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
    known = explain_exception(first)
    explained = f"\nddpgraph explains: {known.render()}" if known is not None else ""
    return f"capture failed: {type(first).__name__}: {text}{explained}"
