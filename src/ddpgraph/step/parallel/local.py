"""No process group: the module is used as it is."""

from __future__ import annotations

from torch import nn

from .base import DataParallel

_SYNC = "require_backward_grad_sync"  # set on the bare module by a script (accelerate)

__all__ = ["Local"]


class Local(DataParallel):
    """The user's module, unwrapped: nothing to synchronize. No DDP underneath, so no
    iteration is timed: ``warmup=n`` captures after n eager steps (DDP's rule would silently
    raise any n to 11 or more; the base's warm-up rule is this one)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.inner = module
        self.sync_dicts, self.sync_keys = (module.__dict__,), (_SYNC,)  # as script_sync reads
