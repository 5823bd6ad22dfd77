"""Module-level worker functions for run_distributed (they must be importable by the workers)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import ddpgraph


def runtime_facts() -> dict:
    rt = ddpgraph.get_runtime()
    assert rt is not None
    t = torch.tensor([float(rt.rank + 1)])
    dist.all_reduce(t)
    return {
        "rank": rt.rank,
        "local_rank": rt.local_rank,
        "world_size": rt.world_size,
        "local_world_size": rt.local_world_size,
        "backend": rt.backend,
        "device": str(rt.device),
        "is_main": rt.is_main,
        "sum": t.item(),
    }


def init_with_fake_uuids(uuids: list[str]) -> None:
    """ddpgraph.init with each rank's device identity replaced by uuids[rank] (CI has no GPU)."""
    from ddpgraph.distributed import runtime

    rank = int(os.environ["RANK"])
    runtime.device_identity = lambda device: uuids[rank]  # type: ignore[assignment]
    ddpgraph.init(backend="gloo")


class _SlowReadStore:
    """A store whose reads of the device list lag on ranks > 0, as on a loaded machine."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self._store, self._rank = store, rank

    def get(self, key: str) -> bytes:
        if self._rank > 0 and key.endswith("/devices"):
            time.sleep(1.5)
        return self._store.get(key)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def init_with_fake_uuids_slow_readers(uuids: list[str]) -> None:
    """init_with_fake_uuids where rank 0, which hosts the store, reads the device list first."""
    from ddpgraph.distributed import runtime

    rank = int(os.environ["RANK"])
    rendezvous = runtime._rendezvous
    runtime._rendezvous = lambda launch, timeout: _SlowReadStore(  # type: ignore[assignment]
        rendezvous(launch, timeout), rank
    )
    init_with_fake_uuids(uuids)


def init_only() -> str:
    rt = ddpgraph.init(backend="gloo")
    return str(rt)


def init_skipped_on_rank1(timeout: float) -> None:
    if int(os.environ["RANK"]) == 1:
        time.sleep(timeout + 10)
    ddpgraph.init(backend="gloo", timeout=timeout)


def return_rank() -> int:
    return int(os.environ["RANK"])


def fail_on_rank(bad: int) -> int:
    rank = int(os.environ["RANK"])
    if rank == bad:
        raise KeyError(f"boom on {rank}")
    return rank


def fail_then_peers_block(bad: int) -> None:
    if dist.get_rank() == bad:
        raise ValueError("rank failed before the collective")
    dist.barrier()


def hang_on_rank(bad: int) -> int:
    rank = int(os.environ["RANK"])
    if rank == bad:
        time.sleep(3600)
    return rank


def exit_abruptly() -> None:
    os._exit(3)


def skip_a_collective_then_shut_down() -> dict:
    """Rank 1 skips the all_reduce that rank 0 enters, then shuts down (a user bug)."""
    ddpgraph.init(backend="gloo", timeout=60)
    started, error = time.perf_counter(), None
    if dist.get_rank() == 0:
        try:
            dist.all_reduce(torch.ones(4))
        except Exception as exc:
            error = str(exc)
    ddpgraph.shutdown()
    return {"seconds": time.perf_counter() - started, "error": error}


def adopt_with_fake_uuids(uuids: list[str], pretend_nccl: bool) -> str:
    """The application makes the group itself, then calls ddpgraph.init (CI has no GPU)."""
    from ddpgraph.distributed import runtime

    rank = int(os.environ["RANK"])
    runtime.device_identity = lambda device: uuids[rank]  # type: ignore[assignment]
    dist.init_process_group("gloo")
    if pretend_nccl:  # this worker process only: the device check is for NCCL groups
        dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]
    try:
        return str(ddpgraph.init().device)
    finally:
        dist.destroy_process_group()


def thread_counts() -> tuple[int, int]:
    """torch's intra-op thread count as the worker runs, and what its environment asked for."""
    return torch.get_num_threads(), int(os.environ["OMP_NUM_THREADS"])
