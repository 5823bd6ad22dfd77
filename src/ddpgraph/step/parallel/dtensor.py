"""DTensor (FSDP2's parameters, gradients and norms) as the step reads it, with no FSDP2 state:
where a tensor's values live, the group a sharded module's mesh spans, a norm as a plain tensor.

Nothing here imports ``torch.distributed.tensor`` at module level (the core import stays light).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["address", "full_tensor", "mesh_group"]


def address(tensor: torch.Tensor) -> int:
    """Where a tensor's values live: a DTensor's (FSDP2's shards) are its local tensor's (its own
    ``data_ptr()`` is 0)."""
    local = getattr(tensor, "_local_tensor", None)
    return (local if local is not None else tensor).data_ptr()


def mesh_group(root: nn.Module) -> Any:
    """The process group the mesh of ``root``'s DTensor parameters spans: every rank that runs
    the step (agreement); the world where the mesh has more dimensions or there is none."""
    from torch.distributed.tensor import DTensor

    for param in root.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            return mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
    return dist.group.WORLD


def full_tensor(norm: torch.Tensor) -> torch.Tensor:
    """A (replicated) DTensor as a plain tensor (``full_tensor()`` of a replicated DTensor moves
    nothing); a plain tensor as it is."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
