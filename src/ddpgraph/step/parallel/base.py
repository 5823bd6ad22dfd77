"""What the step needs from a data-parallel wrapper, stated once (DDP, FSDP2, none): three
protocols, one for each kind of user, and :class:`DataParallel`, the base every wrapper builds on.

* :class:`GradSync`: what the step body needs to run one step: the module it calls, the gradient
  and buffer syncs around its forward and backward, the grad norm;
* :class:`CaptureGate`: what the decision to capture needs: the ranks that agree on it, the
  script's sync flags the runner reads on each call, the warm-up rule, what the wrapper cannot
  capture (at construction) and what it mends just before a capture;
* :class:`Recovery`: what is done between calls and after a failed capture: the script's own use
  of the wrapper undone, a freeze or a move followed, a wrapper left mid-iteration reset, its own
  part in a failure named.

Each user holds the wrapper as the narrowest of these it needs (the body a ``GradSync``), so the
type checker proves it uses nothing else.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CaptureGate",
    "DataParallel",
    "GradSync",
    "Recovery",
    "agree_over",
    "failures_of_every_rank",
]


class GradSync(Protocol):
    """What the step body needs of the wrapper (and the runner of its buffers)."""

    # what the step calls (the wrapper, e.g. a DDP), and the module inside it (a forward with
    # no wrapper bookkeeping: evaluation)
    module: nn.Module
    inner: nn.Module
    # each rank holds only its shard of every gradient (FSDP2): what one rank finds in its own
    # gradients (check_finite's NaN) the others do not see; the all-reduced norm they all do
    shards_gradients: bool
    # rank 0's buffers are due at the next forward outside training (step.evaluate() or the
    # script's own forward through ``module``): written by the runner after each training call
    # and by the wrapper's own hooks for the script's forwards
    buffers_due: bool

    def take_optimizer(self, optimizer: torch.optim.Optimizer) -> None: ...

    def forward_context(
        self, *, sync_grads: bool, sync_buffers: bool
    ) -> contextlib.AbstractContextManager[Any]: ...

    def sync_buffers(self) -> None: ...

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...

    def grad_norm(self) -> torch.Tensor: ...


class CaptureGate(Protocol):
    """What the decision to capture (the warm-up, the runner's per-call read of the script's
    sync flags, the agreement of the ranks) and the step's construction need of the wrapper."""

    # the process group of the ranks that run the step together (None: no peers): agreement
    group: Any
    # where the script's own gradient-sync flags live (a dict each, and the key in it): a
    # replayed call asks ``False in map(dict.get, sync_dicts, sync_keys)`` (one C-level pass,
    # no call) and calls :meth:`script_sync` only when the script turned a sync off
    sync_dicts: tuple[dict[str, Any], ...]
    sync_keys: tuple[str, ...]

    def script_sync(self) -> bool | None: ...

    def count_forwards(self, n: int) -> None: ...

    def allows_capture(self, steps: int) -> bool: ...

    def count_allows_capture(self, forwards: int) -> bool: ...

    def capture_problem(
        self, optimizer: torch.optim.Optimizer, *, fp16: bool, accumulate_calls: int
    ) -> str | None: ...

    def before_capture(self) -> str | None: ...


class Recovery(Protocol):
    """What is done between calls (the script's own use of the wrapper undone, a freeze or a
    move followed) and after a failed capture (the wrapper reset, its part named)."""

    module: nn.Module  # the guard watches both (the wrapper may hold parameters of its own)
    inner: nn.Module
    # whether before_call() does anything (FSDP2): the replayed path calls it only then
    checks_before_call: bool

    def before_call(self) -> None: ...

    def follow_trainable(self) -> bool: ...

    def follow_storage(self) -> str | None: ...

    def explain_capture_failure(self, reason: str) -> str | None: ...

    def dirty(self) -> bool: ...

    def reset(self) -> None: ...

    def check_reset_alone(self) -> None: ...


def agree_over(group: Any, device: torch.device, ok: bool, dirty: bool) -> tuple[bool, bool]:
    """(every rank's ``ok``, any rank's ``dirty``) over ``group``: one all-reduce of two ints,
    the same for every wrapper with peers; as given where there are none (``group`` None).
    Called on every rank at the same step."""
    if group is None:
        return ok, dirty
    flags = torch.tensor([int(ok), int(not dirty)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    every_ok, none_dirty = flags.tolist()
    return bool(every_ok), not none_dirty


def failures_of_every_rank(group: Any, failure: str | None) -> list[str | None]:
    """Every rank's capture failure (None: that rank captured), by rank: called on every rank
    after :func:`agree_over` said one failed, so each rank's fallback names the cause (an object
    all-gather, once per run, only on that path)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [failure]
    gathered: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, failure, group=group)
    return gathered


class DataParallel(GradSync, CaptureGate, Recovery):
    """One data-parallel wrapper around the user's module: all three protocols.

    The defaults are those of a wrapper that synchronizes nothing (:class:`~.local.Local`);
    each method says what an implementation changes. Every method that runs a collective must
    be called on every rank at the same step.
    """

    module: nn.Module
    inner: nn.Module
    shards_gradients: bool = False
    # set on every training call (one attribute: no cost on a replayed call), as DDP's
    # ``require_forward_param_sync`` says after a training forward with its gradient sync on
    buffers_due: bool = False
    group: Any = None
    sync_dicts: tuple[dict[str, Any], ...] = ()
    sync_keys: tuple[str, ...] = ()
    checks_before_call: bool = False

    def take_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The script built ``optimizer`` over the module's parameters; a wrapper that replaced
        them (FSDP2 sharding the model) points it at the new ones."""

    # ----------------------------------------------------------------- GradSync
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

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm`` on the device (no host sync); the total norm, as
        ``torch.nn.utils.clip_grad_norm_`` returns it in the eager loop (its two halves:
        ``_total_norm``, then ``clip_grads_with_norm_``)."""
        params = self._grads_of()
        total = self._total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def grad_norm(self) -> torch.Tensor:
        """The total (2-)norm of the gradients, without clipping, on the device (no host sync):
        the value :meth:`clip_grad_norm_` would return."""
        return self._total_norm([p.grad for p in self._grads_of()])

    def _total_norm(self, grads: list[Any]) -> torch.Tensor:
        """``torch.nn.utils.get_total_norm`` (foreach), as ``clip_grad_norm_`` takes it."""
        return torch.nn.utils.get_total_norm(grads, foreach=True)

    def _grads_of(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.grad is not None]

    # ----------------------------------------------------------------- CaptureGate
    def script_sync(self) -> bool | None:
        """What the script asked of this call's gradient sync on the module it holds:
        ``model.require_backward_grad_sync = ...`` (the bare module, or the wrapper) or a
        ``with model.no_sync():`` around the call; None when it asked nothing."""
        flag = self.inner.__dict__.get("require_backward_grad_sync")
        return None if flag is None else bool(flag)

    def count_forwards(self, n: int) -> None:
        """``n`` training forwards ran the wrapper's host code (eagerly or while capturing)."""

    def allows_capture(self, steps: int) -> bool:
        """Whether the next ``steps`` training forwards may be captured."""
        return True

    def count_allows_capture(self, forwards: int) -> bool:
        """Whether a capture may come after ``forwards`` training forwards (the warm-up rule):
        with nothing timed underneath, after any count, so ``warmup=n`` captures after n eager
        steps."""
        return True

    def capture_problem(
        self, optimizer: torch.optim.Optimizer, *, fp16: bool, accumulate_calls: int
    ) -> str | None:
        """Why this wrapper's step cannot be captured with ``optimizer`` (the run stays eager
        with this reason; ``graph="always"`` raises it), or None."""
        return None

    def before_capture(self) -> str | None:
        """Run just before each capture: make it safe where the wrapper can, and return what it
        found that the script should know (warned at the user's line), or None."""
        return None

    # ----------------------------------------------------------------- Recovery
    def before_call(self) -> None:
        """At the start of every call, before anything runs or is checked: put back in place
        what the script's own use of the wrapper between calls left (FSDP2: parameters it
        unsharded). Cheap: no walk over the model."""

    def follow_trainable(self) -> bool:
        """Rebuild the wrapper over the parameters that require gradients now, if that set
        changed since it was built (a script froze or unfroze some); True if rebuilt. A
        collective where there are peers: every rank changes ``requires_grad`` at the same step.
        The caller drops the training graphs (they read the old wrapper)."""
        return False

    def follow_storage(self) -> str | None:
        """The module's parameters, gradients or buffers moved to new memory since the last
        training call (``model.to()``, ``p.data = ...``): follow them, and say what was done
        (None: nothing was needed). Raises where the wrapper cannot follow. A collective where
        there are peers: every rank moves its model at the same step (frameworks do)."""
        return None

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
