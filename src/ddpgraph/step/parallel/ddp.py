"""DistributedDataParallel as the step's wrapper: the one module that names it.

Facts this is built on (measured on an H200, torch 2.11, NCCL 2.28; see REFERENCES.md):

* DDP must be *constructed* on the side stream that captures, or backward fails with "operation
  would make the legacy stream depend on a capturing blocking stream".
* DDP times its iterations 1..10 and every 100th with CUDA events that a capture cannot hold
  (``ddpgraph.facts``). The wrapper turns the every-100th sampling off (a private DDP setter;
  where it is missing, captures keep to the counts the rule allows), so the first capture comes
  after 11 eager forwards. Forwards under ``no_sync`` do not count; replays do not advance it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..._typed_torch import (
    ddp_remove_autograd_hooks,
    ddp_set_logging_sample_rate,
    ddp_sync_buffers,
    ddp_will_sync_buffers,
)
from ...errors import CaptureError, ConfigError
from ...facts import DDP_STATS_SAMPLE_RATE, ddp_count_allows_capture
from ..streams import on_stream
from .base import DataParallel

__all__ = ["DDP", "check_not_ddp", "inner_of"]

_NEVER = 2**31 - 1  # a DDP runtime-logging sample rate that never comes round
_UNPINNED_COPY = "during CUDA graph capture unless the CPU tensor is pinned"
# DDP's switch for its start-of-forward buffer broadcast (renamed from broadcast_buffers in 2.13)
_FORWARD_BROADCAST = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in DistributedDataParallel.__init__.__code__.co_varnames
    else "broadcast_buffers"
)


class DDP(DataParallel):
    """The module wrapped in DDP on the capture stream (``gradient_as_bucket_view=True`` unless
    ``ddp_kwargs`` says otherwise: it made graphed steps 2-7% faster; its gradient norms are
    taken as without it, :func:`norm_as_unbucketed`)."""

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        stream: torch.cuda.Stream | None,
        ddp_kwargs: Mapping[str, Any],
    ) -> None:
        kwargs: dict[str, Any] = {"gradient_as_bucket_view": True}
        if device.type == "cuda":
            kwargs["device_ids"] = [device.index]
        kwargs.update(ddp_kwargs)
        self._kwargs, self._stream = kwargs, stream
        # the gradients laid out in DDP's buckets by the step's default, not the script's choice:
        # norms as the script's own gradients (each an allocation of its own) give them
        self._norm_unbucketed = "gradient_as_bucket_view" not in ddp_kwargs
        self.inner = module
        self._script_off = False  # the script's no_sync() was on at some earlier call
        self._build()

    def _build(self) -> None:
        # built on the capture stream: built on the default stream, its backward cannot be
        # captured ("operation would make the legacy stream depend on a capturing blocking stream")
        with on_stream(self._stream):
            self.ddp = DistributedDataParallel(self.inner, **self._kwargs)
        self.module = self.ddp
        self.group = self.ddp.process_group  # agreement: every rank of the DDP
        # script_sync's flags: DDP's own (no_sync()) and one set on the bare module
        self.sync_dicts = (self.ddp.__dict__, self.inner.__dict__)
        self.sync_keys = ("require_backward_grad_sync",) * 2
        self._sample_rate = _stop_ddp_sampling(self.ddp)  # the warm-up rule reads it
        self._trainable = _trainable_ids(self.inner)  # what DDP reduces: follow_trainable
        # DDP's own start-of-forward broadcast is switched off and done by forward_context and
        # sync_buffers instead: a graph replays whatever its capture recorded, so which forward
        # broadcasts must be decided by the step (a window's first), not by DDP's host flag
        self._broadcasts = ddp_will_sync_buffers(self.ddp)
        setattr(self.ddp, _FORWARD_BROADCAST, False)
        self._forwards = 0  # DDP forwards that advanced its iteration counter
        self._stepping = False  # inside the step's own training forward (forward_context)
        # the script's own forwards through step.model (evaluation) get DDP's broadcast back
        self.ddp.register_forward_pre_hook(self._script_forward_starts)
        self.ddp.register_forward_hook(self._script_forward_ended)

    # ----------------------------------------------------- GradSync: forward, backward and buffers
    @contextlib.contextmanager
    def forward_context(self, *, sync_grads: bool, sync_buffers: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if not sync_grads:
                stack.enter_context(self.ddp.no_sync())
            if sync_buffers:
                self.sync_buffers()
            self._stepping = True
            stack.callback(setattr, self, "_stepping", False)
            yield

    def _script_forward_starts(self, ddp: nn.Module, args: Any) -> None:
        """DDP's ``_pre_forward`` broadcast for a forward the script makes itself through
        ``step.model`` (an evaluation, as torchvision's ``evaluate(model, ...)``): rank 0's
        buffers first when the last forward was a synced training forward, as plain DDP's
        ``_check_sync_bufs_pre_fwd`` decides. Runs only where Python calls the DDP (never on a
        replay); the step's own forwards broadcast through :meth:`forward_context`."""
        if not self._stepping and self.buffers_due:
            self.sync_buffers()

    def _script_forward_ended(self, ddp: nn.Module, args: Any, output: Any) -> None:
        """DDP's ``_post_forward``: a forward with gradients and the sync on makes the next one
        broadcast; a ``no_grad`` (evaluation) or ``no_sync`` forward does not."""
        if not self._stepping:
            self.buffers_due = torch.is_grad_enabled() and self.ddp.require_backward_grad_sync

    def _total_norm(self, grads: list[Any]) -> torch.Tensor:
        """Where the step chose the bucket views, the norm :func:`norm_as_unbucketed` takes
        (clipping's and ``grad_norm``'s)."""
        return norm_as_unbucketed(grads) if self._norm_unbucketed else super()._total_norm(grads)

    def sync_buffers(self) -> None:
        """Rank 0's buffers to every rank: what DDP's forward does first (its ``_sync_buffers``,
        which also picks up buffers the module reassigned)."""
        if self._broadcasts:
            ddp_sync_buffers(self.ddp)

    # ---------------------------------------------- CaptureGate: the script's sync and the warm-up
    def script_sync(self) -> bool | None:
        """Also ``with step.model.no_sync():`` (DDP's own flag, False inside it); once a script
        has used it, every call outside it is True, a window's end (timm's ``if not need_update:
        with model.no_sync(): ...`` else a plain call: a short last window of one micro-batch
        follows a full one), as FSDP2's."""
        if not self.ddp.require_backward_grad_sync:
            self._script_off = True
            return False
        if self._script_off:
            return True
        flag = self.inner.__dict__.get("require_backward_grad_sync")  # as the base's, inline
        return None if flag is None else bool(flag)

    def count_forwards(self, n: int) -> None:
        self._forwards += n

    def allows_capture(self, steps: int) -> bool:
        first = self._forwards
        return all(self.count_allows_capture(n) for n in range(first, first + steps))

    def count_allows_capture(self, forwards: int) -> bool:
        """The warm-up rule (ddpgraph.facts) at this DDP's sample rate."""
        return ddp_count_allows_capture(forwards, self._sample_rate)

    # ------------------------------------------ Recovery: between calls and after a failed capture
    def follow_trainable(self) -> bool:
        """DDP reduces the parameters that required gradients when it was built; after a freeze
        it would wait for gradients that never come (``find_unused_parameters=True`` searches for
        them on every step, with host work a capture cannot hold), after an unfreeze it would
        leave the new ones unsynced. So it is built again over the set as it is now (DDP's
        construction: a collective, which also sends rank 0's parameters and buffers; they are
        the same on every rank already). DDP's warm-up rule starts again with the new one."""
        if _trainable_ids(self.inner) == self._trainable:
            return False
        self._rebuild()
        return True

    def follow_storage(self) -> str | None:
        """DDP's reducer keeps the gradients as views of its buckets
        (``gradient_as_bucket_view``) and its bucket views of the parameters it was built over;
        after a move it would reduce into the old memory (an eager run's gradients then double
        every step), so it is built again over the module as it is now."""
        self._rebuild()
        return "its DistributedDataParallel was built again over the new memory"

    def _rebuild(self) -> None:
        old = self.ddp
        ddp_remove_autograd_hooks(old)  # the old reducer must not see the next backward
        self._build()
        del old

    def explain_capture_failure(self, reason: str) -> str | None:
        """With ``find_unused_parameters=True`` a step in which some parameter gets no gradient
        makes DDP's reducer copy its pageable CPU bitmap of used parameters to the device (the
        "unless the CPU tensor is pinned" error): DDP's bookkeeping, not the script's tensors."""
        if not self.ddp.find_unused_parameters or _UNPINNED_COPY not in reason:
            return None
        return (
            "DistributedDataParallel(find_unused_parameters=True) found parameters that got no "
            "gradient in this step, and its bookkeeping of them copies a CPU bitmap to the "
            "device, which a CUDA graph cannot hold. Parameters the script froze "
            "(requires_grad=False) are taken out by rebuilding the DDP, which TrainStep does at "
            "the next call; parameters a forward leaves unused on purpose keep the step eager: "
            "use them in every step (e.g. multiply their output by 0) to graph it."
        )

    def dirty(self) -> bool:
        """Whether DDP's reducer was left mid-iteration (a capture failed inside backward)."""
        try:
            self.ddp.reducer._check_reducer_finalized()
        except RuntimeError:
            return True
        return False

    def reset(self) -> None:
        """``_reset_state`` also makes DDP rebuild its gradient buckets at the next forward (a
        collective, and new gradient tensors): the caller drops the training graphs (they read
        the old gradients) and runs two eager steps before the next capture (one records the
        order, the next forward rebuilds)."""
        self.ddp.reducer._reset_state()

    def check_reset_alone(self) -> None:
        if dist.get_world_size(self.ddp.process_group) > 1:
            raise CaptureError(
                "a capture failed inside DDP's backward on this rank while other ranks may be "
                "replaying; DDP can only recover with every rank at the same step. Pad batches "
                "to shapes captured at the start, or pass on_new_shape='eager'."
            )


def norm_as_unbucketed(grads: list[Any]) -> torch.Tensor:
    """The gradients' total norm (``torch.nn.utils.get_total_norm``, foreach) as a DDP script
    gets it: its DDP, built with torch's default ``gradient_as_bucket_view=False``, leaves each
    gradient an allocation of its own. The step's DDP makes them views into its flat buckets,
    where one after an odd-sized one is not aligned to the foreach kernel's 4-element vectors,
    and the kernel sums such a one in another order: on an H100 the total norm, and with it the
    clipping, came out an ulp apart from torchvision's ``train.py --clip-grad-norm`` (30 of 170
    views misaligned; their aligned copies' norms equal the script's:
    ``benchmarks/results/torchvision-amp-adamw-2-h100-d77237d.json``). Those are copied first:
    a transient copy of those gradients only (none where every parameter's size is a multiple
    of 4, as in most transformers); a script that passes ``gradient_as_bucket_view`` itself
    gets torch's norm of the views, as its own DDP had."""
    aligned = [g.clone() if _off_grid(g) else g for g in grads]
    return torch.nn.utils.get_total_norm(aligned, foreach=True)


def _off_grid(grad: torch.Tensor) -> bool:
    # strided only (a sparse gradient has no data pointer, and no bucket view); a tensor whose
    # size is not a multiple of 4 is still summed vectorized in its full 64 Ki-element chunks
    # when aligned, so the size does not exempt one
    return grad.layout is torch.strided and grad.data_ptr() % (4 * grad.element_size()) != 0


def _stop_ddp_sampling(ddp: DistributedDataParallel) -> int:
    """Stop DDP timing every 100th iteration, so that any count after 10 can be captured.

    DDP's timers are diagnostics (``_get_ddp_logging_data``); a timed iteration inside a graph
    crashes a later eager forward ("CUDA error: invalid argument"). The setter is private, so
    where it is missing the step keeps to the counts the default rate allows.
    """
    try:
        ddp_set_logging_sample_rate(ddp, _NEVER)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return DDP_STATS_SAMPLE_RATE
    return _NEVER


def _trainable_ids(module: nn.Module) -> tuple[int, ...]:
    return tuple(id(p) for p in module.parameters() if p.requires_grad)


def inner_of(model: nn.Module) -> nn.Module:
    """The module inside a DDP, or ``model`` itself."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def check_not_ddp(model: object) -> None:
    if isinstance(model, DistributedDataParallel):
        raise ConfigError(
            "TrainStep got a DistributedDataParallel model; pass the bare module: TrainStep "
            "wraps it in DDP itself, on the stream it captures with."
        )
