"""The old name of :mod:`ddpgraph.distributed.torch_patch`, kept so that ``from ddpgraph import compat`` and
``ddpgraph.compat.patch_torch()`` keep working. New code imports :mod:`ddpgraph.distributed.torch_patch`."""

from __future__ import annotations

from .distributed.torch_patch import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    is_patched,
    patch_torch,
    unpatch,
)

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "is_patched",
    "patch_torch",
    "unpatch",
]
