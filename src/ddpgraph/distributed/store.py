"""The one store barrier: ranks meet through the rendezvous store, not through a collective.

:func:`store_barrier` is shared by ``ddpgraph.init``'s device check, the object collectives'
arrival wait (``timeout=``) and the watchdog's verdict read. It works before any process group
exists and when a peer is stuck inside NCCL, and every waiting rank can name the missing ranks
without another store round trip, even after the store's host has gone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta

from torch._C._distributed_c10d import Store

from ..errors import CollectiveTimeout, first_line

__all__ = ["BarrierResult", "forget_barrier", "store_barrier"]

# A waiting rank re-reads the arrival log at growing intervals, from 1 ms (ranks usually arrive
# within milliseconds of each other) to 0.1 s: that bounds both the store's load (<= 10 reads a
# second per waiting rank) and how old the verdict of a rank whose store went away can be.
# (A store.wait() with a short timeout would wake at once, but torch logs a warning for each.)
_FIRST_POLL_S = 0.001
_MAX_POLL_S = 0.1
_GAVE_UP = "!"


@dataclass(frozen=True)
class BarrierResult:
    """What a completed :func:`store_barrier` saw: each rank's payload, and who came last."""

    payloads: dict[int, str]
    last: int  # the rank whose arrival completed the barrier
    waited_s: float  # how long this rank waited


@dataclass(frozen=True)
class _Verdict:
    done: bool  # every expected rank arrived before anyone gave up
    arrived: tuple[int, ...]  # in arrival order, up to the verdict (or all seen, while pending)
    payloads: dict[int, str]
    gave_up: int | None = None  # the first rank that gave up waiting, if any did first


def store_barrier(
    store: Store,
    key: str,
    *,
    rank: int,
    world_size: int,
    timeout: timedelta,
    what: str,
    fix: str,
    payload: str = "",
    ranks: Collection[int] | None = None,
) -> BarrierResult:
    """Wait until every rank of ``ranks`` (default: all ``world_size``) has called this with
    ``key``, or raise :class:`CollectiveTimeout` naming the ranks that had not arrived.

    One append-only log per ``key`` is the whole protocol: a rank arriving appends
    ``"rank payload"``; a rank giving up at its deadline appends ``"! rank"``. Every rank decides
    from the log alone, and all decide the same: *done* if every expected rank appears before
    the first give-up, *timed out* (naming the ranks missing before it) otherwise. A rank that
    arrives after another gave up times out too, so a barrier never lets some ranks through and
    not others. A waiting rank re-reads the log at least every 0.1 s, so when the store itself
    goes away (rank 0 hosts it in a plain env:// job, and may exit right after its own timeout)
    the rank still names the missing ranks from its last read, without another round trip.
    ``payload`` (one line of text) comes back from every rank in ``BarrierResult.payloads``.
    Costs 2 store round trips for the last rank to arrive; a waiting rank reads the log at 1, 2,
    4, ... ms, then every 0.1 s.
    """
    expected = frozenset(range(world_size) if ranks is None else ranks)
    if "\n" in payload:
        raise ValueError(f"store_barrier: payload {payload!r} must be one line")
    start = time.monotonic()
    deadline = start + timeout.total_seconds()
    log_key = f"{key}/log"
    try:
        store.append(log_key, f"{rank} {payload}\n")  # type: ignore[attr-defined]  # not in stubs
    except Exception as exc:  # e.g. this rank is so late that the store's host has exited
        raise CollectiveTimeout(
            f"{what}: this rank ({rank}) could not reach the rendezvous store to arrive "
            f"({first_line(exc)}); in a plain env:// job rank 0 hosts it, and it may have "
            "exited after timing out while this rank was late" + (f"; {fix}." if fix else "."),
        ) from exc
    seen = _Verdict(False, (), {})
    pause = _FIRST_POLL_S
    while True:
        try:
            seen = _read_verdict(store.get(log_key), expected)
        except Exception as exc:  # the store is gone (its host exited): decide from the last read
            raise _barrier_timeout(seen, expected, rank, timeout, what, fix, exc) from exc
        if seen.done or seen.gave_up is not None:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            seen = _give_up(store, log_key, rank, expected, seen)
            break
        time.sleep(min(pause, remaining))
        pause = min(2 * pause, _MAX_POLL_S)
    if not seen.done:
        raise _barrier_timeout(seen, expected, rank, timeout, what, fix, None)
    return BarrierResult(seen.payloads, seen.arrived[-1], time.monotonic() - start)


def forget_barrier(store: Store, key: str) -> None:
    """Delete a barrier's keys once every rank is known to be past it (e.g. at the next one)."""
    with contextlib.suppress(Exception):
        store.delete_key(f"{key}/log")


def _give_up(
    store: Store, log_key: str, rank: int, expected: frozenset[int], seen: _Verdict
) -> _Verdict:
    """Mark this rank as gone, then read the log once more: a rank that arrived before the
    mark still counts (and then every rank goes on). If the store is gone, the last read holds."""
    try:
        store.append(log_key, f"{_GAVE_UP} {rank}\n")  # type: ignore[attr-defined]
        return _read_verdict(store.get(log_key), expected)
    except Exception:
        return seen


def _read_verdict(raw: bytes, expected: frozenset[int]) -> _Verdict:
    arrived: list[int] = []
    payloads: dict[int, str] = {}
    for line in raw.decode().splitlines():
        head, _, rest = line.partition(" ")
        if head == _GAVE_UP:
            return _Verdict(False, tuple(arrived), payloads, gave_up=int(rest))
        who = int(head)
        if who not in payloads:
            arrived.append(who)
            payloads[who] = rest
        if expected <= payloads.keys():
            return _Verdict(True, tuple(arrived), payloads)
    return _Verdict(False, tuple(arrived), payloads)


def _barrier_timeout(
    seen: _Verdict,
    expected: frozenset[int],
    rank: int,
    timeout: timedelta,
    what: str,
    fix: str,
    store_error: Exception | None,
) -> CollectiveTimeout:
    arrived = sorted(set(seen.arrived) & expected)
    missing = sorted(expected - set(arrived))
    limit = f"{timeout.total_seconds():g}s"
    if rank in missing:  # this rank's own arrival came after a peer gave up
        return CollectiveTimeout(
            f"{what}: this rank ({rank}) arrived after the others had given up waiting ({limit}; "
            f"rank {seen.gave_up} first); {fix or 'find what made this rank late'}.",
            missing=[rank],
        )
    if store_error is not None:
        when = (
            f"{what}: the rendezvous store stopped answering while this rank waited "
            f"({first_line(store_error)}; in a plain env:// job rank 0 hosts it and may have "
            "exited after its own timeout); at this rank's last read"
        )
    else:
        when = f"{what} timed out after {limit}:"
    return CollectiveTimeout(
        f"{when} ranks {missing} had not arrived (ranks {arrived} had)"
        + (f"; {fix}." if fix else "."),
        missing=missing,
    )
