"""`ddpgraph launch`: torchrun's options pass through; each worker is guarded before the script."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddpgraph.cli import cli
from ddpgraph.distributed.launch import RUN_MODULE, RUN_PATH, WORKER_MODULE, torchrun_args
from ddpgraph.errors import ConfigError

from .procs import run_python

# An unmodified classic script: no set_device, torch's own all_gather_object, the output list
# sized by LIST_LEN (world size by default). Each rank writes what it got, or the error it saw.
GATHER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = [None] * int(os.environ.get("LIST_LEN", world_size))
    try:
        dist.all_gather_object(out, {"rank": rank})
    except Exception as exc:
        with open(f"rank{rank}.json", "w") as f:
            json.dump({"error": type(exc).__name__, "is_value_error": isinstance(exc, ValueError),
                       "message": str(exc)}, f)
        raise
    with open(f"rank{rank}.json", "w") as f:
        json.dump({"gathered": out, "argv": sys.argv}, f)
    print(f"rank {rank} gathered {out}", flush=True)
    dist.destroy_process_group()
    """
)


def write_script(tmp_path: Path) -> Path:
    script = tmp_path / "gather.py"
    script.write_text(GATHER_SCRIPT)
    return script


def launch(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    return run_python(["-m", "ddpgraph", "launch", *args], cwd=tmp_path, timeout=100, env=env)


def read_rank(tmp_path: Path, rank: int) -> dict:
    return json.loads((tmp_path / f"rank{rank}.json").read_text())


@pytest.mark.timeout(120)
def test_unmodified_gather_script_works(tmp_path):
    write_script(tmp_path)
    proc = launch(tmp_path, "--nproc-per-node", "2", "gather.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert read_rank(tmp_path, rank)["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert f"rank {rank} gathered [{{'rank': 0}}, {{'rank': 1}}]" in proc.stdout
    summary = (
        "[ddpgraph launch] rank 0/2 on cpu: no GPU, nothing to bind, object collectives checked"
    )
    assert proc.stderr.count(summary) == 1  # rank 0 only
    assert "rank 1/2" not in proc.stderr


@pytest.mark.timeout(120)
def test_wrong_list_length_is_a_clear_value_error_on_both_ranks(tmp_path):
    write_script(tmp_path)
    # --monitor-interval 1: the agent kills the surviving rank once one exits; give both ranks
    # time to report before it looks (they fail at the same moment, in the same collective).
    proc = launch(
        tmp_path, "--nproc-per-node", "2", "--monitor-interval", "1", "gather.py",
        env={"LIST_LEN": "3"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    expected = (
        "all_gather_object failed on ranks [0, 1]: rank 0: its object_list has length 3, but the "
        "group has 2 ranks; pass a list of length world_size, e.g. [None] * 2"
    )
    for rank in (0, 1):
        seen = read_rank(tmp_path, rank)
        assert seen["is_value_error"] and seen["error"] == "ObjectArgumentError"
        assert seen["message"].startswith(expected)
        # torch prefixes each rank's uncaught traceback with [rankN]:
        assert f"[rank{rank}]: ddpgraph.errors.ObjectArgumentError: {expected}" in proc.stderr
    assert "ddpgraph launch: the job failed." in proc.stderr and "gather.py FAILED" in proc.stderr


@pytest.mark.timeout(120)
def test_script_arguments_pass_through(tmp_path):
    write_script(tmp_path)
    # --help after SCRIPT belongs to the script, not to ddpgraph or torchrun
    proc = launch(tmp_path, "--nproc-per-node", "1", "gather.py", "--foo", "3", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_rank(tmp_path, 0) == {
        "gathered": [{"rank": 0}],
        "argv": ["gather.py", "--foo", "3", "--help"],
    }
    assert "rank 0/1 on cpu" in proc.stderr


def test_help_describes_the_passthrough():
    result = CliRunner().invoke(cli, ["launch", "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: cli launch [TORCHRUN OPTIONS] SCRIPT [ARGS]..." in result.output
    assert "torchrun" in result.output and "LOCAL_RANK" in result.output


def test_missing_script_is_a_usage_error():
    result = CliRunner().invoke(cli, ["launch", "--nproc-per-node", "2"])
    assert result.exit_code == 2
    assert (
        "missing SCRIPT" in result.output and "ddpgraph launch --nproc-per-node 2" in result.output
    )


def test_nonexistent_script_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["launch", "--nproc-per-node", "2", "nope.py", "--x"])
    assert result.exit_code == 2
    assert "script 'nope.py' does not exist" in result.output and str(tmp_path) in result.output


@pytest.mark.parametrize("count", ["0", "-2"])
def test_no_worker_per_node_is_a_usage_error(tmp_path, count):
    script = tmp_path / "s.py"
    script.write_text("print(1)\n")
    result = CliRunner().invoke(cli, ["launch", f"--nproc-per-node={count}", str(script)])
    assert result.exit_code == 2, result.output
    assert f"--nproc-per-node {count}: each node needs at least 1 worker process" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_unknown_torchrun_option_is_named(tmp_path):
    script = write_script(tmp_path)
    result = CliRunner().invoke(cli, ["launch", "--nproc-per-nodes", "2", str(script)])
    assert result.exit_code == 2
    assert "unrecognized arguments: --nproc-per-nodes" in result.output


def test_worker_command_wraps_script_and_keeps_torchrun_options(tmp_path):
    script = write_script(tmp_path)
    args = torchrun_args(["--nproc-per-node", "3", "--max-restarts", "2", str(script), "-x", "1"])
    assert (args.nproc_per_node, args.max_restarts) == ("3", 2)
    assert args.module and not args.no_python and not args.run_path
    assert args.training_script == WORKER_MODULE
    assert args.training_script_args == [RUN_PATH, str(script), "-x", "1"]


def test_module_mode_runs_the_module_through_the_worker():
    args = torchrun_args(["-m", "some.module", "--flag"])
    assert args.training_script_args == [RUN_MODULE, "some.module", "--flag"]


def test_no_python_cannot_be_guarded(tmp_path):
    script = write_script(tmp_path)
    with pytest.raises(ConfigError, match="cannot guard --no-python"):
        torchrun_args(["--no-python", str(script)])
