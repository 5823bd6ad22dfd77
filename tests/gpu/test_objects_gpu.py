"""Object collectives on NCCL (one GPU): correctness, CPU decoding, the shared-GPU refusal."""

from __future__ import annotations

import pytest
import torch

import ddpgraph
from ddpgraph import DeviceConflictError
from ddpgraph.distributed.torch_patch import patch_torch, unpatch
from ddpgraph.testing import run_distributed

from . import object_gpu_workers

pytestmark = pytest.mark.timeout(180)


def test_nccl_world_size_one_round_trips_and_decodes_on_cpu(rt):
    assert rt.backend == "nccl"
    payload = {"loss": 0.5, "t": torch.arange(4, device="cuda", dtype=torch.bfloat16), "big": 2**80}
    (got,) = ddpgraph.all_gather_object(payload)
    assert got["loss"] == 0.5 and got["big"] == 2**80
    assert got["t"].device.type == "cpu" and got["t"].dtype == torch.bfloat16
    assert torch.equal(got["t"], payload["t"].cpu())
    assert ddpgraph.gather_object([1, (2, 3)], dst=0) == [[1, (2, 3)]]
    assert ddpgraph.broadcast_object("x" * 100_000, src=0) == "x" * 100_000


def test_torch_patch_on_nccl(rt):
    patch_torch()
    try:
        out = [None]
        torch.distributed.all_gather_object(out, {"rank": 0})
        assert out == [{"rank": 0}]
        with pytest.raises(ValueError, match="has length 2, but the group has 1 ranks"):
            torch.distributed.all_gather_object([None, None], {"rank": 0})
    finally:
        unpatch()


def test_ranks_sharing_a_gpu_get_device_conflict_not_nccl_errors():
    results = run_distributed(
        object_gpu_workers.forgot_set_device, 2, init=False, timeout=120, return_exceptions=True
    )
    for exc in results:
        assert isinstance(exc, DeviceConflictError), exc
        assert "ranks 0, 1" in str(exc) and "cuda:0" in str(exc)
