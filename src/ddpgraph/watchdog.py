"""Hang detection: every hang becomes an error that says which rank is behind and where.

:func:`ddpgraph.init` starts one :class:`Watchdog` per rank (``watchdog=False`` turns it off). Its
daemon thread publishes this rank's heartbeat (step, phase, call site, time) through the
rendezvous store about once a second, and watches two things:

* a **watched call** (a TrainStep step, a collective or object collective, entered with
  :meth:`Watchdog.enter` or :func:`watch`) that has not returned after ``timeout``;
* the **last replay's CUDA event** (:meth:`Watchdog.after_replay`) not complete after
  ``timeout``. Collectives inside a replayed CUDA graph are invisible to NCCL's own watchdog
  (work enqueued during capture is never handed to it): this is what watches them.

After ``stall_warning`` seconds it logs one warning naming the ranks that are behind; if they
catch up, nothing else happens. After ``timeout`` it reads every rank's heartbeat, writes one
verdict to the store (the first rank's verdict wins, so every rank that can still speak prints
the same text), logs it, aborts this rank's communicators (``ProcessGroup.abort``: NCCL's
``ncclCommAbort``; a no-op on gloo), and then the main thread gets :class:`CollectiveTimeout`
where it can (a watched call that fails or returns, the next :meth:`~Watchdog.enter`); if it does
not within a few seconds, the process prints the verdict and exits with status
:data:`EXIT_CODE` instead of hanging.

Hot path (per watched call): :meth:`~Watchdog.enter` / :meth:`~Watchdog.leave` are attribute
writes, a list append/pop and one ``time.monotonic()``: no lock, no store I/O (about 0.3 us);
:meth:`~Watchdog.after_replay` adds one ``cudaEventRecord`` (a few us).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ._globals import Global, process_global
from ._log import get_logger
from ._store import store_barrier
from .errors import CollectiveTimeout

if TYPE_CHECKING:
    import torch

__all__ = ["EXIT_CODE", "Watchdog", "active", "watch"]

EXIT_CODE = 124  # as timeout(1): the job ended because something did not finish in time
PHASES = ("warmup", "capture", "replay", "eager", "eval")
PHASE_PREFIXES = ("object:", "collective:")

_HEARTBEAT_S = 1.0  # how often a rank publishes where it is (one store set)
_TICK_S = 0.25  # how often the thread looks at this rank's watched call and replay event
# A heartbeat older than this means its rank's process is stopped, dead or unable to run Python.
_STALE_S = 3.0 * _HEARTBEAT_S + 1.0
# The thread's store client gives up on a call after this: a store host that is itself stopped
# must not stop the watchdog that would report it.
_STORE_CALL_S = 5.0
# After a verdict, the time the main thread gets to take its CollectiveTimeout before the process
# exits, and the time ranks wait for their live peers to have read the verdict (rank 0 may host
# the store: its exiting would otherwise cut the others off before they print it).
_DELIVERY_GRACE_S = 5.0
_VERDICT_READ_S = 3.0
_ABORT_WAIT_S = 2.0
# A watched call that fails this close to the timeout failed of it (gloo's own timeout is the
# same value and races this thread): wait for the verdict instead of passing the error on.
_TIMEOUT_FRACTION = 0.9
_STALL_FRACTION = 0.25
_MAX_STALL_WARNING_S = 60.0

# torch's texts for "a peer's process is gone" (gloo, TCPStore, NCCL); errors.explain() knows
# them too, but names an object collective's failure first when both appear in one message.
_PEER_GONE = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|Connection was likely closed"
    r"|remote process exited",
    re.IGNORECASE,
)

_NOTE_PREFIX = "ddpgraph watchdog:"

_ACTIVE: Global[Watchdog | None] = process_global(
    "watchdog.active", lambda: None, reset_at_shutdown=True
)


def active() -> Watchdog | None:
    """The running :class:`Watchdog`, or None (``watchdog=False``, or no :func:`ddpgraph.init`)."""
    return _ACTIVE.value


def default_stall_warning(timeout: timedelta) -> timedelta:
    """A quarter of the timeout, at most a minute."""
    return timedelta(seconds=min(_STALL_FRACTION * timeout.total_seconds(), _MAX_STALL_WARNING_S))


class watch:  # lower case: used like a function, ``with watch(...)``
    """``with watch("collective:all_reduce", site="train.py:40"):`` marks a watched call.

    A no-op when no watchdog runs. ``step`` defaults to the last step this rank reported. If the
    call fails after the watchdog declared a hang (or at the timeout, as gloo's own timeout does),
    :class:`CollectiveTimeout` with the verdict is raised from the original error; a call that
    fails because a peer is gone gets a note naming the rank(s) whose heartbeat stopped.
    Cost: about 1 us per use with the watchdog on.
    """

    __slots__ = ("_dog", "phase", "site", "step")

    def __init__(self, phase: str, *, site: str | None = None, step: int | None = None) -> None:
        self.phase, self.site, self.step = phase, site, step
        self._dog: Watchdog | None = None

    def __enter__(self) -> Watchdog | None:
        dog = self._dog = _ACTIVE.value
        if dog is not None:
            dog.enter(self.phase, dog.step if self.step is None else self.step, self.site)
        return dog

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        dog = self._dog
        if dog is None:
            return
        dog.leave()
        if exc is not None:
            dog.on_error(exc)


@dataclass(frozen=True)
class _Hang:
    """What this rank is stuck in: a watched call or a replay, since when, and where."""

    kind: str  # "call" or "replay"
    phase: str
    step: int
    site: str | None
    age: float  # seconds
    since: float  # monotonic time it began (identifies it for the once-only stall warning)

    def where(self) -> str:
        site = f" at {self.site}" if self.site else ""
        if self.kind == "replay":
            return f"the CUDA graph replay of step {self.step} (not complete on the GPU)"
        return f"{self.phase}{site}, step {self.step}"


@dataclass(frozen=True)
class _Beat:
    """A rank's heartbeat as read from the store."""

    rank: int
    step: int
    phase: str
    site: str | None
    inside: bool  # inside a watched call (else: between calls, last one named)
    for_s: float  # seconds inside the call, or since leaving the last one, when published
    time: float  # wall-clock time published
    host: str
    pid: int

    def age(self, now: float) -> float:
        return max(0.0, now - self.time)

    def describe(self, now: float) -> str:
        site = f" at {self.site}" if self.site else ""
        state = (
            f"inside {self.phase}{site} for {self.for_s + self.age(now):.1f}s"
            if self.inside
            else f"not in a watched call (last: {self.phase}{site}, "
            f"left {self.for_s + self.age(now):.1f}s ago)"
        )
        return f"step {self.step}, {state}; heartbeat {self.age(now):.1f}s old ({self.host} pid {self.pid})"


class Watchdog:
    """One rank's hang detector; made by :func:`ddpgraph.init`, found with :func:`active`.

    The main thread calls :meth:`enter` / :meth:`leave` around each watched call and
    :meth:`after_replay` after each graph replay; everything else happens on the thread.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        timeout: timedelta,
        stall_warning: timedelta,
        store_host: str,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._exit = exit  # os._exit; tests pass a recorder
        self.timeout_s = timeout.total_seconds()
        self.stall_s = stall_warning.total_seconds()
        self.step = 0
        self._store_host = store_host  # who hosts the store, for a report when it is gone
        # hot-path state: written by the main thread, read by the watchdog thread
        self._stack: list[tuple[str, int, str | None, float]] = []
        self._last: tuple[str, int, str | None, float, float] = ("start", 0, None, 0.0, 0.0)
        self._replay: tuple[torch.cuda.Event, int, float] | None = None
        self._event: torch.cuda.Event | None = None
        # verdict state
        self._verdict: str | None = None
        self._missing: tuple[int, ...] = ()
        self._verdict_at = 0.0
        self._delivered = threading.Event()
        self._declare_lock = threading.Lock()
        self._warned_since: float | None = None
        self._thread_error_logged = False
        self._stop = threading.Event()
        # A clone is the store's own way to be used from a second thread; its short timeout keeps
        # a stopped store host from stopping this thread too.
        self._store = _thread_store(store)
        self._beats = 0
        self._keys: set[str] = set()
        self._thread = threading.Thread(
            target=self._run, name=f"ddpgraph-watchdog-rank{rank}", daemon=True
        )

    # ---- the hot path (main thread) ----

    def enter(self, phase: str, step: int, site: str | None = None) -> None:
        """A watched call begins (a step of ``phase`` at ``step``, or a collective). Call
        :meth:`leave` when it returns, also when it raises. Raises :class:`CollectiveTimeout`
        with the verdict if a hang was already declared. Cost: ~0.3 us, no lock, no I/O."""
        if self._verdict is not None:
            raise self._error()
        self.step = step
        self._stack.append((phase, step, site, time.monotonic()))

    def leave(self) -> None:
        """The innermost watched call returned (or raised)."""
        stack = self._stack
        if stack:
            phase, step, site, began = stack.pop()
            self._last = (phase, step, site, began, time.monotonic())

    def after_replay(self, stream: torch.cuda.Stream, step: int) -> None:
        """Record one CUDA event on ``stream`` after a replay of ``step``; the thread polls it
        (``event.query()``, never blocking) and declares a hang if it is not complete after
        ``timeout``. Cost: one ``cudaEventRecord``."""
        event = self._event
        if event is None:
            import torch

            with torch.cuda.device(stream.device):
                event = self._event = torch.cuda.Event()
        event.record(stream)
        self.step = step
        self._replay = (event, step, time.monotonic())

    # ---- life cycle ----

    def start(self) -> None:
        self._publish()  # peers can read this rank's key from the first moment
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and delete this rank's keys (the verdict's too). Leaves no thread."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=_STORE_CALL_S + 2 * _TICK_S)
        try:
            for key in sorted(self._keys):
                self._store.delete_key(key)
        except Exception:
            pass  # the store is gone (or stopped): one failed call says so, no need for more
        self._keys.clear()

    @property
    def keys(self) -> frozenset[str]:
        """The store keys (under this watchdog's prefix) it has written and not yet deleted."""
        return frozenset(self._keys)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- errors in watched calls (main thread) ----

    def on_error(self, exc: BaseException) -> None:
        """A watched call raised ``exc``: raise the verdict instead if this was the hang, or note
        which peer is gone if a peer's exit broke the call."""
        if isinstance(exc, CollectiveTimeout) and (
            self._verdict is None or str(exc) == self._verdict
        ):
            return  # a timeout of its own (an object collective's timeout=), or ours already
        if any(str(n).startswith(_NOTE_PREFIX) for n in getattr(exc, "__notes__", ())):
            return  # an inner watched call has noted it already
        if self._verdict is None:
            phase, step, site, began, left = self._last
            if left - began >= _TIMEOUT_FRACTION * self.timeout_s:
                self._declare(_Hang("call", phase, step, site, left - began, began))
        if self._verdict is not None:
            self._delivered.set()
            raise self._error() from exc
        if _PEER_GONE.search(str(exc)):
            note = self._gone_note()
            add_note = getattr(exc, "add_note", None)  # Python 3.11+
            if note and add_note is not None:
                add_note(note)

    def _error(self) -> CollectiveTimeout:
        self._delivered.set()
        return CollectiveTimeout(self._verdict or "", self._missing)

    def _gone_note(self) -> str:
        """Which ranks stopped beating: read twice, a heartbeat period and more apart."""
        first = self._read_beats()
        if first is None:
            return f"{_NOTE_PREFIX} the rendezvous store does not answer; {self._store_host}."
        time.sleep(_HEARTBEAT_S * 2.5)
        second = self._read_beats()
        if second is None:
            return f"{_NOTE_PREFIX} the rendezvous store stopped answering; {self._store_host}."
        gone = [
            r
            for r in range(self.world_size)
            if r != self.rank
            and (second.get(r) is None or (first.get(r) and second[r] == first.get(r)))
        ]
        if not gone:
            return ""
        now = time.time()
        where = "; ".join(
            f"rank {r}: " + (b.describe(now) if (b := first.get(r)) else "no heartbeat")
            for r in gone
        )
        return f"{_NOTE_PREFIX} rank(s) {gone} stopped sending heartbeats ({where})."

    # ---- the thread ----

    def _run(self) -> None:
        next_beat = time.monotonic() + _HEARTBEAT_S
        while not self._stop.wait(_TICK_S):
            try:
                now = time.monotonic()
                beat_due = now >= next_beat
                if self._verdict is None:
                    self._check(now, look_for_peer_verdict=beat_due)
                else:
                    self._exit_if_undelivered(now)
                if beat_due and not self._stop.is_set():
                    self._publish()
                    next_beat = now + _HEARTBEAT_S
            except Exception as exc:  # the watchdog must keep watching
                if not self._thread_error_logged:
                    self._thread_error_logged = True
                    get_logger().warning("ddpgraph watchdog: %s: %s", type(exc).__name__, exc)

    def _check(self, now: float, *, look_for_peer_verdict: bool) -> None:
        hang = self._local_hang(now)
        if hang is not None and hang.age >= self.timeout_s:
            self._declare(hang)
        elif hang is not None and hang.age >= self.stall_s and hang.since != self._warned_since:
            self._warned_since = hang.since
            self._warn_stall(hang)
        elif look_for_peer_verdict and self._peer_verdict():  # once a heartbeat: store load
            get_logger().error("%s", self._verdict)
            self._abort_communicators()
            self._acknowledge_verdict()

    def _local_hang(self, now: float) -> _Hang | None:
        hang = None
        stack = self._stack
        try:
            oldest, innermost = stack[0], stack[-1]
        except IndexError:  # empty, or emptied while read
            pass
        else:
            phase, step, site, _ = innermost
            hang = _Hang("call", phase, step, site, now - oldest[3], oldest[3])
        replay = self._replay
        if replay is not None and (hang is None or now - replay[2] > hang.age):
            event, step, recorded = replay
            if now - recorded >= self.stall_s and not event.query():
                hang = _Hang("replay", "replay", step, None, now - recorded, recorded)
        return hang

    def _warn_stall(self, hang: _Hang) -> None:
        beats = self._read_beats()
        slow = "" if beats is None else self._behind_text(beats, hang)
        if slow:
            outlook = "training goes on if they catch up"
        else:  # e.g. a long first step (compiling, capturing) on every rank
            outlook = "no rank is behind it (a long step everywhere, or a wait inside it)"
        get_logger().warning(
            "ddpgraph watchdog: rank %d has been in %s for %.1fs%s; %s, and fails at %gs "
            "(timeout) if this call has not returned.",
            self.rank, hang.where(), hang.age, f"; behind: {slow}" if slow else "", outlook,
            self.timeout_s,
        )  # fmt: skip

    def _declare(self, hang: _Hang) -> None:
        """Build the verdict (or adopt a peer's), log it, abort the communicators."""
        with self._declare_lock:
            if self._verdict is not None:
                return
            beats = self._read_beats()
            report, missing = self._report(hang, beats)
            agreed = self._agree({"report": report, "missing": missing})
            self._verdict, self._missing = agreed["report"], tuple(agreed["missing"])
            self._verdict_at = time.monotonic()
        get_logger().error("%s", self._verdict)
        self._abort_communicators()
        self._acknowledge_verdict()

    def _report(self, hang: _Hang, beats: dict[int, _Beat] | None) -> tuple[str, list[int]]:
        head = (
            f"ddpgraph watchdog: rank {self.rank} has been in {hang.where()} for "
            f"{hang.age:.1f}s (timeout {self.timeout_s:g}s)."
        )
        if beats is None:
            return (
                f"{head} The rendezvous store does not answer, so where the other ranks are is "
                f"unknown; {self._store_host}. The job is stopped instead of hanging.",
                [],
            )
        behind = self._behind(beats, hang)
        now = time.time()
        lines = [
            f"  rank {r}: "
            + (beats[r].describe(now) if r in beats else "no heartbeat")
            + (f"   <- behind ({behind[r]})" if r in behind else "")
            for r in range(self.world_size)
        ]
        named = f"Behind: ranks {sorted(behind)}." if behind else "No rank is behind this one."
        fix = (
            "Look at the behind ranks' own output for an exception, a stop (SIGSTOP, a debugger), "
            "a call that the others make and they skip, or a slower step; raise "
            "ddpgraph.init(timeout=) only if a rank is legitimately this slow."
        )
        return "\n".join([f"{head} {named} Where every rank is:", *lines, fix]), sorted(behind)

    def _behind(self, beats: dict[int, _Beat], hang: _Hang) -> dict[int, str]:
        """Ranks that are behind this one, each with a short reason."""
        now = time.time()
        behind: dict[int, str] = {}
        for r in range(self.world_size):
            beat = beats.get(r)
            if r == self.rank:
                continue
            if beat is None:
                behind[r] = "no heartbeat: not started, or exited"
            elif beat.age(now) > _STALE_S:
                behind[r] = f"no heartbeat for {beat.age(now):.1f}s: stopped or dead"
            elif beat.step < hang.step:
                behind[r] = f"at step {beat.step}"
            elif beat.step == hang.step and not beat.inside:
                behind[r] = f"not in a watched call at step {beat.step}"
        return behind

    def _behind_text(self, beats: dict[int, _Beat], hang: _Hang) -> str:
        now = time.time()
        return "; ".join(
            f"rank {r} ({why}; " + (beats[r].describe(now) if r in beats else "no heartbeat") + ")"
            for r, why in sorted(self._behind(beats, hang).items())
        )

    def _agree(self, mine: dict[str, Any]) -> dict[str, Any]:
        """The first verdict written wins, so that every rank prints the same one."""
        text = json.dumps(mine)
        try:
            stored = self._store.compare_set(_VERDICT, "", text)
            self._keys.add(_VERDICT)
            return dict(json.loads(stored))
        except Exception:  # the store is gone: this rank's own verdict is all there is
            return mine

    def _peer_verdict(self) -> bool:
        """Adopt a verdict another rank wrote (this rank may not be stuck itself)."""
        try:
            if not self._store.check([_VERDICT]):
                return False
            agreed = json.loads(self._store.get(_VERDICT))
        except Exception:
            return False
        with self._declare_lock:
            if self._verdict is None:
                self._verdict, self._missing = agreed["report"], tuple(agreed["missing"])
                self._verdict_at = time.monotonic()
                self._keys.add(_VERDICT)
        return True

    def _acknowledge_verdict(self) -> None:
        """Wait (briefly) until the live peers have the verdict too, then go on."""
        beats = self._read_beats() or {}
        now = time.time()
        live = [r for r, b in beats.items() if b.age(now) <= _STALE_S] + [self.rank]
        self._keys.add(f"{_VERDICT}-read/log")
        with contextlib.suppress(Exception):  # a peer that died meanwhile is not waited for
            store_barrier(
                self._store,
                f"{_VERDICT}-read",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=_VERDICT_READ_S),
                ranks=sorted(set(live)),
                what="ddpgraph watchdog (verdict read)",
                fix="",
            )

    def _exit_if_undelivered(self, now: float) -> None:
        if self._delivered.is_set() or now - self._verdict_at < _DELIVERY_GRACE_S:
            return
        sys.stderr.write(
            f"{self._verdict}\nddpgraph watchdog: rank {self.rank}'s main thread is still "
            f"blocked {_DELIVERY_GRACE_S:g}s after the verdict; exiting with status "
            f"{EXIT_CODE} instead of hanging.\n"
        )
        sys.stderr.flush()
        self._stop.set()  # (when _exit is a test's recorder, the thread ends here)
        self._exit(EXIT_CODE)

    def _abort_communicators(self) -> None:
        """torch's own abort (ProcessGroupNCCL: ncclCommAbort, which also ends NCCL kernels that
        wait for a peer); a no-op on gloo (measured: a blocked gloo call stays blocked). The
        groups stay registered: the main thread's next call fails instead of finding torch's
        bookkeeping changed under it. Run on a thread of its own and waited for only briefly:
        an abort that blocks must not keep this rank from exiting."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        aborter = threading.Thread(target=_abort_all_groups, name="ddpgraph-abort", daemon=True)
        aborter.start()
        aborter.join(timeout=_ABORT_WAIT_S)

    # ---- heartbeats ----

    def _position(self) -> tuple[str, int, str | None, bool, float]:
        now = time.monotonic()
        stack = self._stack
        try:
            phase, step, site, began = stack[-1]
            return phase, step, site, True, now - began
        except IndexError:
            phase, step, site, _, left = self._last
            return phase, max(step, self.step), site, False, now - left if left else 0.0

    def _publish(self) -> None:
        phase, step, site, inside, for_s = self._position()
        replay = self._replay
        if not inside and replay is not None and replay[2] >= self._last[4]:
            phase, step, site, for_s = "replay", replay[1], None, time.monotonic() - replay[2]
        self._beats += 1
        beat = {
            "step": step,
            "phase": phase,
            "site": site,
            "inside": inside,
            "for": round(for_s, 3),
            "time": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "n": self._beats,
        }
        key = _beat_key(self.rank)
        try:
            self._store.set(key, json.dumps(beat))
            self._keys.add(key)
        except Exception:
            pass  # the store is gone or slow: the next beat tries again

    def _read_beats(self) -> dict[int, _Beat] | None:
        """Every rank's last heartbeat (missing ranks absent), or None if the store is gone."""
        keys = [_beat_key(r) for r in range(self.world_size)]
        try:
            if self._store.check(keys):
                raws = dict(zip(range(self.world_size), self._store.multi_get(keys), strict=True))
            else:
                raws = {r: self._store.get(k) for r, k in enumerate(keys) if self._store.check([k])}
        except Exception:
            return None
        beats = {}
        for r, raw in raws.items():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                d = json.loads(raw)
                beats[r] = _Beat(
                    r, d["step"], d["phase"], d["site"], d["inside"], d["for"], d["time"],
                    d["host"], d["pid"],
                )  # fmt: skip
        return beats


_VERDICT = "verdict"


def _abort_all_groups() -> None:
    with contextlib.suppress(Exception):
        for group in reversed(list(dist.distributed_c10d._world.pg_map)):
            abort = getattr(group, "abort", None)
            if abort is not None:
                with contextlib.suppress(Exception):
                    abort()


def _beat_key(rank: int) -> str:
    return f"beat/{rank}"


def _thread_store(store: dist.Store) -> dist.Store:
    try:
        clone = store.clone()  # type: ignore[attr-defined]  # not in the stubs
    except Exception:  # a store type without clone: share it (its calls are thread-safe in c10d)
        return store
    with contextlib.suppress(Exception):
        clone.set_timeout(timedelta(seconds=_STORE_CALL_S))
    return clone


# ---- start / stop (ddpgraph.init / ddpgraph.shutdown) ----


def start(
    store: dist.Store,
    *,
    rank: int,
    world_size: int,
    timeout: timedelta,
    stall_warning: timedelta | None,
    store_host: str,
) -> Watchdog:
    """Start this rank's watchdog on ``store`` (a prefix of its own); stops any earlier one."""
    stop()
    dog = Watchdog(
        store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        stall_warning=stall_warning or default_stall_warning(timeout),
        store_host=store_host,
    )
    dog.start()
    _ACTIVE.value = dog
    return dog


def stop() -> None:
    """Stop the running watchdog, if any: no thread and none of its store keys remain."""
    dog, _ACTIVE.value = _ACTIVE.value, None
    if dog is not None:
        dog.stop()
