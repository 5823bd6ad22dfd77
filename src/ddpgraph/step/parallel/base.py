"""What the step needs from a data-parallel wrapper, stated once (DDP, FSDP2, none)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...facts import DDP_STATS_SAMPLE_RATE, ddp_count_allows_capture

__all__ = ["DataParallel", "agree_over"]


def agree_over(group: Any, device: torch.device, ok: bool, dirty: bool) -> tuple[bool, bool]:
    """(every rank's ``ok``, any rank's ``dirty``) over ``group``: one all-reduce of two ints,
    the same for every wrapper with peers."""
    flags = torch.tensor([int(ok), int(not dirty)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    every_ok, none_dirty = flags.tolist()
    return bool(every_ok), not none_dirty


class DataParallel:
    """One data-parallel wrapper around the user's module, as the step uses it.

    ``module`` is what the step calls (the wrapper, e.g. a DDP); ``inner`` the module inside it
    (a forward with no wrapper bookkeeping: evaluation). The defaults are those of a wrapper
    that synchronizes nothing (:class:`~.local.Local`); each method says what an implementation
    changes. Every method that runs a collective must be called on every rank at the same step.
    """

    module: nn.Module
    inner: nn.Module
    # DDP's runtime-logging sample rate: the warm-up rule of ddpgraph.facts reads it
    sample_rate: int = DDP_STATS_SAMPLE_RATE
    # each rank holds only its shard of every gradient (FSDP2): what one rank finds in its own
    # gradients (check_finite's NaN) the others do not see; the all-reduced norm they all do
    shards_gradients: bool = False
    # rank 0's buffers are due at the next forward outside training (step.evaluate() or the
    # script's own forward through ``module``): the last forward was a training forward with
    # its gradient sync on, as DDP's ``require_forward_param_sync`` says; the step sets it on
    # every training call, the wrapper reads it (one attribute: no cost on a replayed call)
    buffers_due: bool = False
    # where the script's own gradient-sync flags live (a dict each, and the key in it), kept
    # by each wrapper where it builds what holds them: a replayed call outside any window asks
    # ``False in map(dict.get, sync_dicts, sync_keys)`` (one C-level pass, no call) and calls
    # :meth:`script_sync` only when the script turned a sync off
    sync_dicts: tuple[dict[str, Any], ...] = ()
    sync_keys: tuple[str, ...] = ()

    def take_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The script built ``optimizer`` over the module's parameters; a wrapper that replaced
        them (FSDP2 sharding the model) points it at the new ones."""

    # ----------------------------------------------------------------- forward and backward
    def forward_context(
        self, *, sync_grads: bool, sync_buffers: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """Around one forward and its backward: ``sync_grads`` False for an accumulating
        micro-batch (no gradient sync); ``sync_buffers`` True for a window's first forward, which
        starts with rank 0's buffers sent to every rank (DDP's start-of-forward broadcast; the
        later forwards of a window keep each rank's own buffers, as under DDP's ``no_sync``).
        DDP decides both at the forward; FSDP2's ``set_requires_gradient_sync`` governs the
        backward, hence both inside."""
        return contextlib.nullcontext()

    def sync_buffers(self) -> None:
        """Rank 0's buffers to every rank now (a collective: every rank at the same call), as
        DDP's forward starts: before an ``accumulate_calls`` window's first call and before the
        first evaluation after a training step. A no-op without buffers to sync."""

    def follow_trainable(self) -> bool:
        """Rebuild the wrapper over the parameters that require gradients now, if that set
        changed since it was built (a script froze or unfroze some); True if rebuilt. A
        collective where there are peers: every rank changes ``requires_grad`` at the same step.
        The caller drops the training graphs (they read the old wrapper)."""
        return False

    # whether before_call() does anything (FSDP2): the replayed path calls it only then
    checks_before_call = False

    def before_call(self) -> None:
        """At the start of every call, before anything runs or is checked: put back in place
        what the script's own use of the wrapper between calls left (FSDP2: parameters it
        unsharded). Cheap: no walk over the model."""

    def follow_storage(self) -> str | None:
        """The module's parameters, gradients or buffers moved to new memory since the last
        training call (``model.to()``, ``p.data = ...``): follow them, and say what was done
        (None: nothing was needed). Raises where the wrapper cannot follow. A collective where
        there are peers: every rank moves its model at the same step (frameworks do)."""
        return None

    def script_sync(self) -> bool | None:
        """What the script asked of this call's gradient sync on the module it holds:
        ``model.require_backward_grad_sync = ...`` (the bare module, or the wrapper) or a
        ``with model.no_sync():`` around the call; None when it asked nothing."""
        flag = self.inner.__dict__.get("require_backward_grad_sync")
        return None if flag is None else bool(flag)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm`` on the device (no host sync); the total norm, as
        ``torch.nn.utils.clip_grad_norm_`` returns it in the eager loop."""
        return torch.nn.utils.clip_grad_norm_(self._grads_of(), max_norm, foreach=True)

    def grad_norm(self) -> torch.Tensor:
        """The total (2-)norm of the gradients, without clipping, on the device (no host sync):
        the value :meth:`clip_grad_norm_` would return."""
        grads = [p.grad for p in self._grads_of() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, foreach=True)

    def _grads_of(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.grad is not None]

    # ----------------------------------------------------------------- capture preconditions
    def count_forwards(self, n: int) -> None:
        """``n`` training forwards ran the wrapper's host code (eagerly or while capturing)."""

    def allows_capture(self, steps: int) -> bool:
        """Whether the next ``steps`` training forwards may be captured."""
        return True

    def count_allows_capture(self, forwards: int) -> bool:
        """The warm-up rule (ddpgraph.facts) at this wrapper's sample rate."""
        return ddp_count_allows_capture(forwards, self.sample_rate)

    def capture_problem(
        self, optimizer: torch.optim.Optimizer, *, fp16: bool, accumulate_calls: int
    ) -> str | None:
        """Why this wrapper's step cannot be captured with ``optimizer`` (the run stays eager
        with this reason; ``graph="always"`` raises it), or None."""
        return None

    def agree(self, ok: bool, dirty: bool) -> tuple[bool, bool]:
        """(every rank's ``ok``, any rank's ``dirty``): one tiny collective where there are
        peers."""
        return ok, dirty

    def peer_group(self) -> Any:
        """The process group of the ranks that run the step together (None: no peers)."""
        return None

    def failures_of_every_rank(self, failure: str | None) -> list[str | None]:
        """Every rank's capture failure (None: that rank captured), by rank: called on every
        rank after :meth:`agree` said one failed, so each rank's fallback names the cause
        (an object all-gather, once per run, only on that path)."""
        group = self.peer_group()
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return [failure]
        gathered: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, failure, group=group)
        return gathered

    def before_capture(self) -> str | None:
        """Run just before each capture: make it safe where the wrapper can, and return what it
        found that the script should know (warned at the user's line), or None."""
        return None

    # ----------------------------------------------------------------- failed captures
    def explain_capture_failure(self, reason: str) -> str | None:
        """The wrapper's own part in a failed capture, when the failure text shows it (named
        instead of a host sync seen in warm-up, which would blame the script); else None."""
        return None

    def dirty(self) -> bool:
        """Whether a failed capture left the wrapper mid-iteration."""
        return False

    def reset(self) -> None:
        """Let the wrapper run again after a backward that never finished (on every rank at
        the same step); it may rebuild what the training graphs read."""

    def check_reset_alone(self) -> None:
        """Before :meth:`reset` on this rank only (a later capture failed here, peers may be
        replaying): raise :class:`~ddpgraph.CaptureError` if the reset needs its peers."""
