"""Whole-step graphs with NCCL across several GPUs (skipped with fewer than 2)."""

from __future__ import annotations

import pytest
import torch

from ddpgraph.testing import run_distributed

from . import multi_gpu_workers

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs"),
]


@pytest.mark.parametrize("model_name", ["mlp", "resnet", "transformer"])
def test_graphed_equals_eager_ddp_on_every_rank(model_name):
    world = torch.cuda.device_count()
    results = run_distributed(
        multi_gpu_workers.graphed_and_eager,
        world,
        backend="nccl",
        args=(model_name, 45),
        timeout=540,
    )
    for rank, result in enumerate(results):
        graphed, eager = result["graphed"], result["eager"]
        assert graphed["mode"] == "graphed" and graphed["replays"] >= 30, rank
        assert torch.equal(graphed["losses"], eager["losses"]), rank
        for name, value in eager["state"].items():
            assert torch.equal(graphed["state"][name], value), (rank, name)
        for a, b in zip(graphed["opt"], eager["opt"], strict=True):
            assert torch.equal(a, b), rank
    for name, value in results[0]["graphed"]["state"].items():
        for other in results[1:]:
            assert torch.equal(other["graphed"]["state"][name], value), name  # DDP kept them equal


def test_ranks_replaying_capturing_and_running_eagerly_in_one_step_stay_in_sync():
    """Safe mixtures: in one step a rank may replay, capture a new shape, or run eagerly while its
    peers do something else; the graph's all-reduces pair with eager ones (same buckets, same
    order). Every mode ends bitwise equal to all-eager DDP, on every rank."""
    world = torch.cuda.device_count()
    results = run_distributed(
        multi_gpu_workers.mixed_graphed_and_eager_steps,
        world,
        backend="nccl",
        args=(70,),
        timeout=540,
    )
    for rank, result in enumerate(results):
        for mode in ("capture", "eager_new_shapes"):
            assert torch.equal(result[mode]["losses"], result["eager"]["losses"]), (rank, mode)
            for name, value in result["eager"]["state"].items():
                assert torch.equal(result[mode]["state"][name], value), (rank, mode, name)
