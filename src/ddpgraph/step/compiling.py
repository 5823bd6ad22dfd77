"""The first forward of a compiled module, run on its own to see whether it compiles."""

from __future__ import annotations

import torch

from ..errors import first_line
from .batch import Batch, gathered_batch
from .body import StepBody

__all__ = ["first_forward_failure"]


def first_forward_failure(body: StepBody, batch: Batch, device: torch.device) -> str | None:
    """Run the compiled module's first forward (it compiles) outside the wrapper, with the RNG
    forked and the buffers put back, so training sees no extra step; why it failed, or None."""
    from torch._dynamo.exc import TorchDynamoException

    if batch.source is not None:  # step(data): the batch it would gather first
        batch = gathered_batch(batch.source, batch.source.peek())
    first = batch.split(body.accumulate)[0]
    module = body.parallel.inner
    plain = getattr(module, "_orig_mod", module)
    saved = [b.detach().clone() for b in plain.buffers()]
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), body.precision.autocast():
            body.forward(module, first)
    except TorchDynamoException as exc:
        root = exc.__cause__ or getattr(exc, "inner_exception", None)  # a backend's own error
        cause = f" ({first_line(root, with_type=True)})" if root is not None else ""
        return first_line(exc, with_type=True) + cause
    finally:
        with torch.no_grad():
            for buffer, value in zip(plain.buffers(), saved):
                buffer.copy_(value)
    return None
