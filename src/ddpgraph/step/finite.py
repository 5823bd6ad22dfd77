"""``TrainStep(check_finite=True)``: stop at the first update whose loss or gradients are not
finite, with an error naming that step, raised alike on every rank, without a host sync per step.

On the device (inside the step, so inside its graph):

- each micro-batch's loss enters backward multiplied by ``1 + 0 * loss``: exactly 1.0 for a
  finite loss (the gradients are the same bits), NaN for a NaN or infinite one. A bad loss on any
  rank so makes every gradient NaN after the gradient all-reduce, on every rank: the ranks see
  the same gradients and so agree on the flag with no collective of the check's own.
- at each update the first element of every gradient (DDP's all-reduced ones, or this rank's
  FSDP2 shard) and the grad norm where one is measured are probed: ``0 * x`` sums to 0 unless one
  is NaN or inf. The first bad update's index (1-based, counting from the loaded step count) is
  kept in a device tensor. About ten tiny kernels per update.

On the host, after each call: on the CPU the flag is read at once (there is no device to wait
for). On CUDA one copy of the flag to pinned memory is queued with an event; a later call reads
it only once ``event.query()`` says the copy is done (it never waits), so the error comes a call
or two after the bad step and names the step itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._typed_torch import cuda_event
from ..errors import NonFiniteError

__all__ = ["FiniteCheck"]


class FiniteCheck:
    """The device flag of the first non-finite update, and its non-blocking read-back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._updates = torch.zeros((), dtype=torch.int64, device=device)
        self._first_bad = torch.zeros((), dtype=torch.int64, device=device)  # 0: none yet
        cuda = device.type == "cuda"
        self._host = torch.zeros((), dtype=torch.int64, pin_memory=cuda)
        self._event = cuda_event() if cuda else None
        self._pending = False  # a copy of the flag to ``_host`` is queued, not yet read
        self._error: NonFiniteError | None = None

    # ------------------------------------------------------------------ device side
    def seed(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` with a backward seed that is NaN when the loss is not finite (1.0 else)."""
        return loss * (loss.detach() * 0 + 1)

    def record(self, grads: Iterable[torch.Tensor], grad_norm: torch.Tensor | None) -> None:
        """Count one update; keep its index if its gradients (or grad norm) are not finite."""
        probes = [_first_element(g) for g in grads]
        if grad_norm is not None:
            probes.append(grad_norm.detach().reshape(-1).float())
        self._updates.add_(1)
        if not probes:
            return
        bad = torch.cat(probes).mul(0).sum().isnan()  # 0 * inf and 0 * nan are nan
        self._first_bad.add_(self._updates * (bad & self._first_bad.eq(0)))

    # ------------------------------------------------------------------ host side
    def check(self, *, wait: bool = False) -> None:
        """Raise :class:`NonFiniteError` if a finished update was not finite (see the module);
        ``wait``: every update queued so far, waiting for the device (a host sync)."""
        if self._error is not None:
            raise self._error
        if self._event is None or wait:
            self._raise_if(int(self._first_bad))
            return
        if self._pending:
            if not self._event.query():  # type: ignore[no-untyped-call]
                return  # the device is still behind: look again at a later call
            self._pending = False
            self._raise_if(int(self._host))
        self._host.copy_(self._first_bad, non_blocking=True)
        self._event.record()
        self._pending = True

    def start_at(self, updates: int) -> None:
        """A checkpoint was loaded: count on from its ``updates``, with no bad step recorded."""
        if self._event is not None:
            self._event.synchronize()  # no copy into ``_host`` may still be in flight
        self._updates.fill_(updates)
        self._first_bad.zero_()
        self._pending = False
        self._error = None

    def _raise_if(self, step: int) -> None:
        if step > 0:
            self._error = NonFiniteError(
                f"training diverged: the loss or the gradients were not finite (NaN or inf) at "
                f"step {step}, on at least one rank. Lower the learning rate, clip the gradients "
                "(clip_grad_norm=1.0), or find the first NaN on an eager step "
                "(TrainStep(graph='never') under torch.autograd.detect_anomaly()); "
                "check_finite=False turns this check off.",
                step,
            )
            raise self._error


def _first_element(grad: torch.Tensor) -> torch.Tensor:
    """The gradient's first local element (none for an empty FSDP2 shard), as float32."""
    local = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's own shard
    return local.detach().reshape(-1)[:1].float()
