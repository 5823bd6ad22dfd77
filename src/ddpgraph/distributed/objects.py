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

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ._object_call import DEFAULT_MAX_BYTES, _Call
from ._object_exchange import _decode_from, _exchange

__all__ = ["DEFAULT_MAX_BYTES", "all_gather_object", "broadcast_object", "gather_object"]


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
