"""``DeviceData``: a data set held on the device, its batches gathered inside the captured step.

A 0.14 ms graphed step leaves no room for host work per batch: a DataLoader, ``prefetch`` or even
a gather indexed from Python each step costs as much as the step (benchmarks/loader.py). When
the data set fits in device memory (small models, RL policies, CIFAR-scale runs), a
``DeviceData`` keeps it there, computes each epoch's order once per epoch, and lets
``TrainStep`` gather each batch inside the step (``step(data)``): the batch index is a device
tensor that the step advances, so a replay needs no host work besides the launch, and
``TrainStep(steps_per_replay=K)`` puts K whole steps in one replay.

The order is exactly ``BatchSampler(DistributedSampler(range(n), num_replicas, rank,
shuffle=shuffle, seed=seed, drop_last=True), batch_size, drop_last=True)`` with
``set_epoch(epoch)``: the same batches a DataLoader run sees, so the two compare.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from .._checks import check_int
from .._globals import Global, process_global
from ..errors import ConfigError
from .prefetch import upload_into

__all__ = ["DeviceData", "fits_on_device", "on_epoch_end"]

_TOKENS: Global[Iterator[int]] = process_global(
    "device_data.tokens", itertools.count, reset_at_shutdown=False
)
# called when a loop's iteration over a DeviceData ends an epoch (TrainStep registers one that
# warns about an accumulation window left open); weak, so a hook never keeps its owner alive
_EPOCH_END_HOOKS: Global[list[weakref.WeakMethod[Callable[[DeviceData], None]]]] = process_global(
    "device_data.epoch_end_hooks", list, reset_at_shutdown=False
)


def on_epoch_end(hook: Callable[[DeviceData], None]) -> None:
    """Call the bound method ``hook(data)`` whenever ``for batch in data`` finishes an epoch of a
    DeviceData (``data.last_batch`` is the epoch's last; held weakly: it goes with its object)."""
    _EPOCH_END_HOOKS.value.append(weakref.WeakMethod(hook))


def _epoch_ended(data: DeviceData) -> None:
    alive = [ref for ref in _EPOCH_END_HOOKS.value if ref() is not None]
    _EPOCH_END_HOOKS.value[:] = alive
    for ref in alive:
        hook = ref()
        if hook is not None:
            hook(data)


# The share of the device's free memory a data set may take before ``fits_on_device`` says no:
# the model, its gradients, optimizer state and activations need the rest.
FIT_FRACTION = 0.25


class DeviceData:
    """Tensors of one data set on one device, read in shuffled, rank-sharded batches.

    ``DeviceData(x, y, batch_size=64)`` copies each tensor to ``device`` once (default: the
    device ``ddpgraph.init()`` bound this rank to; without it the first tensor's if that is a
    GPU, else the current CUDA device, else the CPU); every tensor is
    indexed along dim 0, so all must have the same length. ``channels_last=True`` stores image
    tensors (4-D) in NHWC, so batches come out channels_last for ``TrainStep(channels_last=True)``
    without a copy per step. ``num_replicas``/``rank`` default to the process group's. Each epoch has ``len(data)`` batches per rank, in the order
    ``BatchSampler(DistributedSampler(..., seed=seed, drop_last=True), batch_size,
    drop_last=True)`` gives for that epoch (:meth:`indices`).

    Use it as ``losses = step(data)``: the :class:`~ddpgraph.TrainStep` gathers the next batch
    (or ``steps_per_replay`` batches) on the device, inside its graph, and returns one loss per
    step. ``DeviceData({"input_ids": ids, "labels": labels}, batch_size=32)`` holds a mapping:
    its batches are passed as ``model(**batch)``, as ``step(batch)`` does with a dict.
    Iterating (``for x, y in data``) yields the rest of the current epoch's batches for
    loops that call ``step(x, y)`` or evaluate; each batch is gathered by the host then.

    :meth:`state_dict` / :meth:`load_state_dict` hold the epoch and the position in it; pass the
    object as ``loader=`` to :func:`~ddpgraph.save_checkpoint` for exact resume. Every rank
    builds its own ``DeviceData`` and calls the step the same number of times.
    """

    def __init__(
        self,
        *tensors: torch.Tensor | Mapping[str, torch.Tensor],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        device: torch.device | str | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        channels_last: bool = False,
    ) -> None:
        self.kind, self.names, values = _named(tensors)
        _check_tensors(values)
        check_int("batch_size", batch_size, minimum=1, fix="e.g. batch_size=64")
        check_int("seed", seed, minimum=None, fix="e.g. seed=0")
        for name, flag in (("shuffle", shuffle), ("channels_last", channels_last)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name}={flag!r} must be True or False.")
        replicas, rank = _replicas_and_rank(num_replicas, rank)
        self.device = _device(device, values)
        self.tensors = tuple(_placed(t, self.device, channels_last) for t in values)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = replicas
        self.rank = rank
        self._sampler: DistributedSampler[int] = DistributedSampler(
            range(len(values[0])),  # type: ignore[arg-type]
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.batches_per_epoch = self._sampler.num_samples // batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError(
                f"DeviceData holds {len(values[0])} samples, {self._sampler.num_samples} per "
                f"rank over {replicas} rank(s): not one batch of batch_size={batch_size}; use a "
                f"batch_size <= {max(self._sampler.num_samples, 1)} or more data."
            )
        self.token = next(_TOKENS.value)  # graphs are keyed by it: each reads this object's tensors
        # each gathered tensor's shape, dtype and device: what a step's graph is captured for
        self.batch_shapes = tuple(
            (torch.Size((batch_size, *t.shape[1:])), t.dtype, t.device) for t in self.tensors
        )
        self.epoch = 0
        self.position = 0  # batches of `epoch` consumed
        self.last_batch: tuple[torch.Tensor, ...] | None = None  # yielded last by iteration
        # two epochs' orders, so that K steps of one replay may run past an epoch's end
        self._order = torch.empty(
            (2 * self.batches_per_epoch, batch_size), dtype=torch.long, device=self.device
        )
        # the rows of _order the next batches are in (position, position + 1, ...): a step
        # gathers the first k, and advances them all, on the device
        self._rows = torch.empty(self.batches_per_epoch, dtype=torch.long, device=self.device)
        self._orders: dict[int, torch.Tensor] = {}  # each epoch's order, computed once
        self._load_window()

    # ------------------------------------------------------------------ facts
    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self.batches_per_epoch

    @property
    def num_samples(self) -> int:
        return len(self.tensors[0])

    @property
    def nbytes(self) -> int:
        """Device memory the data set takes (the orders besides: two epochs of int64 indices)."""
        return nbytes_of(self.tensors)

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in self.tensors
        )
        return (
            f"DeviceData({shapes} on {self.device}, batch_size={self.batch_size}, "
            f"{len(self)} batches per epoch on rank {self.rank} of {self.num_replicas}, "
            f"epoch {self.epoch} batch {self.position})"
        )

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices of ``epoch``, one row per batch (CPU, int64): what
        ``BatchSampler(DistributedSampler(...))`` yields after ``set_epoch(epoch)``."""
        self._sampler.set_epoch(epoch)
        order = torch.tensor(list(self._sampler), dtype=torch.long)
        usable = self.batches_per_epoch * self.batch_size
        return order[:usable].view(self.batches_per_epoch, self.batch_size)

    # ------------------------------------------------------------- gathering
    def next_batches(self, k: int) -> list[tuple[torch.Tensor, ...]]:
        """Gather the next ``k`` batches (one gather per tensor) and advance, on the device.

        Runs inside TrainStep's call (eager or captured), so it must not touch the host; the
        host's count moves with :meth:`advance`, once the call that consumed the batches is over.
        Each batch is a view of one gathered tensor: a few kernels per call, not per step.
        """
        samples = self._samples(k)
        self._rows.add_(k)
        gathered = [_gather(t, samples) for t in self.tensors]
        size = self.batch_size
        return [tuple(g[j * size : (j + 1) * size] for g in gathered) for j in range(k)]

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """:meth:`next_batches` of one."""
        return self.next_batches(1)[0]

    def peek(self) -> tuple[torch.Tensor, ...]:
        """The batch :meth:`next_batch` would gather, without advancing (compiling a model)."""
        return tuple(_gather(t, self._samples(1)) for t in self.tensors)

    def rewind(self) -> None:
        """Put the device cursor back at the host's position (after a call that failed midway
        had moved it): the next call gathers the batches that call would have."""
        self._load_window()

    def advance(self, batches: int) -> None:
        """The host's count after ``batches`` were gathered on the device (by :meth:`next_batch`).

        Past an epoch's end the window moves on one epoch (the next order is copied once per
        epoch) and the device cursor is set to the position in the new epoch.
        """
        self.position += batches
        if self.position < self.batches_per_epoch:
            return
        self.epoch += self.position // self.batches_per_epoch
        self.position %= self.batches_per_epoch
        self._load_window()

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch, one gathered batch at a time (host-driven): tuples,
        or dicts for a DeviceData built from a mapping."""
        epoch = self.epoch
        while self.epoch == epoch:
            batch = self.next_batch()
            self.advance(1)
            self.last_batch = batch
            yield dict(zip(self.names, batch)) if self.kind == "mapping" else batch
        _epoch_ended(self)  # runs once the loop asks past the last batch: after its last step

    # ------------------------------------------------------------- resuming
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches": self.position,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "num_replicas": self.num_replicas,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved epoch and batch; refuses a state of another data set or split."""
        ours = self.state_dict()
        differ = [
            f"{key}={state[key]!r} (here {ours[key]!r})"
            for key in ("num_samples", "batch_size", "num_replicas", "seed", "shuffle")
            if key in state and state[key] != ours[key]
        ]
        if differ:
            raise ConfigError(
                "this DeviceData state was saved for other data or another split: "
                f"{', '.join(differ)}; resume with the data, batch size, seed and world size "
                "the run was started with."
            )
        position = int(state["batches"])
        if not 0 <= position < self.batches_per_epoch:
            raise ConfigError(
                f"DeviceData state says batch {position} of an epoch of "
                f"{self.batches_per_epoch}; it belongs to another data set."
            )
        self.epoch, self.position = int(state["epoch"]), position
        self._load_window()

    # ------------------------------------------------------------- internals
    def _samples(self, k: int) -> torch.Tensor:
        """The sample indices of the next ``k`` batches, read at the device cursor."""
        return self._order.index_select(0, self._rows[:k]).view(-1)

    def _load_window(self) -> None:
        """Put this epoch's and the next one's orders on the device and the cursor at position."""
        window = (self.epoch, self.epoch + 1)
        self._orders = {
            e: self._orders[e] if e in self._orders else self.indices(e) for e in window
        }
        upload_into(self._order, torch.cat([self._orders[e] for e in window]))
        # a kernel with the bounds as arguments: no copy, no sync
        torch.arange(self.position, self.position + len(self._rows), out=self._rows)


def _placed(tensor: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    if channels_last and tensor.dim() == 4:
        return tensor.to(device).contiguous(memory_format=torch.channels_last)
    return tensor.to(device)


def _gather(tensor: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """``tensor[samples]``; a channels_last image tensor stays channels_last (gathered as the
    NHWC tensor it is in memory), so a channels_last model needs no copy per step."""
    nhwc = tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last)
    if nhwc and not tensor.is_contiguous():
        return tensor.permute(0, 2, 3, 1).index_select(0, samples).permute(0, 3, 1, 2)
    return tensor.index_select(0, samples)


def nbytes_of(tensors: Any) -> int:
    """The memory ``tensors`` take: what a DeviceData of them holds on its device."""
    return sum(t.numel() * t.element_size() for t in tensors)


def fits_on_device(nbytes: int, device: torch.device, fraction: float = FIT_FRACTION) -> bool:
    """Whether a data set of ``nbytes`` may live on ``device``: at most ``fraction`` of the
    free memory on CUDA; on CPU it is already in memory."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= fraction * free


# ---------------------------------------------------------------- checks
def _named(tensors: tuple[Any, ...]) -> tuple[str, tuple[str, ...], tuple[torch.Tensor, ...]]:
    """("mapping", keys, values) for one mapping (a batch passed as ``model(**batch)``), else
    ("args", "0", "1", ..., tensors) for positional tensors (``model(*inputs)``, target last)."""
    if len(tensors) == 1 and isinstance(tensors[0], Mapping):
        mapping = tensors[0]
        bad = [key for key in mapping if not isinstance(key, str)]
        if bad or not mapping:
            raise ConfigError(
                f"DeviceData's mapping needs string keys (the model's keyword arguments), got "
                f"{list(mapping)!r}."
            )
        return "mapping", tuple(mapping), tuple(mapping.values())
    return "args", tuple(str(i) for i in range(len(tensors))), tensors


def _check_tensors(tensors: tuple[Any, ...]) -> None:
    if not tensors:
        raise ConfigError(
            "DeviceData needs at least one tensor, e.g. DeviceData(x, y, batch_size=64)."
        )
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"DeviceData's tensor {i} is a {type(t).__name__}; pass tensors (for a "
                "TensorDataset: DeviceData(*dataset.tensors, batch_size=...))."
            )
        if t.dim() == 0:
            raise ConfigError(f"DeviceData's tensor {i} is 0-dim; samples are indexed on dim 0.")
    lengths = [len(t) for t in tensors]
    if len(set(lengths)) != 1:
        raise ConfigError(
            f"DeviceData's tensors have different lengths along dim 0: {lengths}; every tensor "
            "holds one entry per sample."
        )


def _replicas_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    grouped = dist.is_available() and dist.is_initialized()
    replicas = (
        num_replicas if num_replicas is not None else (dist.get_world_size() if grouped else 1)
    )
    rank = rank if rank is not None else (dist.get_rank() if grouped else 0)
    check_int("num_replicas", replicas, minimum=1, fix="the number of ranks")
    check_int("rank", rank, minimum=0, fix="this process's rank")
    if rank >= replicas:
        raise ConfigError(f"rank={rank} must be below num_replicas={replicas}.")
    return replicas, rank


def _device(device: torch.device | str | None, tensors: tuple[torch.Tensor, ...]) -> torch.device:
    from ..distributed.runtime import get_runtime

    if device is not None:
        chosen = torch.device(device)
        if chosen.type == "cuda" and chosen.index is None:  # "cuda": the current one, by index
            chosen = torch.device("cuda", torch.cuda.current_device())
        return chosen
    rt = get_runtime()
    if rt is not None:
        return rt.device
    if tensors[0].device.type != "cpu" or not torch.cuda.is_available():
        return tensors[0].device
    return torch.device("cuda", torch.cuda.current_device())
