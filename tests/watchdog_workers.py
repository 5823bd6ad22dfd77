"""Module-level workers for the store barrier and watchdog tests (run by run_distributed)."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpgraph.distributed.store import store_barrier
from ddpgraph.errors import CollectiveTimeout


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


def gather_then_exit_at_once(timeout: float, absent: int) -> Any:
    """Ranks but ``absent`` gather with ``timeout``; each shuts down the moment it has its error
    (rank 0's store goes with it, as when its process exits)."""
    import ddpgraph

    ddpgraph.init(backend="gloo")
    rank = _rank()
    if rank == absent:
        time.sleep(timeout + 3)
        ddpgraph.shutdown()
        return "absent"
    try:
        ddpgraph.all_gather_object(rank, timeout=timeout)
        outcome: Any = "passed"
    except CollectiveTimeout as exc:
        outcome = (list(exc.missing), str(exc))
    ddpgraph.shutdown()
    return outcome


def _base_store(store: dist.Store) -> dist.Store:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _store_barrier(store: dist.Store, key: str) -> None:
    store.add(key, 1)
    while int(store.add(key, 0)) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)


def watchdog_keys_after_shutdown() -> dict[str, list[str]]:
    """After every rank's shutdown: watchdog threads left here, and (rank 0) watchdog keys left
    in the job's store."""
    import threading

    import ddpgraph
    from ddpgraph.distributed import watchdog

    base = _base_store(dist.distributed_c10d._get_default_store())
    with watchdog.watch("eager", step=1):
        time.sleep(1.5)  # heartbeats written
    ddpgraph.all_gather_object(0)  # and an object collective watched
    before = [k for k in base.list_keys() if "watchdog" in k] if _rank() == 0 else []
    _store_barrier(base, "test/listed")  # rank 0 has listed before anyone shuts down
    ddpgraph.shutdown()
    _store_barrier(base, "test/shut-down")
    threads = [t.name for t in threading.enumerate() if t.name.startswith("ddpgraph-watchdog")]
    keys = [k for k in base.list_keys() if "watchdog" in k] if _rank() == 0 else []
    base.add("test/read", 1)
    while _rank() == 0 and int(base.add("test/read", 0)) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)  # rank 0 keeps the store up until every rank is done with it
    return {"threads": threads, "keys": keys, "before": before}
