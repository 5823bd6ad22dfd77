"""Object collectives that fail the same way on every rank instead of hanging or lying.

``all_gather_object``, ``gather_object`` and ``broadcast_object`` send Python objects between the
ranks of a group. Compared with torch's functions of similar names they

* use the safe ``"data"`` codec by default (see :mod:`ddpgraph.distributed.codec`; pickle only when asked),
* send a fixed header with every object (status, codec, size, call number, call site), so that a
  rank that cannot encode its object, is over ``max_bytes``, uses another codec or is at another
  call makes *every* rank raise the same :class:`ObjectCollectiveError`, naming the rank(s);
* take one collective where every rank's object fits in its slot next to the header, and two
  otherwise (the first round carries the sizes, checked against ``max_bytes`` before the second
  round allocates anything). The slot is 16 KiB, or larger where the group's own history
  predicts larger objects: the same calls in the same order (an evaluation loop gathering
  predictions) settle into one round each (see :class:`_SlotPredictor`);
* with ``timeout=``, name the rank(s) that never arrived (:class:`CollectiveTimeout`);
* on NCCL use the device bound to this rank (``ddpgraph.init``'s, else the group's
  ``device_id``, else the current device), after checking once per group, through the store,
  that no two ranks of a host share it (:class:`DeviceConflictError`, before any NCCL call);
* refuse at once while a CUDA stream is capturing (they synchronize with the host);
* work at world size 1 and without any process group, encoding and decoding as they would with
  more ranks, so that code tested on one process fails the same way as on eight.

Every function must be called by every rank of the group, in the same order, from the same line
(the call site is compared: ``if rank == 0: f(a) else: f(b)`` on two lines is refused; compute
the argument first and call once).
"""

from __future__ import annotations

import numbers
import os
import struct
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .._frames import frame_outside, in_modules
from .._globals import Global, process_global
from .._log import get_logger
from ..errors import (
    CollectiveTimeout,
    DistributedStateError,
    ObjectArgumentError,
    ObjectCollectiveError,
    with_explanation,
)
from . import watchdog
from .codec import CODECS, DecodeError, decode, encode_parts
from .runtime import as_timedelta, check_unique_devices, get_runtime, group_device
from .store import forget_barrier, store_barrier

__all__ = ["DEFAULT_MAX_BYTES", "all_gather_object", "broadcast_object", "gather_object"]

DEFAULT_MAX_BYTES = 1 << 30

# One slot per rank in the first round. Objects whose payload fits next to the header travel in
# that single collective; larger ones send only the header there and their bytes in a second
# round. 16 KiB holds typical metrics dicts; on gloo (2 ranks, measured) a collective of 16 KiB
# per rank costs the same as one of 100 bytes (0.25 ms); to be checked on NCCL.
_SLOT = 16384
# A learned slot (see _SlotPredictor) is at most this large: beyond it the copies cost far more
# than the second round's latency, and a wrong guess would make a small call move this much.
_MAX_LEARNED_SLOT = 64 << 20
# First-round buffers up to this size (world_size x slot) are kept between calls; larger ones are
# allocated per call, so that one big gather does not pin its buffers for the life of the group.
_KEEP_BUFFERS = 16 << 20
# The first round all-gathers every rank's slot, so for gather_object and broadcast_object a
# large slot moves world_size times the bytes that their own second round would (to one rank,
# from one rank): they learn only slots small enough for latency to dominate.
_LEARNED_CAP = {
    "all_gather_object": _MAX_LEARNED_SLOT,
    "gather_object": 256 << 10,
    "broadcast_object": 256 << 10,
}
_MAGIC = b"DGOC"
_VERSION = 1
# magic, version, status, op, codec, root, arg, seq, site hash, size, max_bytes, site text
_HEADER = struct.Struct("<4sBBBBiIQQQQ40s")
_INLINE = _SLOT - _HEADER.size
_MAX_MESSAGE = 2000  # bytes of a rank's error text sent to its peers

_OK, _ENCODE_FAILED, _TOO_LARGE, _BAD_ARGUMENT = 0, 1, 2, 3
_OPS = {1: "all_gather_object", 2: "gather_object", 3: "broadcast_object"}
_OP_IDS = {name: op for op, name in _OPS.items()}
_CODEC_NAMES = {i: name for name, i in CODECS.items()}
_in_our_modules = in_modules({__name__, "ddpgraph.distributed.torch_patch"})
_DEFAULT_CHECK_TIMEOUT = timedelta(minutes=10)
# A rank that arrives after half the timeout is named in a warning, before it becomes an error.
_STRAGGLER_FRACTION = 0.5


# ---- public API ----


def all_gather_object(
    obj: Any,
    *,
    group: dist.ProcessGroup | None = None,
    codec: str = "data",
    timeout: float | timedelta | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[Any]:
    """Every rank's ``obj``, as a list indexed by group rank (never flattened). Call on every rank.

    Each entry, this rank's included, is a decoded copy: tensors come back on the CPU.
    ``codec="data"`` (default) carries plain data, tensors and numpy arrays and never runs code
    from a peer; ``codec="pickle"`` carries anything picklable but **unpickling runs code the
    sender chooses**: use it only between trusted ranks (and a rank that cannot unpickle a
    peer's object, e.g. its class is missing there, raises alone). ``timeout`` (seconds) bounds
    the wait for the other ranks to arrive, through the rendezvous store; pass the same value on
    every rank. A rank arriving after half of it is named in a warning. Without ``timeout`` the
    process group's own timeout applies. ``max_bytes`` caps each rank's encoded object.

    Raises :class:`ObjectCollectiveError` on every rank if any rank cannot encode its object, is
    over ``max_bytes``, passed a bad argument, or is not at the same call (codec, call number,
    call site); :class:`CollectiveTimeout` naming the missing rank(s) after ``timeout``. Limit:
    a call that one rank skips in a loop, on the line that the next iteration calls again, looks
    like that next call (same site, and each rank counts its own calls): the ranks then pair
    different iterations until one runs out of calls, which ``timeout=`` turns into an error.
    """
    call = _Call.make("all_gather_object", group, codec, timeout, max_bytes, root=None)
    payloads = _exchange(call, obj, send=True)
    return [_decode_from(call, rank, data) for rank, data in enumerate(payloads)]


def gather_object(
    obj: Any,
    dst: int = 0,
    *,
    group: dist.ProcessGroup | None = None,
    codec: str = "data",
    timeout: float | timedelta | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[Any] | None:
    """Every rank's ``obj`` as a list on rank ``dst`` (a global rank, as in torch); None elsewhere.

    Call on every rank of the group. Options and errors as in :func:`all_gather_object`; every
    rank, not only ``dst``, learns of another rank's failure and raises.
    """
    call = _Call.make("gather_object", group, codec, timeout, max_bytes, root=dst)
    payloads = _exchange(call, obj, send=True)
    if call.rank != call.root:
        return None
    return [_decode_from(call, rank, data) for rank, data in enumerate(payloads)]


def broadcast_object(
    obj: Any,
    src: int = 0,
    *,
    group: dist.ProcessGroup | None = None,
    codec: str = "data",
    timeout: float | timedelta | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Any:
    """Rank ``src``'s ``obj`` (a global rank, as in torch) on every rank. Call on every rank.

    Other ranks' ``obj`` is ignored (pass None). On ``src`` the very object passed in is returned;
    elsewhere a decoded copy (tensors on the CPU). Options and errors as in
    :func:`all_gather_object`; a failure on ``src`` (e.g. it cannot encode) raises on every rank.
    """
    call = _Call.make("broadcast_object", group, codec, timeout, max_bytes, root=src)
    payloads = _exchange(call, obj, send=call.rank == call.root)
    if call.rank == call.root:
        return obj
    return _decode_from(call, call.root, payloads[call.root])


# ---- one call ----


@dataclass(frozen=True)
class _Call:
    name: str
    group: dist.ProcessGroup | None  # None: no process group at all (a single process)
    rank: int  # in the group
    world_size: int
    root: int  # group rank of src / dst; -1 for all_gather
    codec: str
    timeout: timedelta | None
    max_bytes: int
    site: tuple[int, str]  # stable hash and "file.py:line" of the caller
    arg: int = 0  # a value every rank must agree on (torch_patch sends list lengths)
    argument_error: str | None = None  # a bad argument found locally, reported by every rank

    @classmethod
    def make(
        cls,
        name: str,
        group: dist.ProcessGroup | None,
        codec: str,
        timeout: float | timedelta | None,
        max_bytes: int,
        *,
        root: int | None,
        arg: int = 0,
        argument_error: str | None = None,
    ) -> _Call:
        _refuse_while_capturing(name)
        pg, rank, world_size = _resolve_group(name, group)
        # A bad argument on one rank is sent to every rank (status _BAD_ARGUMENT) instead of being
        # raised here, where it would leave the peers waiting; stand-ins keep the header valid.
        problems = [] if argument_error is None else [argument_error]
        if codec not in CODECS:
            problems.append(f"codec={codec!r} is not one of {sorted(CODECS)}")
            codec = "data"
        if type(max_bytes) is not int or max_bytes < 1:
            problems.append(f"max_bytes={max_bytes!r} is not a positive int")
            max_bytes = DEFAULT_MAX_BYTES
        group_root = -1
        if name != "all_gather_object":  # src / dst: None is as wrong as any other non-rank
            group_root, root_problem = _group_rank(name, pg, root)
            problems += [root_problem] if root_problem else []
        # a bad timeout stays local: without one this rank would skip the arrival check
        # that its peers wait in (and the same code passes the same value on every rank)
        limit = None if timeout is None else as_timedelta(timeout, caller=name)
        return cls(
            name,
            pg,
            rank,
            world_size,
            group_root,
            codec,
            limit,
            max_bytes,
            _call_site(),
            arg,
            "; ".join(problems) or None,
        )


def _refuse_while_capturing(name: str) -> None:
    # is_initialized first: without a CUDA context nothing can be capturing, and the check stays
    # free on CPU-only machines.
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():  # type: ignore[no-untyped-call]
        raise ObjectCollectiveError(
            f"{name} was called while a CUDA stream is capturing a graph; object collectives "
            "synchronize with the host and cannot be captured. Call it outside the captured "
            "region (e.g. after TrainStep returns), on every rank."
        )


def _resolve_group(
    name: str, group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup | None, int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise DistributedStateError(
                f"{name}: group= was given but no process group is initialized; call "
                "ddpgraph.init() first."
            )
        world = os.environ.get("WORLD_SIZE", "1").strip()
        if world not in ("", "1"):
            raise DistributedStateError(
                f"{name}: no process group is initialized but WORLD_SIZE={world}; call "
                "ddpgraph.init() (or torch.distributed.init_process_group) on every rank before "
                "any collective, and none after ddpgraph.shutdown()."
            )
        return None, 0, 1
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    rank = dist.get_rank(pg)
    if rank < 0:
        raise DistributedStateError(
            f"{name}: this process (global rank {dist.get_rank()}) is not a member of the group "
            "passed as group=; call it only on that group's ranks."
        )
    return pg, rank, dist.get_world_size(pg)


def _group_rank(name: str, pg: dist.ProcessGroup | None, root: object) -> tuple[int, str | None]:
    """``root``'s rank in the group, or 0 and what is wrong with it."""
    what = "dst" if name.startswith("gather") else "src"
    if isinstance(root, bool) or not isinstance(root, numbers.Integral):
        return 0, f"{what}={root!r} is a {type(root).__name__}, not a rank (an int)"
    root = int(root)
    if pg is None:
        if root != 0:
            return 0, f"{what}={root!r}, but without a process group only 0 exists"
        return 0, None
    try:
        group_rank = dist.get_group_rank(pg, root)
    except (ValueError, RuntimeError, TypeError):
        group_rank = -1
    if not 0 <= group_rank < dist.get_world_size(pg):
        return 0, (
            f"{what}={root!r} is not a (global) rank of this group of "
            f"{dist.get_world_size(pg)}; pass the global rank of a member"
        )
    return group_rank, None


def _call_site() -> tuple[int, str]:
    """The first caller outside ddpgraph, as a hash stable across hosts (no absolute paths)."""
    frame, _ = frame_outside(_in_our_modules)
    key = (frame.f_code, frame.f_lineno)
    site = _SITES.value.get(key)
    if site is None:  # a dict hit is several times cheaper than hashing the text every call
        code = frame.f_code
        text = f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
        site = _SITES.value[key] = (zlib.crc32(f"{text}:{code.co_name}".encode()), text)
    return site


_SITES: Global[dict[tuple[object, int], tuple[int, str]]] = process_global(
    "objects.call_sites", dict, reset_at_shutdown=False
)


# ---- the exchange ----


class _Header(NamedTuple):
    status: int
    op: int
    codec: int
    root: int
    arg: int
    seq: int
    site: int
    size: int
    max_bytes: int
    where: str


@dataclass
class _GroupState:
    store_prefix: str  # this group's keys in the rendezvous store
    seq: int = 0  # object collectives this rank has entered on the group
    device: torch.device | None = None  # on NCCL: the rank's device, once checked unique
    on_cpu: bool | None = None  # the group's backend carries CPU tensors (gloo); found once
    slots: _Slots | None = None
    predictor: _SlotPredictor = field(default_factory=lambda: _SlotPredictor())


class _SlotPredictor:
    """The first round's slot size for the next call, from what every rank of the group saw.

    Every rank must pass the same slot size to the first round's all-gather, so the guess may
    use only what all ranks agree on: the headers of earlier calls, which every rank received
    alike. It keys on the call site of the previous call (agreed in its headers) and remembers
    the sizes of the calls that followed it the last two times (a new site: its first
    follower's, twice); the smaller of the two is used, so a change to larger objects must
    repeat before a call pays for a large slot (a once-per-epoch evaluation gather after many
    small metrics calls leaves the small slot for those). A loop repeating one call takes two
    collectives in its first two calls and one from the third on. A call that fails
    after its first round forgets the previous site, alike on every rank. A local argument
    (this call's site, op or ``max_bytes``) never enters the guess: ranks at different calls
    would then gather different sizes, and the mismatch would hang instead of being reported.
    """

    _REMEMBERED = 64  # sites; the oldest is dropped (the same one on every rank)

    def __init__(self) -> None:
        self.after: dict[int, tuple[int, int]] = {}  # previous site -> last two slot sizes
        self.previous: int | None = None  # the site of the last call that passed its checks
        self.pending: int | None = None  # ``previous`` as it was when this call started

    def start(self) -> int:
        """The slot for the call that begins now. Until its headers are checked, the call after
        it cannot use it: a failure leaves ``previous`` unset on every rank alike."""
        self.pending, self.previous = self.previous, None
        seen = self.after.get(self.pending) if self.pending is not None else None
        return _SLOT if seen is None else min(seen)

    def learn(self, site: int, sizes: list[int], cap: int) -> None:
        """The call at ``site`` passed its header checks with these payload sizes."""
        need = _slot_for(max(sizes), cap)
        if self.pending is not None:
            older = self.after.pop(self.pending, (need, need))[1]
            self.after[self.pending] = (older, need)
            if len(self.after) > self._REMEMBERED:
                del self.after[next(iter(self.after))]
        self.previous = site


def _slot_for(size: int, cap: int) -> int:
    """A slot that holds the header and ``size`` bytes with a little room to grow, rounded so
    that it wastes at most about 6 %; ``_SLOT`` where that is larger or over ``cap``."""
    need = _HEADER.size + size
    need += need >> 5  # a payload a few percent larger next time still fits
    if need <= _SLOT or need > cap:
        return _SLOT
    step = 1 << max(need.bit_length() - 6, 12)  # 32 to 64 steps per power of two
    return -(-need // step) * step


# Kept as long as its group: the peers count the same calls, and a call number used again would
# meet the old call's barrier log in the store.
_GROUPS: Global[weakref.WeakKeyDictionary[dist.ProcessGroup, _GroupState]] = process_global(
    "objects.groups", weakref.WeakKeyDictionary, reset_at_shutdown=False
)


def _exchange(call: _Call, obj: Any, *, send: bool) -> list[memoryview | None]:
    """Run the protocol; return each rank's payload where this rank needs it, else None."""
    status, parts = _encode(call, obj if send else None)
    if not send and status == _OK:
        parts = []  # a receiver of broadcast_object sends only its header
    size = sum(len(p) for p in parts)
    if call.group is None or call.world_size == 1:
        payload = b"".join(parts)
        slot = memoryview(_header(call, 1, status, size) + payload[:_INLINE])
        _raise_on_problems(call, [_parse_header(slot)], [slot])
        return [memoryview(payload)]
    # The watchdog's heartbeat names this call and its site; a peer that never comes is reported
    # after the init timeout even without timeout= here.
    with watchdog.watch(f"object:{call.name}", site=call.site[1]):
        state = _group_state(call.group)
        device = _device_for(call, state)
        state.seq += 1
        if call.timeout is not None:
            _await_arrivals(call, state)
        header = _header(call, state.seq, status, size)
        # From sizes checked in earlier calls (never from this call's headers, not read yet):
        # the same on every rank, and bounded before anything is allocated for it.
        slot_size = state.predictor.start()
        with _explained(call, state.seq):
            slots = _first_round(call, device, state, slot_size, header, parts, size)
        headers = [_parse_header(slots[r]) for r in range(call.world_size)]
        _raise_on_problems(call, headers, slots)
        good = [h for h in headers if isinstance(h, _Header)]
        state.predictor.learn(good[0].site, [h.size for h in good], _LEARNED_CAP[call.name])
        with _explained(call, state.seq):
            inline = slot_size - _HEADER.size
            return _second_round(call, device, headers, slots, parts, size, inline)


@contextmanager
def _explained(call: _Call, seq: int) -> Iterator[None]:
    """torch's own collective errors (a peer gone, a group timeout) with the call and its fix."""
    try:
        yield
    except (RuntimeError, TimeoutError) as exc:
        if isinstance(exc, ObjectCollectiveError | torch.OutOfMemoryError):
            raise  # ours already, or not the collective's doing
        raise ObjectCollectiveError(
            f"{call.name} at {call.site[1]} (call #{seq} on this group) failed inside torch's "
            f"collective on group rank {call.rank}: {with_explanation(exc)}"
        ) from exc


def _encode(call: _Call, obj: Any) -> tuple[int, list[bytes | memoryview]]:
    """The status and the payload's pieces (views of tensor memory: copied once, when sent)."""
    if call.argument_error is not None:
        return _BAD_ARGUMENT, [_message(call.argument_error)]
    try:
        parts = encode_parts(obj, call.codec)
    except Exception as exc:  # any failure is reported by every rank, not raised here alone
        return _ENCODE_FAILED, [_message(f"cannot encode its object: {exc}")]
    size = sum(len(p) for p in parts)
    if size > call.max_bytes:
        return _TOO_LARGE, [
            _message(
                f"its object is {size} bytes encoded, over max_bytes={call.max_bytes}; "
                "send less (e.g. reduce tensors first) or raise max_bytes="
            )
        ]
    return _OK, parts


def _message(text: str) -> bytes:
    """An error text for the peers, cut to stay readable (and well inside the first round's slot)."""
    raw = text.encode()
    return raw if len(raw) <= _MAX_MESSAGE else raw[: _MAX_MESSAGE - 6] + b" [...]"


def _write(parts: list[bytes | memoryview], into: memoryview) -> None:
    offset = 0
    for part in parts:
        into[offset : offset + len(part)] = part
        offset += len(part)


def _header(call: _Call, seq: int, status: int, size: int) -> bytes:
    site_hash, where = call.site
    return _HEADER.pack(
        _MAGIC,
        _VERSION,
        status,
        _OP_IDS[call.name],
        CODECS[call.codec],
        call.root,
        call.arg,
        seq,
        site_hash,
        size,
        call.max_bytes,
        where.encode()[-40:],
    )


def _parse_header(slot: memoryview | None) -> _Header | str:
    """The header, or a description of why it is not one (a mismatched or corrupt peer)."""
    assert slot is not None
    magic, version, *rest = _HEADER.unpack_from(slot)
    if magic != _MAGIC:
        return f"no ddpgraph header (first bytes {bytes(slot[:8]).hex()})"
    if version != _VERSION:
        return f"header version {version}, this rank speaks {_VERSION} (mixed ddpgraph versions)"
    *fields, where = rest
    return _Header._make([*fields, where.rstrip(b"\0").decode(errors="replace")])


def _device_for(call: _Call, state: _GroupState) -> torch.device:
    """CPU where the group has gloo; else the CUDA device bound to this rank, checked unique once
    per group and then kept (so a later call from a thread, whose current device is cuda:0,
    still uses it)."""
    assert call.group is not None
    if state.on_cpu is None:
        backend = str(dist.get_backend(call.group)).lower()
        state.on_cpu = "gloo" in backend or "nccl" not in backend
    if state.on_cpu:
        return torch.device("cpu")
    if state.device is None:
        device = _bound_device(call.group)
        # Through the store, not NCCL: two ranks on one GPU make NCCL hang or fail obscurely.
        try:
            check_unique_devices(
                dist.distributed_c10d._get_default_store(),
                call.rank,
                call.world_size,
                device,
                key=f"{state.store_prefix}/devices",
                timeout=call.timeout or _DEFAULT_CHECK_TIMEOUT,
            )
        except CollectiveTimeout as exc:
            raise CollectiveTimeout(
                f"{call.name} at {call.site[1]}: the first object collective on this group "
                f"checks every rank's GPU, and not all ranks arrived ({exc})",
                missing=exc.missing,
            ) from exc
        state.device = device
    return state.device


def _bound_device(group: dist.ProcessGroup) -> torch.device:
    """ddpgraph.init's device, else the group's bound device_id, else the current device."""
    runtime = get_runtime()
    if runtime is not None and runtime.device.type == "cuda":
        return runtime.device
    return group_device(group)


def _group_state(group: dist.ProcessGroup) -> _GroupState:
    groups = _GROUPS.value
    state = groups.get(group)
    if state is None:
        # The default store of a group ddpgraph.init made is prefixed per init, so these keys
        # never meet those of an earlier group of the same name in torchrun's long-lived store.
        name = dist.distributed_c10d._get_process_group_name(group)
        state = groups[group] = _GroupState(f"ddpgraph/objects/{name}")
    return state


def _await_arrivals(call: _Call, state: _GroupState) -> None:
    """Wait until every rank has entered call number ``state.seq``, or raise naming the missing
    ones (:func:`ddpgraph.distributed.store.store_barrier`).

    Only after all have arrived does any rank start the collective, so a timeout never leaves a
    peer blocked inside it; the barrier's verdict is the same on every rank.
    """
    assert call.timeout is not None
    store = dist.distributed_c10d._get_default_store()
    prefix, seq = state.store_prefix, state.seq
    arrived = store_barrier(
        store,
        f"{prefix}/{seq}",
        rank=call.rank,
        world_size=call.world_size,
        timeout=call.timeout,
        what=f"{call.name} at {call.site[1]} (call #{seq} on this group)",
        fix="every rank must make the same object collectives in the same order; check the "
        "missing ranks for an exception, a skipped call or a slow step, or raise timeout=",
    )
    if arrived.waited_s > _STRAGGLER_FRACTION * call.timeout.total_seconds():
        get_logger().warning(
            "%s at %s (call #%d): waited %.1fs of the %gs timeout for rank %d, the last to "
            "arrive; it is slow here (an uneven step, I/O, or a skipped warm-up?)",
            call.name, call.site[1], seq, arrived.waited_s, call.timeout.total_seconds(),
            arrived.last,
        )  # fmt: skip
    if arrived.last == call.rank and seq > 1:
        # Every rank is past call seq - 1 (it arrived here), so its keys can go.
        forget_barrier(store, f"{prefix}/{seq - 1}")


def _gather_slots(call: _Call, device: torch.device, slot: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.empty(call.world_size * size, dtype=torch.uint8, device=device)
    _all_gather_single(out, slot.to(device), group=call.group)
    return out.cpu()


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather_single: Callable[..., Any] = getattr(
    dist, "all_gather_single", dist.all_gather_into_tensor
)


class _Slots:
    """The first round's host buffers for one slot size; kept per group while small, so that a
    repeated call allocates nothing.

    Reusing them is safe because every payload is decoded (copied out) before the call returns.
    """

    def __init__(self, world_size: int, slot: int) -> None:
        self.slot = slot
        # numpy's zeros come from calloc: a large slot's untouched pages cost nothing to clear
        self.send = torch.from_numpy(np.zeros(slot, dtype=np.uint8))
        self.send_view = self.send.numpy().data
        self.recv = torch.empty(world_size * slot, dtype=torch.uint8)
        self.dirty = 0  # payload bytes the last call left after the header (zeroed when shorter)

    def fill(self, header: bytes, parts: list[bytes | memoryview], size: int) -> None:
        """Header, then the payload where it fits; the rest of the slot is zeros, never bytes
        of an earlier call."""
        view = self.send_view
        view[: _HEADER.size] = header
        written = size if size <= self.slot - _HEADER.size else 0
        if written:
            _write(parts, view[_HEADER.size : _HEADER.size + written])
        if self.dirty > written:
            self.send[_HEADER.size + written : _HEADER.size + self.dirty].zero_()
        self.dirty = written


def _first_round(
    call: _Call,
    device: torch.device,
    state: _GroupState,
    slot: int,
    header: bytes,
    parts: list[bytes | memoryview],
    size: int,
) -> list[memoryview | None]:
    slots = state.slots
    if slots is None or slots.slot != slot:
        slots = _Slots(call.world_size, slot)
        state.slots = slots if call.world_size * slot <= _KEEP_BUFFERS else None
    slots.fill(header, parts, size)
    if device.type == "cpu":
        _all_gather_single(slots.recv, slots.send, group=call.group)
        received = slots.recv
    else:
        received = _gather_slots(call, device, slots.send, slot)
    view = received.numpy().data
    return [view[r * slot : (r + 1) * slot] for r in range(call.world_size)]


def _second_round(
    call: _Call,
    device: torch.device,
    headers: list[_Header | str],
    slots: list[memoryview | None],
    parts: list[bytes | memoryview],
    size: int,
    inline: int,
) -> list[memoryview | None]:
    """Inline payloads from the slots; the rest in one more collective sized from the headers."""
    sizes = [h.size for h in headers if isinstance(h, _Header)]
    result: list[memoryview | None] = []
    for slot, n in zip(slots, sizes, strict=True):
        assert slot is not None
        result.append(slot[_HEADER.size : _HEADER.size + n] if n <= inline else None)
    large = [r for r, size in enumerate(sizes) if size > inline]
    if not large:
        return result
    # Sizes were checked against max_bytes before this point: nothing below allocates more.
    width = max(sizes[r] for r in large)
    send = torch.empty(width, dtype=torch.uint8)
    if size > inline:
        _write(parts, send.numpy().data)  # the one copy of tensor data on the way out
    send[size if size > inline else 0 :].zero_()  # padding: send zeros, not stale memory
    if call.name == "broadcast_object":
        received = _broadcast_bytes(call, device, send)
        result[call.root] = received.numpy().data[: sizes[call.root]]
        return result
    if call.name == "gather_object":
        gathered = _gather_bytes(call, device, send)
    else:
        gathered = _gather_slots(call, device, send, width)
    if gathered is not None:
        view = gathered.numpy().data
        for r in large:
            result[r] = view[r * width : r * width + sizes[r]]
    return result


def _broadcast_bytes(call: _Call, device: torch.device, send: torch.Tensor) -> torch.Tensor:
    buf = send.to(device)
    dist.broadcast(buf, src=dist.get_global_rank(call.group, call.root), group=call.group)  # type: ignore[arg-type]
    return buf.cpu()


def _gather_bytes(call: _Call, device: torch.device, send: torch.Tensor) -> torch.Tensor | None:
    width = send.numel()
    out = None
    if call.rank == call.root:
        out = torch.empty(call.world_size * width, dtype=torch.uint8, device=device)
    parts = list(out.chunk(call.world_size)) if out is not None else None
    dst = dist.get_global_rank(call.group, call.root)  # type: ignore[arg-type]
    dist.gather(send.to(device), parts, dst=dst, group=call.group)
    return out.cpu() if out is not None else None


# ---- agreeing on failure ----


def _raise_on_problems(
    call: _Call, headers: list[_Header | str], slots: list[memoryview | None]
) -> None:
    """Raise the same error on every rank: it depends only on the headers every rank received."""
    corrupt = {r: h for r, h in enumerate(headers) if isinstance(h, str)}
    if corrupt:
        ranks = sorted(corrupt)
        detail = "; ".join(f"rank {r}: {why}" for r, why in corrupt.items())
        raise ObjectCollectiveError(
            f"object collective: ranks {ranks} sent no valid ddpgraph header ({detail}). The "
            "ranks are not running the same collective: one may be calling torch's "
            "all_gather_object or another collective here, or a different ddpgraph version.",
            ranks,
        )
    good = [h for h in headers if isinstance(h, _Header)]
    first = good[0]
    if all(
        h.status == _OK
        and h.size <= h.max_bytes
        and h[1:7] == first[1:7]
        and h.max_bytes == first.max_bytes
        for h in good
    ):
        return  # the common case, decided without building any message
    if any(h.status == _BAD_ARGUMENT for h in good):
        _raise_on_status(good, slots)  # first: a stand-in value may also look like a mismatch
    _raise_on_mismatch(good)
    _raise_on_status(good, slots)
    _raise_on_size(good)


def _describe(rank: int, h: _Header) -> str:
    root = "" if h.root < 0 else f", root {h.root}"
    arg = f", list length {h.arg}" if h.arg else ""
    codec = _CODEC_NAMES.get(h.codec, f"#{h.codec}")
    op = _OPS.get(h.op, f"op #{h.op}")
    return f"rank {rank}: {op} call #{h.seq} at {h.where} (codec {codec!r}{root}{arg})"


def _raise_on_mismatch(headers: list[_Header]) -> None:
    fields = {
        "op": "collective",
        "seq": "call number",
        "site": "call site",
        "codec": "codec",
        "root": "src/dst",
        "arg": "list length",
    }
    differ = [label for f, label in fields.items() if len({getattr(h, f) for h in headers}) > 1]
    if not differ:
        return
    lowest = min(h.seq for h in headers)
    odd = [r for r, h in enumerate(headers) if h.seq != lowest] or list(range(len(headers)))
    error = ObjectArgumentError if differ == ["list length"] else ObjectCollectiveError
    raise error(
        f"{_OPS.get(headers[0].op, 'object collective')}: the ranks are not in the same call "
        f"(they differ in {', '.join(differ)}): "
        + "; ".join(_describe(r, h) for r, h in enumerate(headers))
        + ". Every rank must make the same object collectives in the same order with the same "
        "codec and src/dst; look for a call that some ranks skip or add (a rank-dependent "
        "branch, an exception caught on one rank).",
        odd,
    )


def _raise_on_status(headers: list[_Header], slots: list[memoryview | None]) -> None:
    failed = [r for r, h in enumerate(headers) if h.status != _OK]
    if not failed:
        return
    reasons = []
    for r in failed:
        h, slot = headers[r], slots[r]
        assert slot is not None
        text = bytes(slot[_HEADER.size : _HEADER.size + min(h.size, _INLINE)]).decode(
            errors="replace"
        )
        reasons.append(f"rank {r}: {text.rstrip('.')}")
    op = _OPS.get(headers[0].op, "object collective")
    bad_argument = any(headers[r].status == _BAD_ARGUMENT for r in failed)
    error = ObjectArgumentError if bad_argument else ObjectCollectiveError
    raise error(
        f"{op} failed on ranks {failed}: " + " | ".join(reasons) + ". Every rank raised this "
        "error and nothing was returned.",
        failed,
    )


def _raise_on_size(headers: list[_Header]) -> None:
    # A peer's own cap was applied when it encoded; here every rank applies the smallest cap of
    # all, so a corrupt size or ranks with different max_bytes still fail before allocating.
    cap = min(h.max_bytes for h in headers)
    over = [r for r, h in enumerate(headers) if h.size > cap]
    if over:
        sizes = ", ".join(f"rank {r}: {headers[r].size} bytes" for r in over)
        raise ObjectCollectiveError(
            f"{_OPS.get(headers[0].op, 'object collective')}: objects over max_bytes={cap} "
            f"(the smallest max_bytes of any rank) announced by {sizes}; nothing was allocated. "
            "Pass the same, larger max_bytes= on every rank, or send less.",
            over,
        )


def _decode_from(call: _Call, rank: int, data: memoryview | None) -> Any:
    assert data is not None
    try:
        return decode(data, call.codec)
    except DecodeError as exc:
        raise ObjectCollectiveError(
            f"{call.name}: the object from rank {rank} ({len(data)} bytes, codec "
            f"{call.codec!r}) could not be decoded: {exc}. The sender is not speaking this "
            "codec: it may run another ddpgraph version, or the bytes were corrupted.",
            [rank],
        ) from None
