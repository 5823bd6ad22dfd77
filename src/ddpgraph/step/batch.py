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
from typing import Any, Literal, NamedTuple

import torch

__all__ = [
    "NO_BATCH",
    "Batch",
    "GraphKey",
    "Leaf",
    "Role",
    "Signature",
    "data_batch",
    "describe",
    "differences",
    "gathered_batch",
    "make_batch",
]

Kind = Literal["args", "mapping", "data"]
# "sync": a window's last micro-batch with the gradient sync, "update": the optimizer step alone
# (TrainStep(defer_update=True): the script's own optimizer.step() line, as step.update())
Role = Literal["train", "micro", "sync", "update", "eval"]


class Leaf(NamedTuple):
    """One batch tensor as a graph sees it."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


class Signature(NamedTuple):
    """What a graph's static inputs fix: the call's kind, its entries' names, each tensor's leaf."""

    kind: Kind
    names: tuple[str, ...]
    leaves: tuple[Leaf, ...]


@dataclass(frozen=True)
class GraphKey:
    """Which graph a call replays: one per role, module modes and input signature.

    ``role`` is "train" (steps the optimizer), "micro" (an ``accumulate_calls`` micro-batch: no
    sync, no update) or "eval"; ``modes`` is every submodule's ``training`` flag (a graph never
    replays in another mode than it was captured in); ``signature`` the inputs, including for
    ``step(data)`` the DeviceData it gathers from (another data set never replays its graph);
    ``divisor`` a short window's own loss divisor (``step(..., window=n)``).
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


@dataclass(frozen=True)
class Batch:
    kind: Kind
    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    source: Any = None  # "data": the DeviceData the step gathers from
    steps: int = 1  # "data": training steps in this call

    @property
    def signature(self) -> Signature:
        if self.source is not None:
            # the token: a graph gathers from one DeviceData's tensors, never another's
            names = (f"{self.steps} steps", f"DeviceData #{self.source.token}", *self.names)
            return Signature("data", names, self.source.batch_shapes)
        leaves = tuple(Leaf(t.shape, t.dtype, t.device) for t in self.tensors)
        return Signature(self.kind, self.names, leaves)

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> Batch:
        return replace(self, tensors=tuple(tensors))

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


NO_BATCH = Batch("args", (), ())  # what the update graph reads: nothing but the gradients


def data_batch(data: Any, steps: int) -> Batch:
    """``steps`` training steps whose batches the step gathers from ``data`` (a DeviceData)."""
    return Batch("data", data.names, (), source=data, steps=steps)


def gathered_batch(data: Any, tensors: tuple[torch.Tensor, ...]) -> Batch:
    """One batch gathered from a DeviceData: positional, or a mapping as its keys say."""
    return Batch(data.kind, data.names, tensors)


def make_batch(args: tuple[Any, ...], *, min_positional: int) -> Batch:
    """Check ``step(...)``'s arguments and name them; raise naming the entry that is wrong."""
    if len(args) == 1 and isinstance(args[0], Mapping):
        mapping = args[0]
        names = tuple(str(k) for k in mapping)
        for name in names:
            _require_tensor(mapping[name], f"batch[{name!r}]")
        if not names:
            raise ValueError("TrainStep got an empty mapping; pass the model's keyword inputs.")
        return Batch("mapping", names, tuple(mapping[n] for n in names))
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
        _require_tensor(item, f"batch element {i}")
    return Batch("args", tuple(str(i) for i in range(len(args))), tuple(args))


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
