"""What feeds a :class:`~ddpgraph.TrainStep` at graph speed: shape buckets and a prefetching loader.

* :func:`pad_batch` pads every tensor of a batch along one dimension to the next multiple (a
  *bucket*), with per-entry pad values that keep the loss unchanged (``labels`` padded with
  ``-100``, which ``CrossEntropyLoss`` ignores; ``attention_mask`` padded with ``0``). With
  ``TrainStep(on_new_shape="capture")`` each bucket gets one graph instead of one per length.
* :func:`prefetch` wraps a loader: on CUDA the next batch is pinned and copied to the device on a
  side stream while the current step runs, and handed over stream-ordered; on CPU it changes
  nothing.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Generic, TypeVar

import torch

from .errors import ConfigError

__all__ = ["Prefetcher", "pad_batch", "prefetch"]

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


def check_int(name: str, value: object, *, minimum: int | None, fix: str) -> None:
    """An integer option (not a bool) of at least ``minimum``; ``ConfigError`` naming it."""
    if not _is_int(value) or (minimum is not None and value < minimum):  # type: ignore[operator]
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"{name}={value!r} must be an integer{bound}; {fix}.")


def _check_dim(dim: object) -> None:
    if not _is_int(dim) or dim < 0:  # type: ignore[operator]
        raise ConfigError(
            f"dim={dim!r} must be a non-negative integer (the dimension to pad, e.g. dim=1 for "
            "[batch, sequence] tensors); a negative dim would also pad the per-sample "
            "tensors that have fewer dimensions."
        )


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


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
        return _rebuild_mapping(batch, dict(entries))  # type: ignore[return-value]
    return _rebuild_sequence(batch, items)  # type: ignore[arg-type, return-value]


def _rebuild_mapping(batch: Mapping[Any, Any], new: dict[Any, Any]) -> Mapping[Any, Any]:
    """The same mapping type where it can be rebuilt, else a dict (as torch's pin_memory does).

    A mutable mapping is copied and updated, so attributes beside the items survive (an HF
    ``BatchEncoding`` keeps its ``encodings``); another mapping type is called with a dict.
    """
    try:
        if isinstance(batch, MutableMapping):
            clone = copy.copy(batch)
            clone.update(new)
            return clone
        return type(batch)(new)  # type: ignore[call-arg]
    except TypeError:
        return new


def _rebuild_sequence(batch: Sequence[Any], items: list[Any]) -> Sequence[Any]:
    cls: Any = type(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return cls(*items)
    try:
        return cls(items)  # tuple, list or a subclass that takes an iterable
    except TypeError:
        return tuple(items) if isinstance(batch, tuple) else items


# -------------------------------------------------------------------------------- prefetch
def prefetch(
    loader: Iterable[B], device: torch.device | str | int, *, depth: int = 1
) -> Prefetcher[B]:
    """Iterate ``loader`` with each batch already on ``device``, copied while the previous step ran.

    On CUDA, every CPU tensor of a batch (tensors, tuples/lists, mappings, nested; other leaves
    pass through) is pinned if it is not already (``DataLoader(pin_memory=True)`` has pinned
    it), then copied with ``non_blocking=True`` on a side stream, ``depth`` batches
    ahead of the one being used. Handing a batch over makes the consumer's current stream wait
    for its copy (no step reads a half-copied batch) and records the batch's tensors on that
    stream, so the caching allocator cannot give their memory to a later copy while the step
    still reads them. No host synchronisation: the loop runs ahead as it would with
    ``.to(device, non_blocking=True)``, and a graph replay never races a copy.

    The loader must yield new tensors for each batch (a DataLoader does): one that refilled a
    single pinned buffer in place would overwrite a batch whose copy is still in flight.

    On CPU (``device.type == "cpu"``) it yields the loader's batches unchanged, with no thread
    and no copy. ``len()`` is the loader's. Each ``iter()`` is a new pass over the loader.

    Use it around the loader on every rank: ``for x, y in ddpgraph.prefetch(loader, rt.device):``.
    """
    return Prefetcher(loader, _check_device(device), depth=depth)


def _check_device(device: object) -> torch.device:
    try:
        resolved = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"device={device!r} is not a device ({exc}); pass e.g. rt.device or 'cuda:0'."
        ) from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ConfigError(
            f"prefetch(device={device!r}): only 'cuda' and 'cpu' devices are supported; move "
            f"{resolved.type} batches with .to(device) in the loop."
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"prefetch(device={device!r}) but CUDA is not available; pass the device the model "
            "is on (rt.device, 'cpu' here)."
        )
    if resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


class Prefetcher(Generic[B]):
    """The iterable :func:`prefetch` returns; see there."""

    def __init__(self, loader: Iterable[B], device: torch.device, *, depth: int = 1) -> None:
        if not isinstance(loader, Iterable):
            raise ConfigError(
                f"prefetch got a {type(loader).__name__}, which is not iterable; pass the "
                "DataLoader (or any iterable of batches)."
            )
        _check_positive_int("depth", depth, fix="depth=1 (the next batch) is usually enough")
        self.loader = loader
        self.device = device
        self.depth = depth
        self._copy_stream: torch.cuda.Stream | None = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # TypeError if the loader has none

    def __iter__(self) -> Iterator[B]:
        if self.device.type == "cpu":
            return iter(self.loader)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream, device = self._copy_stream, self.device
        return _Lookahead(
            iter(self.loader),
            stage=lambda batch: _stage(batch, stream, device),
            hand_over=lambda staged: _hand_over(staged, device),
            depth=self.depth,
        )


S = TypeVar("S")


class _Lookahead(Iterator[B], Generic[B, S]):
    """Yields ``source``'s items in order, each staged ``depth`` items before it is handed over.

    ``stage`` starts an item's copy (returns what ``hand_over`` needs); ``hand_over`` finishes
    it for the consumer. An exception from ``source`` is raised after the items produced before
    it, as a plain loop over ``source`` would. Nothing runs in the background: breaking out of
    the loop just drops this object (and the source iterator with it).
    """

    def __init__(
        self,
        source: Iterator[B],
        *,
        stage: Callable[[B], S],
        hand_over: Callable[[S], B],
        depth: int,
    ) -> None:
        self._source = source
        self._stage = stage
        self._hand_over = hand_over
        self._staged: deque[S] = deque()
        self._error: Exception | None = None
        self._exhausted = False
        for _ in range(depth):
            self._stage_next()

    def __next__(self) -> B:
        if not self._staged:
            error, self._error = self._error, None
            if error is not None:
                raise error
            raise StopIteration
        staged = self._staged.popleft()
        # Stage the following item before the caller enqueues work on this one, so that its
        # copy runs on the copy stream while the caller's step runs on its own stream.
        self._stage_next()
        return self._hand_over(staged)

    def _stage_next(self) -> None:
        if self._exhausted:
            return
        try:
            item = next(self._source)
        except StopIteration:
            self._exhausted = True
            return
        except Exception as exc:  # raised once the items before it are handed over
            self._exhausted = True
            self._error = exc
            return
        self._staged.append(self._stage(item))


def _stage(batch: B, stream: torch.cuda.Stream, device: torch.device) -> tuple[B, torch.cuda.Event]:
    """Start copying ``batch`` to ``device`` on the copy ``stream``; the event marks its end."""
    with torch.cuda.stream(stream):
        moved = _map_tensors(batch, lambda tensor: _copy_to(tensor, device))
        copied = torch.cuda.Event()
        copied.record(stream)
    return moved, copied


def upload_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy host ``source`` into device ``target`` without stalling the stream: from pinned
    memory, non_blocking (the host allocator keeps the pinned block until the copy has run)."""
    if target.device.type != "cuda":
        target.copy_(source)
        return
    target.copy_(source if source.is_pinned() else source.pin_memory(), non_blocking=True)


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device.type == "cpu" and not tensor.is_pinned():
        # from pageable memory a non_blocking copy would wait for the host staging copy
        tensor = tensor.pin_memory()
    # Dropping the pinned source after this is safe: the host allocator keeps its block until
    # the copy stream has passed the copy.
    return tensor.to(device, non_blocking=True)


def _hand_over(staged: tuple[B, torch.cuda.Event], device: torch.device) -> B:
    batch, copied = staged
    consumer = torch.cuda.current_stream(device)
    consumer.wait_event(copied)  # the step cannot start before its batch has arrived
    for tensor in _tensors(batch):
        if tensor.device == device:
            # allocated on the copy stream: without this the allocator could hand the memory to
            # the next copy as soon as the caller drops the batch, while its step still reads it
            tensor.record_stream(consumer)
    return batch


def _tensors(data: Any) -> Iterator[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, Mapping):
        for value in data.values():
            yield from _tensors(value)
    elif isinstance(data, (tuple, list)):
        for value in data:
            yield from _tensors(value)


def _map_tensors(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor in nested tuples/lists/mappings; other leaves unchanged.

    Containers are rebuilt as their own type where possible (namedtuples, ``BatchEncoding``),
    as :func:`pad_batch` does.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, {k: _map_tensors(v, fn) for k, v in data.items()})
    if isinstance(data, (tuple, list)):
        return _rebuild_sequence(data, [_map_tensors(v, fn) for v in data])
    return data
