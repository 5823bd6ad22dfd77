from __future__ import annotations

import pytest
import torch.distributed as dist

from ddpgraph import ObjectCollectiveError
from ddpgraph.distributed import torch_patch
from ddpgraph.testing import run_distributed

from . import object_workers as w
from .test_objects import assert_same_error_everywhere

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("size", [10, 10_000])
def test_patched_functions_give_torchs_results(size):
    results = run_distributed(w.torch_patch_matches_torch, 2, args=(size,), timeout=120)
    for rank, (theirs, ours, gathered, blist) in enumerate(results):
        assert ours == theirs and [o["rank"] for o in ours] == [0, 1]
        assert gathered == (theirs if rank == 0 else None)
        assert blist == [theirs[1], 1]


@pytest.mark.parametrize("kind", ["all_gather", "gather", "broadcast"])
def test_a_wrong_list_length_on_one_rank_is_a_value_error_on_every_rank(kind):
    # the gather output list only matters on dst (rank 0); the others' lists are checked elsewhere
    bad = 0 if kind == "gather" else 1
    results = run_distributed(
        w.torch_patch_bad_length, 2, args=(kind, bad), timeout=60, return_exceptions=True
    )
    message = assert_same_error_everywhere(results, ValueError)
    assert "length 3" in message and ("[None] * 2" in message or "list length" in message)


def test_unpicklable_object_on_one_rank():
    results = run_distributed(
        w.torch_patch_unpicklable_on, 2, args=(0,), timeout=60, return_exceptions=True
    )
    assert_same_error_everywhere(
        results, ObjectCollectiveError, "failed on ranks [0]", "cannot pickle"
    )


def test_patch_is_reversible_and_idempotent():
    original = dist.all_gather_object
    torch_patch.patch_torch()
    torch_patch.patch_torch()
    assert dist.all_gather_object is torch_patch.all_gather_object
    assert dist.distributed_c10d.broadcast_object_list is torch_patch.broadcast_object_list
    assert torch_patch.is_patched()
    torch_patch.unpatch()
    assert dist.all_gather_object is original and not torch_patch.is_patched()
    torch_patch.unpatch()
    assert dist.all_gather_object is original


def test_single_process_patched_functions_fill_lists():
    torch_patch.patch_torch()
    try:
        out = [None]
        dist.all_gather_object(out, {"a": {1}})
        assert out == [{"a": {1}}]
        with pytest.raises(ValueError, match="length 2, but the group has 1 ranks"):
            dist.all_gather_object([None, None], 1)
    finally:
        torch_patch.unpatch()


def test_the_old_module_name_compat_still_hands_out_the_same_functions():
    from ddpgraph import compat

    assert set(compat.__all__) == set(torch_patch.__all__) | {
        "all_gather_object",
        "broadcast_object_list",
        "gather_object",
    }
    for name in compat.__all__:
        assert getattr(compat, name) is getattr(torch_patch, name)
