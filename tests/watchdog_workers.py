"""Module-level workers for the store barrier and watchdog tests (run by run_distributed)."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpgraph.errors import CollectiveTimeout
from ddpgraph.runtime import store_barrier


def _rank() -> int:
    return int(os.environ["RANK"])


def _coordination_store() -> dist.TCPStore:
    """A store for the test's own bookkeeping, hosted by rank 0 for the whole job."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=_rank() == 0,
        timeout=timedelta(seconds=60),
    )


def barrier_whose_host_leaves(iterations: int, timeout: float, absent: int) -> list[Any]:
    """Each iteration: rank 0 hosts a fresh store; every rank but ``absent`` enters a barrier on
    it, rank 1 a little later than rank 0 (so rank 0 times out first); rank 0 closes its store
    the moment it raises, as a process exiting would. Returns what each iteration raised."""
    rank, world_size = _rank(), int(os.environ["WORLD_SIZE"])
    coord = _coordination_store()
    outcomes: list[Any] = []
    for i in range(iterations):
        host = None
        if rank == 0:
            host = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
            coord.set(f"port{i}", str(host.port))
        port = int(coord.get(f"port{i}"))
        store = host or dist.TCPStore("127.0.0.1", port, None, is_master=False)
        coord.barrier(f"ready{i}", world_size)
        outcome: Any = "absent"
        if rank != absent:
            time.sleep(0.05 * (i % 4) * rank)  # rank 1 arrives up to 0.15 s after rank 0
            try:
                store_barrier(
                    store, "b", rank=rank, world_size=world_size,
                    timeout=timedelta(seconds=timeout), what="test barrier", fix="",
                )  # fmt: skip
                outcome = "passed"
            except CollectiveTimeout as exc:
                outcome = (list(exc.missing), str(exc))
            if host is not None:
                del store, host  # the store's host leaves right after raising
        outcomes.append(outcome)
        coord.barrier(f"done{i}", world_size)
    return outcomes
