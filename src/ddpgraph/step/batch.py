"""A step's batch as TrainStep sees it: named tensors, a signature, the call it becomes, and the
typed :class:`GraphKey` under which its graph is kept.

``step(x, y)`` is a positional batch (entries named "0", "1", ...); ``step(batch)`` with one
mapping (a dict, an HF ``BatchEncoding``) is a keyword batch passed as ``model(**batch)``. Both
flatten to the same shape so static buffers, guards and accumulation treat them alike.
``step(data)`` with a :class:`~ddpgraph.DeviceData` is a "data" batch: no tensors to copy in (the
step gathers its batches on the device), its signature the gathered shapes and the step count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any, Literal, NamedTuple

import torch

__all__ = [
    "NO_BATCH",
    "Batch",
    "GraphKey",
    "Leaf",
    "LeafKey",
    "Role",
    "Signature",
    "batch_of",
    "data_batch",
    "describe",
    "differences",
    "gathered_batch",
    "make_batch",
    "named",
]

Kind = Literal["args", "mapping", "data"]
# "sync": a window's last micro-batch with the gradient sync, "update": the optimizer step alone
# (TrainStep(defer_update=True): the script's own optimizer.step() line, as step.update())
Role = Literal["train", "micro", "sync", "update", "eval"]


# One batch tensor as a graph's key holds it: its shape, dtype and device. A plain tuple, built
# by zip in C on every call (a named tuple's constructor is a Python frame: 0.4 us of each
# replayed call); equal to, and hashed as, the named :class:`Leaf` a report shows.
LeafKey = tuple[torch.Size, torch.dtype, torch.device]


class Leaf(NamedTuple):
    """One batch tensor as a graph sees it (the named form of a :data:`LeafKey`, in reports)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


class Signature(NamedTuple):
    """What a graph's static inputs fix: the call's kind, its entries' names, each tensor's leaf."""

    kind: Kind
    names: tuple[str, ...]
    leaves: tuple[LeafKey, ...]


class GraphKey(NamedTuple):
    """Which graph a call replays: one per role, module modes and input signature.

    ``role`` is "train" (steps the optimizer), "micro" (an ``accumulate_calls`` micro-batch: no
    sync, no update) or "eval"; ``modes`` is every submodule's ``training`` flag (a graph never
    replays in another mode than it was captured in); ``signature`` the inputs, including for
    ``step(data)`` the DeviceData it gathers from (another data set never replays its graph);
    ``divisor`` a short window's own loss divisor (``step(..., window=n)``). A named tuple:
    built, hashed and compared in C on every replayed call (a frozen dataclass's hash is a
    Python frame).
    """

    role: Role
    modes: tuple[bool, ...]
    signature: Signature
    # what an accumulate_calls micro-batch divides its loss by (a constant of its graph): the
    # window's length, accumulate_calls unless the script said window=n; 0 where none applies
    divisor: int = 0

    @property
    def trains(self) -> bool:
        return self.role != "eval"

    @property
    def reads_device_data(self) -> bool:
        return self.signature.kind == "data"


@dataclass(slots=True)
class Batch:
    """A call's tensors, named, with their :class:`Signature` computed once where the batch is
    made (the key of every graph lookup: a replayed call reads it, never rebuilds it). Make one
    with :func:`make_batch`, :func:`data_batch`, :func:`gathered_batch` or :func:`batch_of`;
    treat it as immutable (:meth:`with_tensors` makes another). Not frozen: a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``, 0.5-1 µs of every
    replayed call."""

    kind: Kind
    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    signature: Signature
    source: Any = None  # "data": the DeviceData the step gathers from
    steps: int = 1  # "data": training steps in this call

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> Batch:
        """The same entries on other tensors (a device copy, static inputs): their own
        signature (a CUDA copy of a CPU batch is keyed as what it is)."""
        tensors = tuple(tensors)
        if self.source is not None:
            return replace(self, tensors=tensors)
        return replace(self, tensors=tensors, signature=_signature(self.kind, self.names, tensors))

    def to(self, device: torch.device, *, channels_last: bool) -> Batch:
        """The batch on ``device`` (non-blocking); 4-d tensors channels_last if asked."""
        return self.with_tensors([_moved(t, device, channels_last) for t in self.tensors])

    def as_mapping(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.tensors))

    def split(self, k: int) -> list[Batch]:
        """k equal micro-batches along dim 0 (gradient accumulation)."""
        if k == 1:
            return [self]
        sizes = {t.shape[0] if t.dim() else None for t in self.tensors}
        size = next(iter(sizes))
        if len(sizes) != 1 or size is None or size % k:
            shapes = {n: tuple(t.shape) for n, t in zip(self.names, self.tensors)}
            raise ValueError(
                f"accumulate={k} splits every batch tensor along dim 0 into {k} equal parts, "
                f"but got shapes {shapes}; use a batch size divisible by {k}."
            )
        chunks = [t.chunk(k) for t in self.tensors]
        return [self.with_tensors([c[i] for c in chunks]) for i in range(k)]


def _moved(tensor: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    tensor = tensor.to(device, non_blocking=True)
    if channels_last and tensor.dim() == 4:
        tensor = tensor.contiguous(memory_format=torch.channels_last)
    return tensor


_shape, _dtype, _device = attrgetter("shape"), attrgetter("dtype"), attrgetter("device")
# a named tuple built in C: its own constructor is a Python frame on every replayed call
_record = tuple.__new__


def _signature(kind: Kind, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> Signature:
    # C-level zip: no Python frame per tensor on the replayed path
    leaves = zip(map(_shape, tensors), map(_dtype, tensors), map(_device, tensors))
    return Signature(kind, names, tuple(leaves))


def named(signature: Signature) -> Signature:
    """``signature`` with each leaf a :class:`Leaf` (``leaves[0].shape``), as reports show it."""
    kind, names, leaves = signature
    return Signature(kind, names, tuple(Leaf._make(leaf) for leaf in leaves))


def batch_of(kind: Kind, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> Batch:
    """A batch of tensors with its signature."""
    return Batch(kind, names, tensors, _signature(kind, names, tensors))


NO_BATCH = batch_of("args", (), ())  # what the update graph reads: nothing but the gradients


def data_batch(data: Any, steps: int) -> Batch:
    """``steps`` training steps whose batches the step gathers from ``data`` (a DeviceData)."""
    # the token: a graph gathers from one DeviceData's tensors, never another's
    names = (f"{steps} steps", f"DeviceData #{data.token}", *data.names)
    signature = Signature("data", names, data.batch_shapes)
    return Batch("data", data.names, (), signature, source=data, steps=steps)


def gathered_batch(data: Any, tensors: tuple[torch.Tensor, ...]) -> Batch:
    """One batch gathered from a DeviceData: positional, or a mapping as its keys say."""
    return batch_of(data.kind, data.names, tensors)


# "0", "1", ...: the names of positional entries, made once
_POSITIONAL = tuple(map(str, range(32)))


def make_batch(args: tuple[Any, ...], *, min_positional: int) -> Batch:
    """Check ``step(...)``'s arguments and name them; raise naming the entry that is wrong.

    On every call: an inline type test per entry and the names from a table (no helper frame
    unless an entry is wrong)."""
    if len(args) == 1 and isinstance(args[0], Mapping):
        mapping = args[0]
        names = tuple(map(str, mapping))
        for name in names:
            if not isinstance(mapping[name], torch.Tensor):
                _require_tensor(mapping[name], f"batch[{name!r}]")
        if not names:
            raise ValueError("TrainStep got an empty mapping; pass the model's keyword inputs.")
        return batch_of("mapping", names, tuple(map(mapping.__getitem__, names)))
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        raise TypeError(
            f"TrainStep got one {type(args[0]).__name__} of {len(args[0])} item(s), not tensors; "
            "unpack it: step(*batch), e.g. step(x, y) for a batch (x, y)."
        )
    if len(args) < min_positional:
        raise ValueError(
            f"TrainStep got {len(args)} tensor(s); call step(*inputs, target), e.g. step(x, y), "
            "or step(batch) with one mapping of the model's keyword inputs."
        )
    for i, item in enumerate(args):
        if not isinstance(item, torch.Tensor):
            _require_tensor(item, f"batch element {i}")
    names = (
        _POSITIONAL[: len(args)]
        if len(args) <= len(_POSITIONAL)
        else tuple(map(str, range(len(args))))
    )
    # the signature inline (as _signature): no helper frame on the replayed path
    leaves = zip(map(_shape, args), map(_dtype, args), map(_device, args))
    return Batch("args", names, args, _record(Signature, ("args", names, tuple(leaves))))


def _require_tensor(value: object, what: str) -> None:
    if not isinstance(value, torch.Tensor):
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        raise TypeError(
            f"{what} is {type(value).__name__} {shown}, not a tensor; pass tensors, e.g. "
            "torch.as_tensor(value), or batches from a DataLoader."
        )


def describe(signature: Signature) -> str:
    kind, names, leaves = signature
    parts = [f"{tuple(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype, _ in leaves]
    if kind == "data":
        return f"{names[0]} of {names[1]} batches " + ", ".join(parts)
    if kind == "mapping":
        parts = [f"{name}: {part}" for name, part in zip(names, parts)]
    return ", ".join(parts)


def differences(new: Signature, known: Signature, *, known_as: str = "captured") -> str:
    """What changed from ``known`` to ``new``, naming each entry (key or position); ``known_as``
    says what ``known`` is (a captured batch, or the first one where nothing is captured)."""
    if new[:2] != known[:2]:
        return f"the entries changed from {list(known[1])} to {list(new[1])}"
    changed = [
        f"{_entry(new[0], name)} {tuple(a[0])} {str(a[1]).removeprefix('torch.')} "
        f"({known_as} {tuple(b[0])} {str(b[1]).removeprefix('torch.')})"
        for name, a, b in zip(new[1], new[2], known[2])
        if a != b
    ]
    return "; ".join(changed)


def _entry(kind: Kind, name: str) -> str:
    return f"batch[{name!r}]" if kind == "mapping" else f"batch element {name}"
