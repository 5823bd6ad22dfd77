"""The console script's own behaviour: a ddpgraph error is its message unless --debug asks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddpgraph.cli import cli

from .procs import child_env, run_python, sigint_default

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


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ddpgraph", *args],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, which a terminal's Ctrl-C signals
        preexec_fn=sigint_default,  # as from a terminal, also when the suite runs in background
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


@needs_proc
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "command", [["train", "--steps", "100000"], ["doctor"], ["bench", "--quick"]]
)
def test_ctrl_c_while_the_command_itself_imports_torch_is_exit_130_and_one_line(command, tmp_path):
    job = _start(*command, *(["--out", str(tmp_path / "out")] if command[0] != "doctor" else []))
    try:
        deadline = time.monotonic() + 120
        while not _has_loaded_libtorch(Path(f"/proc/{job.pid}")):
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "torch not loaded within 120 s"
            time.sleep(0.002)
        os.killpg(job.pid, signal.SIGINT)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stderr
    (line,) = [text for text in stderr.splitlines() if "interrupted" in text]
    assert re.match(rf"ddpgraph( {command[0]})?: interrupted \(SIGINT\)", line), stderr


@needs_proc
@pytest.mark.timeout(300)
def test_ctrl_c_while_the_train_workers_import_torch_is_exit_130_and_one_line(tmp_path):
    job = _start("train", "--steps", "100000", "--out", str(tmp_path / "run"))
    stdout, stderr = _ctrl_c_once_workers_import_torch(job)
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr + stdout and "KeyboardInterrupt" not in stderr
    starting, line = stderr.strip().splitlines()  # the first line is said before the workers
    assert starting == f"ddpgraph train: starting 2 worker(s) (CPU, gloo); --out {tmp_path}/run"
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


# --- every subcommand: --help, and one bad value per option, without a traceback --------------


def _bad_values(tmp_path: Path) -> dict[str, list[list[str]]]:
    """For each subcommand, argument lists with one bad value each (one per option)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return {
        "train": [
            ["--model", "nope"],
            ["--steps", "0"],
            ["--batch-size", "x"],
            ["--lr", "0"],
            ["--lr", "nan"],
            ["--lr", "inf"],
            ["--lr", "1e9"],
            ["--nproc", "0"],
            ["--seed", "x"],
            ["--out", str(a_file)],  # a file, not a directory
            ["--timeout", "-1"],
            ["--timeout", "nan"],
            ["--timeout", "inf"],
            ["--timeout", "0.001"],
            ["--checkpoint-every", "0"],
            ["--resume=yes"],
            ["--stop-after", "0"],
            ["--max-restarts", "-1"],
            ["--data", "disk"],
            ["--steps-per-replay", "0"],
            ["--parallel", "zero"],
        ],
        "bench": [
            ["--config", "nope"],
            ["--mode", "nope"],
            ["--steps", "4"],
            ["--repeats", "0"],
            ["--quick=yes"],
            ["--varlen=yes"],
            ["--varlen", "--hf", "nope", "--out", str(tmp_path / "hf.json")],
            ["--out", str(a_file / "b.json")],  # in a file, not a folder
            ["--parallel", "zero"],
            ["--parallel", "fsdp2", "--config", "mlp", "--out", str(tmp_path / "f.json")],
        ],
        "lint": [["--format", "xml", __file__], ["--strict=yes", __file__], []],
        "explain": [[""], []],
        "doctor": [
            ["--json=yes"],
            ["--nproc", "0"],
            ["--timeout", "0"],
            ["--timeout", "nan"],
            ["--timeout", "inf"],
        ],
        "launch": [
            [],
            ["--nproc-per-node", "0", __file__],
            ["--nproc-per-node", "abc", __file__],
            ["--nnodes", "0", __file__],
            ["--nnodes", "2:1", __file__],
            ["--node-rank", "-1", __file__],
            ["--max-restarts", "-1", __file__],
            ["--monitor-interval", "nan", __file__],
            ["--monitor-interval", "inf", __file__],
            ["--rdzv-conf", "x", __file__],
            ["--rdzv-backend", "nope", __file__],
            ["--no-such-option", __file__],
        ],
    }


def _float_options(command: str) -> list[str]:
    import click

    return [
        p.opts[0]
        for p in cli.commands[command].params
        if isinstance(p.type, (click.FloatRange, type(click.FLOAT)))
    ]


def test_every_subcommand_has_help_and_refuses_each_bad_value_in_one_message(tmp_path):
    bad = _bad_values(tmp_path)
    assert set(bad) == set(cli.commands)  # a new subcommand needs its bad values here
    runner = CliRunner()
    for command, cases in bad.items():
        shown = runner.invoke(cli, [command, "--help"])
        assert shown.exit_code == 0 and "Usage:" in shown.output, (command, shown.output)
        options = {p.opts[0] for p in cli.commands[command].params if p.opts[0].startswith("-")}
        tried = {arg.split("=")[0] for case in cases for arg in case if arg.startswith("--")}
        assert options <= tried, f"{command}: no bad value for {sorted(options - tried)}"
        for option in _float_options(command):  # nan passes click's own ranges
            for value in ("nan", "inf"):
                assert [option, value] in cases, f"{command} {option} {value}: not tried"
        for args in cases:
            result = runner.invoke(cli, [command, *args])
            where = f"ddpgraph {command} {' '.join(args)}:\n{result.output}"
            assert result.exit_code == 2, where
            assert isinstance(result.exception, SystemExit), where  # not a crash
            assert "Traceback" not in result.output, where
            assert "Error" in result.output or "error" in result.output, where
    for args in (["--nope"], ["nope"]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 2 and "Traceback" not in result.output


# --- nothing silently ignored ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hf", "gpt2"], "--hf runs real transformers models on variable-length batches"),
        (["--varlen", "--steps", "8"], "--steps: not used by a --varlen run"),
        (["--varlen", "--config", "mlp", "--mode", "train_step"], "--config, --mode: not used"),
        (["--varlen", "--hf", "gpt2", "--quick"], "--quick: not used by a --varlen --hf run"),
        (["--parallel", "fsdp2", "--mode", "train_step"], "--mode: not used by a --parallel fsdp2"),
        (
            ["--config", "mlp", "--mode", "train_step_fp16"],
            "train_step_fp16 does not apply to mlp (fp16 is measured next to the bf16 configs",
        ),
        (
            ["--quick", "--mode", "train_step_channels_last"],
            "train_step_channels_last does not apply to --quick's tiny MLP (channels_last "
            "applies to conv nets only)",
        ),
        (
            ["--parallel", "fsdp2", "--config", "mlp", "--config", "resnet50"],
            "mlp, resnet50: DDP config(s); --parallel fsdp2 runs transformer and transformer-large",
        ),
    ],
)
def test_a_bench_option_its_run_would_ignore_is_refused(args, message, tmp_path):
    result = CliRunner().invoke(cli, ["bench", *args, "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not (tmp_path / "r.json").exists()


def test_a_bench_mode_measured_on_some_configs_only_says_where_it_is_not(tmp_path, monkeypatch):
    import ddpgraph.bench

    monkeypatch.setattr(ddpgraph.bench, "run_bench", _fake_bench_run)
    monkeypatch.setattr(ddpgraph.bench, "torchvision_problem", lambda: None)  # as if installed
    args = ["--config", "mlp", "--config", "resnet50", "--mode", "train_step_channels_last"]
    result = CliRunner().invoke(cli, ["bench", *args, "--out", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    assert (
        "ddpgraph bench: note: train_step_channels_last is not measured on mlp (channels_last "
        "applies to conv nets only)"
    ) in result.output


@pytest.mark.skipif(not Path("/proc/version").exists(), reason="needs Linux's /proc")
def test_a_bench_out_that_cannot_be_opened_says_the_error_opening_it_gave():
    import errno

    try:
        open("/proc/version", "a").close()
    except OSError as exc:
        expected = exc.strerror
    else:
        pytest.skip("/proc/version is writable here")
    result = CliRunner().invoke(cli, ["bench", "--quick", "--out", "/proc/version"])
    assert result.exit_code == 2
    assert f"/proc/version cannot be written ({expected}); pick another file." in (
        " ".join(result.output.split())
    )
    assert os.strerror(errno.ENOENT) not in result.output


@pytest.mark.parametrize("command", ["bench", "train"])
def test_an_empty_out_is_refused_as_empty_not_taken_as_the_working_folder(command, tmp_path):
    result = CliRunner().invoke(cli, [command, "--out", ""])
    assert result.exit_code == 2
    assert "Invalid value for '--out': empty; pass where to write, e.g. " in result.output
    assert "foreign" not in result.output and "delete" not in result.output


def test_train_refuses_steps_per_replay_with_the_loader_feed(tmp_path):
    args = ["train", "--data", "loader", "--steps-per-replay", "4", "--out", str(tmp_path)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert "Invalid value for '--steps-per-replay': 4: steps per replay take their batches" in (
        " ".join(result.output.split())
    )
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_lint_refuses_a_file_that_is_not_python(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("x = 1\n")  # parses as Python, but is not a script
    result = CliRunner().invoke(cli, ["lint", str(notes)])
    assert result.exit_code == 2
    assert f"error: {notes}: is not a Python file" in result.output
    script = tmp_path / "train"
    script.write_text("#!/usr/bin/env python3\nx = 1\n")
    assert CliRunner().invoke(cli, ["lint", str(script)]).exit_code == 0  # a #! line will do


def test_explain_of_nothing_says_so():
    result = CliRunner().invoke(cli, ["explain", ""])
    assert result.exit_code == 2 and "Invalid value for 'SOURCE': empty; pass" in result.output
    result = CliRunner().invoke(cli, ["explain", "-"], input="  \n")
    assert result.exit_code == 2 and "no text on stdin; pipe the error" in result.output
    assert "directory" not in result.output and "No known explanation" not in result.output


# --- bench: every path said, one result set per --out -----------------------------------------


def _fake_bench_run(names, *, modes, steps, repeats, quick, out):
    from ddpgraph.bench import write_outputs

    run = {m: {"median_ms": 1.0, "first_fast_step_s": 0.1} for m in ("eager_ddp", "train_step")}
    write_outputs({"environment": {}, "world_size": 1, "configs": {"c": {"runs": [run]}}}, out)


def test_bench_says_every_path_it_writes_and_replaces_the_whole_result_set(tmp_path, monkeypatch):
    import ddpgraph.bench

    monkeypatch.setattr(ddpgraph.bench, "run_bench", _fake_bench_run)
    out = tmp_path / "new" / "dir" / "b.json"
    result = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"ddpgraph bench: created {out.parent}" in result.output
    written = [line for line in result.output.splitlines() if "wrote" in line]
    expected = [out, out.with_suffix(".md")] + [out.with_suffix(".png")] * _has_matplotlib()
    assert written == [f"ddpgraph bench: wrote {path}" for path in expected]

    # the same kind again: the old table is removed first (said), so no mix is ever left
    result = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(out)])
    assert f"ddpgraph bench: removed {out.with_suffix('.md')}" in result.output

    # another kind's set, or a file that is not a result, is refused before anything runs
    varlen = tmp_path / "varlen.json"
    varlen.write_text(json.dumps({"config": {}, "runs": []}))
    result = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(varlen)])
    assert result.exit_code == 2
    assert f"{varlen} holds varlen; this is a ddpgraph bench run" in result.output
    result = CliRunner().invoke(cli, ["bench", "--varlen", "--out", str(out)])
    assert result.exit_code == 2 and f"{out} holds bench; this is a --varlen run" in result.output
    assert out.with_suffix(".md").exists()  # refused: nothing removed
    other = tmp_path / "notes.json"
    other.write_text("[1, 2]")
    result = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(other)])
    assert result.exit_code == 2 and "not a ddpgraph bench result" in result.output


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


# --- checkpoints: one line each for a damaged or incomplete one -------------------------------


def test_a_damaged_shard_is_one_line_without_torchs_frames():
    from pickle import UnpicklingError

    from torch.distributed.checkpoint.api import CheckpointException

    from ddpgraph.checkpoint.layout import _first_cause

    frames = traceback.extract_stack()
    failure = CheckpointException("load", {0: (UnpicklingError("bad\nid"), frames)})
    assert _first_cause(failure) == "rank 0: UnpicklingError: bad id"
    assert _first_cause(failure, name_rank=False) == "UnpicklingError: bad id"


def test_resume_names_a_checkpoint_that_lost_its_metadata_as_incomplete(tmp_path):
    step = tmp_path / "checkpoints" / "step-00004800"
    step.mkdir(parents=True)
    (step / "ddpgraph.json").write_text(json.dumps({"step": 4800, "world_size": 2}))
    result = CliRunner().invoke(cli, ["train", "--nproc", "2", "--resume", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert (
        f"--resume found no complete checkpoint in {tmp_path / 'checkpoints'}: step-00004800: "
        f"{step / '.metadata'} (DCP's index of the saved values) is missing. Restore"
    ) in " ".join(result.output.split())


# --- a diverged run fails with the step, never "finished" on NaN ------------------------------


@pytest.mark.timeout(300)
def test_a_run_that_diverges_stops_with_the_step_and_exit_1(tmp_path):
    out = tmp_path / "run"
    # SGD at the largest --lr allowed diverges the MLP within a few steps
    job = run_python(["-m", "ddpgraph", "train", "--lr", "10", "--steps", "60", "--out", str(out)],
                     timeout=280)  # fmt: skip
    assert job.returncode == 1, job.stderr[-3000:]
    assert "Traceback" not in job.stderr and "finished" not in job.stderr
    assert re.search(
        r"ddpgraph train: failed: NonFiniteError: training diverged at step "
        r"\d+: the loss or the gradients became NaN or inf \(on at least one rank\); lower --lr "
        r"\(this run: --lr 10\)\.",
        job.stderr,
    ), job.stderr
    assert not (out / "run.json").exists()


def test_a_timeout_message_names_the_command_lines_option():
    from ddpgraph import CollectiveTimeout
    from ddpgraph.demo.train import TrainConfig, reported_message

    exc = CollectiveTimeout("rank 1 did not arrive within 1s; start every rank, or raise timeout=.")
    assert reported_message(TrainConfig(), exc) == (
        "rank 1 did not arrive within 1s; start every rank, or raise --timeout."
    )


@pytest.mark.timeout(300)
def test_an_fsdp2_run_says_so_on_the_console(tmp_path):
    job = run_python(["-m", "ddpgraph", "train", "--parallel", "fsdp2", "--steps", "4", "--out",
                      str(tmp_path / "run")], timeout=280)  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    assert (
        "ddpgraph train: parallel: FSDP2 (fully_shard per block, then the root), AdamW at "
        "--lr/50 = 0.001"
    ) in job.stdout + job.stderr
