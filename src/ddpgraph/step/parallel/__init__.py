"""The data-parallel wrapper behind one interface: the only place that knows which one is in use.

:func:`wrap` picks the implementation: :class:`~.ddp.DDP` (DistributedDataParallel) when a
process group exists, :class:`~.local.Local` (the module as is) otherwise. The step body, the
capture policy and checkpoints talk to :class:`DataParallel` alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .base import DataParallel
from .local import Local

__all__ = ["DataParallel", "check_not_wrapped", "unwrap", "wrap"]


def wrap(
    module: nn.Module,
    device: torch.device,
    stream: torch.cuda.Stream | None,
    ddp_kwargs: Mapping[str, Any],
) -> DataParallel:
    """The wrapper for ``module`` in this process: DDP with a process group, else the module."""
    if not (dist.is_available() and dist.is_initialized()):
        return Local(module)
    from .ddp import DDP

    return DDP(module, device, stream, ddp_kwargs)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper and torch.compile (whose state_dict keys are
    prefixed)."""
    from .ddp import inner_of

    module = inner_of(model)
    return getattr(module, "_orig_mod", module)


def check_not_wrapped(model: object) -> None:
    """Refuse a model the script already wrapped: the wrapping must happen on the capture
    stream."""
    from .ddp import check_not_ddp

    check_not_ddp(model)
