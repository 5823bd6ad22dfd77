"""The console script's own behaviour: a ddpgraph error is its message unless --debug asks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .procs import child_env, run_python

BAD_LAUNCHER_ENV = {"RANK": "0", "WORLD_SIZE": "x"}  # init() refuses it with a ConfigError
MESSAGE = "WORLD_SIZE='x' is not an integer; launch with torchrun, which sets it"


@pytest.mark.timeout(120)
def test_a_ddpgraph_error_is_one_message_with_exit_2_and_the_traceback_only_with_debug(tmp_path):
    command = ["-m", "ddpgraph", "bench", "--quick", "--out", str(tmp_path / "b.json")]
    plain = run_python(command, env=BAD_LAUNCHER_ENV, timeout=100)
    assert plain.returncode == 2
    assert plain.stderr.startswith(f"ddpgraph: error: {MESSAGE}")
    assert "(rerun with --debug or DDPGRAPH_DEBUG=1 for the traceback)" in plain.stderr
    assert "Traceback" not in plain.stderr

    debug = run_python(["-m", "ddpgraph", "--debug", *command[2:]], env=BAD_LAUNCHER_ENV,
                       timeout=100)  # fmt: skip
    assert debug.returncode == 1  # Python's own exit status for an uncaught exception
    assert "Traceback (most recent call last)" in debug.stderr
    assert f"ddpgraph.errors.ConfigError: {MESSAGE}" in debug.stderr


# --- Ctrl-C: exit status 130 and one line, at any moment --------------------------------------


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ddpgraph", *args],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, which a terminal's Ctrl-C signals
    )


def _workers_importing_torch(parent: int) -> list[int]:
    """The multiprocessing workers ``parent`` started (torch's agent spawns them) that are
    importing torch: its library is loaded, the Python modules around it not yet all."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        if ppid == parent and b"spawn_main" in cmdline and _has_loaded_libtorch(stat.parent):
            found.append(int(stat.parent.name))
    return found


def _has_loaded_libtorch(process: Path) -> bool:
    try:
        return "libtorch" in (process / "maps").read_text()
    except OSError:
        return False


def _ctrl_c_once_workers_import_torch(job: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGINT to ``job``'s process group as soon as its workers are in the middle of importing
    torch (a second or more); the job's stdout and stderr."""
    try:
        deadline = time.monotonic() + 120
        while not _workers_importing_torch(job.pid):
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "no worker process within 120 s"
            time.sleep(0.005)
        os.killpg(job.pid, signal.SIGINT)
        return job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


@needs_proc
@pytest.mark.timeout(300)
def test_ctrl_c_while_the_train_workers_import_torch_is_exit_130_and_one_line(tmp_path):
    job = _start("train", "--steps", "100000", "--out", str(tmp_path / "run"))
    stdout, stderr = _ctrl_c_once_workers_import_torch(job)
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr + stdout and "KeyboardInterrupt" not in stderr
    (line,) = stderr.strip().splitlines()
    assert re.fullmatch(
        r"ddpgraph train: interrupted \(SIGINT\) (before the first step|at step \d+ of 100000); "
        r"no checkpoint saved, .*",
        line,
    ), stderr


@needs_proc
@pytest.mark.timeout(300)
def test_ctrl_c_during_the_doctor_self_test_is_exit_130_not_a_failed_check():
    job = _start("doctor")
    stdout, stderr = _ctrl_c_once_workers_import_torch(job)
    assert job.returncode == 130, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr + stdout and "SignalException" not in stdout + stderr
    assert "self-test processes" not in stdout  # not reported as a broken environment
    assert stderr.strip().splitlines()[-1] == "ddpgraph doctor: interrupted (SIGINT)"
