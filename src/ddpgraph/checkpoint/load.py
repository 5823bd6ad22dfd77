"""Loading: the newest committed checkpoint every rank can read, in place, so graphs stay valid."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._log import get_logger
from ..step.optim import restore_identities, tensor_slots
from .layout import (
    _STEP_DIR,
    MANIFEST,
    CheckpointError,
    _first_cause,
    checkpoint_problem,
    read_manifest,
    step_dirs,
)
from .save import _group, _quiet_single_process, wait_for_pending_save
from .state import _live_state, _opened, _Parts, _resolve, _set_rng_state


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    train_step: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    loader: Any = None,
    reshard: bool = False,
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

    ``reshard=True`` loads a checkpoint saved by another world size: model and optimizer (DCP
    reshards FSDP2's DTensor shards to this job's ranks; DDP's state is whole on every rank),
    scheduler and the TrainStep's counters. Each rank's RNG states and data position were saved
    per rank and have no counterpart here: they are left as they are, so the run continues, it
    does not resume exactly.
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
            other_world = manifest["world_size"] != world_size
            if other_world and not reshard:
                raise CheckpointError(
                    f"{path} was saved by {manifest['world_size']} rank(s), this job has "
                    f"{world_size}; resume with {manifest['world_size']} ranks (e.g. --nproc "
                    f"{manifest['world_size']}): RNG states and data positions are per rank "
                    "(or pass reshard=True to load model, optimizer and counters alone)."
                )
            state = _live_state(parts, rank)  # creates optimizer state that does not exist yet
            if other_world:  # per-rank entries: saved for other ranks
                state.pop("rng")
                state.pop("loader", None)
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
    from torch.distributed.checkpoint.api import CheckpointException

    from .._typed_torch import dcp_load

    try:
        with _quiet_single_process():
            dcp_load(state, checkpoint_id=path, no_dist=not distributed)
    except (Exception, CheckpointException) as exc:
        # _agreed names the rank
        return f"its data does not load ({_first_cause(exc, name_rank=False)})"
    return None


def _agreed(problem: str | None, distributed: bool) -> str | None:
    """``problem`` as every rank sees it: the first rank's that has one, or None on every rank."""
    if not distributed:
        return problem
    from ..distributed.objects import all_gather_object

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
        from ..distributed.objects import all_gather_object

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
        from ..distributed.objects import all_gather_object

        problems = dict(enumerate(all_gather_object(problem)))
    found = {rank: text for rank, text in problems.items() if text is not None}
    if not found:
        return
    first = min(found)
    ranks = "" if len(problems) == 1 else f"on rank(s) {sorted(found)}: "
    raise CheckpointError(ranks + str(found[first]))


def _misfit(path: Path, state: dict[str, Any]) -> str | None:
    """Missing or unexpected keys and shape mismatches of model and optimizer, named, or None."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from .._typed_torch import filesystem_reader

    saved = filesystem_reader(str(path)).read_metadata().state_dict_metadata
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
        # after the in-place loads: the graphs re-read the optimizer's LR tensors, the feed the
        # scheduler's count, fp16 its loss scale
        parts.train_step.load_extra_state(_opened(state["train_step"]))
    if parts.loader is not None and "loader" in state:
        parts.loader.load_state_dict(_opened(state["loader"][f"rank{rank}"]))
    if "rng" in state:
        _set_rng_state(_opened(state["rng"][f"rank{rank}"]))
