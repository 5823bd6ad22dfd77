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
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, Store
from torch.distributed.rendezvous import rendezvous

from .. import _globals
from .._globals import Global, process_global
from .._log import configure_logging, get_logger
from ..errors import (
    CollectiveTimeout,
    ConfigError,
    DeviceConflictError,
    DistributedStateError,
    first_line,
)
from . import watchdog as _watchdog
from .store import store_barrier

__all__ = [
    "Runtime",
    "check_unique_devices",
    "get_runtime",
    "group_device",
    "init",
    "on_shutdown",
    "shutdown",
]

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


_STATE: Global[_State | None] = process_global(
    "runtime.state", lambda: None, reset_at_shutdown=True
)
# store keys stay unique across inits of one process: torchrun's store outlives process groups
_STORE_KEYS: Global[int] = process_global("runtime.store_keys", int, reset_at_shutdown=False)
_SHUTDOWN_HOOKS: Global[list[Callable[[], object]]] = process_global(
    "runtime.shutdown_hooks", list, reset_at_shutdown=False
)


def get_runtime() -> Runtime | None:
    """The :class:`Runtime` of the current :func:`init`, or None before it / after :func:`shutdown`."""
    state = _STATE.value
    return state.runtime if state is not None else None


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

    ``watchdog=True`` (default) starts :mod:`ddpgraph.distributed.watchdog` on this rank: a watched call (a
    TrainStep step, an object collective, ``watchdog.watch(...)``) or a graph replay not done
    after ``timeout`` ends the job with :class:`CollectiveTimeout` naming the ranks behind and
    where each rank is, instead of hanging; after ``stall_warning`` (default a quarter of
    ``timeout``, at most 60 s) one warning names the slow ranks.
    """
    limit = as_timedelta(timeout, caller="ddpgraph.init")
    stall = _stall_warning(stall_warning, limit, watchdog)
    requested = (backend, limit, stall, watchdog)
    current = _STATE.value
    if current is not None:
        if current.requested != requested:
            raise DistributedStateError(
                f"ddpgraph.init() was already called with {_describe_request(current.requested)}; "
                f"this call asks {_describe_request(requested)}. Call ddpgraph.shutdown() "
                "first, or pass the same arguments."
            )
        return current.runtime
    if dist.is_available() and dist.is_initialized():
        runtime, store = _adopt_group(limit)
        _STATE.value = _State(runtime, requested, owns_group=False)
    else:
        runtime, store = _new_group(backend, limit)
        _STATE.value = _State(runtime, requested, owns_group=True)
    configure_logging(runtime.rank)
    if watchdog:
        _watchdog.start(
            PrefixStore(f"{_next_store_key('watchdog')}", store),
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

    First the :func:`on_shutdown` hooks run (a ``save_checkpoint_async`` still writing is waited
    for: it uses a group of this process's); then the watchdog stops, leaving no thread and no
    store key behind, and every process-global value that belongs to one ``init()`` is reset. A
    hook's error is raised after all of that, so a failed save never leaves a half shut-down
    process.

    Then it runs the cyclic garbage collector: a DDP model (always in a reference cycle) that
    the caller no longer holds is freed with its process group now, not during interpreter
    finalization, where torch's gloo threads can abort a job that succeeded ("terminate called
    without an active exception"). So let training objects go out of scope (return from the
    function that built them) before calling shutdown.
    """
    try:
        _run_shutdown_hooks()
    finally:
        _watchdog.stop()  # a watchdog must not report the group's end as a hang
        state = _STATE.value
        _globals.reset_at_shutdown()
        if state is not None and state.owns_group and dist.is_initialized():
            _destroy_group()


def on_shutdown(hook: Callable[[], object]) -> Callable[[], object]:
    """Run ``hook()`` at the start of every :func:`shutdown`, while the process group still
    exists, before the watchdog stops; hooks run in the order registered, each once however
    often it is registered. Returns ``hook``, so it also serves as a decorator.

    The modules that keep work in flight (checkpoint's async save) register here, so that
    runtime needs to know none of them.
    """
    if hook not in _SHUTDOWN_HOOKS.value:
        _SHUTDOWN_HOOKS.value.append(hook)
    return hook


def _run_shutdown_hooks() -> None:
    """Every hook, even after one failed; the first failure is raised at the end."""
    errors: list[BaseException] = []
    for hook in list(_SHUTDOWN_HOOKS.value):
        try:
            hook()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _destroy_group() -> None:
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


def _no_graph_registration_with_expandable_segments() -> None:
    """NCCL registers the buffers of captured collectives; with ``expandable_segments:True``
    that crashes replays (illegal memory access, pytorch#158029). NCCL reads the variable when
    the communicator is made, so it is set here, before the group exists, unless the user chose."""
    if expandable_segments_on() and "NCCL_GRAPH_REGISTER" not in os.environ:
        os.environ["NCCL_GRAPH_REGISTER"] = "0"
        get_logger().info("NCCL_GRAPH_REGISTER=0: expandable_segments:True is on (pytorch#158029)")


def expandable_segments_on() -> bool:
    """Whether PyTorch's CUDA allocator grows segments (``expandable_segments:True``)."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        options = os.environ.get(var, "").replace(" ", "").lower().split(",")
        if "expandable_segments:true" in options:
            return True
    return False


def _new_group(backend: str | None, timeout: timedelta) -> tuple[Runtime, Store]:
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
        store = HashStore()
    generation = _next_store_key("init")
    check_unique_devices(
        store, launch.rank, launch.world_size, device, key=generation, timeout=timeout
    )
    if name == "nccl":
        _no_graph_registration_with_expandable_segments()
    dist.init_process_group(
        name,
        # torch names the group "0" again after destroy_process_group, and torchrun's store
        # outlives it: without a prefix of its own, a second init would read the first group's
        # addresses (gloo: "Connection refused") or its NCCL unique id.
        store=PrefixStore(f"{generation}/pg", store),
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


def _rendezvous(launch: LaunchEnv, timeout: timedelta) -> Store:
    store: Store
    try:
        store, _, _ = next(rendezvous("env://", launch.rank, launch.world_size, timeout=timeout))
    except dist.DistError as exc:
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        raise CollectiveTimeout(
            f"rank {launch.rank}: the rendezvous at {where} did not complete within "
            f"{timeout.total_seconds():g}s ({first_line(exc)}); check that MASTER_ADDR "
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


def _adopt_group(timeout: timedelta) -> tuple[Runtime, Store]:
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
    _STORE_KEYS.value += 1
    return f"ddpgraph/{_restart_tag()}/{kind}{_STORE_KEYS.value}"


def _restart_tag() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return f"{run_id}/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def check_unique_devices(
    store: Store,
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
