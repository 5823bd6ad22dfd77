"""Workers for the NCCL object-collective tests (module level, for run_distributed)."""

from __future__ import annotations

import torch.distributed as dist

import ddpgraph


def forgot_set_device() -> str:
    """The classic bug: an NCCL group and no set_device, so every rank sits on cuda:0."""
    dist.init_process_group("nccl")
    try:
        ddpgraph.all_gather_object({"rank": dist.get_rank()}, timeout=30)
    finally:
        dist.destroy_process_group()
    return "no error"
