"""Route torch's object collectives through ddpgraph's checks, for scripts you cannot edit.

After :func:`patch_torch`, ``torch.distributed.all_gather_object``, ``gather_object`` and
``broadcast_object_list`` keep their signatures and in-place output lists but run ddpgraph's
protocol: one collective for small objects, the device bound to the rank on NCCL (checked unique
before any NCCL call), and a failure on any rank — an object that cannot be pickled, an output
list whose length is not the group's size, ranks at different calls — raises on *every* rank
instead of hanging one of them. :func:`unpatch` restores torch's functions.

The patched functions keep torch's semantics of sending arbitrary objects, so they use
``codec="pickle"``: **unpickling runs code the sender chooses**, exactly as with torch's own
functions; only use them between trusted ranks. Differences from torch, on purpose: tensors in
the objects arrive on the CPU (torch puts them back on the sender's GPU, pytorch#76865); every
rank's list length is checked (torch silently leaves a trailing ``None``); ``device=`` of
``broadcast_object_list`` is ignored (the rank's bound device is used).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch.distributed as dist

from .._globals import Global, process_global
from ._object_call import DEFAULT_MAX_BYTES, _Call
from ._object_exchange import _decode_from, _exchange

__all__ = ["is_patched", "patch_torch", "unpatch"]

_CODEC = "pickle"  # torch's functions send arbitrary objects; so must their replacements
# torch's own functions while patched (by module and name): the process's, until unpatch()
_originals: Global[dict[tuple[ModuleType, str], Any]] = process_global(
    "torch_patch.originals", dict, reset_at_shutdown=False
)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Drop-in for ``torch.distributed.all_gather_object``: fills ``object_list`` in place."""
    expected = _world_size(group)
    problem = _length_problem("object_list", object_list, expected)
    call = _Call.make(
        "all_gather_object", group, _CODEC, None, DEFAULT_MAX_BYTES, root=None,
        argument_error=problem,
    )  # fmt: skip
    payloads = _exchange(call, obj, send=True)
    for rank, data in enumerate(payloads):
        object_list[rank] = _decode_from(call, rank, data)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
) -> None:
    """Drop-in for ``torch.distributed.gather_object``: fills ``object_gather_list`` on ``dst``."""
    dst = _global_root("dst", dst, group_dst, group)
    on_dst = not dist.is_initialized() or dist.get_rank() == dst
    problem = (
        _length_problem("object_gather_list", object_gather_list, _world_size(group))
        if on_dst
        else None
    )
    call = _Call.make(
        "gather_object", group, _CODEC, None, DEFAULT_MAX_BYTES, root=dst, argument_error=problem
    )
    payloads = _exchange(call, obj, send=True)
    if call.rank == call.root:
        assert object_gather_list is not None
        for rank, data in enumerate(payloads):
            object_gather_list[rank] = _decode_from(call, rank, data)


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    """Drop-in for ``torch.distributed.broadcast_object_list``: fills ``object_list`` in place on
    every rank but ``src``. Every rank's list must have ``src``'s length (checked on all ranks)."""
    del device  # the rank's bound device is used; see the module docstring
    src = _global_root("src", src, group_src, group)
    is_list = isinstance(object_list, list)
    problem = None if is_list else f"its object_list is a {type(object_list).__name__}, not a list"
    call = _Call.make(
        "broadcast_object", group, _CODEC, None, DEFAULT_MAX_BYTES, root=src,
        arg=len(object_list) if is_list else 0, argument_error=problem,
    )  # fmt: skip
    payloads = _exchange(call, list(object_list) if is_list else None, send=call.rank == call.root)
    if call.rank != call.root:
        object_list[:] = _decode_from(call, call.root, payloads[call.root])


_REPLACEMENTS = {
    "all_gather_object": all_gather_object,
    "gather_object": gather_object,
    "broadcast_object_list": broadcast_object_list,
}


def patch_torch() -> None:
    """Replace torch's object collectives (in ``torch.distributed`` and ``distributed_c10d``).

    Idempotent. Call before the code that uses them looks them up (``from torch.distributed
    import all_gather_object`` done earlier keeps torch's function).
    """
    for module in (dist, dist.distributed_c10d):
        for name, replacement in _REPLACEMENTS.items():
            _originals.value.setdefault((module, name), getattr(module, name))
            setattr(module, name, replacement)


def unpatch() -> None:
    """Restore torch's functions; harmless when not patched."""
    while _originals.value:
        (module, name), original = _originals.value.popitem()
        setattr(module, name, original)


def is_patched() -> bool:
    return bool(_originals.value)


def _world_size(group: Any) -> int:
    if not dist.is_initialized():
        return 1
    return max(dist.get_world_size(group), 1)  # -1 for a non-member: _Call.make names that


def _length_problem(what: str, value: Any, expected: int) -> str | None:
    if not isinstance(value, list):
        return f"its {what} is {type(value).__name__}, not a list of length {expected}"
    if len(value) != expected:
        return (
            f"its {what} has length {len(value)}, but the group has {expected} ranks; pass a "
            f"list of length world_size, e.g. [None] * {expected}"
        )
    return None


def _global_root(what: str, root: int | None, group_root: int | None, group: Any) -> int:
    if root is not None and group_root is not None:
        raise ValueError(f"pass {what}= or group_{what}=, not both")
    if group_root is None:
        return 0 if root is None else root
    if not dist.is_initialized():
        return group_root
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    return dist.get_global_rank(pg, group_root)
