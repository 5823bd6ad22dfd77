"""No process group: the module is used as it is."""

from __future__ import annotations

from torch import nn

from .base import DataParallel

__all__ = ["Local"]


class Local(DataParallel):
    """The user's module, unwrapped: nothing to synchronize."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.inner = module
