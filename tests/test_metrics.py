"""gather_for_metrics: an evaluation over a DistributedSampler, gathered, equals one process over
the whole set exactly; ranks that disagree all raise the same error."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

import ddpgraph as dg
from ddpgraph.errors import ObjectArgumentError
from ddpgraph.testing import run_distributed

from . import metrics_workers as w
from .test_objects import assert_same_error_everywhere

pytestmark = pytest.mark.timeout(300)

BATCH_SIZES = [4, 5]  # 19 samples a rank at 2 ranks, 13 at 3: both leave an uneven last batch


def assert_equal_results(gathered: dict, expected: dict) -> None:
    assert gathered["records"] == expected["records"]
    assert gathered["columns"] == expected["columns"]
    assert torch.equal(gathered["logits"], expected["logits"])
    assert gathered["logits"].dtype == torch.float64
    assert gathered["mixed"]["label"] == expected["mixed"]["label"]
    assert torch.equal(gathered["mixed"]["correct"], expected["mixed"]["correct"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_sampler_evaluation_equals_one_process_over_the_whole_set(world_size):
    results = run_distributed(w.distributed_evaluations, world_size, args=(BATCH_SIZES,))
    for rank_results in results:
        for case in rank_results:
            batch_size, shuffle = case["config"]
            expected = w.reference(batch_size, shuffle)
            gathered = case["gathered"]
            assert_equal_results(gathered, expected)
            assert w.metrics(gathered) == w.metrics(expected)  # exactly, floats included
            assert w.metrics(gathered)["samples"] == w.SAMPLES
    # the test can fail: gathered naively, the padded samples are there twice
    assert results[0][0]["naive"] == w.SAMPLES + (world_size - w.SAMPLES % world_size)


def test_shuffled_order_is_the_samplers_permutation():
    sampler = DistributedSampler(w.dataset(), num_replicas=1, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(1)
    ids = w.reference(4, shuffle=True)["columns"]["id"]
    assert ids == list(sampler) and sorted(ids) == list(range(w.SAMPLES)) and ids != sorted(ids)


def test_one_process_returns_every_kind_as_it_was():
    ids = list(range(7))
    assert dg.gather_for_metrics(ids, total=7) == ids
    rows = torch.arange(14).reshape(7, 2)
    assert torch.equal(dg.gather_for_metrics(rows, total=7), rows)
    both = dg.gather_for_metrics({"a": ids, "b": rows}, total=7)
    assert both["a"] == ids and torch.equal(both["b"], rows)
    sampler = DistributedSampler(w.dataset(), num_replicas=1, rank=0, shuffle=False)
    everything = list(range(w.SAMPLES))
    assert dg.gather_for_metrics(everything, sampler=sampler) == everything


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({}, "pass exactly one of sampler="),
        ({"total": -1}, "total=-1 is not a non-negative int"),
        ({"total": 2.0}, "total=2.0 is not a non-negative int"),
        ({"sampler": [1, 2]}, "sampler= is a list, not a DistributedSampler"),
    ],
)
def test_one_process_bad_arguments(kwargs, fragment):
    with pytest.raises(ObjectArgumentError, match="rank 0") as info:
        dg.gather_for_metrics([1, 2], **kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("obj", "fragment"),
    [
        ((1, 2), "obj is a tuple; pass a list"),
        (torch.tensor(1.0), "0-d tensor"),
        ({}, "empty dict"),
        ({1: [1]}, "keys that are not str"),
        ({"a": [1], "b": [1, 2]}, "different numbers of results"),
        ([1, 2, 3], "holds 3 results, its share of 2 samples is 2"),
        ([1], "holds 1 results, its share of 2 samples is 2"),
    ],
)
def test_one_process_bad_objects(obj, fragment):
    with pytest.raises(ObjectArgumentError) as info:
        dg.gather_for_metrics(obj, total=2)
    assert fragment in str(info.value)


DISAGREEMENTS = {
    "fields": "differ in fields",
    "total": "the totals differ",
    "too_few": "hold a wrong number of results",
    "too_many": "hold a wrong number of results",
    "dtype": "differ in tensor layout",
    "row_shape": "differ in tensor layout",
    "kind": "differ in kind of obj",
    "both": "pass exactly one of sampler=",
    "neither": "pass exactly one of sampler=",
    "sampler_world": "the sampler splits for rank 0 of",
    "loader": "not a DistributedSampler (pass loader.sampler)",
    "tuple": "obj is a tuple",
    "uneven_fields": "different numbers of results",
}


@pytest.mark.parametrize("world_size", [2, 3])
def test_disagreeing_ranks_all_raise_the_same_error(world_size):
    results = run_distributed(w.disagreements, world_size)
    for case, fragment in DISAGREEMENTS.items():
        message = assert_same_error_everywhere(
            [r[case] for r in results], ObjectArgumentError, fragment
        )
        assert "Every rank raised this error" in message
        if case not in ("fields", "kind", "dtype", "row_shape", "total"):
            assert f"rank {world_size - 1}" in message, (case, message)
    for r in results:  # the group is still usable, and in step
        assert len(r["after"]) == w.SAMPLES
