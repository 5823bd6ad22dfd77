"""The exits nobody designed (issue 43): each case a newcomer met, now refused or said in one
line naming the value, the cause and the fix. The full-disk writes are in tests/test_bench.py and
tests/demo/test_launcher.py; the numbers of every option in tests/test_cli_numbers.py."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import ddpgraph as dg
from ddpgraph.cli import cli
from ddpgraph.demo.train import TrainConfig
from ddpgraph.distributed.launch import torchrun_args
from ddpgraph.errors import ConfigError

from .procs import child_env, on_tiny_disk, sigint_default

# --- checkpoints into a read-only folder -------------------------------------------------------

SAVE_INTO = """
import sys, torch, ddpgraph as dg
from torch import nn
model = nn.Linear(4, 2)
step = dg.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.MSELoss())
step(torch.randn(8, 4), torch.randn(8, 2))
try:
    dg.save_checkpoint(sys.argv[1], step=1, train_step=step)
except dg.CheckpointError as exc:
    print(exc)
"""


@pytest.mark.timeout(120)
def test_a_checkpoint_into_a_read_only_folder_asks_for_write_access_not_space(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(SAVE_INTO)
    mount = tmp_path / "ro"
    job = on_tiny_disk(mount, "1m", f"mount -o remount,ro {mount} && {sys.executable} {script} "
                       f"{mount}/ckpt", timeout=100)  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.startswith(
        f"save_checkpoint could not write the checkpoint of step 1 in {mount}/ckpt: {mount}/ckpt "
        "is not writable (rank 0: OSError: [Errno 30] Read-only file system"
    ), job.stdout
    assert "Make it writable or save elsewhere" in job.stdout
    assert "Free space" not in job.stdout
    # a read-only folder never got a partial folder: none is said to be removed (issue 50)
    assert "nothing of it was written and the older checkpoints are kept" in job.stdout
    assert "partial" not in job.stdout


# --- bench: Ctrl-C after a repeat, options that a run would ignore ------------------------------


@pytest.mark.timeout(200)
def test_ctrl_c_after_a_bench_repeat_is_exit_130_and_says_the_repeats_kept(tmp_path):
    out = tmp_path / "b.json"
    job = subprocess.Popen(
        [sys.executable, "-m", "ddpgraph", "bench", "--quick", "--steps", "3000", "--out", str(out)],
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=sigint_default,
    )  # fmt: skip
    try:
        assert job.stdout is not None
        for line in job.stdout:  # the first repeat's line: it is written now
            if line.startswith("[bench]"):
                break
        time.sleep(0.2)
        job.send_signal(signal.SIGINT)
        _, stderr = job.communicate(timeout=150)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"ddpgraph bench: interrupted (SIGINT); the 1 finished repeat(s) are in {out}"
    )
    assert out.exists() and not out.with_suffix(".png").exists()


def test_bench_refuses_varlen_with_fsdp2_instead_of_ignoring_it(tmp_path):
    result = CliRunner().invoke(
        cli, ["bench", "--varlen", "--parallel", "fsdp2", "--out", str(tmp_path / "f.json")]
    )
    assert result.exit_code == 2
    assert "--varlen: not used by a --parallel fsdp2 run" in result.output


def test_a_bench_usage_error_creates_no_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["bench", "--quick", "--parallel", "fsdp2", "--config", "mlp"])
    assert result.exit_code == 2 and "mlp: DDP config(s)" in result.output
    assert list(tmp_path.iterdir()) == []


# --- train: caps said, impossible resumes refused ----------------------------------------------


def test_steps_per_replay_above_one_epoch_is_said_with_the_number_used(tmp_path):
    from ddpgraph.demo.launch import _notes

    config = TrainConfig(out=str(tmp_path), steps=21, steps_per_replay=1000)
    assert _notes(config, 2) == [
        "--steps-per-replay 1000 is more than the 64 batches of one epoch on each rank (8192 "
        "samples / 2 rank(s) / --batch-size 64): a replay takes 64 steps at most."
    ]
    assert _notes(TrainConfig(out=str(tmp_path), steps_per_replay=64), 2) == []


def test_resume_with_stop_after_at_or_before_the_checkpoint_is_refused(tmp_path):
    from ddpgraph.demo.launch import _check_manifest_fits

    config = TrainConfig(out=str(tmp_path), steps=40, stop_after=10, resume=True)
    found = tmp_path / "checkpoints" / "step-00000020"
    manifest = {"step": 20, "world_size": 2, "extra": {}}
    assert _check_manifest_fits(config, 2, found, manifest) == (
        f"--stop-after 10 is not after step 20, where {found} resumes: there would be nothing to "
        "train. Pass a --stop-after between 21 and 39, or leave it out to train to step 40."
    )


# --- launch: node ranks outside the job, scripts that are not Python, a killed worker ----------


def test_a_node_rank_outside_the_job_is_refused_instead_of_waiting(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    with pytest.raises(ConfigError, match=r"--node-rank 5 is outside a job of --nnodes 2 \(node "):
        torchrun_args(["--nnodes", "2", "--node-rank", "5", str(script)])


def test_launching_a_text_file_is_one_usage_error_not_a_traceback_per_rank(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("These are my notes\nabout training.\n")
    result = CliRunner().invoke(cli, ["launch", "--nproc-per-node", "2", str(notes)])
    assert result.exit_code == 2
    assert (
        f"script '{notes}' is not Python (SyntaxError at line 1: invalid syntax)" in result.output
    )


def test_a_killed_worker_is_one_line_not_the_agents_traceback(capsys):
    from ddpgraph.distributed.launch import _ShutdownNoise

    try:
        raise RuntimeError("the agent's own poll loop")
    except RuntimeError:
        record = logging.LogRecord(
            "torch.distributed.elastic.multiprocessing.api", logging.ERROR, "api.py", 836,
            "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)",
            (-9, 0, 123, "launched_worker", "spawn"), sys.exc_info(),
        )  # fmt: skip
    assert _ShutdownNoise(reported_exits=(3,)).filter(record) is False
    assert capsys.readouterr().err == (
        "ddpgraph: worker 0 ended (killed by SIGKILL); stopping the others\n"
    )


# --- explain: a script is not a log -------------------------------------------------------------


def test_explain_refuses_a_script_and_points_to_lint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("buggy.py").write_text("import torch.distributed as dist\ndist.all_gather_object(o, x)\n")
    result = CliRunner().invoke(cli, ["explain", "buggy.py"])
    assert result.exit_code == 2
    assert "buggy.py is a Python script, not an error message. Check it with `ddpgraph lint " in (
        " ".join(result.output.split())
    )
    Path("run.log").write_text(
        'Traceback (most recent call last):\n  File "buggy.py", line 2\nRuntimeError: '
        "Connection closed by peer\n"
    )
    assert CliRunner().invoke(cli, ["explain", "run.log"]).exit_code in (0, 1)  # read as a log


# --- TrainStep: messages that name the value, the cause and the fix ---------------------------


def _step(model: nn.Module, loss_fn: nn.Module | None = None) -> dg.TrainStep:
    params = list(model.parameters()) or [nn.Parameter(torch.zeros(1))]
    return dg.TrainStep(model, torch.optim.SGD(params, lr=0.1), loss_fn=loss_fn)


def test_a_model_without_parameters_is_said_to_have_nothing_to_train():
    with pytest.raises(ConfigError, match=r"model with no parameters \(Sequential\): there is "):
        _step(nn.Sequential(nn.ReLU()), nn.CrossEntropyLoss())


def test_a_list_batch_is_told_to_unpack_and_a_number_is_named():
    step = _step(nn.Linear(4, 3), nn.CrossEntropyLoss())
    x, y = torch.randn(8, 4), torch.randint(3, (8,))
    with pytest.raises(TypeError, match=r"got one list of 2 item\(s\), not tensors; unpack it"):
        step([x, y])
    with pytest.raises(TypeError, match=r"batch element 0 is int 3, not a tensor; pass tensors"):
        step(3, 4)


class _KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, input: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.linear(input)


def test_a_mapping_batch_with_a_torch_loss_says_what_the_loss_gets():
    step = _step(_KeywordModel(), nn.CrossEntropyLoss())
    batch = {"input": torch.randn(8, 4), "labels": torch.randint(3, (8,))}
    with pytest.raises(TypeError, match=r"loss_fn=CrossEntropyLoss\(\) with a mapping batch gets"):
        step(batch)


def test_on_new_shape_error_without_a_graph_speaks_of_the_batches_it_holds():
    model = nn.Linear(4, 3)
    step = dg.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.CrossEntropyLoss(),
        on_new_shape="error",
    )
    for _ in range(30):  # past the warm-up: the step runs eagerly on the CPU, no graph
        step(torch.randn(8, 4), torch.randint(3, (8,)))
    with pytest.raises(ValueError) as raised:
        step(torch.randn(6, 4), torch.randint(3, (6,)))
    assert "but it holds batches of (8, 4) float32, (8,) int64 (the first after warm-up;" in str(
        raised.value
    )
    assert "its graph" not in str(raised.value) and "captured" not in str(raised.value)


@pytest.mark.parametrize(
    ("timeout", "warned_at"), [(1.0, 0.9), (7.5, 5.0), (20.0, None), (600.0, None)]
)
def test_a_short_train_timeout_warns_of_a_slow_rank_only_past_the_startup_skew(timeout, warned_at):
    from ddpgraph.demo.train import stall_warning

    assert stall_warning(timeout) == warned_at  # None: init's own default, a quarter
