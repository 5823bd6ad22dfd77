"""Module-level workers for the checkpoint tests (run by run_distributed on gloo, or in-process)."""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ddpgraph
from ddpgraph import (
    CheckpointError,
    ResumableLoader,
    TrainStep,
    load_checkpoint,
    save_checkpoint,
    save_checkpoint_async,
)


class Job:
    """A small model with BatchNorm, Adam, a scheduler, a TrainStep and a data loader."""

    def __init__(self, seed: int = 0, width: int = 16) -> None:
        torch.manual_seed(seed)
        self.model = _bare_model(width)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)
        self.step = TrainStep(
            self.model, self.optimizer, nn.CrossEntropyLoss(), scheduler=self.scheduler
        )
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
        self.batches = ResumableLoader(_Epochs(_batches(5, gen)))
        # ranks draw different dropout masks: a restored RNG must be the rank's own
        torch.manual_seed(100 + rank)

    def train(self, steps: int) -> None:
        done = 0
        while done < steps:
            for x, y in self.batches:
                self.step(x, y)
                self.scheduler.step()
                done += 1
                if done == steps:
                    return

    def save(self, directory: str | Path, step: int, **kwargs: Any) -> Path:
        return save_checkpoint(
            directory, step=step, train_step=self.step, loader=self.batches, **kwargs
        )

    def save_async(self, directory: str | Path, step: int, **kwargs: Any) -> Future[Path]:
        return save_checkpoint_async(
            directory, step=step, train_step=self.step, loader=self.batches, **kwargs
        )

    def load(self, directory: str | Path) -> dict[str, Any]:
        return load_checkpoint(directory, train_step=self.step, loader=self.batches)

    def tensors(self) -> list[torch.Tensor]:
        """Parameters, buffers and optimizer state: everything a captured graph reads."""
        state = [v for s in self.optimizer.state.values() for v in s.values()]
        lrs = [g["lr"] for g in self.optimizer.param_groups if isinstance(g["lr"], torch.Tensor)]
        return [*self.model.state_dict().values(), *state, *lrs]

    def snapshot(self) -> dict[str, Any]:
        return {
            "tensors": [t.detach().clone() for t in self.tensors()],
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "steps": self.step.report().steps,
            "position": self.batches.state_dict(),
        }


class _Epochs:
    """A fixed list of batches, iterable once per epoch, like a DataLoader without shuffling."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _batches(n: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.randn(8, 8, generator=gen), torch.randint(4, (8,), generator=gen)) for _ in range(n)
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---- multi-rank workers ----


def save_at_then_finish(directory: str, at: int, total: int, async_save: bool = False) -> dict:
    """Train to ``at``, save, train to ``total``; the reference an exact resume must match."""
    job = Job()
    job.train(at)
    save = job.save_async if async_save else job.save
    saved = save(directory, at, keep_last=2, note="hello")
    job.train(total - at)  # an async save writes while training goes on
    if isinstance(saved, Future):
        saved = saved.result()
        ddpgraph.checkpoint.wait_for_pending_save()
    final = job.snapshot()
    final["random"] = torch.rand(3)
    final["saved"] = str(saved)
    return final


def load_then_finish(directory: str, total: int) -> dict:
    """Train two other steps first (a different state), load, then train to ``total``."""
    job = Job(seed=7)
    job.train(2)
    before = [t.data_ptr() for t in job.tensors()]
    state = job.load(directory)
    after = [t.data_ptr() for t in job.tensors()]
    job.train(total - state["step"])
    final = job.snapshot()
    final["random"] = torch.rand(3)
    final["pointers_kept"] = before == after
    final["loaded"] = {k: str(v) if isinstance(v, Path) else v for k, v in state.items()}
    return final


def train_only(steps: int) -> list[torch.Tensor]:
    job = Job()
    job.train(steps)
    return job.snapshot()["tensors"]


def die_during_second_save(directory: str, victim: int, where: str) -> None:
    """Save step 2; during the save of step 4, SIGKILL rank ``victim`` at ``where``."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    job = Job()
    job.train(2)
    job.save(directory, 2)
    job.train(2)
    if torch.distributed.get_rank() == victim:
        if where == "write":  # while DCP writes this rank's tensors
            original = dcp_fs.FileSystemWriter.write_data

            def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
                original(self, plan, planner)
                os.kill(os.getpid(), signal.SIGKILL)

            dcp_fs.FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
        else:  # rank 0, after every rank's data and the metadata, before the rename
            ddpgraph.checkpoint.save._commit_on_rank0 = _die
    job.save(directory, 4)


def _die(*args: Any, **kwargs: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def load_expecting_error(
    directory: str, width: int = 16, only_rank: int | None = None
) -> BaseException | None:
    """Load into a job whose model may differ (``width``), on every rank or on ``only_rank``.

    DDP itself refuses parameters that differ across ranks, so the one-rank case loads a bare
    model (``model=``), as an application with its own replication might.
    """
    try:
        if only_rank is None:
            Job(width=width).load(directory)
        else:
            rank = torch.distributed.get_rank()
            load_checkpoint(directory, model=_bare_model(width if rank == only_rank else 16))
    except Exception as exc:
        return exc
    return None


def _bare_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 4)
    )


def save_a_rank_dependent_step(directory: str) -> BaseException | None:
    """Rank r saves step r: a bug every rank must be told about, before anything is written."""
    job = Job()
    try:
        job.save(directory, torch.distributed.get_rank())
    except Exception as exc:
        return exc
    return None


def async_save_then_shutdown(path: str) -> str | None:
    """shutdown() right after an async save: it must wait for the commit, not cut the writer's
    group from under it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddpgraph.save_checkpoint_async(path, step=1, model=model, optimizer=opt)
    ddpgraph.shutdown()
    found = ddpgraph.latest_checkpoint(path)
    return None if found is None else found.name


def load_with_one_rank_seeing_damage(directory: str, total: int, seer: int) -> dict:
    """As :func:`load_then_finish`, but rank ``seer`` alone finds the newest checkpoint damaged
    (as a rank with a stale file-system cache might): every rank must load the same older one."""
    from ddpgraph.checkpoint import layout, load

    newest = layout.step_dirs(directory)[0]
    real = load.checkpoint_problem  # as the loader calls it
    if torch.distributed.get_rank() == seer:
        load.checkpoint_problem = (  # type: ignore[assignment]
            lambda path: "seen damaged here" if path == newest else real(path)
        )
    try:
        return load_then_finish(directory, total)
    finally:
        load.checkpoint_problem = real  # type: ignore[assignment]


def save_into_a_full_disk(directory: str, victim: int, where: str) -> BaseException | None:
    """Save step 2; the save of step 4 meets ENOSPC on rank ``victim``: while DCP writes its
    tensors (``where="write"``), or on rank 0 while it commits (``"commit"``). Returns the
    error this rank raised (None: none)."""
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from ddpgraph.checkpoint import save as save_module

    job = Job()
    job.train(2)
    job.save(directory, 2, keep_last=2)
    job.train(2)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    module, name = (dcp_fs, "_write_item") if where == "write" else (save_module, "_write_synced")
    original = getattr(module, name)
    if rank == victim:
        setattr(module, name, full)
    try:
        job.save(directory, 4, keep_last=2)
    except CheckpointError as exc:
        return exc
    finally:  # the test process (one rank, no group) goes on with other tests
        setattr(module, name, original)
    return None
