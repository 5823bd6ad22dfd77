"""``TrainStep(check_finite=True)``: stop at the first update whose loss or gradients are not
finite, with an error naming that step, raised alike on every rank, without a host sync per step.

On the device (inside the step, so inside its graph):

- each micro-batch's loss passes through an identity whose backward adds ``0 * loss * loss`` to
  the gradient flowing into the loss (one ``addcmul`` kernel, none in the forward): exactly the
  same bits for a finite loss, NaN for a NaN or infinite one. A bad loss on any rank so makes
  every gradient NaN after the gradient all-reduce, on every rank: the ranks see the same
  gradients and so agree on the flag with no collective of the check's own.
- at each update one probe: torch's own inf/NaN check of GradScaler
  (``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1, which writes every value back
  unchanged) over the total grad norm where the step measures one (``clip_grad_norm``,
  ``grad_norm=True``: a non-finite gradient element makes it inf or NaN), else over every
  gradient, one multi-tensor launch per dtype (more only past torch's per-launch limits of
  tensors and blocks). Its flag stays set once set; one more kernel adds ``[1, flag]`` to the
  device counts ``[updates, updates since the first bad one]``, from which the host names the
  first bad update (1-based, counting from the loaded step count). Two kernels per update on a
  small model, and one in the backward for the seed, where the old check (three kernels and a
  backward one for the seed, a cat of every gradient's first element, then seven scalar kernels)
  took about fourteen; ``benchmarks/finite_check_cost.py`` measures the cost per replayed
  step (not yet run on a GPU for this probe).
- FSDP2 keeps only its shard of each gradient on a rank, so a NaN in one element is seen by one
  rank alone: there the probe reads the all-reduced total norm (the clipping's, or
  :meth:`~ddpgraph.step.parallel.DataParallel.grad_norm` computed for the check), which every
  rank sees alike. (A finite gradient whose squares overflow float32, above about 1e19, also makes
  that norm inf: the check then stops a run that has diverged all the same.)

On the host, after each call: on the CPU the counts are read at once (there is no device to wait
for). On CUDA one copy of the counts to pinned memory is queued with an event; a later call reads
it only once ``event.query()`` says the copy is done (it never waits), so the error comes a call
or two after the bad step and names the step itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

from .._typed_torch import cuda_event
from ..errors import NonFiniteError

__all__ = ["FiniteCheck"]


class FiniteCheck:
    """The device counts of updates and bad updates, and their non-blocking read-back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # [1, flag]: added to the counts at each update; the flag is the check's found_inf,
        # set to 1 by the first non-finite probe and never reset (until a checkpoint is loaded)
        self._increment = torch.tensor([1.0, 0.0], device=device)
        self._found = self._increment[1:]
        self._one = torch.ones((), device=device)  # the "scale" the check divides by
        # [updates, updates since the first bad one (itself included)]; float64: exact counts
        self._counts = torch.zeros(2, dtype=torch.float64, device=device)
        cuda = device.type == "cuda"
        self._host = torch.zeros(2, dtype=torch.float64, pin_memory=cuda)
        self._event = cuda_event() if cuda else None
        self._pending = False  # a copy of the counts to ``_host`` is queued, not yet read
        self._error: NonFiniteError | None = None

    # ------------------------------------------------------------------ device side
    def seed(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as it is, whose backward makes every gradient NaN when it is not finite."""
        return cast(torch.Tensor, _NanSeed.apply(loss))  # type: ignore[no-untyped-call, unused-ignore]

    def record(self, grads: Iterable[torch.Tensor], grad_norm: torch.Tensor | None) -> None:
        """Count one update, flagging it if its total grad norm (where given: the caller passes
        one every rank sees alike when gradients are sharded) or else any gradient element is
        not finite."""
        probed = [grad_norm.detach()] if grad_norm is not None else [_local(g) for g in grads]
        for same_dtype in _by_dtype(probed):
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, self._found, self._one)
        self._counts.add_(self._increment)

    # ------------------------------------------------------------------ host side
    def check(self, *, wait: bool = False) -> None:
        """Raise :class:`NonFiniteError` if a finished update was not finite (see the module);
        ``wait``: every update queued so far, waiting for the device (a host sync)."""
        if self._error is not None:
            raise self._error
        if self._event is None or wait:
            self._raise_if(self._counts.tolist())
            return
        if self._pending:
            if not self._event.query():  # type: ignore[no-untyped-call]
                return  # the device is still behind: look again at a later call
            self._pending = False
            self._raise_if(self._host.tolist())
        self._host.copy_(self._counts, non_blocking=True)
        self._event.record()
        self._pending = True

    def start_at(self, updates: int) -> None:
        """A checkpoint was loaded: count on from its ``updates``, with no bad step recorded."""
        if self._event is not None:
            self._event.synchronize()  # no copy into ``_host`` may still be in flight
        self._counts[0].fill_(updates)
        self._counts[1].zero_()
        self._found.zero_()
        self._pending = False
        self._error = None

    def _raise_if(self, counts: list[float]) -> None:
        updates, bad = (int(c) for c in counts)
        if bad > 0:
            step = updates - bad + 1  # the first flagged update, 1-based
            self._error = NonFiniteError(
                f"training diverged: the loss or the gradients were not finite (NaN or inf) at "
                f"step {step}, on at least one rank. Lower the learning rate, clip the gradients "
                "(clip_grad_norm=1.0), or find the first NaN on an eager step "
                "(TrainStep(graph='never') under torch.autograd.detect_anomaly()); "
                "check_finite=False turns this check off.",
                step,
            )
            raise self._error


class _NanSeed(torch.autograd.Function):
    """Identity in the forward (a view: no kernel); the backward passes the gradient on as
    ``grad + 0 * loss * loss`` (one kernel): the same bits when the loss is finite (the
    gradient reaching a loss is never -0.0, the one value ``+ 0`` would change), NaN when it is
    NaN or infinite (``0 * inf`` is NaN)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (loss,) = ctx.saved_tensors
        return torch.addcmul(grad, loss, loss, value=0)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's values on this rank (a DTensor's own shard)."""
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    return local.detach()


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by dtype (as GradScaler groups them): one check kernel per group."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())
