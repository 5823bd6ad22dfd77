"""Shape buckets: :func:`pad_batch` pads every tensor of a batch along one dimension to the next
multiple (a *bucket*), with per-entry pad values that keep the loss unchanged (``labels`` padded
with ``-100``, which ``CrossEntropyLoss`` ignores; ``attention_mask`` padded with ``0``). With
``TrainStep(on_new_shape="capture")`` each bucket gets one graph instead of one per length.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from .._checks import check_int, is_int
from ..errors import ConfigError
from .containers import rebuild_mapping, rebuild_sequence

__all__ = ["IGNORE_INDEX", "pad_batch"]

IGNORE_INDEX = -100  # torch's CrossEntropyLoss / NLLLoss default ignore_index, and HF's
Key = Any  # a mapping key, or a position in a tuple/list batch
PadValue = float | int | bool | None
B = TypeVar("B")


# ------------------------------------------------------------------------------- pad_batch
def pad_batch(
    batch: B,
    *,
    multiple: int = 64,
    dim: int = 1,
    values: Mapping[Key, PadValue] | Sequence[PadValue] | None = None,
    batch_multiple: int | None = None,
) -> B:
    """Pad every tensor of ``batch`` along ``dim`` to the next multiple of ``multiple``.

    ``batch`` is a tuple/list or a mapping (``dict``, HF ``BatchEncoding``, any ``Mapping``); the
    result has the same container type where it can be rebuilt (a plain ``dict`` for a mapping
    type that cannot), and holds the input tensors themselves where nothing needed padding.
    Entries that are not tensors, and tensors with ``dim`` or fewer dimensions (a per-sample
    scalar such as a class label), pass through unchanged. A batch in which nothing could be
    padded is refused, naming why (no tensor has a ``dim``; rows not yet collated; numpy arrays).

    ``values`` gives the pad value of each entry: for a mapping batch a mapping by key, for a
    tuple/list batch a sequence aligned with the positions (or a mapping by position). ``None``
    as a value leaves that entry unpadded. Entries it does not name are padded with ``0``,
    except a mapping's ``"labels"``, padded with ``-100``. So for an HF causal-LM batch the
    default is loss-neutral: padded positions have ``attention_mask == 0`` (no real token
    attends to them) and ``labels == -100`` (``CrossEntropyLoss(ignore_index=-100)`` leaves them
    out of the sum *and* of the count it divides by), so the loss and its gradients equal those
    of the unpadded batch, up to float rounding.

    ``batch_multiple`` (default ``None``: off) also pads the batch dimension (dim 0) to a
    multiple, for the last batch of an epoch (``drop_last=False``), with the same per-entry
    values: the extra rows carry ``labels == -100`` and are masked out of the loss. This is only
    loss-neutral for models without batch statistics: BatchNorm would average the padded rows
    into the real rows' normalisation. The padded rows' outputs must also be finite (an
    attention that masks a whole row can give NaN, whose gradient is NaN even where the loss
    ignores it). The alternative is to leave that batch as it is: ``TrainStep`` runs a shape it
    has no graph for eagerly (``on_new_shape="eager"``, the default). A tuple batch has no
    ``labels`` key, so ``batch_multiple`` needs ``values`` naming the target's pad value.

    Padding allocates new tensors on the input's device; call it where the batch is built (in
    the loader's ``collate_fn``) so the copy happens on the host, off the training stream.
    """
    _check_positive_int("multiple", multiple, fix="e.g. multiple=64 (1 pads nothing)")
    _check_dim(dim)
    if batch_multiple is not None:
        _check_positive_int("batch_multiple", batch_multiple, fix="or batch_multiple=None")
        if dim == 0:
            raise ConfigError(
                "pad_batch(dim=0, batch_multiple=...) pads dim 0 twice; use dim=0 with "
                "multiple=... alone, or keep dim=1 for the sequence and batch_multiple for rows."
            )
    entries = _entries(batch)
    pad_values = _pad_values(entries, batch, values)
    _check_something_to_pad(entries, pad_values, dim)
    if batch_multiple is not None:
        _require_masked_rows(batch, values)
    padded = _pad_entries(entries, pad_values, dim=dim, multiple=multiple)
    if batch_multiple is not None:
        padded = _pad_entries(padded, pad_values, dim=0, multiple=batch_multiple)
    return _rebuild(batch, padded)


def _check_positive_int(name: str, value: object, *, fix: str) -> None:
    check_int(name, value, minimum=1, fix=fix)


def _check_dim(dim: object) -> None:
    if not is_int(dim) or dim < 0:  # type: ignore[operator]
        raise ConfigError(
            f"dim={dim!r} must be a non-negative integer (the dimension to pad, e.g. dim=1 for "
            "[batch, sequence] tensors); a negative dim would also pad the per-sample "
            "tensors that have fewer dimensions."
        )


def _entries(batch: object) -> list[tuple[Key, Any]]:
    if isinstance(batch, Mapping):
        return list(batch.items())
    if isinstance(batch, (tuple, list)):
        return list(enumerate(batch))
    raise TypeError(
        f"pad_batch got a {type(batch).__name__}; pass a tuple/list of tensors or a mapping "
        "(dict, BatchEncoding), e.g. pad_batch((x,)) for a single tensor."
    )


def _check_something_to_pad(
    entries: list[tuple[Key, Any]], pad_values: Mapping[Key, PadValue], dim: int
) -> None:
    """Refuse a batch where nothing could ever be padded: returning it unchanged would hide it.

    Entries left unpadded on purpose (``values={key: None}``) do not count; numpy arrays would be
    passed over silently, so they are named with the conversion that fixes them.
    """
    wanted = [(key, item) for key, item in entries if pad_values.get(key) is not None]
    for key, item in wanted:
        if type(item).__module__ == "numpy" and getattr(item, "ndim", 0) > dim:
            raise TypeError(
                f"pad_batch: entry {key!r} is a numpy.ndarray of shape {item.shape}; pad_batch "
                "pads torch tensors only. Convert it with torch.from_numpy(...) (or collate with "
                f"torch.utils.data.default_collate), or leave it with values={{{key!r}: None}}."
            )
    if not wanted or any(_pads(item, pad_values[key], dim) for key, item in wanted):
        return
    tensors = {key: tuple(item.shape) for key, item in wanted if isinstance(item, torch.Tensor)}
    if tensors:
        shapes = ", ".join(f"{key!r}: {shape}" for key, shape in tensors.items())
        raise ValueError(
            f"pad_batch(dim={dim}) found no tensor with a dim {dim} to pad (shapes {shapes}); "
            f"dim counts from 0 and includes the batch dimension: use dim={max(0, dim - 1)} "
            "(dim=1 for [batch, sequence] tensors)."
        )
    kinds = sorted({type(item).__name__ for _, item in wanted})
    rows = "; a list of dicts is a list of samples: collate it first" if "dict" in kinds else ""
    raise TypeError(
        f"pad_batch found no tensor in the batch (its entries are {', '.join(kinds)}){rows}. "
        "Pass a collated batch of torch tensors, e.g. "
        "pad_batch(torch.utils.data.default_collate(samples)), or call it in the loader's "
        "collate_fn after collating."
    )


def _pad_values(
    entries: list[tuple[Key, Any]],
    batch: object,
    values: Mapping[Key, PadValue] | Sequence[PadValue] | None,
) -> dict[Key, PadValue]:
    """The pad value of every entry (None: leave it as it is), defaults filled in and checked."""
    is_mapping = isinstance(batch, Mapping)
    chosen: dict[Key, PadValue] = {key: 0 for key, _ in entries}
    if is_mapping and "labels" in chosen:
        chosen["labels"] = IGNORE_INDEX
    chosen.update(_explicit_values(entries, is_mapping, values))
    for key, tensor in entries:
        if isinstance(tensor, torch.Tensor):
            _check_value_fits(key, chosen[key], tensor.dtype)
    return chosen


def _explicit_values(
    entries: list[tuple[Key, Any]],
    is_mapping: bool,
    values: Mapping[Key, PadValue] | Sequence[PadValue] | None,
) -> dict[Key, PadValue]:
    if values is None:
        return {}
    keys = [key for key, _ in entries]
    if isinstance(values, Mapping):
        unknown = [key for key in values if key not in keys]
        if unknown:
            raise ConfigError(
                f"values names {unknown!r}, which the batch does not have (its entries: {keys!r}); "
                "a misspelt key would silently pad with 0, so fix or remove it."
            )
        given = dict(values)
    elif not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ConfigError(
            f"values={values!r} must be None, a mapping of pad values by key/position, or (for a "
            "tuple/list batch) a sequence with one pad value per position."
        )
    elif is_mapping:
        raise ConfigError(
            f"values={values!r} is a sequence, but the batch is a mapping; pass pad values by "
            "key, e.g. values={'labels': -100, 'attention_mask': 0}."
        )
    elif len(values) != len(entries):
        raise ConfigError(
            f"values has {len(values)} pad values for a batch of {len(entries)} entries; "
            "give one per position (None leaves an entry unpadded), or a dict by position."
        )
    else:
        given = dict(enumerate(values))
    for key, value in given.items():
        if value is not None and not isinstance(value, numbers.Real):
            raise ConfigError(
                f"values[{key!r}]={value!r} must be a number (or None to leave the entry unpadded)."
            )
    return given


def _check_value_fits(key: Key, value: PadValue, dtype: torch.dtype) -> None:
    if value is None or dtype.is_floating_point or dtype.is_complex:
        return
    if dtype == torch.bool:
        ok = value in (0, 1)
    else:
        info = torch.iinfo(dtype)
        ok = float(value).is_integer() and info.min <= value <= info.max
    if not ok:
        raise ConfigError(
            f"pad value {value!r} for entry {key!r} does not fit its dtype {dtype}; pass a value "
            f"of that type in values={{{key!r}: ...}} (e.g. 0), or cast the entry."
        )


def _require_masked_rows(batch: object, values: object) -> None:
    if values is None and not (isinstance(batch, Mapping) and "labels" in batch):
        raise ConfigError(
            "pad_batch(batch_multiple=...) adds rows that the loss must ignore, but nothing "
            "marks them: the batch has no 'labels' entry (padded with -100 by default). Name the "
            "target's pad value, e.g. values=(0, -100) for (inputs, target) with "
            "CrossEntropyLoss(ignore_index=-100)."
        )


def _pad_entries(
    entries: list[tuple[Key, Any]], pad_values: Mapping[Key, PadValue], *, dim: int, multiple: int
) -> list[tuple[Key, Any]]:
    length = _common_length(entries, pad_values, dim)
    if length is None:
        return entries
    target = math.ceil(length / multiple) * multiple
    out: list[tuple[Key, Any]] = []
    for key, item in entries:
        value = pad_values.get(key)
        if value is not None and _pads(item, value, dim) and target != length:
            item = _pad_tensor(item, dim=dim, size=target, value=value)
        out.append((key, item))
    return out


def _pads(item: object, value: PadValue, dim: int) -> bool:
    return isinstance(item, torch.Tensor) and value is not None and item.dim() > dim


def _common_length(
    entries: list[tuple[Key, Any]], pad_values: Mapping[Key, PadValue], dim: int
) -> int | None:
    """The size along ``dim`` shared by every tensor to pad; a clear error if they differ."""
    sizes = {key: item.shape[dim] for key, item in entries if _pads(item, pad_values.get(key), dim)}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{key!r}: {size}" for key, size in sizes.items())
        raise ValueError(
            f"pad_batch(dim={dim}) needs one size along dim {dim} for every tensor it pads, but "
            f"the batch has {listed}; leave an entry unpadded with values={{key: None}}, or pad "
            "along another dim."
        )
    return next(iter(sizes.values()), None)


def _pad_tensor(
    tensor: torch.Tensor, *, dim: int, size: int, value: float | int | bool
) -> torch.Tensor:
    # new_full + copy rather than F.pad: one code path for every dtype (bool masks included)
    shape = list(tensor.shape)
    length, shape[dim] = shape[dim], size
    out = tensor.new_full(shape, value)
    out.narrow(dim, 0, length).copy_(tensor)
    return out


def _rebuild(batch: B, entries: list[tuple[Key, Any]]) -> B:
    items = [item for _, item in entries]
    if isinstance(batch, Mapping):
        return rebuild_mapping(batch, dict(entries))  # type: ignore[return-value]
    return rebuild_sequence(batch, items)  # type: ignore[arg-type, return-value]
