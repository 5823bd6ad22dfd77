"""``ddpgraph train`` resumes exactly: after --stop-after/--resume and after a rank is SIGKILLed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddpgraph import latest_checkpoint
from ddpgraph.cli import cli
from ddpgraph.demo.train import TrainConfig, run_worker
from ddpgraph.testing import run_distributed

from ..procs import sigint_default

STEPS = 200  # ~2 s of training on 2 CPU ranks: room to kill a rank after the first checkpoint


def run_job(out: Path, steps: int = STEPS, **options: object) -> list[dict]:
    """The workers of ``ddpgraph train`` without the CLI and elastic agent (seconds faster)."""
    config = TrainConfig(steps=steps, out=str(out), **options)  # type: ignore[arg-type]
    return run_distributed(run_worker, 2, init=False, args=(config,), timeout=120)


def final_hash(out: Path, steps: int = STEPS) -> str:
    run = json.loads((out / "run.json").read_text())
    assert run["steps_done"] == steps
    assert {r["params_sha256"] for r in run["ranks"]} == {run["params_sha256"]}  # replicas agree
    return str(run["params_sha256"])


@pytest.mark.timeout(200)
def test_interrupted_runs_end_bitwise_identical_to_an_uninterrupted_one(tmp_path):
    whole = tmp_path / "whole"
    run_job(whole)
    reference = final_hash(whole)

    # stopped at step 70 with a checkpoint, then resumed by a new job
    parts = tmp_path / "parts"
    run_job(parts, stop_after=70)
    assert final_hash(parts, 70) != reference
    metrics = run_job(parts, resume=True)
    assert [m["resumed_from"] for m in metrics] == [70, 70]
    assert final_hash(parts) == reference

    # a rank SIGKILLed mid-run: torch's elastic agent restarts both, they resume and finish
    killed = tmp_path / "killed"
    job = _start("--steps", str(STEPS), "--checkpoint-every", "25", "--max-restarts", "1",
                 "--out", str(killed))  # fmt: skip
    stdout, stderr = _after_first_checkpoint(
        job, killed, lambda: os.kill(_a_worker_pid(job.pid), signal.SIGKILL)
    )
    assert job.returncode == 0, stderr[-3000:]
    assert re.search(r"saved checkpoint of step \d+ in .*killed/checkpoints/step-", stderr)
    assert "resuming after a restart from step" in stdout, stdout[-2000:]
    run = json.loads((killed / "run.json").read_text())
    assert all(r["resumed_from"] > 0 for r in run["ranks"])
    assert final_hash(killed) == reference


@pytest.mark.timeout(200)
def test_a_truncated_newest_checkpoint_is_skipped_and_the_run_still_ends_exactly(tmp_path):
    # (the skip's warning, by name and reason, is checked in tests/test_checkpoint.py: workers
    # started by a forkserver made in an earlier test do not write to this test's stderr)
    whole = tmp_path / "whole"
    run_job(whole, steps=100)
    parts = tmp_path / "parts"
    run_job(parts, steps=100, checkpoint_every=20, stop_after=60)  # keeps step 40 and step 60
    shard = sorted((parts / "checkpoints" / "step-00000060").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    metrics = run_job(parts, steps=100, checkpoint_every=20, resume=True)
    assert [m["resumed_from"] for m in metrics] == [40, 40]  # every rank the same older one
    assert final_hash(parts, 100) == final_hash(whole, 100)


def test_resume_past_a_garbled_manifest_checks_the_next_one(tmp_path):
    out = tmp_path / "run"
    _fake_checkpoint(out, world_size=4)
    newer = out / "checkpoints" / "step-00000020"
    newer.mkdir()
    (newer / "ddpgraph.json").write_text("{garbled")
    result = CliRunner().invoke(cli, ["train", "--nproc", "2", "--resume", "--out", str(out)])
    assert result.exit_code == 2
    assert "step-00000010 was saved by 4 rank(s), this run has 2" in result.output
    (out / "checkpoints" / "step-00000010" / "ddpgraph.json").write_text("")
    result = CliRunner().invoke(cli, ["train", "--nproc", "2", "--resume", "--out", str(out)])
    assert result.exit_code == 2
    assert f"--resume found no loadable checkpoint in {out / 'checkpoints'}: " in result.output
    assert "step-00000020: " in result.output and "is not readable JSON" in result.output


def _start(*args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "ddpgraph", "train", "--nproc", "2", *args]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the finally above can end all of it
        preexec_fn=sigint_default,  # Ctrl-C reaches it also when the suite runs in background
    )


def _after_first_checkpoint(
    job: subprocess.Popen[str], out: Path, act: Callable[[], None]
) -> tuple[str, str]:
    """``act()`` once ``job`` saved its first checkpoint in ``out``; then the job's output."""
    try:
        _wait_for_checkpoint(out / "checkpoints", job)
        act()
        return job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def _wait_for_checkpoint(directory: Path, job: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while latest_checkpoint(directory) is None:
        assert job.poll() is None, "the job ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 60 s"
        time.sleep(0.01)


def _a_worker_pid(launcher: int) -> int:
    """The pid of the launcher's second training worker (read from /proc: Linux only).

    torch's agent sets RANK inside the worker after it starts, so /proc/PID/environ does not
    show it; the workers are the launcher's multiprocessing-spawn children, started in order.
    """
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and _descends_from(int(entry.name), launcher):
            workers.append(int(entry.name))
    assert len(workers) == 2, f"expected 2 workers under pid {launcher}, found {workers}"
    return max(workers)


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            # the parent pid is the 4th field, after "(comm)", which may itself hold spaces
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def _fake_checkpoint(out: Path, *, world_size: int = 2, **config: object) -> None:
    """What the launcher reads before starting workers: a committed directory and its manifest."""
    step = out / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    saved = {"model": "mlp", "steps": 300, "batch_size": 64, "lr": 0.05, "seed": 0, **config}
    manifest = {"step": 10, "world_size": world_size, "extra": {"config": saved}}
    (step / "ddpgraph.json").write_text(json.dumps(manifest))


def test_resume_problems_are_refused_before_any_worker_starts(tmp_path):
    def train(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli, ["train", "--nproc", "2", *args])
        return result.exit_code, result.output

    code, output = train("--resume", "--out", str(tmp_path / "none"))
    assert code == 2
    assert f"--resume found no checkpoint in {tmp_path / 'none' / 'checkpoints'}" in output

    code, output = train("--checkpoint-every", "0")
    assert code == 2 and "Invalid value for '--checkpoint-every': 0 is not in the range" in output

    code, output = train("--steps", "50", "--stop-after", "50", "--out", str(tmp_path / "a"))
    assert code == 2 and "--stop-after 50 is not before --steps 50" in output

    other = tmp_path / "other"
    _fake_checkpoint(other, lr=0.1, model="resnet")
    code, output = train("--resume", "--out", str(other))
    assert code == 2
    assert "was saved by a run with other options (--model resnet --lr 0.1)" in output

    wider = tmp_path / "wider"
    _fake_checkpoint(wider, world_size=4)
    code, output = train("--resume", "--out", str(wider))
    assert code == 2 and "was saved by 4 rank(s), this run has 2; resume with --nproc 4" in output

    # a fresh run must not find another run's checkpoints: a restart would resume from them
    code, output = train("--checkpoint-every", "5", "--out", str(wider))
    assert code == 2
    assert "already holds checkpoints (newest: step-00000010); pass --resume" in output


def test_timeout_reaches_init_and_run_json_records_the_hash(tmp_path, monkeypatch):
    import ddpgraph

    seen = []
    real_init = ddpgraph.init

    def init(**kwargs: object) -> ddpgraph.Runtime:
        seen.append(kwargs)
        return real_init(**kwargs)

    monkeypatch.setattr(ddpgraph, "init", init)
    run_worker(TrainConfig(steps=3, batch_size=16, out=str(tmp_path), timeout=7.5))
    assert seen == [{"timeout": 7.5, "stall_warning": 5.0}]  # not 1.9 s: ranks start apart
    run = json.loads((tmp_path / "run.json").read_text())
    assert len(run["params_sha256"]) == 64 and run["config"]["timeout"] == 7.5


def _train(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ddpgraph", "train", "--nproc", "2", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_a_run_says_where_it_stopped_saves_its_end_and_reports_worker_errors_plainly(tmp_path):
    out, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    first = _train("--steps", "60", "--stop-after", "30", "--checkpoint-every", "500",
                   "--out", str(out))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert (
        "ddpgraph train: note: --checkpoint-every 500 is not below the 30 steps this run trains: "
        "the only checkpoint will be the one at the end (step 30)" in first.stderr
    )
    assert (
        f"ddpgraph train: stopped at step 30 of 60 (--stop-after 30); checkpoint "
        f"{ckpt / 'step-00000030'}; continue with --resume: ddpgraph train --resume --out {out} "
        "--steps 60 --checkpoint-every 500 --nproc 2" in first.stderr
    )
    # a copy whose only checkpoint is damaged: the workers' error is one line, exit status 2
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    shard = sorted((broken / "checkpoints" / "step-00000030").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])

    second = _train("--steps", "60", "--resume", "--checkpoint-every", "500", "--out", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"finished all 60 steps; final checkpoint {ckpt / 'step-00000060'}" in second.stderr
    third = _train("--steps", "60", "--resume", "--out", str(out))  # nothing left: said at once
    assert third.returncode == 2
    assert f"{ckpt / 'step-00000060'} is the end of a finished run (step 60 of --steps 60)" in (
        third.stderr
    )

    failed = _train("--steps", "60", "--resume", "--out", str(broken))
    assert failed.returncode == 2, failed.stderr[-3000:]
    # the first rank to fail ends the job; a peer may be stopped before it reports the same
    assert re.search(
        r"ddpgraph train: failed: CheckpointError: no checkpoint in "
        + re.escape(f"{broken / 'checkpoints'} loads: step-00000030: {shard} is truncated (100 of"),
        failed.stderr,
    ), failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr and "--debug" in failed.stderr
    assert "Terminating process" not in failed.stderr
    assert not list(broken.glob(".failed-rank*"))  # read and removed by the launcher


@pytest.mark.timeout(200)
def test_ctrl_c_stops_every_worker_and_names_the_step_and_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    job = _start("--steps", "100000", "--checkpoint-every", "20", "--out", str(out))
    # as a terminal's Ctrl-C: SIGINT to the whole process group
    _, stderr = _after_first_checkpoint(job, out, lambda: os.killpg(job.pid, signal.SIGINT))
    assert job.returncode == 130, stderr[-3000:]
    found = re.search(
        r"ddpgraph train: interrupted \(SIGINT\) at step (\d+) of 100000; newest checkpoint: "
        r"step (\d+) \((.*)\); continue with --resume: ddpgraph train --resume --out (\S+) "
        r"--steps 100000 --checkpoint-every 20 --nproc 2",
        stderr,
    )
    assert found, stderr[-3000:]
    step, saved = int(found.group(1)), int(found.group(2))
    assert 20 <= saved <= step and found.group(3) == str(latest_checkpoint(out / "checkpoints"))
    assert "Traceback" not in stderr and "SignalException" not in stderr
    assert "death signal" not in stderr
    assert not (out / ".interrupted").exists()


def test_a_plain_run_is_told_of_old_checkpoints_it_leaves_and_a_restartable_one_refused(tmp_path):
    from ddpgraph.demo.launch import _check_checkpoints, _notes

    _fake_checkpoint(tmp_path)
    plain = TrainConfig(out=str(tmp_path))
    (note,) = _notes(plain, 2)
    assert note == (
        f"--out {tmp_path} holds checkpoints of an earlier run (newest: step-00000010); this run "
        f"neither uses nor replaces them. Pass --resume to continue that run, or delete "
        f"{tmp_path / 'checkpoints'} to start clean."
    )
    assert _check_checkpoints(plain, 2) is None
    # a restart would resume from them: refused, as with checkpointing on
    restartable = TrainConfig(out=str(tmp_path), max_restarts=1)
    problem = _check_checkpoints(restartable, 2)
    assert problem is not None and "already holds checkpoints (newest: step-00000010)" in problem
    assert _notes(TrainConfig(out=str(tmp_path / "fresh")), 2) == []


def test_a_reported_worker_error_is_one_line_per_message_and_other_endings_are_named(
    tmp_path, capsys
):
    from types import SimpleNamespace

    from ddpgraph.demo.launch import _failed
    from ddpgraph.demo.train import FAILED, REPORTED_EXIT

    config = TrainConfig(out=str(tmp_path))
    report = {"type": "CheckpointError", "message": "no checkpoint loads", "usage": True}
    (tmp_path / FAILED.format(rank=0)).write_text(json.dumps(report))
    failures = {
        0: SimpleNamespace(exitcode=REPORTED_EXIT),
        1: SimpleNamespace(exitcode=-15),
        2: SimpleNamespace(exitcode=143),  # handled the launcher's SIGTERM
    }
    assert _failed(config, SimpleNamespace(failures=failures)) == 2
    err = capsys.readouterr().err
    assert "ddpgraph train: failed: CheckpointError: no checkpoint loads\n" in err
    assert (
        "ddpgraph train: also ended: rank 1 (exit code -15), rank 2 (stopped by SIGTERM)\n" in err
    )
    assert not list(tmp_path.iterdir())  # the report is taken

    # a failure no rank reported: torch's own report, exit status 1
    failures = {1: SimpleNamespace(exitcode=-9)}
    crashed = SimpleNamespace(failures=failures, format_msg=lambda: "rank 1 got SIGKILL")
    assert _failed(config, crashed) == 1
    assert "ddpgraph train: failed:\nrank 1 got SIGKILL" in capsys.readouterr().err


@pytest.mark.timeout(200)
def test_device_data_and_the_dataloader_train_the_same_bits_and_run_json_says_which(tmp_path):
    """The two feeds of ``ddpgraph train``: batches gathered inside the step (2 a call) and the DataLoader through prefetch, with the same sampler order and LRs."""
    steps = 60
    device = run_job(tmp_path / "device", steps=steps, data="device")
    loader = run_job(tmp_path / "loader", steps=steps, data="loader")
    assert [m["data"] for m in device] == ["device", "device"]
    assert [m["steps_per_replay"] for m in device] == [2, 2]
    assert [m["data"] for m in loader] == ["loader", "loader"]
    assert final_hash(tmp_path / "device", steps) == final_hash(tmp_path / "loader", steps)
