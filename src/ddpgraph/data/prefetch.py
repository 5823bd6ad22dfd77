"""A prefetching loader: on CUDA the next batch is pinned and copied to the device on a side
stream while the current step runs, and handed over stream-ordered; on CPU it changes nothing.
:func:`upload_into` is the one pinned, non-blocking host-to-device copy (DeviceData's order
window and the step's LR table use it too).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch

from .._checks import check_int
from .._typed_torch import cuda_event, cuda_stream, torch_device
from ..errors import ConfigError
from .containers import rebuild_mapping, rebuild_sequence

__all__ = ["Prefetcher", "prefetch", "upload_into"]

B = TypeVar("B")


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
        resolved = torch_device(device)
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
        return torch.device("cuda", int(torch.cuda.current_device()))
    return resolved


class Prefetcher(Generic[B]):
    """The iterable :func:`prefetch` returns; see there."""

    def __init__(self, loader: Iterable[B], device: torch.device, *, depth: int = 1) -> None:
        if not isinstance(loader, Iterable):
            raise ConfigError(
                f"prefetch got a {type(loader).__name__}, which is not iterable; pass the "
                "DataLoader (or any iterable of batches)."
            )
        check_int("depth", depth, minimum=1, fix="depth=1 (the next batch) is usually enough")
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
            self._copy_stream = cuda_stream(self.device)
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
        copied = cuda_event()
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
        return rebuild_mapping(data, {k: _map_tensors(v, fn) for k, v in data.items()})
    if isinstance(data, (tuple, list)):
        return rebuild_sequence(data, [_map_tensors(v, fn) for v in data])
    return data
