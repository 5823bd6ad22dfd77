from __future__ import annotations

import pytest
import torch.distributed as dist

from ddpgraph import ObjectCollectiveError, compat
from ddpgraph.testing import run_distributed

from . import object_workers as w
from .test_objects import assert_same_error_everywhere

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("size", [10, 10_000])
def test_patched_functions_give_torchs_results(size):
    results = run_distributed(w.compat_matches_torch, 2, args=(size,), timeout=120)
    for rank, (theirs, ours, gathered, blist) in enumerate(results):
        assert ours == theirs and [o["rank"] for o in ours] == [0, 1]
        assert gathered == (theirs if rank == 0 else None)
        assert blist == [theirs[1], 1]


@pytest.mark.parametrize("kind", ["all_gather", "gather", "broadcast"])
def test_a_wrong_list_length_on_one_rank_is_a_value_error_on_every_rank(kind):
    # the gather output list only matters on dst (rank 0); the others' lists are checked elsewhere
    bad = 0 if kind == "gather" else 1
    results = run_distributed(
        w.compat_bad_length, 2, args=(kind, bad), timeout=60, return_exceptions=True
    )
    message = assert_same_error_everywhere(results, ValueError)
    assert "length 3" in message and ("[None] * 2" in message or "list length" in message)


def test_unpicklable_object_on_one_rank():
    results = run_distributed(
        w.compat_unpicklable_on, 2, args=(0,), timeout=60, return_exceptions=True
    )
    assert_same_error_everywhere(
        results, ObjectCollectiveError, "failed on ranks [0]", "cannot pickle"
    )


def test_patch_is_reversible_and_idempotent():
    original = dist.all_gather_object
    compat.patch_torch()
    compat.patch_torch()
    assert dist.all_gather_object is compat.all_gather_object
    assert dist.distributed_c10d.broadcast_object_list is compat.broadcast_object_list
    assert compat.is_patched()
    compat.unpatch()
    assert dist.all_gather_object is original and not compat.is_patched()
    compat.unpatch()
    assert dist.all_gather_object is original


def test_single_process_compat_fills_lists():
    compat.patch_torch()
    try:
        out = [None]
        dist.all_gather_object(out, {"a": {1}})
        assert out == [{"a": {1}}]
        with pytest.raises(ValueError, match="length 2, but the group has 1 ranks"):
            dist.all_gather_object([None, None], 1)
    finally:
        compat.unpatch()
