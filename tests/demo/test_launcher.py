"""What ``ddpgraph train``'s launcher says: a disk that fills up (the reason on the console, exit
status 1, the partial checkpoint removed and the older ones kept), errors per rank, Ctrl-C before
the first checkpoint, restarts without checkpoints."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest

from ddpgraph.demo.train import REPORTED_EXIT, TrainConfig

from ..procs import on_tiny_disk

TINY = "1100k"  # room for one checkpoint of the MLP (~730 KiB), not for two


@pytest.mark.timeout(300)
def test_a_checkpoint_that_fills_the_disk_is_one_line_exit_1_and_the_older_one_is_kept(tmp_path):
    mount = tmp_path / "tiny"
    train = [sys.executable, "-m", "ddpgraph", "train", "--steps", "40", "--checkpoint-every",
             "10", "--out", f"{mount}/run"]  # fmt: skip
    script = f"{' '.join(train)}; code=$?; echo left: $(ls -A {mount}/run/checkpoints); exit $code"
    job = on_tiny_disk(mount, TINY, script, timeout=280)
    assert job.returncode == 1, job.stderr[-3000:]
    line = next(text for text in job.stderr.splitlines() if "failed: " in text)
    assert re.fullmatch(
        r"ddpgraph train: failed: CheckpointWriteError: save_checkpoint "
        rf"could not write the checkpoint of step 20 in {mount}/run/checkpoints: no space left "
        r"on the device \(0\.\d MiB free; .*\)\. Free space there or save elsewhere; the partial "
        r"\.step-00000020\.partial-\w+ was removed and the older checkpoints are kept\.",
        line,
    ), job.stderr
    assert "Traceback" not in job.stderr and "Root Cause" not in job.stderr
    (left,) = [text for text in job.stdout.splitlines() if text.startswith("left: ")]
    assert left == "left: latest step-00000010"  # no partial folder


@pytest.mark.timeout(300)
def test_run_json_on_a_full_disk_is_one_line_exit_1_after_the_metrics_and_nothing_half_written(
    tmp_path,
):
    mount = tmp_path / "full"
    train = f"{sys.executable} -m ddpgraph train --steps 4 --batch-size 8 --out {mount}/run"
    job = on_tiny_disk(mount, "256k", f"{train}; code=$?; echo left: $(ls -A {mount}/run); "
                       "exit $code", leave_free_kib=0, timeout=280)  # fmt: skip
    assert job.returncode == 1, job.stderr[-3000:]
    assert "│    0 │    cpu │" in job.stdout  # the metrics table came first
    (line,) = [text for text in job.stderr.splitlines() if "OutputWriteError" in text]
    assert re.fullmatch(
        rf"ddpgraph train: failed( on rank 0)?: OutputWriteError: could not write {mount}/run/"
        r"run\.json: no space left on the device \(0\.0 MiB free; \[Errno 28\] No space left on "
        r"device\)\. Free space there or pass another --out \(the metrics are in the table "
        r"above\); nothing half-written was left\.",
        line,
    ), job.stderr
    assert "Traceback" not in job.stderr + job.stdout and "Root Cause" not in job.stderr
    (left,) = [text for text in job.stdout.splitlines() if text.startswith("left:")]
    assert left == "left:"  # no run.json, no partial file, no report left behind


def test_workers_that_could_not_leave_their_reports_are_said_to_have_printed_them(tmp_path, capsys):
    from ddpgraph.demo.launch import _failed

    failures = {0: SimpleNamespace(exitcode=REPORTED_EXIT), 1: SimpleNamespace(exitcode=-15)}
    config = TrainConfig(out=str(tmp_path))
    assert _failed(config, SimpleNamespace(failures=failures, format_msg=lambda: "box")) == 1
    err = capsys.readouterr().err
    assert err == (
        "ddpgraph train: failed on rank(s) 0: the reason is above (no room for it in --out "
        f"{tmp_path})\n"
    )


def test_different_errors_are_said_per_rank_and_one_error_once(tmp_path, capsys):
    import json

    from ddpgraph.demo.launch import _failed
    from ddpgraph.demo.train import FAILED

    config = TrainConfig(out=str(tmp_path))
    for rank, message in enumerate(["a", "b"]):
        report = {"type": "ConfigError", "message": message, "usage": True}
        (tmp_path / FAILED.format(rank=rank)).write_text(json.dumps(report))
    failures = {r: SimpleNamespace(exitcode=REPORTED_EXIT) for r in (0, 1)}
    assert _failed(config, SimpleNamespace(failures=failures)) == 2
    err = capsys.readouterr().err
    assert "failed on rank(s) 0: ConfigError: a\n" in err
    assert "failed on rank(s) 1: ConfigError: b\n" in err


def test_ctrl_c_before_the_first_checkpoint_names_when_it_would_have_come(tmp_path):
    from ddpgraph.demo.launch import _interrupted

    config = TrainConfig(out=str(tmp_path), checkpoint_every=500)
    assert _interrupted(config, None, "SIGINT") == (
        "interrupted (SIGINT) before the first step; no checkpoint saved yet (the first comes at "
        "step 500), so a new run starts from step 0."
    )
    assert "pass --checkpoint-every N" in _interrupted(
        TrainConfig(out=str(tmp_path)), None, "SIGINT"
    )


def test_restarts_without_checkpoints_are_told_they_start_over(tmp_path):
    from ddpgraph.demo.launch import _notes

    (note,) = _notes(TrainConfig(out=str(tmp_path), max_restarts=2), 2)
    assert note == (
        "--max-restarts 2 without --checkpoint-every: a restart trains again from step 0; pass "
        "--checkpoint-every N to restart from the newest checkpoint."
    )
    assert _notes(TrainConfig(out=str(tmp_path), max_restarts=2, checkpoint_every=10), 2) == []
