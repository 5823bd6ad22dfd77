"""A small training job for the watchdog's fault tests, run as one process per rank.

``python -m tests.watchdog_job SCENARIO TIMEOUT STALL OUT_DIR`` with the launcher's variables
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) set, as a plain env:// job where rank 0 hosts the
store. Each step is plain DDP on gloo inside ``watchdog.watch("eager", step=...)``; the scenario
injects one fault. Each rank writes its progress to ``OUT_DIR/rank{r}.step`` and, on the way out,
``OUT_DIR/rank{r}.json`` (what it raised, its log lines); an exception still ends the process
with a traceback and a non-zero status, as in a user's script.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpgraph
from ddpgraph.distributed import watchdog

STEPS = 400
FAULT_STEP = 20
STEP_PAUSE_S = 0.02  # leaves the test time to act between steps


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[float, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.time(), record.levelname, record.getMessage()))


def main(scenario: str, timeout: float, stall: float, out: Path) -> None:
    rank = int(os.environ["RANK"])
    records = _Records()
    logging.getLogger("ddpgraph").addHandler(records)
    outcome: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    try:
        # the context manager shuts down on the way out, also after an error, so the process
        # ends with the exception's status, not with gloo's threads aborting at finalization
        with ddpgraph.init(backend="gloo", timeout=timeout, stall_warning=stall):
            outcome["result"] = _train(scenario, rank, out)
    except BaseException as exc:
        outcome["error"] = type(exc).__name__
        outcome["message"] = str(exc)
        outcome["missing"] = list(getattr(exc, "missing", ()))
        outcome["notes"] = list(getattr(exc, "__notes__", ()))
        outcome["failed_at"] = time.time()
        raise
    finally:
        outcome["log"] = records.lines
        (out / f"rank{rank}.json").write_text(json.dumps(outcome))


def _train(scenario: str, rank: int, out: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    last = FAULT_STEP + 3 if scenario in ("skip", "straggler") else STEPS
    for step in range(last):
        (out / f"rank{rank}.step").write_text(str(step))
        x = torch.randn(16, 8, generator=data)
        if step == FAULT_STEP:
            _before_step(scenario, rank, step)
        with watchdog.watch("eager", step=step, site="watchdog_job.py:train"):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        _extra_collective(scenario, rank, step)
        time.sleep(STEP_PAUSE_S)
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    if scenario == "skip" and rank == 1:
        time.sleep(120)  # alive, busy elsewhere: its peer waits in the collective it skipped
    return {"steps": last, "checksum": checksum}


def _before_step(scenario: str, rank: int, step: int) -> None:
    if scenario == "straggler" and rank == 1:
        time.sleep(float(os.environ["STRAGGLE_S"]))  # slow data loading, then catches up
    if scenario == "kill_in_object" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if scenario == "kill_in_object":
        ddpgraph.all_gather_object({"rank": rank, "step": step})


def _extra_collective(scenario: str, rank: int, step: int) -> None:
    """An explicit all-reduce after the step, where the kill and skip scenarios strike."""
    if scenario not in ("kill_in_allreduce", "skip"):
        return
    last = step == FAULT_STEP + 2
    with watchdog.watch("collective:all_reduce", site="watchdog_job.py:all_reduce"):
        if scenario == "kill_in_allreduce" and rank == 1 and step == FAULT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "skip" and rank == 1 and last:
            return  # skips the job's last all-reduce
        dist.all_reduce(torch.ones(4))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]))
