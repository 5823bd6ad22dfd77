"""The data-parallel wrapper behind one interface: the only place that knows which one is in use.

:func:`wrap` picks the implementation: :class:`~.fsdp2.FSDP2` for a model sharded with
``fully_shard`` (or with ``parallel="fsdp2"``, sharded here), :class:`~.ddp.DDP`
(DistributedDataParallel) for any other model when a process group exists, :class:`~.local.Local`
(the module as is) otherwise, or with ``parallel="none"`` on a group of one rank. Each
implements :class:`DataParallel`'s three protocols (:mod:`.base`); the step body holds it as a
:class:`GradSync`, the runner's decision and construction as a :class:`CaptureGate`, the paths
between calls and after a failed capture as a :class:`Recovery`. :mod:`.dtensor` reads
DTensors (FSDP2's) with no FSDP2 state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.runtime import expandable_segments_on
from ...errors import ConfigError
from .base import CaptureGate, DataParallel, GradSync, Recovery, agree_over, failures_of_every_rank
from .local import Local

__all__ = [
    "PARALLEL_CHOICES",
    "CaptureGate",
    "DataParallel",
    "GradSync",
    "ParallelMode",
    "Recovery",
    "agree_over",
    "check_graph_registration",
    "check_not_wrapped",
    "failures_of_every_rank",
    "unwrap",
    "wrap",
]

ParallelMode = Literal["auto", "ddp", "fsdp2", "none"]
PARALLEL_CHOICES = ("auto", "ddp", "fsdp2", "none")


def wrap(
    module: nn.Module,
    device: torch.device,
    stream: torch.cuda.Stream | None,
    ddp_kwargs: Mapping[str, Any],
    parallel: ParallelMode = "auto",
) -> DataParallel:
    """The wrapper for ``module`` in this process: FSDP2 for a sharded model (or
    ``parallel="fsdp2"``), else DDP with a process group, else (or ``parallel="none"``) the
    module."""
    from .fsdp2 import FSDP2, find_fsdp2, shard_blocks

    grouped = dist.is_available() and dist.is_initialized()
    inner = getattr(module, "_orig_mod", module)  # torch.compile's
    sharded = bool(find_fsdp2(inner))
    if parallel == "none":
        check_alone(sharded, dist.get_world_size() if grouped else 1, ddp_kwargs)
        return Local(module)
    if parallel == "ddp" and sharded:
        raise ConfigError(
            "TrainStep(parallel='ddp') got a model sharded with fully_shard; pass "
            "parallel='fsdp2' (or 'auto'), or pass the model before sharding it."
        )
    if parallel == "fsdp2" or sharded:
        if not grouped:
            raise ConfigError(
                "FSDP2 needs a process group (its device mesh spans the ranks); call "
                "ddpgraph.init() before sharding or building the TrainStep."
            )
        if ddp_kwargs:
            raise ConfigError(
                f"ddp_kwargs={dict(ddp_kwargs)!r} are DistributedDataParallel's arguments, but "
                "the model trains with FSDP2; drop them (pass fully_shard's own to fully_shard)."
            )
        if module is not inner:
            raise ConfigError(
                "compile=True with FSDP2: torch.compile around FSDP2's root does not compose "
                "with its hooks inside one graph; compile each block before fully_shard "
                "(torchtitan's way: block.compile()) and pass compile=False."
            )
        replaced = None if sharded else shard_blocks(inner)
        check_graph_registration(device)
        return FSDP2(module, stream, replaced)
    if not grouped:
        return Local(module)
    from .ddp import DDP

    check_graph_registration(device)
    return DDP(module, device, stream, ddp_kwargs)


def check_alone(sharded: bool, world_size: int, ddp_kwargs: Mapping[str, Any]) -> None:
    """``parallel="none"`` trains the module unwrapped on this rank alone, as
    ``accelerator.prepare`` does on one process: refused where gradients would need a sync."""
    if sharded:
        raise ConfigError(
            "TrainStep(parallel='none') got a model sharded with fully_shard, whose gradients "
            "FSDP2 reduces; pass parallel='auto' (or 'fsdp2'), or the model before sharding it."
        )
    if world_size > 1:
        raise ConfigError(
            f"TrainStep(parallel='none') trains the module on this rank alone, but the process "
            f"group has {world_size} ranks: their gradients would never be averaged and the "
            "replicas would drift apart; pass parallel='auto' (DDP) or 'fsdp2'."
        )
    if ddp_kwargs:
        raise ConfigError(
            f"ddp_kwargs={dict(ddp_kwargs)!r} are DistributedDataParallel's arguments, but "
            "parallel='none' trains the module unwrapped; drop them, or pass parallel='auto'."
        )


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper and torch.compile (whose state_dict keys are
    prefixed)."""
    from .ddp import inner_of

    module = inner_of(model)
    return getattr(module, "_orig_mod", module)


def check_not_wrapped(model: object) -> None:
    """Refuse a model the script already wrapped: the wrapping must happen on the capture
    stream; refuse FSDP1 (FSDP2's ``fully_shard`` is taken as it is)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    from .ddp import check_not_ddp
    from .fsdp2 import check_not_fsdp1, find_fsdp2

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        inside = model.module
        if find_fsdp2(inside):
            raise ConfigError(
                "the model is both wrapped in DistributedDataParallel and sharded with "
                "fully_shard; use one of them: pass the fully_shard-ed module without DDP "
                "(FSDP2 reduces the gradients itself)."
            )
    check_not_ddp(model)
    check_not_fsdp1(model)


def check_graph_registration(device: torch.device) -> None:
    """Refuse NCCL + CUDA graphs + ``expandable_segments:True`` with NCCL's graph registration on.

    NCCL registers the buffers a captured collective uses; with segments that grow and unmap
    that gives illegal memory accesses on Hopper (pytorch#158029; Megatron sets the same
    variable). ``ddpgraph.init()`` sets ``NCCL_GRAPH_REGISTER=0`` itself before it creates the
    group when it sees expandable segments; this catches a group the script made itself.
    """
    if device.type != "cuda" or not _uses_nccl():
        return
    if expandable_segments_on() and os.environ.get("NCCL_GRAPH_REGISTER", "1") != "0":
        raise ConfigError(
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True and NCCL registers the "
            "buffers of captured collectives (NCCL_GRAPH_REGISTER is "
            f"{os.environ.get('NCCL_GRAPH_REGISTER', 'unset')!r}): replays then crash with "
            "illegal memory accesses (pytorch#158029). Set NCCL_GRAPH_REGISTER=0 in the "
            "environment before the process group exists (ddpgraph.init() does it), or drop "
            "expandable_segments:True."
        )


def _uses_nccl() -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return "nccl" in str(dist.get_backend()).lower()
