"""One-call distributed set-up: read the launcher's environment, bind the device, check it.

``init()`` turns torchrun's environment (or none: a single process) into a process group whose
every rank is bound to its own device *before* any CUDA work, and proves that no two ranks of a
host share a GPU before NCCL is touched. Everything else in ddpgraph relies on that binding.
"""

from __future__ import annotations

import contextlib
import gc
import numbers
import os
import socket
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist

from . import watchdog as _watchdog
from ._log import configure_logging
from .errors import CollectiveTimeout, ConfigError, DeviceConflictError, DistributedStateError

__all__ = ["Runtime", "check_unique_devices", "get_runtime", "group_device", "init", "shutdown"]

DEFAULT_TIMEOUT = timedelta(minutes=10)
_BACKENDS = ("nccl", "gloo")
# How long ranks wait for every peer to have read the device list before going on or
# raising: long enough for a loaded machine, short enough not to matter when a peer died.
_ALL_READ_TIMEOUT = timedelta(seconds=30)
_MAX_TIMEOUT_S = 10**9  # about 31 years: beyond it a timeout is a typo, and timedelta overflows


@dataclass(frozen=True)
class LaunchEnv:
    """The launcher's view of this process, validated."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launched: bool  # False: no launcher, a single process of world size 1


@dataclass(frozen=True)
class Runtime:
    """This process's place in the job. Returned by :func:`init`; a context manager that shuts down."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    timeout: timedelta

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __enter__(self) -> Runtime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        shutdown()


@dataclass
class _State:
    runtime: Runtime
    requested: tuple[str | None, timedelta, timedelta | None, bool]  # backend, timeout, stall, dog
    owns_group: bool


_state: _State | None = None
_init_count = 0


def get_runtime() -> Runtime | None:
    """The :class:`Runtime` of the current :func:`init`, or None before it / after :func:`shutdown`."""
    return _state.runtime if _state is not None else None


def init(
    *,
    backend: str | None = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    stall_warning: float | timedelta | None = None,
    watchdog: bool = True,
) -> Runtime:
    """Set up this rank: process group, device binding, device-uniqueness check. Call on every rank.

    Reads torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT``; with none of them this is a single process of world size
    1 whose collectives still work. ``backend`` defaults to ``"nccl"`` where CUDA is present and
    ``"gloo"`` otherwise. On CUDA the rank is bound to ``cuda:LOCAL_RANK`` before any CUDA work, and
    the ranks exchange GPU UUIDs through the rendezvous store so that two ranks of one host on one
    GPU raise :class:`DeviceConflictError` on every rank instead of hanging inside NCCL.

    A repeated call with the same arguments returns the same :class:`Runtime`; one with other
    arguments raises :class:`DistributedStateError`. If the application already created the default
    process group, ``init`` adopts it (and leaves it to the application to destroy).

    ``watchdog=True`` (default) starts :mod:`ddpgraph.watchdog` on this rank: a watched call (a
    TrainStep step, an object collective, ``watchdog.watch(...)``) or a graph replay not done
    after ``timeout`` ends the job with :class:`CollectiveTimeout` naming the ranks behind and
    where each rank is, instead of hanging; after ``stall_warning`` (default a quarter of
    ``timeout``, at most 60 s) one warning names the slow ranks.
    """
    global _state
    limit = as_timedelta(timeout, caller="ddpgraph.init")
    stall = _stall_warning(stall_warning, limit, watchdog)
    requested = (backend, limit, stall, watchdog)
    if _state is not None:
        if _state.requested != requested:
            raise DistributedStateError(
                f"ddpgraph.init() was already called with {_describe_request(_state.requested)}; "
                f"this call asks {_describe_request(requested)}. Call ddpgraph.shutdown() "
                "first, or pass the same arguments."
            )
        return _state.runtime
    if dist.is_available() and dist.is_initialized():
        runtime, store = _adopt_group(limit)
        _state = _State(runtime, requested, owns_group=False)
    else:
        runtime, store = _new_group(backend, limit)
        _state = _State(runtime, requested, owns_group=True)
    configure_logging(runtime.rank)
    if watchdog:
        _watchdog.start(
            dist.PrefixStore(f"{_next_store_key('watchdog')}", store),
            rank=runtime.rank,
            world_size=runtime.world_size,
            timeout=limit,
            stall_warning=stall,
            store_host=_store_host(),
        )
    return runtime


def _describe_request(requested: tuple[str | None, timedelta, timedelta | None, bool]) -> str:
    backend, timeout, stall, watchdog = requested
    return f"backend={backend!r}, timeout={timeout}, stall_warning={stall}, watchdog={watchdog}"


def _stall_warning(
    value: float | timedelta | None, timeout: timedelta, watchdog: bool
) -> timedelta | None:
    if not isinstance(watchdog, bool):
        raise ConfigError(f"ddpgraph.init: watchdog={watchdog!r} must be True or False.")
    if value is None:
        return None
    stall = as_timedelta(value, caller="ddpgraph.init(stall_warning=)")
    if stall >= timeout:
        raise ConfigError(
            f"ddpgraph.init: stall_warning={stall.total_seconds():g}s is not shorter than "
            f"timeout={timeout.total_seconds():g}s, so it would never warn; pass a shorter "
            "stall_warning= (or None for a quarter of the timeout)."
        )
    return stall


def _store_host() -> str:
    """Who hosts the rendezvous store, for a report written when it stops answering."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun's agent hosts it, so the agent may have ended the job"
    return "in a plain env:// job rank 0 hosts it, so rank 0 has probably exited or is stopped"


def shutdown() -> None:
    """Destroy the process group that :func:`init` made (call on every rank); harmless if none.

    An ``async_save`` still writing is waited for first (it uses a group of this process's);
    then the watchdog stops, leaving no thread and no store key behind.

    Then it runs the cyclic garbage collector: a DDP model (always in a reference cycle) that
    the caller no longer holds is freed with its process group now, not during interpreter
    finalization, where torch's gloo threads can abort a job that succeeded ("terminate called
    without an active exception"). So let training objects go out of scope (return from the
    function that built them) before calling shutdown.
    """
    global _state
    if "ddpgraph.checkpoint" in sys.modules:  # only a process that saved can have a save pending
        sys.modules["ddpgraph.checkpoint"].wait_for_pending_save()
    _watchdog.stop()  # a watchdog must not report the group's end as a hang
    state, _state = _state, None
    if state is None or not state.owns_group or not dist.is_initialized():
        return
    # No barrier first: a rank that skipped a collective would have it pair with the peer's
    # pending one and hang both; destroying the group makes that peer fail at once instead.
    dist.destroy_process_group()
    # DDP sits in a reference cycle and holds the process group: collected only by the cyclic
    # GC, often during interpreter finalization, where gloo's threads can abort the process.
    # Collect now, so that a DDP model the caller no longer holds takes the group with it.
    gc.collect()


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Validate the launcher variables; raise :class:`ConfigError` naming the bad one and the fix."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        if env.get("LOCAL_RANK", "0").strip() not in ("", "0"):
            # e.g. a variable left over from a parent job: say so rather than silently use cuda:0
            warnings.warn(
                f"LOCAL_RANK={env['LOCAL_RANK']} is set but RANK and WORLD_SIZE are not, so "
                "ddpgraph runs a single process on device 0 and ignores it; launch with torchrun "
                "to run several ranks, or unset LOCAL_RANK.",
                stacklevel=4,  # the caller of ddpgraph.init()
            )
        return LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, launched=False)
    for name in ("RANK", "WORLD_SIZE"):
        if name not in env:
            other = "WORLD_SIZE" if name == "RANK" else "RANK"
            raise ConfigError(
                f"{other} is set but {name} is not; launch with torchrun, which sets both, "
                "or unset both to run a single process."
            )
    world_size = _env_int(env, "WORLD_SIZE")
    rank = _env_int(env, "RANK")
    if world_size < 1:
        raise ConfigError(f"WORLD_SIZE={world_size} must be at least 1.")
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size}).")
    if "LOCAL_RANK" not in env and world_size > 1:
        raise ConfigError(
            "LOCAL_RANK is not set, so the device of this rank is unknown; launch with torchrun "
            "(or `ddpgraph launch`), which sets it, or set LOCAL_RANK yourself."
        )
    local_rank = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    local_world_size = (
        _env_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size
    )
    if not 1 <= local_world_size <= world_size:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={local_world_size} must be between 1 and WORLD_SIZE={world_size}."
        )
    if not 0 <= local_rank < local_world_size:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} is outside 0..{local_world_size - 1} "
            f"(LOCAL_WORLD_SIZE={local_world_size})."
        )
    return LaunchEnv(rank, local_rank, world_size, local_world_size, launched=True)


def _env_int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not an integer; launch with torchrun, which sets it, "
            f"or export {name} as a whole number."
        ) from None


def as_timedelta(timeout: float | timedelta, *, caller: str) -> timedelta:
    """``timeout`` (seconds or a timedelta) as a positive timedelta, or :class:`ConfigError`."""
    if isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):  # numpy too
        if not 0 < timeout < _MAX_TIMEOUT_S:  # also NaN and inf, which timedelta cannot hold
            raise ConfigError(
                f"{caller}: timeout={timeout!r} must be a positive, finite number of seconds."
            )
        value = timedelta(seconds=float(timeout))
    else:
        raise ConfigError(
            f"{caller}: timeout={timeout!r} is a {type(timeout).__name__}; pass seconds as a "
            "number, or a datetime.timedelta."
        )
    if not value.total_seconds() > 0:  # not "<= 0": NaN is refused too
        raise ConfigError(
            f"{caller}: timeout={timeout!r} must be positive (seconds or a timedelta)."
        )
    return value


def resolve_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    name = backend.lower()
    if name not in _BACKENDS:
        raise ConfigError(f"backend={backend!r} is not supported; use one of {_BACKENDS} or None.")
    if name == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "backend='nccl' needs CUDA, but torch.cuda.is_available() is False; "
            "use backend='gloo' (or None, which picks gloo here)."
        )
    return name


def bind_device(local_rank: int) -> torch.device:
    """``cuda:local_rank`` made current (before any CUDA work), or the CPU where there is no CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={visible}); start at most {count} process(es) per node "
            f"(torchrun --nproc-per-node={count})."
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def device_identity(device: torch.device) -> str | None:
    """A host-unique name of the physical device (GPU UUID), or None for the CPU, which ranks share."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def _new_group(backend: str | None, timeout: timedelta) -> tuple[Runtime, dist.Store]:
    launch = read_launch_env()
    name = resolve_backend(backend)
    device = bind_device(launch.local_rank)
    if launch.launched:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise ConfigError(f"{var} is not set; launch with torchrun, which sets it.")
        _check_port(os.environ["MASTER_PORT"])
        store = _rendezvous(launch, timeout)
    else:
        store = dist.HashStore()
    generation = _next_store_key("init")
    check_unique_devices(
        store, launch.rank, launch.world_size, device, key=generation, timeout=timeout
    )
    dist.init_process_group(
        name,
        # torch names the group "0" again after destroy_process_group, and torchrun's store
        # outlives it: without a prefix of its own, a second init would read the first group's
        # addresses (gloo: "Connection refused") or its NCCL unique id.
        store=dist.PrefixStore(f"{generation}/pg", store),
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timeout,
        device_id=device if name == "nccl" else None,
    )
    runtime = Runtime(
        launch.rank,
        launch.local_rank,
        launch.world_size,
        launch.local_world_size,
        device,
        name,
        timeout,
    )
    return runtime, store


def _rendezvous(launch: LaunchEnv, timeout: timedelta) -> dist.Store:
    try:
        store, _, _ = next(
            dist.rendezvous("env://", launch.rank, launch.world_size, timeout=timeout)
        )
    except dist.DistError as exc:
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        raise CollectiveTimeout(
            f"rank {launch.rank}: the rendezvous at {where} did not complete within "
            f"{timeout.total_seconds():g}s ({str(exc).splitlines()[0]}); check that MASTER_ADDR "
            f"resolves and is reachable from this host, that all {launch.world_size} rank(s) "
            "were started with the same MASTER_ADDR/MASTER_PORT, or raise timeout=."
        ) from exc
    return store


def _check_port(value: str) -> None:
    if not (value.strip().isdigit() and 0 < int(value) < 65536):
        raise ConfigError(
            f"MASTER_PORT={value!r} is not a TCP port (1-65535); launch with torchrun, which "
            "sets it, or set a free port number."
        )


def _adopt_group(timeout: timedelta) -> tuple[Runtime, dist.Store]:
    launch = read_launch_env()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if launch.launched and (launch.rank, launch.world_size) != (rank, world_size):
        raise ConfigError(
            f"the existing process group has rank {rank} of {world_size}, but RANK={launch.rank} "
            f"and WORLD_SIZE={launch.world_size}; create the group from the same environment."
        )
    device = _adopted_device()
    backend = str(dist.get_backend())
    store = dist.distributed_c10d._get_default_store()
    if "nccl" in backend.lower():
        # The application bound (or forgot to bind) the device itself: check it like init()
        # does, so that two ranks on one GPU fail here, naming them, instead of hanging in NCCL.
        # (gloo ranks may share a GPU for compute: their collectives never touch it.)
        check_unique_devices(
            store,
            rank,
            world_size,
            device,
            key=_next_store_key("adopt"),
            timeout=timeout,
        )
    runtime = Runtime(
        rank,
        launch.local_rank,
        world_size,
        launch.local_world_size,
        device,
        backend,
        timeout,
    )
    return runtime, store


def _adopted_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    assert dist.group.WORLD is not None
    return group_device(dist.group.WORLD)


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The CUDA device ``group`` is bound to (``device_id=``), else the current CUDA device."""
    bound = getattr(group, "bound_device_id", None)
    if bound is not None and bound.type == "cuda":
        return torch.device(bound)
    return torch.device("cuda", torch.cuda.current_device())


def _next_store_key(kind: str) -> str:
    """A store key no earlier init or adoption of this process used (torchrun's store outlives
    process groups)."""
    global _init_count
    _init_count += 1
    return f"ddpgraph/{_restart_tag()}/{kind}{_init_count}"


def _restart_tag() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return f"{run_id}/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def check_unique_devices(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    key: str,
    timeout: timedelta,
) -> None:
    """Raise :class:`DeviceConflictError` on every rank if two ranks of a host share a GPU.

    Each rank sends ``rank, hostname, GPU UUID`` through a :func:`store_barrier` and waits until
    all have; the store, not a collective, carries this so that a conflict is found before NCCL
    can hang on it. Must be called by all ``world_size`` ranks with the same ``key``.
    """
    if world_size == 1:
        return
    identity = device_identity(device) or "-"
    arrived = store_barrier(
        store,
        f"{key}/devices",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        payload=f"{rank}\t{socket.gethostname()}\t{identity}\t{device}",
        what="ddpgraph.init (device check)",
        fix="start every rank, or raise timeout=",
    )
    entries = _parse_devices(arrived.payloads.values())
    # Rank 0 may host the store (a plain env:// job): were it to raise or return and exit at
    # once, a slower peer still waiting for the list would fail with "Connection closed" instead.
    # (a peer or the store gone since: raise this rank's own verdict regardless)
    with contextlib.suppress(Exception):
        store_barrier(
            store,
            f"{key}/all-read",
            rank=rank,
            world_size=world_size,
            timeout=_ALL_READ_TIMEOUT,
            what="ddpgraph.init (device list read)",
            fix="",
        )
    raise_on_device_conflicts(entries)


# ---- the one store barrier ----

# A waiting rank re-reads the arrival log at growing intervals, from 1 ms (ranks usually arrive
# within milliseconds of each other) to 0.1 s: that bounds both the store's load (<= 10 reads a
# second per waiting rank) and how old the verdict of a rank whose store went away can be.
# (A store.wait() with a short timeout would wake at once, but torch logs a warning for each.)
_BARRIER_FIRST_POLL_S = 0.001
_BARRIER_MAX_POLL_S = 0.1
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
    store: dist.Store,
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
            f"({_first_line(exc)}); in a plain env:// job rank 0 hosts it, and it may have "
            "exited after timing out while this rank was late" + (f"; {fix}." if fix else "."),
        ) from exc
    seen = _Verdict(False, (), {})
    pause = _BARRIER_FIRST_POLL_S
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
        pause = min(2 * pause, _BARRIER_MAX_POLL_S)
    if not seen.done:
        raise _barrier_timeout(seen, expected, rank, timeout, what, fix, None)
    return BarrierResult(seen.payloads, seen.arrived[-1], time.monotonic() - start)


def forget_barrier(store: dist.Store, key: str) -> None:
    """Delete a barrier's keys once every rank is known to be past it (e.g. at the next one)."""
    with contextlib.suppress(Exception):
        store.delete_key(f"{key}/log")


def _give_up(
    store: dist.Store, log_key: str, rank: int, expected: frozenset[int], seen: _Verdict
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


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


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
            f"({_first_line(store_error)}; in a plain env:// job rank 0 hosts it and may have "
            "exited after its own timeout); at this rank's last read"
        )
    else:
        when = f"{what} timed out after {limit}:"
    return CollectiveTimeout(
        f"{when} ranks {missing} had not arrived (ranks {arrived} had)"
        + (f"; {fix}." if fix else "."),
        missing=missing,
    )


def _parse_devices(lines: Iterable[str]) -> dict[int, tuple[str, str, str]]:
    entries: dict[int, tuple[str, str, str]] = {}
    for line in lines:
        rank, host, identity, device = line.split("\t")
        entries[int(rank)] = (host, identity, device)
    return entries


def raise_on_device_conflicts(entries: Mapping[int, tuple[str, str, str]]) -> None:
    """``entries``: rank -> (hostname, device identity or "-", device). Raise if any GPU is shared."""
    users: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rank, (host, identity, _) in sorted(entries.items()):
        if identity != "-":
            users[(host, identity)].append(rank)
    clashes = [(key, ranks) for key, ranks in users.items() if len(ranks) > 1]
    if not clashes:
        return
    parts = []
    for (host, identity), ranks in clashes:
        devices = sorted({entries[r][2] for r in ranks})
        parts.append(
            f"ranks {', '.join(map(str, ranks))} on host {host} all use {'/'.join(devices)} "
            f"({identity})"
        )
    raise DeviceConflictError(
        "; ".join(parts) + ". Each rank of a host needs its own GPU: call ddpgraph.init() or "
        "torch.cuda.set_device(LOCAL_RANK) before any collective, and do not give two ranks "
        "the same CUDA_VISIBLE_DEVICES."
    )
