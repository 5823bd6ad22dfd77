"""Module-level workers for gather_for_metrics on NCCL (one process per GPU)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

import ddpgraph as dg

from .. import metrics_workers as w


def evaluate_on_gpu(batch_size: int) -> dict[str, Any]:
    """The CPU tests' evaluation with the logits on this rank's GPU, gathered as tensors there."""
    rt = dg.get_runtime()
    assert rt is not None
    sampler = DistributedSampler(w.dataset(), shuffle=True, seed=3)
    sampler.set_epoch(1)
    ids, logits = [], []
    for idx, x, _ in DataLoader(w.dataset(), batch_size=batch_size, sampler=sampler):
        ids += idx.tolist()
        logits.append(w.logits_of(x.to(rt.device)))
    gathered = dg.gather_for_metrics({"id": ids, "logits": torch.cat(logits)}, sampler=sampler)
    bools = dg.gather_for_metrics(torch.cat(logits).argmax(1) > 0, sampler=sampler)
    return {
        "device": str(gathered["logits"].device),
        "rank_device": str(rt.device),
        "ids": gathered["id"],
        "logits": gathered["logits"].cpu(),
        "bools": bools.cpu(),
        "bools_device": str(bools.device),
    }
