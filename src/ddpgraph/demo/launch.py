"""Start ``ddpgraph train``'s workers through torch.distributed's own elastic launcher."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, latest_checkpoint, read_manifest, step_dirs
from ..launch import default_nproc, run_local
from .train import SAME_ON_RESUME, TRAIN_SAMPLES, TrainConfig, run_worker


def launch_training(config: TrainConfig, *, nproc: int | None = None) -> int:
    """Run :func:`run_worker` on ``nproc`` local processes (torchrun --standalone); return an exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    workers = nproc or default_nproc()
    if torch.cuda.is_available() and workers > torch.cuda.device_count():
        print(
            f"ddpgraph train: --nproc {workers} is more than the {torch.cuda.device_count()} "
            f"visible GPU(s); each rank needs its own GPU. Use --nproc {torch.cuda.device_count()}.",
            file=sys.stderr,
        )
        return 2
    problem = _check_before_launch(config, workers)
    if problem:
        print(f"ddpgraph train: {problem}", file=sys.stderr)
        return 2
    try:
        run_local(run_worker, config, nproc=workers, name="train", max_restarts=config.max_restarts)
    except ChildFailedError as exc:
        print(f"ddpgraph train failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    return 0


def _check_before_launch(config: TrainConfig, workers: int) -> str | None:
    """What would make the run fail or hang after it started, found before any worker starts."""
    per_rank = TRAIN_SAMPLES // workers
    if config.batch_size > per_rank:
        # drop_last would leave every rank with no batch at all: the loop would never step
        return (
            f"--batch-size {config.batch_size} is more than the {per_rank} training samples each "
            f"of the {workers} rank(s) gets ({TRAIN_SAMPLES} in all); use --batch-size "
            f"{per_rank} or less."
        )
    out = Path(config.out)
    try:  # the metrics are written at the very end: find an unwritable --out before training
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        return f"--out {out} is not a writable directory ({exc.strerror or exc}); pick another."
    return _check_checkpoints(config, workers)


def _check_checkpoints(config: TrainConfig, workers: int) -> str | None:
    """--resume needs a checkpoint that fits this run; a fresh run must not find old ones."""
    if config.stop_after is not None and config.stop_after >= config.steps:
        return (
            f"--stop-after {config.stop_after} is not before --steps {config.steps}; use a "
            f"smaller --stop-after, or leave it out to train all {config.steps} steps."
        )
    found = latest_checkpoint(config.checkpoints)
    if not config.resume:
        if found is None or (config.checkpoint_every is None and config.stop_after is None):
            return None
        # a restart (--max-restarts) resumes from the newest checkpoint: it must be this run's
        return (
            f"--out {config.out} already holds checkpoints (newest: {found.name}); pass --resume "
            f"to continue that run, or pick another --out (or delete {config.checkpoints})."
        )
    if found is None:
        return (
            f"--resume found no checkpoint in {config.checkpoints}; start without --resume, or "
            "point --out at the directory of the run to continue."
        )
    return _check_fits_run(config, workers)


def _check_fits_run(config: TrainConfig, workers: int) -> str | None:
    """The newest checkpoint whose manifest reads must fit this run (the workers skip damaged
    checkpoints for older ones on their own, naming each)."""
    unreadable = []
    for found in step_dirs(config.checkpoints):
        try:
            manifest = read_manifest(found)
        except CheckpointError as exc:
            unreadable.append(f"{found.name}: {exc}")
            continue
        return _check_manifest_fits(config, workers, found, manifest)
    return (
        f"--resume found no loadable checkpoint in {config.checkpoints}: {'; '.join(unreadable)}; "
        "restore them from a copy, or start without --resume."
    )


def _check_manifest_fits(
    config: TrainConfig, workers: int, found: Path, manifest: dict
) -> str | None:
    if manifest.get("world_size") != workers:
        return (
            f"{found} was saved by {manifest.get('world_size')} rank(s), this run has {workers}; "
            f"resume with --nproc {manifest.get('world_size')}."
        )
    saved = manifest.get("extra", {}).get("config", {})
    ours = asdict(config)
    differ = [name for name in SAME_ON_RESUME if name in saved and saved[name] != ours[name]]
    if differ:
        flags = " ".join(f"--{n.replace('_', '-')} {saved[n]}" for n in differ)
        return (
            f"{found} was saved by a run with other options ({flags}); an exact resume needs "
            f"the same ones: add {flags}."
        )
    return None
