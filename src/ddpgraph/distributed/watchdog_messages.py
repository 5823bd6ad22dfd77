"""What the watchdog knows and what it says: its records, and its messages as pure functions.

No thread, no store and no clock here: every function takes the time (``now``, wall clock for
heartbeats) and the records it speaks of, so that each message can be tested on its own.
:mod:`ddpgraph.distributed.watchdog` gathers the records (on its thread, from the store) and logs or raises
what these functions return.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "NOTE_PREFIX",
    "Hang",
    "Heartbeat",
    "Observer",
    "Verdict",
    "behind",
    "gone_note",
    "stall_warning",
    "undelivered",
    "verdict_report",
]

NOTE_PREFIX = "ddpgraph watchdog:"


@dataclass(frozen=True)
class Observer:
    """The rank whose watchdog speaks, and what it knows of the job."""

    rank: int
    world_size: int
    timeout_s: float
    store_host: str  # who hosts the store, for a report written when it is gone
    stale_s: float  # a heartbeat older than this: its rank is stopped, dead or cannot run Python


@dataclass(frozen=True)
class Hang:
    """What this rank is stuck in: a watched call or a replay, since when, and where."""

    kind: Literal["call", "replay"]
    phase: str
    step: int
    site: str | None
    age: float  # seconds
    since: float  # monotonic time it began (identifies it for the once-only stall warning)

    def where(self) -> str:
        if self.kind == "replay":
            return f"the CUDA graph replay of step {self.step} (not complete on the GPU)"
        return f"{self.phase}{_at(self.site)}, step {self.step}"


@dataclass(frozen=True)
class Heartbeat:
    """Where a rank is, as it publishes it through the store about once a second."""

    step: int
    phase: str
    site: str | None
    inside: bool  # inside a watched call (else: between calls, last one named)
    for_s: float  # seconds inside the call, or since leaving the last one, when published
    time: float  # wall-clock time published
    host: str
    pid: int
    n: int = 0  # how many heartbeats the rank has published

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "phase": self.phase,
                "site": self.site,
                "inside": self.inside,
                "for": round(self.for_s, 3),
                "time": self.time,
                "host": self.host,
                "pid": self.pid,
                "n": self.n,
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> Heartbeat:
        """Raises ``ValueError``, ``KeyError`` or ``TypeError`` for what is not a heartbeat."""
        d = json.loads(raw)
        return cls(
            step=int(d["step"]),
            phase=str(d["phase"]),
            site=None if d["site"] is None else str(d["site"]),
            inside=bool(d["inside"]),
            for_s=float(d["for"]),
            time=float(d["time"]),
            host=str(d["host"]),
            pid=int(d["pid"]),
            n=int(d.get("n", 0)),
        )

    def age(self, now: float) -> float:
        return max(0.0, now - self.time)

    def describe(self, now: float) -> str:
        since = self.for_s + self.age(now)
        state = (
            f"inside {self.phase}{_at(self.site)} for {since:.1f}s"
            if self.inside
            else f"not in a watched call (last: {self.phase}{_at(self.site)}, left {since:.1f}s ago)"
        )
        return (
            f"step {self.step}, {state}; heartbeat {self.age(now):.1f}s old "
            f"({self.host} pid {self.pid})"
        )


@dataclass(frozen=True)
class Verdict:
    """The one report of a hang that every rank prints (the first one written to the store)."""

    report: str
    missing: tuple[int, ...]  # the ranks behind

    def to_json(self) -> str:
        return json.dumps({"report": self.report, "missing": list(self.missing)})

    @classmethod
    def from_json(cls, raw: str | bytes) -> Verdict:
        d = json.loads(raw)
        return cls(str(d["report"]), tuple(int(r) for r in d["missing"]))


Beats = Mapping[int, Heartbeat]


def behind(me: Observer, beats: Beats, hang: Hang, now: float) -> dict[int, str]:
    """The ranks that are behind ``me``, stuck in ``hang``, each with a short reason."""
    found: dict[int, str] = {}
    for r in range(me.world_size):
        beat = beats.get(r)
        if r == me.rank:
            continue
        if beat is None:
            found[r] = "no heartbeat: not started, or exited"
        elif beat.age(now) > me.stale_s:
            found[r] = f"no heartbeat for {beat.age(now):.1f}s: stopped or dead"
        elif beat.step < hang.step:
            found[r] = f"at step {beat.step}"
        elif beat.step == hang.step and not beat.inside:
            found[r] = f"not in a watched call at step {beat.step}"
    return found


def stall_warning(me: Observer, hang: Hang, beats: Beats | None, now: float) -> str:
    """The one warning of a call (or replay) past ``stall_warning``: who is behind, if anyone."""
    slow = "" if beats is None else _behind_text(beats, behind(me, beats, hang, now), now)
    if slow:
        outlook = "training goes on if they catch up"
    else:  # e.g. a long first step (compiling, capturing) on every rank
        outlook = "no rank is behind it (a long step everywhere, or a wait inside it)"
    return (
        f"{NOTE_PREFIX} rank {me.rank} has been in {hang.where()} for {hang.age:.1f}s"
        + (f"; behind: {slow}" if slow else "")
        + f"; {outlook}, and fails at {me.timeout_s:g}s (timeout) if this call has not returned."
    )


def verdict_report(me: Observer, hang: Hang, beats: Beats | None, now: float) -> Verdict:
    """The report of a hang past ``timeout``: where every rank is, and the ranks behind."""
    head = (
        f"{NOTE_PREFIX} rank {me.rank} has been in {hang.where()} for "
        f"{hang.age:.1f}s (timeout {me.timeout_s:g}s)."
    )
    if beats is None:
        return Verdict(
            f"{head} The rendezvous store does not answer, so where the other ranks are is "
            f"unknown; {me.store_host}. The job is stopped instead of hanging.",
            (),
        )
    late = behind(me, beats, hang, now)
    lines = [
        f"  rank {r}: "
        + (beats[r].describe(now) if r in beats else "no heartbeat")
        + (f"   <- behind ({late[r]})" if r in late else "")
        for r in range(me.world_size)
    ]
    named = f"Behind: ranks {sorted(late)}." if late else "No rank is behind this one."
    fix = (
        "Look at the behind ranks' own output for an exception, a stop (SIGSTOP, a debugger), "
        "a call that the others make and they skip, or a slower step; raise "
        "ddpgraph.init(timeout=) only if a rank is legitimately this slow."
    )
    return Verdict(
        "\n".join([f"{head} {named} Where every rank is:", *lines, fix]), tuple(sorted(late))
    )


def gone_note(me: Observer, first: Beats | None, second: Beats | None, now: float) -> str:
    """The note on an error that a peer's exit caused: which ranks stopped beating between two
    reads of the heartbeats (``None``: the store did not answer); "" if none did."""
    if first is None:
        return f"{NOTE_PREFIX} the rendezvous store does not answer; {me.store_host}."
    if second is None:
        return f"{NOTE_PREFIX} the rendezvous store stopped answering; {me.store_host}."
    gone = [
        r
        for r in range(me.world_size)
        if r != me.rank and (second.get(r) is None or (r in first and second[r] == first[r]))
    ]
    if not gone:
        return ""
    where = "; ".join(
        f"rank {r}: " + (first[r].describe(now) if r in first else "no heartbeat") for r in gone
    )
    return f"{NOTE_PREFIX} rank(s) {gone} stopped sending heartbeats ({where})."


def undelivered(me: Observer, verdict_text: str, grace_s: float, exit_code: int) -> str:
    """What a rank prints before it exits because its main thread never took the verdict."""
    return (
        f"{verdict_text}\n{NOTE_PREFIX} rank {me.rank}'s main thread is still blocked "
        f"{grace_s:g}s after the verdict; exiting with status {exit_code} instead of hanging.\n"
    )


def _behind_text(beats: Beats, late: Mapping[int, str], now: float) -> str:
    return "; ".join(
        f"rank {r} ({why}; " + (beats[r].describe(now) if r in beats else "no heartbeat") + ")"
        for r, why in sorted(late.items())
    )


def _at(site: str | None) -> str:
    return f" at {site}" if site else ""
