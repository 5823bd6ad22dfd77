"""The capture stream: one side stream per CUDA device, on which every TrainStep runs (its eager
steps, its wrapper's set-up, its captures and replays), and the context that enters it.

A module of its own, below the engines and the data-parallel wrappers that all run on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._globals import Global, process_global
from .._typed_torch import cuda_stream

__all__ = ["capture_stream", "on_stream"]

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
