"""One object-collective call as every rank describes it: its group, ranks, call site, limits
(and the wire constants), checked before anything is sent."""

from __future__ import annotations

import numbers
import os
import struct
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .._frames import frame_outside, in_modules
from .._globals import Global, process_global
from ..errors import (
    DistributedStateError,
    ObjectCollectiveError,
)
from .codec import CODECS
from .runtime import as_timedelta

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
# the frames a call site is looked for outside of: the public functions and torch's replacements
_in_our_modules = in_modules(
    {
        __name__,
        "ddpgraph.distributed.objects",
        "ddpgraph.distributed._object_exchange",
        "ddpgraph.distributed.metrics",
        "ddpgraph.distributed.torch_patch",
    }
)
_DEFAULT_CHECK_TIMEOUT = timedelta(minutes=10)
# A rank that arrives after half the timeout is named in a warning, before it becomes an error.
_STRAGGLER_FRACTION = 0.5


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
