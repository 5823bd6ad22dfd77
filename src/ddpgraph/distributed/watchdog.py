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
writes, a list append/pop and one ``time.monotonic()``: no lock, no store I/O (about 0.4 us);
:meth:`~Watchdog.after_replay` adds one ``cudaEventRecord`` (a few us).

What it says (the stall warning, the verdict, the note on a peer's exit) is written by the pure
functions of :mod:`ddpgraph.distributed.watchdog_messages`, from the records this module gathers.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from .._globals import Global, process_global
from .._log import get_logger
from ..errors import CollectiveTimeout
from .store import store_barrier
from .watchdog_messages import (
    NOTE_PREFIX,
    Hang,
    Heartbeat,
    Observer,
    Verdict,
    gone_note,
    stall_warning,
    undelivered,
    verdict_report,
)

if TYPE_CHECKING:
    import torch

__all__ = ["ACTIVE", "EXIT_CODE", "StepCount", "Watchdog", "active", "replay_hook", "watch"]

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

_ACTIVE: Global[Watchdog | None] = process_global(
    "watchdog.active", lambda: None, reset_at_shutdown=True
)


# the running watchdog as ``ACTIVE.value`` (what :func:`active` returns): a replayed step reads
# the attribute, no call
ACTIVE = _ACTIVE


def active() -> Watchdog | None:
    """The running :class:`Watchdog`, or None (``watchdog=False``, or no :func:`ddpgraph.init`)."""
    return _ACTIVE.value


class StepCount(Protocol):
    steps: int  # the current step number (a TrainStep's report has it)


def replay_hook(count: StepCount) -> Callable[[torch.cuda.Stream], None]:
    """A replay hook: the running watchdog records an event after each replay and names
    ``count.steps`` if it never completes (NCCL's own watchdog cannot see inside a graph)."""

    def hook(stream: torch.cuda.Stream) -> None:
        watchdog = _ACTIVE.value
        if watchdog is not None:
            watchdog.after_replay(stream, count.steps)

    return hook


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


class _Watched(NamedTuple):
    """A watched call on this rank's stack: written by the main thread, read by the thread."""

    phase: str
    step: int
    site: str | None
    began: float  # monotonic


class _Event(Protocol):
    """What the thread needs of a CUDA event: ``query()``, which never blocks."""

    def query(self) -> bool: ...


class _Replay(NamedTuple):
    """The last replay: the CUDA event recorded after it, its step, and when (monotonic)."""

    event: _Event
    step: int
    recorded: float


# A NamedTuple's own constructor is a call of Python code (~0.2 us); tuple.__new__ makes the same
# record in half of that (enter() is on every step's path).
_record = tuple.__new__


class Watchdog:
    """One rank's hang detector; made by :func:`ddpgraph.init`, found with :func:`active`.

    The main thread calls :meth:`enter` / :meth:`leave` around each watched call and
    :meth:`after_replay` after each graph replay; everything else happens on the thread.
    """

    def __init__(
        self,
        store: Store,
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
        self._me = Observer(rank, world_size, self.timeout_s, store_host, _STALE_S)
        # hot-path state: written by the main thread, read by the watchdog thread
        self._stack: list[_Watched] = []
        # the last watched call that returned, and when (monotonic; 0.0: none has yet)
        self._last: tuple[_Watched, float] = (_Watched("start", 0, None, 0.0), 0.0)
        self._replay: _Replay | None = None
        self._event: torch.cuda.Event | None = None
        self._record_event: Callable[[torch.cuda.Event, torch.cuda.Stream], None] | None = None
        # verdict state
        self._verdict: Verdict | None = None
        self._verdict_at = 0.0
        self._delivered = threading.Event()
        self._declare_lock = threading.Lock()
        self._warned_since: float | None = None
        self._thread_error_logged = False
        # the store's host (rank 0 in a plain env:// job) has exited: every later store call
        # would fail again, and torch logs each failure with ~20 lines of C++ frames
        self._store_gone = False
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
        with the verdict if a hang was already declared. Cost: ~0.4 us, no lock, no I/O."""
        if self._verdict is not None:
            raise self._error()
        self.step = step
        self._stack.append(_record(_Watched, (phase, step, site, time.monotonic())))

    def leave(self) -> None:
        """The innermost watched call returned (or raised)."""
        stack = self._stack
        if stack:
            self._last = (stack.pop(), time.monotonic())

    def after_replay(self, stream: torch.cuda.Stream, step: int) -> None:
        """Record one CUDA event on ``stream`` after a replay of ``step``; the thread polls it
        (``event.query()``, never blocking) and declares a hang if it is not complete after
        ``timeout``. Cost: one ``cudaEventRecord``."""
        event = self._event
        if event is None:
            event = self._new_event(stream)
        self._record_event(event, stream)  # type: ignore[misc]  # set with the event
        self.step = step
        self._replay = _record(_Replay, (event, step, time.monotonic()))

    def _new_event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        import torch

        with torch.cuda.device(stream.device):
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        # torch.cuda.Event.record's C half: the Python wrapper only fills in a stream not given
        self._record_event = torch._C._CudaEventBase.record
        return self._event

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
            self._verdict is None or str(exc) == self._verdict.report
        ):
            return  # a timeout of its own (an object collective's timeout=), or ours already
        if any(str(n).startswith(NOTE_PREFIX) for n in getattr(exc, "__notes__", ())):
            return  # an inner watched call has noted it already
        if self._verdict is None:
            call, left = self._last
            if left - call.began >= _TIMEOUT_FRACTION * self.timeout_s:
                self._declare(
                    Hang("call", call.phase, call.step, call.site, left - call.began, call.began)
                )
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
        found = self._verdict
        return CollectiveTimeout(found.report, found.missing) if found else CollectiveTimeout("")

    def _gone_note(self) -> str:
        """Which ranks stopped beating: read twice, a heartbeat period and more apart."""
        first = second = self._read_beats()
        if first is not None:
            time.sleep(_HEARTBEAT_S * 2.5)
            second = self._read_beats()
        return gone_note(self._me, first, second, time.time())

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
            get_logger().error("%s", self._verdict.report if self._verdict else "")
            self._abort_communicators()
            self._acknowledge_verdict()

    def _local_hang(self, now: float) -> Hang | None:
        hang = None
        stack = self._stack
        try:
            oldest, innermost = stack[0], stack[-1]
        except IndexError:  # empty, or emptied while read
            pass
        else:
            hang = Hang(
                "call", innermost.phase, innermost.step, innermost.site,
                now - oldest.began, oldest.began,
            )  # fmt: skip
        replay = self._replay
        if replay is not None and (hang is None or now - replay.recorded > hang.age):
            age = now - replay.recorded
            if age >= self.stall_s and not replay.event.query():
                hang = Hang("replay", "replay", replay.step, None, age, replay.recorded)
        return hang

    def _warn_stall(self, hang: Hang) -> None:
        text = stall_warning(self._me, hang, self._read_beats(), time.time())
        get_logger().warning("%s", text)

    def _declare(self, hang: Hang) -> None:
        """Build the verdict (or adopt a peer's), log it, abort the communicators."""
        with self._declare_lock:
            if self._verdict is not None:
                return
            mine = verdict_report(self._me, hang, self._read_beats(), time.time())
            self._verdict = self._agree(mine)
            self._verdict_at = time.monotonic()
        get_logger().error("%s", self._verdict.report)
        self._abort_communicators()
        self._acknowledge_verdict()

    def _agree(self, mine: Verdict) -> Verdict:
        """The first verdict written wins, so that every rank prints the same one."""
        if self._store_gone:
            return mine
        try:
            stored = self._store.compare_set(_VERDICT, "", mine.to_json())
            self._keys.add(_VERDICT)
            return Verdict.from_json(stored)
        except Exception as exc:  # the store is gone: this rank's own verdict is all there is
            self._note_store_failure(exc)
            return mine

    def _peer_verdict(self) -> bool:
        """Adopt a verdict another rank wrote (this rank may not be stuck itself)."""
        if self._store_gone:
            return False
        try:
            if not self._store.check([_VERDICT]):
                return False
            agreed = Verdict.from_json(self._store.get(_VERDICT))
        except Exception as exc:
            self._note_store_failure(exc)
            return False
        with self._declare_lock:
            if self._verdict is None:
                self._verdict = agreed
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
        report = self._verdict.report if self._verdict else ""
        sys.stderr.write(undelivered(self._me, report, _DELIVERY_GRACE_S, EXIT_CODE))
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

    def _heartbeat(self) -> Heartbeat:
        """Where this rank is: the innermost watched call, else the last replay or call."""
        now = time.monotonic()
        replay, (last, left) = self._replay, self._last
        try:
            call = self._stack[-1]
        except IndexError:  # between watched calls
            if replay is not None and replay.recorded >= left:
                phase, step, site, for_s = "replay", replay.step, None, now - replay.recorded
            else:
                phase, step, site = last.phase, max(last.step, self.step), last.site
                for_s = now - left if left else 0.0
            inside = False
        else:
            phase, step, site, inside, for_s = (
                call.phase,
                call.step,
                call.site,
                True,
                now - call.began,
            )
        self._beats += 1
        return Heartbeat(
            step, phase, site, inside, for_s, time.time(), socket.gethostname(), os.getpid(),
            self._beats,
        )  # fmt: skip

    def _publish(self) -> None:
        if self._store_gone:
            return
        key = _beat_key(self.rank)
        try:
            self._store.set(key, self._heartbeat().to_json())
            self._keys.add(key)
        except Exception as exc:
            self._note_store_failure(exc)  # gone: stop; slow: the next beat tries again

    def _note_store_failure(self, exc: BaseException) -> None:
        import torch.distributed as dist

        network_error = getattr(dist, "DistNetworkError", ())
        if isinstance(exc, network_error):
            self._store_gone = True

    def _read_beats(self) -> dict[int, Heartbeat] | None:
        """Every rank's last heartbeat (missing ranks absent), or None if the store is gone."""
        if self._store_gone:
            return None
        keys = [_beat_key(r) for r in range(self.world_size)]
        try:
            if self._store.check(keys):
                raws = dict(zip(range(self.world_size), self._store.multi_get(keys), strict=True))
            else:
                raws = {r: self._store.get(k) for r, k in enumerate(keys) if self._store.check([k])}
        except Exception as exc:
            self._note_store_failure(exc)
            return None
        beats = {}
        for r, raw in raws.items():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                beats[r] = Heartbeat.from_json(raw)
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


def _thread_store(store: Store) -> Store:
    try:
        clone: Store = store.clone()  # type: ignore[attr-defined, unused-ignore]  # not in the stubs
    except Exception:  # a store type without clone: share it (its calls are thread-safe in c10d)
        return store
    with contextlib.suppress(Exception):
        clone.set_timeout(timedelta(seconds=_STORE_CALL_S))
    return clone


# ---- start / stop (ddpgraph.init / ddpgraph.shutdown) ----


def start(
    store: Store,
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
