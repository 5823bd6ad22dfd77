"""How an object collective moves bytes: the fixed header, the learned first-round slot, one or
two rounds, and every rank agreeing on a failure from what every rank received."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .._globals import Global, process_global
from .._log import get_logger
from ..errors import (
    CollectiveTimeout,
    ObjectArgumentError,
    ObjectCollectiveError,
    with_explanation,
)
from . import watchdog
from ._object_call import (
    _BAD_ARGUMENT,
    _CODEC_NAMES,
    _DEFAULT_CHECK_TIMEOUT,
    _ENCODE_FAILED,
    _HEADER,
    _INLINE,
    _KEEP_BUFFERS,
    _LEARNED_CAP,
    _MAGIC,
    _MAX_MESSAGE,
    _OK,
    _OP_IDS,
    _OPS,
    _SLOT,
    _STRAGGLER_FRACTION,
    _TOO_LARGE,
    _VERSION,
    _Call,
)
from .codec import CODECS, DecodeError, decode, encode_parts
from .runtime import check_unique_devices, get_runtime, group_device
from .store import forget_barrier, store_barrier

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
