"""Start ``ddpgraph train``'s workers through torch.distributed's own elastic launcher."""

from __future__ import annotations

import sys

import torch

from ..launch import default_nproc, run_local
from .train import TrainConfig, run_worker


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
    try:
        run_local(run_worker, config, nproc=workers, name="train")
    except ChildFailedError as exc:
        print(f"ddpgraph train failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    return 0
