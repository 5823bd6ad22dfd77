"""The watchdog's messages, as pure functions of its records (no thread, no store, no clock)."""

from __future__ import annotations

import pytest

from ddpgraph.distributed.watchdog_messages import (
    Hang,
    Heartbeat,
    Observer,
    Verdict,
    behind,
    gone_note,
    stall_warning,
    undelivered,
    verdict_report,
)

NOW = 1_000.0
ME = Observer(rank=0, world_size=3, timeout_s=30.0, store_host="rank 0 hosts it", stale_s=4.0)
STUCK = Hang("call", "collective:all_reduce", 7, "train.py:40", age=31.0, since=5.0)


def beat(step: int, *, inside: bool = True, age: float = 0.5, phase: str = "replay") -> Heartbeat:
    return Heartbeat(step, phase, None, inside, 2.0, NOW - age, "node1", 4242, n=3)


def test_a_heartbeat_goes_through_the_store_and_back_unchanged():
    sent = Heartbeat(7, "object:all_gather_object", "train.py:9", True, 1.25, NOW, "node1", 42, 9)
    assert Heartbeat.from_json(sent.to_json().encode()) == sent
    with pytest.raises((ValueError, KeyError, TypeError)):
        Heartbeat.from_json(b'{"step": 1}')


def test_a_verdict_goes_through_the_store_and_back_unchanged():
    sent = Verdict("rank 1 is behind", (1, 2))
    assert Verdict.from_json(sent.to_json()) == sent


def test_a_heartbeat_says_where_its_rank_is_and_how_old_it_is():
    inside = Heartbeat(7, "collective:all_reduce", "a.py:3", True, 2.0, NOW - 1.0, "node1", 42)
    assert inside.describe(NOW) == (
        "step 7, inside collective:all_reduce at a.py:3 for 3.0s; heartbeat 1.0s old (node1 pid 42)"
    )
    between = Heartbeat(7, "replay", None, False, 0.5, NOW, "node1", 42)
    assert between.describe(NOW).startswith("step 7, not in a watched call (last: replay, left")


def test_a_hang_says_where_it_is():
    assert STUCK.where() == "collective:all_reduce at train.py:40, step 7"
    replay = Hang("replay", "replay", 41, None, 31.0, 5.0)
    assert replay.where() == "the CUDA graph replay of step 41 (not complete on the GPU)"


def test_behind_names_missing_stale_earlier_and_idle_ranks_with_a_reason():
    assert behind(ME, {0: beat(7), 1: beat(7)}, STUCK, NOW) == {
        2: "no heartbeat: not started, or exited"
    }
    assert behind(ME, {1: beat(7, age=9.0), 2: beat(6)}, STUCK, NOW) == {
        1: "no heartbeat for 9.0s: stopped or dead",
        2: "at step 6",
    }
    assert behind(ME, {1: beat(7, inside=False), 2: beat(8)}, STUCK, NOW) == {
        1: "not in a watched call at step 7"
    }


def test_the_verdict_lists_every_rank_and_marks_those_behind():
    found = verdict_report(ME, STUCK, {0: beat(7), 1: beat(6), 2: beat(7)}, NOW)
    assert found.missing == (1,)
    lines = found.report.splitlines()
    assert lines[0] == (
        "ddpgraph watchdog: rank 0 has been in collective:all_reduce at train.py:40, step 7 for "
        "31.0s (timeout 30s). Behind: ranks [1]. Where every rank is:"
    )
    assert lines[2].startswith("  rank 1: step 6,") and lines[2].endswith("<- behind (at step 6)")
    assert "<- behind" not in lines[1] + lines[3]
    assert lines[-1].startswith("Look at the behind ranks' own output")


def test_the_verdict_without_a_store_says_who_hosts_it():
    found = verdict_report(ME, STUCK, None, NOW)
    assert found.missing == ()
    assert "The rendezvous store does not answer" in found.report
    assert "rank 0 hosts it. The job is stopped instead of hanging." in found.report


def test_the_stall_warning_names_the_slow_ranks_or_says_none_is():
    slow = stall_warning(ME, STUCK, {1: beat(6), 2: beat(7)}, NOW)
    assert "; behind: rank 1 (at step 6; step 6, inside replay" in slow
    assert "training goes on if they catch up, and fails at 30s (timeout)" in slow
    everyone = stall_warning(ME, STUCK, {1: beat(7), 2: beat(7)}, NOW)
    assert "behind:" not in everyone and "no rank is behind it" in everyone


def test_the_gone_note_names_ranks_whose_heartbeat_stopped_between_two_reads():
    first = {1: beat(7), 2: beat(7)}
    second = {1: first[1], 2: beat(7, age=0.1)}  # rank 1 published nothing new
    note = gone_note(ME, first, second, NOW)
    assert note.startswith("ddpgraph watchdog: rank(s) [1] stopped sending heartbeats (rank 1: ")
    assert gone_note(ME, first, {1: beat(8), 2: beat(8)}, NOW) == ""
    assert "store does not answer; rank 0 hosts it" in gone_note(ME, None, None, NOW)
    assert "store stopped answering" in gone_note(ME, first, None, NOW)


def test_the_exit_message_repeats_the_verdict_then_says_why_the_process_ends():
    text = undelivered(ME, "the verdict", 5.0, 124)
    assert text == (
        "the verdict\nddpgraph watchdog: rank 0's main thread is still blocked 5s after the "
        "verdict; exiting with status 124 instead of hanging.\n"
    )
