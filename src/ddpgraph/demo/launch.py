"""Start ``ddpgraph train``'s workers through torch.distributed's own elastic launcher."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from ..launch import default_nproc, run_local
from .train import TRAIN_SAMPLES, TrainConfig, run_worker


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
        run_local(run_worker, config, nproc=workers, name="train")
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
    return None
