"""What ``ddpgraph train``'s launcher says: a disk that fills up (the reason on the console, exit
status 1, the partial checkpoint removed and the older ones kept), errors per rank, Ctrl-C before
the first checkpoint, restarts without checkpoints."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpgraph.demo.train import REPORTED_EXIT, TrainConfig

from ..procs import child_env

TINY = "1100k"  # room for one checkpoint of the MLP (~730 KiB), not for two


def _tiny_filesystem_works(where: Path) -> bool:
    """Whether this machine lets the test mount a tmpfs of its own (in a user and mount
    namespace: no root needed where unprivileged user namespaces are allowed)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={TINY} tmpfs {where}"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.timeout(300)
def test_a_checkpoint_that_fills_the_disk_is_one_line_exit_1_and_the_older_one_is_kept(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if not _tiny_filesystem_works(mount):
        pytest.skip("cannot mount a tmpfs here (unshare -rm is not permitted); the ENOSPC cases "
                    "of tests/test_checkpoint.py still run")  # fmt: skip
    train = [sys.executable, "-m", "ddpgraph", "train", "--steps", "40", "--checkpoint-every",
             "10", "--out", f"{mount}/run"]  # fmt: skip
    script = (
        f"mount -t tmpfs -o size={TINY} tmpfs {mount} && {' '.join(train)}; code=$?; "
        f"echo left: $(ls -A {mount}/run/checkpoints); exit $code"
    )
    job = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=child_env(),
                         capture_output=True, text=True, timeout=280)  # fmt: skip
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
