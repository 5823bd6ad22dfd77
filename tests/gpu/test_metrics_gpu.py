"""gather_for_metrics on NCCL: tensors gathered as tensors on each rank's GPU, in the sampler's
order, equal to one process over the whole set (the multi-GPU test needs 2+ GPUs)."""

from __future__ import annotations

import pytest
import torch

import ddpgraph as dg
from ddpgraph.testing import run_distributed

from .. import metrics_workers as w
from . import metrics_gpu_workers

pytestmark = pytest.mark.timeout(300)


def test_world_size_one_keeps_tensors_on_the_gpu(rt):
    rows = torch.arange(14, device=rt.device, dtype=torch.bfloat16).reshape(7, 2)
    out = dg.gather_for_metrics({"rows": rows, "ids": list(range(7))}, total=7)
    assert out["rows"].device == rt.device and torch.equal(out["rows"], rows)
    assert out["ids"] == list(range(7))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_every_gpu_gets_the_whole_evaluation_on_its_own_device():
    world = torch.cuda.device_count()
    results = run_distributed(
        metrics_gpu_workers.evaluate_on_gpu, world, backend="nccl", args=(5,), timeout=240
    )
    expected = w.reference(5, shuffle=True)
    for rank, result in enumerate(results):
        assert result["device"] == result["rank_device"] == f"cuda:{rank}"
        assert result["bools_device"] == f"cuda:{rank}"
        assert result["ids"] == expected["columns"]["id"]
        assert torch.equal(result["logits"], expected["logits"])
        assert torch.equal(result["bools"], expected["logits"].argmax(1) > 0)
