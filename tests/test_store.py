"""The store barrier's protocol, decided from its log alone (multi-rank runs: test_runtime.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ddpgraph.distributed.store import _read_verdict, store_barrier
from ddpgraph.errors import CollectiveTimeout


def test_a_barrier_lets_all_ranks_through_or_none():
    everyone = frozenset({0, 1, 2})
    done = _read_verdict(b"0 a\n2 c\n1 b\n! 0\n", everyone)
    assert done.done and done.arrived == (0, 2, 1) and done.payloads[2] == "c"
    late = _read_verdict(b"0 a\n1 b\n! 0\n2 c\n", everyone)
    assert not late.done and late.gave_up == 0 and late.arrived == (0, 1)
    pending = _read_verdict(b"1 b\n", everyone)
    assert not pending.done and pending.gave_up is None and pending.arrived == (1,)


def test_a_rank_that_cannot_reach_the_store_to_arrive_gets_a_collective_timeout():
    class GoneStore:
        def append(self, key, value):
            raise RuntimeError("Connection reset by peer")

    with pytest.raises(CollectiveTimeout, match=r"test barrier: this rank \(1\) could not reach"):
        store_barrier(
            GoneStore(), "k", rank=1, world_size=2, timeout=timedelta(seconds=1),
            what="test barrier", fix="",
        )  # fmt: skip
