"""Checkpoints that lose nothing, on ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds the model, optimizer and LR scheduler (through torch's
``get_state_dict``/``set_state_dict``, keyed by parameter name), the :class:`TrainStep`'s counters,
every rank's RNG states (CPU and its CUDA device), the data position (a :class:`ResumableLoader`
or any object with ``state_dict``/``load_state_dict``), the step and the caller's ``extra`` values.

Layout of ``directory``::

    step-00000100/      one committed checkpoint: DCP's files, its ``.metadata``, ddpgraph.json
    step-00000200/
    latest              the newest committed directory's name (for people and tools)
    .step-00000300.partial-<token>/   a save in progress, or one a crash interrupted

A save writes into a ``.partial`` directory; once every rank's data and DCP's metadata are on
disk, rank 0 writes ``ddpgraph.json`` and renames the directory to ``step-N``: a writer killed at
any point before that rename leaves the earlier checkpoints as they were and loadable. Loading
takes the newest ``step-N`` that loads, and copies the values into the tensors the model and
optimizer already hold, so CUDA graphs captured over them stay valid. A newest checkpoint damaged
later (a truncated shard, a lost ``.metadata``, a garbled ``ddpgraph.json``) is skipped, by name
and reason, for the next older one; every rank agrees on which one it loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

import torch
import torch.distributed as dist
from torch import nn

from ._globals import Global, process_global
from ._log import get_logger
from .errors import ConfigError
from .optim import restore_identities, tensor_slots
from .runtime import on_shutdown

if TYPE_CHECKING:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from .step import TrainStep

__all__ = [
    "JSON",
    "CheckpointError",
    "ResumableLoader",
    "Stateful",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "save_checkpoint_async",
]

MANIFEST = "ddpgraph.json"
LATEST = "latest"
FORMAT_VERSION = 1
_DCP_METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_RESERVED_EXTRA = frozenset({"path"})  # keys load_checkpoint's result already uses


class CheckpointError(ConfigError):
    """A checkpoint cannot be saved or does not fit the job loading it (world size, model)."""


class Stateful(Protocol):
    """What a checkpoint takes besides the model and optimizer: an LR scheduler, a data position
    (:class:`ResumableLoader`), anything with these two methods. The shape of DCP's own
    ``torch.distributed.checkpoint.stateful.Stateful``, so either one fits the other."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


# What save_checkpoint's extra values may be (checked at run time: json.dumps must take them).
JSON: TypeAlias = bool | int | float | str | Sequence["JSON"] | Mapping[str, "JSON"] | None


# ---------------------------------------------------------------- the data position


class ResumableLoader:
    """Iterates a data loader epoch by epoch and remembers how far training got, for exact resume.

    ``iter(loader)`` runs one epoch: it calls ``sampler.set_epoch(epoch)`` (a
    ``DistributedSampler``'s shuffle depends on it) and yields the loader's batches, counting
    them. After a :func:`load_checkpoint`, the next epoch starts at the saved epoch and skips the
    batches already trained on, so a resumed run sees exactly the batches an uninterrupted one
    would. Skipped batches are drawn and dropped (they cost loading time, not training).

    Wrap the loader outermost (around any prefetching), so that what is counted is what the
    training step consumed, and save checkpoints after the step that used the batch.
    ``sampler`` defaults to ``loader.sampler``.
    """

    def __init__(self, loader: Iterable[Any], *, sampler: Any = None) -> None:
        self.loader = loader
        self.sampler = sampler if sampler is not None else getattr(loader, "sampler", None)
        self.epoch = 0
        self.batches = 0  # batches of `epoch` handed out so far

    def __iter__(self) -> Iterator[Any]:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self.epoch)
        skip = self.batches
        for i, batch in enumerate(self.loader):
            if i < skip:
                continue
            self.batches = i + 1
            yield batch
        self.epoch += 1
        self.batches = 0

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.batches = int(state["batches"])


# ---------------------------------------------------------------- finding checkpoints


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint under ``directory`` (or ``directory`` itself), or None.

    Committed: both metadata files exist. Whether it still loads is :func:`checkpoint_problem`'s
    question; :func:`load_checkpoint` skips one that does not.
    """
    root = Path(directory)
    if _is_committed(root):
        return root
    found = sorted(_committed(root), key=lambda item: item[0])
    return found[-1][1] if found else None


def _committed(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    result = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and _is_committed(entry):
            result.append((int(match.group(1)), entry))
    return result


def _is_committed(path: Path) -> bool:
    return (path / _DCP_METADATA).is_file() and (path / MANIFEST).is_file()


def step_dirs(directory: str | os.PathLike[str]) -> list[Path]:
    """Every ``step-N`` directory under ``directory``, newest first, whole or damaged; or
    ``[directory]`` when it is a checkpoint directory itself."""
    root = Path(directory)
    if _STEP_DIR.match(root.name) or (root / MANIFEST).exists() or (root / _DCP_METADATA).exists():
        return [root]
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), e) for e in root.iterdir() if (m := _STEP_DIR.match(e.name))]
    return [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]


def read_manifest(path: Path) -> dict[str, Any]:
    """``path``'s ddpgraph.json; :class:`CheckpointError` naming the file and what is wrong."""
    manifest = path / MANIFEST
    try:
        data = json.loads(manifest.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest} is missing") from None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise CheckpointError(f"{manifest} is not readable JSON ({exc})") from None
    if not isinstance(data, dict) or not all(
        isinstance(data.get(key), int) for key in ("step", "world_size")
    ):
        raise CheckpointError(f"{manifest} lacks its integer step and world_size")
    return data


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint ``path`` cannot load, found from its files without loading it, or None.

    Reads the manifest and DCP's ``.metadata`` (small), and compares each data file's size with
    the bytes the metadata places in it: a truncated or missing shard is found without reading it.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        read_manifest(path)
    except CheckpointError as exc:
        return str(exc)
    if not (path / _DCP_METADATA).is_file():
        return f"{path / _DCP_METADATA} (DCP's index of the saved values) is missing"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # an unpickling error of any type: the file is damaged
        return f"{path / _DCP_METADATA} is not readable ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"{shard} is missing"
        have = shard.stat().st_size
        if have < size:
            return f"{shard} is truncated ({have} of its {size} bytes)"
    return None


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# ---------------------------------------------------------------- what goes in


@dataclass
class _Parts:
    """The objects one checkpoint covers, resolved from the arguments."""

    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    scheduler: Stateful | None
    train_step: TrainStep | None
    loader: Stateful | None


def _resolve(
    caller: str,
    train_step: TrainStep | None,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Stateful | None,
    loader: Stateful | None,
) -> _Parts:
    if train_step is not None:
        if model is not None or optimizer is not None:
            raise ConfigError(
                f"{caller}: pass train_step= or model=/optimizer=, not both; the TrainStep "
                "already holds its model and optimizer."
            )
        if scheduler is not None and train_step.scheduler not in (None, scheduler):
            raise ConfigError(
                f"{caller}: scheduler= differs from the TrainStep's own scheduler; pass one."
            )
        model, optimizer = train_step.model, train_step.optimizer
        scheduler = scheduler if scheduler is not None else train_step.scheduler
    if model is None:
        raise ConfigError(
            f"{caller}: nothing to checkpoint; pass train_step=step, or model= (and optimizer=)."
        )
    if optimizer is None and scheduler is not None:
        raise ConfigError(f"{caller}: scheduler= needs the optimizer it drives; pass optimizer=.")
    for name, obj in (("loader", loader), ("scheduler", scheduler)):
        if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(
                f"{caller}: {name}={type(obj).__name__} has no state_dict()/load_state_dict(); "
                + (
                    "wrap the data loader in ddpgraph.ResumableLoader."
                    if name == "loader"
                    else "pass a torch.optim.lr_scheduler scheduler."
                )
            )
    return _Parts(model, optimizer, scheduler, train_step, loader)


def _live_state(parts: _Parts, rank: int) -> dict[str, Any]:
    """The checkpoint's state dict; its tensors *are* the live ones, so DCP loads in place.

    Model and optimizer come from torch's ``get_state_dict`` (keys are parameter names, DDP and
    torch.compile prefixes removed). Per-rank entries (RNG, data position) are keyed by rank:
    DCP keeps one copy of a key that every rank saves, which is right only for replicated state.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    assert parts.model is not None
    optimizers = () if parts.optimizer is None else (parts.optimizer,)
    if parts.optimizer is not None:
        _create_optimizer_state(parts.optimizer)
    model_state, optimizer_state = get_state_dict(parts.model, optimizers)
    state: dict[str, Any] = {"model": model_state}
    if parts.optimizer is not None:
        # hyperparameters as one value: whether "lr" is a float or a tensor must not matter
        groups = _Opaque(optimizer_state["param_groups"])
        state["optimizer"] = {**optimizer_state, "param_groups": groups}
    if parts.scheduler is not None:
        # its _last_lr holds floats until the first step with a tensor LR, tensors after it
        state["scheduler"] = _Opaque(parts.scheduler.state_dict())
    if parts.train_step is not None:
        state["train_step"] = _Opaque(_train_step_counters(parts.train_step))
    state["rng"] = {f"rank{rank}": _Opaque(_rng_state())}  # whole: with or without CUDA
    if parts.loader is not None:
        state["loader"] = {f"rank{rank}": _Opaque(parts.loader.state_dict())}
    return state


class _Opaque:
    """A value DCP stores whole (pickled) instead of flattening it key by key.

    DCP loads a flattened entry only where the live object has the same structure; the
    scheduler's or a loader's state changes shape during training (a float becomes a tensor, a
    list grows), which a resumed process has not seen yet. Tensors inside go to the CPU: DCP
    writes replicated values from rank 0, and a CUDA tensor would load onto rank 0's GPU.
    """

    def __init__(self, value: Any) -> None:
        self.value = _on_cpu(value)


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def _opened(value: Any) -> Any:
    return value.value if isinstance(value, _Opaque) else value


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped yet its state tensors, to be saved or loaded into.

    torch's ``get_state_dict`` does this itself with one step of zero gradients at LR 0, but it
    sets a tensor LR to a new *CPU* tensor for that step, which a graph-safe optimizer on CUDA
    (LR on the device, fused or capturable kernels) may refuse. Here the LR tensor is zeroed in
    place instead. The parameters do not change: the gradients and the LR are zero.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not params or any(p.grad is not None for p in params):
        return  # as torch's rule: gradients mean a step is under way; leave the optimizer be
    saved = []
    for group in optimizer.param_groups:
        lr = group["lr"]
        saved.append(lr.clone() if isinstance(lr, torch.Tensor) else lr)
        if isinstance(lr, torch.Tensor):
            lr.zero_()
        else:
            group["lr"] = 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved):
        if isinstance(lr, torch.Tensor):
            group["lr"].copy_(lr)
        else:
            group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call, unused-ignore]
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())


# ---------------------------------------------------------------- process group


def _group() -> tuple[int, int, bool]:
    """(rank, world_size, distributed) of the default group, or a single process without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


# (default group, its gloo group for async saves); dropped at shutdown with the group it serves
_ASYNC_GROUP: Global[tuple[Any, Any]] = process_global(
    "checkpoint.async_group", lambda: (None, None), reset_at_shutdown=True
)
_PENDING: Global[Future[Path] | None] = process_global(
    "checkpoint.pending_save", lambda: None, reset_at_shutdown=True
)


def _checkpoint_group() -> Any:
    """A gloo group for async saves, made once per process group (a collective: every rank
    saves together).

    DCP's background thread runs collectives; on the training group they would interleave with
    the training's own and hang or corrupt both. gloo because async_save needs a CPU backend.
    """
    world = dist.group.WORLD
    if _ASYNC_GROUP.value[0] is not world:  # first save, or a new init() since the last
        _ASYNC_GROUP.value = (world, dist.new_group(backend="gloo"))
    return _ASYNC_GROUP.value[1]


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every call without a process group; world size 1 is a case ddpgraph supports.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def wait_for_pending_save() -> None:
    """Block until the last async save of this process is committed (re-raising its error).

    :func:`ddpgraph.shutdown` calls it first (an ``on_shutdown`` hook): the save uses a group
    that shutdown destroys."""
    pending, _PENDING.value = _PENDING.value, None
    if pending is not None:
        pending.result()


on_shutdown(wait_for_pending_save)


# ---------------------------------------------------------------- save


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    step: int,
    train_step: TrainStep | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    loader: Stateful | None = None,
    keep_last: int | None = None,
    async_save: Literal[False] = False,  # deprecated: a type checker flags True, it still runs
    **extra: JSON,
) -> Path:
    """Save a checkpoint of ``step`` as ``directory/step-NNNNNNNN``. Call on every rank, together.

    Pass ``train_step=`` (its model, optimizer, scheduler and counters) or ``model=`` with
    ``optimizer=``/``scheduler=``. ``loader``: the data position (a :class:`ResumableLoader`, or
    anything with ``state_dict``/``load_state_dict``). ``extra``: JSON values returned by
    :func:`load_checkpoint` (e.g. ``best_loss=0.3``). ``keep_last=k`` deletes all but the newest
    ``k`` checkpoints after this one is committed.

    Returns the committed directory. To write in the background, call
    :func:`save_checkpoint_async`. ``async_save=True`` still does that (returning its
    :class:`~concurrent.futures.Future`), with a ``DeprecationWarning``: it is the one argument
    that changed what this function returns.
    """
    if async_save is not False:
        if async_save is not True:
            raise ConfigError(f"save_checkpoint: async_save={async_save!r} must be True or False.")
        warnings.warn(
            "save_checkpoint(..., async_save=True) is deprecated; call "
            "ddpgraph.save_checkpoint_async(...) with the same arguments, which returns the "
            "Future of the committed directory.",
            DeprecationWarning,
            stacklevel=2,
        )
        return save_checkpoint_async(
            directory, step=step, train_step=train_step, model=model, optimizer=optimizer,
            scheduler=scheduler, loader=loader, keep_last=keep_last, **extra,
        )  # fmt: skip
    save = _prepare(
        "save_checkpoint", directory, step, train_step, model, optimizer, scheduler, loader,
        keep_last, extra,
    )  # fmt: skip
    _write(save.state, save.partial, save.distributed)
    error = _commit_on_rank0(save)
    if save.distributed:
        # every rank learns whether rank 0's commit worked, so all raise alike or none does
        from .objects import broadcast_object

        error = broadcast_object(error, src=0)
    if error is not None:
        raise CheckpointError(error)
    get_logger().info("saved checkpoint of step %d in %s", step, save.final)
    return save.final


def save_checkpoint_async(
    directory: str | os.PathLike[str],
    *,
    step: int,
    train_step: TrainStep | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    loader: Stateful | None = None,
    keep_last: int | None = None,
    **extra: JSON,
) -> Future[Path]:
    """:func:`save_checkpoint`, written in the background. Call on every rank, together.

    The state is copied to host memory before this returns, so training may go on and change it;
    a background thread writes it (``torch.distributed.checkpoint.async_save``, over a gloo group
    of its own, so its collectives never meet the training's). Returns a
    :class:`~concurrent.futures.Future` of the committed directory; the checkpoint is committed
    once rank 0's future is done. The next save or load, and :func:`ddpgraph.shutdown`, wait for
    it (and raise its error, if it failed).
    """
    save = _prepare(
        "save_checkpoint_async", directory, step, train_step, model, optimizer, scheduler,
        loader, keep_last, extra,
    )  # fmt: skip
    return _save_async(save)


@dataclass(frozen=True)
class _Save:
    """One save, prepared: what goes in, where it is written, and what commits it."""

    state: dict[str, Any]
    root: Path
    partial: Path  # written first, renamed to ``final`` by rank 0 once complete
    step: int
    manifest: dict[str, Any]
    keep_last: int | None
    rank: int
    distributed: bool

    @property
    def final(self) -> Path:
        return self.root / step_dir_name(self.step)


def _prepare(
    caller: str,
    directory: str | os.PathLike[str],
    step: int,
    train_step: TrainStep | None,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Stateful | None,
    loader: Stateful | None,
    keep_last: int | None,
    extra: Mapping[str, JSON],
) -> _Save:
    """Check the arguments, wait for the last async save, agree on the in-progress directory."""
    _check_save_options(caller, step, keep_last, extra)
    parts = _resolve(caller, train_step, model, optimizer, scheduler, loader)
    wait_for_pending_save()
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise CheckpointError(
            f"{caller}: {root} is a file, not a directory; pass a directory (each checkpoint "
            f"goes in DIRECTORY/{step_dir_name(step)}), e.g. {root.parent / 'checkpoints'}."
        )
    rank, world_size, distributed = _group()
    partial = root / _agreed_partial_name(step, distributed)
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "torch": torch.__version__,
        "saved_at": time.time(),
        "extra": dict(extra),
    }
    state = _live_state(parts, rank)
    return _Save(state, root, partial, step, manifest, keep_last, rank, distributed)


def _check_save_options(
    caller: str, step: object, keep_last: object, extra: Mapping[str, object]
) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"{caller}: step={step!r} must be an integer >= 0.")
    if keep_last is not None and (
        not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
    ):
        raise ConfigError(f"{caller}: keep_last={keep_last!r} must be an integer >= 1 or None.")
    for key, value in extra.items():
        if key in _RESERVED_EXTRA:
            raise ConfigError(
                f"{caller}: extra key {key!r} is reserved (load_checkpoint returns it); rename it."
            )
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{caller}: extra value {key}={type(value).__name__} is not JSON ({exc}); "
                "pass numbers, strings, lists or dicts (tensors belong in the model or optimizer)."
            ) from None


def _agreed_partial_name(step: int, distributed: bool) -> str:
    """The in-progress directory's name, the same on every rank; every rank's step must agree."""
    name = f".{step_dir_name(step)}.partial-{uuid.uuid4().hex[:8]}"
    if not distributed:
        return name
    from .objects import all_gather_object

    proposals = all_gather_object((step, name))
    steps = [s for s, _ in proposals]
    if len(set(steps)) != 1:
        raise CheckpointError(
            f"save_checkpoint: ranks passed different steps {dict(enumerate(steps))}; every rank "
            "must save the same step, at the same point of training."
        )
    return str(proposals[0][1])


def _planner() -> DefaultSavePlanner:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    # DCP writes a key every rank holds once, from a rank of its choosing. DDP replicas are not
    # all equal: BatchNorm's running stats differ per rank until the next forward broadcasts
    # rank 0's. Rank 0's copy is the one training continues from, so rank 0 writes them.
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def _write(state: dict[str, Any], partial: Path, distributed: bool) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save

    try:
        with _quiet_single_process():
            save(state, checkpoint_id=partial, planner=_planner(), no_dist=not distributed)
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        raise CheckpointError(
            f"save_checkpoint could not write {partial} ({_first_cause(exc)}); check that "
            f"{partial.parent} is a writable directory with space."
        ) from None


def _save_async(save: _Save) -> Future[Path]:
    from torch.distributed.checkpoint.state_dict_saver import async_save

    group = _checkpoint_group() if save.distributed else None
    if not save.distributed:
        # the writer thread warns again after _quiet_single_process has ended; world size 1
        # without a process group is a supported case, not a mistake
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", module="torch.distributed"
        )
    with _quiet_single_process():
        response: Any = async_save(
            save.state,
            checkpoint_id=save.partial,
            planner=_planner(),
            process_group=group,
            no_dist=not save.distributed,
        )
    upload: Future[Any] = getattr(response, "upload_completion", response)
    done: Future[Path] = Future()

    def commit(finished: Future[Any]) -> None:
        # runs on DCP's writer thread once this rank's part (and, on rank 0, the metadata) is on disk
        try:
            finished.result()
            error = _commit_on_rank0(save)
            if error is not None:
                raise CheckpointError(error)
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(save.final)

    upload.add_done_callback(commit)
    _PENDING.value = done
    return done


def _commit_on_rank0(save: _Save) -> str | None:
    """Rank 0: manifest, rename to ``step-N``, ``latest``, pruning. Returns an error text or None.

    DCP's save returns on rank 0 only after every rank's data and the metadata are written, so
    the rename is the single moment the checkpoint becomes visible.
    """
    if save.rank != 0:
        return None
    root, partial, final = save.root, save.partial, save.final
    try:
        _write_synced(partial / MANIFEST, json.dumps(save.manifest, indent=2) + "\n")
        if final.exists():  # a resumed run saving a step again: replace the older copy
            stale = root / f".{final.name}.replaced-{uuid.uuid4().hex[:8]}"
            os.rename(final, stale)
            os.rename(partial, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(partial, final)
        _fsync_dir(root)
        _write_synced(root / LATEST, final.name + "\n", atomic=True)
        _prune(root, save.keep_last)
    except OSError as exc:
        return (
            f"could not commit the checkpoint of step {save.step} in {root}: {exc}; check that the "
            "directory is writable and has space."
        )
    return None


def _write_synced(path: Path, text: str, *, atomic: bool = False) -> None:
    target = path.with_name(path.name + ".tmp") if atomic else path
    with open(target, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep_last: int | None) -> None:
    # partial directories left by crashed saves: no save runs now (saves are serialised)
    for entry in root.iterdir():
        if entry.name.startswith(".step-") and (
            ".partial-" in entry.name or ".replaced-" in entry.name
        ):
            shutil.rmtree(entry, ignore_errors=True)
    if keep_last is None:
        return
    ordered = sorted(_committed(root), key=lambda item: item[0])
    for _, path in ordered[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- load


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    train_step: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    loader: Any = None,
) -> dict[str, Any]:
    """Load the newest committed checkpoint in ``directory`` (or that checkpoint directory itself).

    Call on every rank, with the same objects :func:`save_checkpoint` got. Values are copied into
    the tensors the model and optimizer already hold (their ``data_ptr`` do not change), so a
    captured TrainStep keeps replaying without re-capture. Also restores the scheduler, the
    TrainStep's counters, this rank's RNG states and the data position.

    A checkpoint damaged after its commit (a truncated or missing shard, no ``.metadata``, an
    unreadable ``ddpgraph.json``, data that fails to load) is skipped with a warning naming it and
    why, for the next older one; every rank loads the same one (a checkpoint any rank finds
    damaged is skipped by all).

    Returns ``{"step": ..., "path": ..., **extra}``. Raises :class:`CheckpointError` when there is
    no checkpoint, none loads (naming each with its reason), or the one to load was saved by
    another world size or for another model (naming the mismatching keys or shapes). Non-tensor values are unpickled: load only checkpoints you trust.
    """
    parts = _resolve("load_checkpoint", train_step, model, optimizer, scheduler, loader)
    wait_for_pending_save()
    rank, world_size, distributed = _group()
    candidates = _agreed_candidates(directory, distributed)
    if not candidates:
        raise CheckpointError(
            f"no checkpoint in {directory} (looked for step-N directories with "
            f"{MANIFEST}); save one with ddpgraph.save_checkpoint first, or start without resuming."
        )
    before: dict[tuple[int, str], torch.Tensor] | None = None
    skipped: list[str] = []
    for path, problem in candidates:
        if problem is None:
            manifest = read_manifest(path)  # checked on every rank above
            if manifest["world_size"] != world_size:
                raise CheckpointError(
                    f"{path} was saved by {manifest['world_size']} rank(s), this job has "
                    f"{world_size}; resume with {manifest['world_size']} ranks (e.g. --nproc "
                    f"{manifest['world_size']}): RNG states and data positions are per rank."
                )
            state = _live_state(parts, rank)  # creates optimizer state that does not exist yet
            if before is None:
                before = tensor_slots(parts.optimizer) if parts.optimizer is not None else {}
            _raise_on_any_rank(_misfit(path, state), distributed)
            problem = _agreed(_read_into(state, path, distributed), distributed)
        if problem is not None:
            skipped.append(f"{path.name}: {problem}")
            if rank == 0:  # every rank skips it alike: one report
                get_logger().warning(
                    "skipped checkpoint %s: %s; trying the next older one", path, problem
                )
            continue
        _apply(parts, state, rank, before or {})
        get_logger().info("loaded checkpoint of step %d from %s", manifest["step"], path)
        return {**manifest.get("extra", {}), "step": int(manifest["step"]), "path": path}
    raise CheckpointError(
        f"no checkpoint in {directory} loads: "
        + "; ".join(skipped)
        + ". Restore the damaged files from a copy, or start without resuming."
    )


def _read_into(state: dict[str, Any], path: Path, distributed: bool) -> str | None:
    """DCP's load of ``path`` into ``state``; what went wrong on this rank, or None.

    DCP gathers every rank's read errors and raises them on every rank as a
    ``CheckpointException`` (a ``BaseException``, which ``except Exception`` misses).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path, no_dist=not distributed)
    except (Exception, CheckpointException) as exc:
        # _agreed names the rank
        return f"its data does not load ({_first_cause(exc, name_rank=False)})"
    return None


def _first_cause(exc: BaseException, *, name_rank: bool = True) -> str:
    """The first underlying error of a DCP failure (it wraps each rank's), as ``[rank N: ]Type:
    text`` on one line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        rank, inner = min(failures.items(), key=lambda item: item[0])
        inner = getattr(inner, "exc", inner)  # a _WrappedException holds the real one
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            inner = inner[0]  # torch 2.13: (the exception, its FrameSummary list)
        return f"rank {rank}: {_one_line(inner)}" if name_rank else _one_line(inner)
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    """``Type: text`` on one line (an unpickling error's text has line breaks)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _agreed(problem: str | None, distributed: bool) -> str | None:
    """``problem`` as every rank sees it: the first rank's that has one, or None on every rank."""
    if not distributed:
        return problem
    from .objects import all_gather_object

    found = [(r, p) for r, p in enumerate(all_gather_object(problem)) if p is not None]
    return None if not found else f"{found[0][1]} (rank {found[0][0]})"


def _agreed_candidates(
    directory: str | os.PathLike[str], distributed: bool
) -> list[tuple[Path, str | None]]:
    """The step directories newest first, each with why it cannot load (None: it may), the same
    on every rank: a directory is usable only where every rank sees it and finds nothing wrong."""
    mine = {path.name: checkpoint_problem(path) for path in step_dirs(directory)}
    views = [mine]
    if distributed:
        from .objects import all_gather_object

        views = all_gather_object(mine)
    root = Path(directory)
    single = step_dirs(directory) == [root]
    names = {name for view in views for name in view}
    result = []
    for name in sorted(names, key=_step_of, reverse=True):
        missing = [r for r, view in enumerate(views) if name not in view]
        problems = [(r, view[name]) for r, view in enumerate(views) if view.get(name)]
        problem = None
        if missing:
            problem = (
                f"not visible on rank(s) {missing}; put {directory} on a file system every "
                "rank shares"
            )
        elif problems:
            r, text = problems[0]
            problem = text if len(views) == 1 else f"{text} (rank {r})"
        result.append((root if single else root / name, problem))
    return result


def _step_of(name: str) -> int:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else -1


def _raise_on_any_rank(problem: str | None, distributed: bool) -> None:
    """Raise ``problem`` on every rank when any rank has one (the others would wait in DCP)."""
    problems = {0: problem}
    if distributed:
        from .objects import all_gather_object

        problems = dict(enumerate(all_gather_object(problem)))
    found = {rank: text for rank, text in problems.items() if text is not None}
    if not found:
        return
    first = min(found)
    ranks = "" if len(problems) == 1 else f"on rank(s) {sorted(found)}: "
    raise CheckpointError(ranks + str(found[first]))


def _misfit(path: Path, state: dict[str, Any]) -> str | None:
    """Missing or unexpected keys and shape mismatches of model and optimizer, named, or None."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    wanted, _ = flatten_state_dict({k: state[k] for k in ("model", "optimizer") if k in state})
    # the model first: when it differs, the optimizer's differences only repeat it. Of the
    # optimizer, its per-parameter state only: hyperparameter keys vary across torch versions.
    for part, prefix in (("model", "model."), ("optimizer", "optimizer.state.")):
        if part not in state:
            continue  # not asked for: a model can be loaded without its optimizer
        mine = {k for k in wanted if k.startswith(prefix)}
        theirs = {k for k in saved if k.startswith(prefix)}
        problems = []
        if mine - theirs:
            problems.append(f"keys missing from the checkpoint: {_few(sorted(mine - theirs))}")
        if theirs - mine:
            problems.append(f"keys in the checkpoint but not here: {_few(sorted(theirs - mine))}")
        shapes = [
            f"{key} (checkpoint {size}, here {shape})"
            for key in sorted(mine & theirs)
            for size, shape in [_shapes(saved[key], wanted[key])]
            if size != shape
        ]
        if shapes:
            problems.append(f"shapes differ: {_few(shapes)}")
        if problems:
            return (
                f"{path} does not fit this {part}: {'; '.join(problems)}. Build the model and "
                "optimizer the same way as the run that saved it, or start without resuming."
            )
    return None


def _shapes(saved: Any, value: Any) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(saved shape, our shape) of a tensor entry; (None, None) for other values."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(saved, TensorStorageMetadata) and isinstance(value, torch.Tensor):
        return tuple(saved.size), tuple(value.shape)
    return None, None


def _few(keys: list[str], limit: int = 4) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _train_step_counters(train_step: Any) -> dict[str, Any]:
    """What a TrainStep holds besides model and optimizer: its step count, fp16's scale."""
    counters: dict[str, Any] = {"steps": train_step.report().steps}
    scaler = train_step.state_dict().get("scaler")
    if scaler is not None:
        counters["scaler"] = scaler
    return counters


def _apply(
    parts: _Parts, state: dict[str, Any], rank: int, before: dict[tuple[int, str], torch.Tensor]
) -> None:
    """After DCP filled the tensors: the non-tensor values, through torch's own loaders."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    assert parts.model is not None
    optimizers = () if parts.optimizer is None else (parts.optimizer,)
    optimizer_state = dict(state.get("optimizer", {}))
    if optimizer_state:
        optimizer_state["param_groups"] = _opened(optimizer_state["param_groups"])
    set_state_dict(
        parts.model, optimizers, model_state_dict=state["model"], optim_state_dict=optimizer_state
    )
    if parts.optimizer is not None:
        restore_identities(parts.optimizer, before)
    if parts.scheduler is not None:
        parts.scheduler.load_state_dict(_opened(state["scheduler"]))
    if parts.train_step is not None:
        # TrainStep's own in-place load: re-reads the optimizer's LR tensors and replay guard
        own = parts.train_step.state_dict()
        saved = _opened(state["train_step"])
        own["steps"] = int(saved["steps"])
        if "scaler" in saved:  # fp16's loss scale
            own["scaler"] = saved["scaler"]
        parts.train_step.load_state_dict(own)
    if parts.loader is not None:
        parts.loader.load_state_dict(_opened(state["loader"][f"rank{rank}"]))
    _set_rng_state(_opened(state["rng"][f"rank{rank}"]))
