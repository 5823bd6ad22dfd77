"""Start ``ddpgraph train``'s workers through torch.distributed's own elastic launcher."""

from __future__ import annotations

import logging
import sys
import uuid

import torch

from .train import TrainConfig, run_worker

CPU_WORKERS = 2


def default_nproc() -> int:
    """One worker per local GPU, or 2 CPU workers (gloo) where there is none."""
    return torch.cuda.device_count() if torch.cuda.is_available() else CPU_WORKERS


def launch_training(config: TrainConfig, *, nproc: int | None = None) -> int:
    """Run :func:`run_worker` on ``nproc`` local processes (torchrun --standalone); return an exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    workers = nproc or default_nproc()
    if torch.cuda.is_available() and workers > torch.cuda.device_count():
        print(
            f"ddpgraph train: --nproc {workers} is more than the {torch.cuda.device_count()} "
            f"visible GPU(s); each rank needs its own GPU. Use --nproc {torch.cuda.device_count()}.",
            file=sys.stderr,
        )
        return 2
    # The agent logs every rendezvous step at INFO; the user wants the training output.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=workers,
        run_id=f"ddpgraph-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(launch, run_worker)(config)
    except ChildFailedError as exc:
        print(f"ddpgraph train failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    return 0
