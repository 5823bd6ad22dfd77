"""Saving: every rank writes its shard into a partial folder; rank 0 commits it atomically."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .._files import why_not_written, write_atomically
from .._globals import Global, process_global
from .._log import get_logger
from ..distributed.runtime import on_shutdown
from ..errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ..step import TrainStep

from .layout import (
    _RESERVED_EXTRA,
    FORMAT_VERSION,
    JSON,
    LATEST,
    MANIFEST,
    CheckpointError,
    Stateful,
    _committed,
    _first_cause,
    step_dir_name,
)
from .state import _live_state, _resolve


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (no space left, no permission): a failure of the run,
    not of its arguments. Its partial folder is removed; the older checkpoints are kept."""


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
    _write(save)
    error = _commit_on_rank0(save)
    if save.distributed:
        # every rank learns whether rank 0's commit worked, so all raise alike or none does
        from ..distributed.objects import broadcast_object

        error = broadcast_object(error, src=0)
    if error is not None:
        raise CheckpointWriteError(error)
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
    from ..distributed.objects import all_gather_object

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


def _write(save: _Save) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    partial = save.partial
    try:
        with _quiet_single_process():
            dcp_save(
                save.state, checkpoint_id=partial, planner=_planner(), no_dist=not save.distributed
            )
    except (CheckpointException, OSError) as exc:  # CheckpointException is a BaseException
        # DCP raises on every rank once every rank's writes have ended: nothing writes there now
        left = _remove_partial(save)
        message = str(_not_written("save_checkpoint", save, exc, partial_left=left))
        if save.distributed:  # rank 0's words (the free space it saw) on every rank
            from ..distributed.objects import broadcast_object

            message = broadcast_object(message, src=0)
        raise CheckpointWriteError(message) from None


def _not_written(
    caller: str, save: _Save, exc: BaseException, *, partial_left: bool = True
) -> CheckpointWriteError:
    """The error of a save whose writes failed, its likely reason first: a full disk shows as
    ENOSPC, or as torch's short-write check ("unexpected pos") in a shard's serialisation; a
    read-only folder as EROFS or EACCES (no space to free there). A partial folder is spoken of
    only where one was made (``partial_left``): a read-only folder never gets one."""
    reason, remedy = why_not_written(save.root, _first_cause(exc))
    left = (
        f"the partial {save.partial.name} was removed"
        if partial_left
        else "nothing of it was written"
    )
    return CheckpointWriteError(
        f"{caller} could not write the checkpoint of step {save.step} in {save.root}: {reason}. "
        f"{remedy} or save elsewhere; {left} and the older checkpoints are kept."
    )


def _remove_partial(save: _Save) -> bool:
    """Rank 0 removes a failed save's partial folder, so that it does not keep the disk full;
    whether there was one (rank 0's view; True elsewhere)."""
    if save.rank != 0:
        return True
    existed = save.partial.exists()
    shutil.rmtree(save.partial, ignore_errors=True)
    return existed


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
            _written(finished, save)
            error = _commit_on_rank0(save)
            if error is not None:
                raise CheckpointWriteError(error)
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(save.final)

    upload.add_done_callback(commit)
    _PENDING.value = done
    return done


def _written(finished: Future[Any], save: _Save) -> None:
    """An async save's writes ended: raise as :func:`_write` does if they failed."""
    try:
        finished.result()
    except BaseException as exc:
        from torch.distributed.checkpoint.api import CheckpointException

        if not isinstance(exc, (CheckpointException, OSError)):
            raise
        left = _remove_partial(save)
        raise _not_written("save_checkpoint_async", save, exc, partial_left=left) from None


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
        write_atomically(root / LATEST, (final.name + "\n").encode())
        _prune(root, save.keep_last)
    except OSError as exc:
        _remove_partial(save)
        reason, remedy = why_not_written(root, str(exc))
        return (
            f"could not commit the checkpoint of step {save.step} in {root}: {reason}. {remedy} "
            "or save elsewhere; the older checkpoints are kept."
        )
    return None


def _write_synced(path: Path, text: str) -> None:
    # inside the partial directory, which one rename makes visible: no rename of its own
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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
