"""The watchdog on CUDA: a replay that never finishes ends the process with a report.

Each job runs in subprocesses (a hung GPU must not take pytest with it). Run on the GPU machine;
the NCCL test needs 2 GPUs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpgraph.distributed import watchdog

TIMEOUT_S = 5.0
REPO = Path(__file__).resolve().parents[2]


def _launch(scenario: str, world_size: int) -> list[subprocess.Popen[str]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    if world_size == 1:
        for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name)
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.gpu.watchdog_gpu_job", scenario, str(TIMEOUT_S)],
            cwd=REPO,
            env={**env, **({"RANK": str(r), "LOCAL_RANK": str(r)} if world_size > 1 else {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world_size)
    ]


def _finish(
    procs: list[subprocess.Popen[str]], limit: float
) -> list[tuple[int | None, str, float]]:
    """Exit status (None: killed at ``limit``), output and the time each ended."""
    deadline = time.monotonic() + limit
    results = []
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        results.append((code, proc.communicate()[0], time.time()))
    return results


def _replayed_at(output: str) -> float:
    line = next(line for line in output.splitlines() if line.startswith("REPLAYED"))
    return float(line.split()[2])


@pytest.mark.timeout(180)
def test_a_replay_that_never_finishes_is_reported_and_the_process_ends():
    [(code, output, ended)] = _finish(_launch("sleep", 1), 150)
    assert code == watchdog.EXIT_CODE, output
    assert "SYNCHRONIZE RETURNED" not in output
    assert "rank 0 has been in the CUDA graph replay of step 3" in output, output
    assert "(timeout 5s)" in output
    assert ended - _replayed_at(output) < TIMEOUT_S + 10, output


@pytest.mark.timeout(180)
def test_a_trainstep_replay_that_never_finishes_names_the_step():
    [(code, output, ended)] = _finish(_launch("trainstep_sleep", 1), 150)
    assert code == watchdog.EXIT_CODE, output
    assert "SYNCHRONIZE RETURNED" not in output
    assert "rank 0 has been in the CUDA graph replay of step 15" in output, output
    assert ended - _replayed_at(output) < TIMEOUT_S + 10, output


@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_hang_inside_a_replayed_nccl_all_reduce_names_the_rank_that_stopped():
    procs = _launch("nccl_hang", 2)
    (code0, output0, ended0), (code1, output1, _) = _finish(procs, 200)
    assert code0 not in (None, 0) and code1 not in (None, 0), (output0, output1)
    assert "the CUDA graph replay of step 3" in output0, output0
    assert "Behind: ranks [1]" in output0, output0
    assert "Behind: ranks [1]" in output1  # the same verdict, printed by the rank behind too
    assert ended0 - _replayed_at(output0) < TIMEOUT_S + 10, output0
