"""Every number the command line takes, fed the values a newcomer's typo or a script's bug gives
(0, -1, nan, inf, 10**30 and a word): each is taken, or refused at parse time with exit status 2
and one line naming the option and the value, never a traceback. The commands' runs are replaced
by stubs, so no worker starts; the checks before them are the real ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from ddpgraph.cli import cli

VALUES = ("0", "-1", "nan", "inf", str(10**30), "1e30", "abc")
TORCHRUN_NUMBERS = (
    "--nnodes",
    "--nproc-per-node",
    "--max-restarts",
    "--monitor-interval",
    "--node-rank",
    "--master-port",
    "--shutdown-timeout",
)
# The only pairs of this sweep in range; any other value must be refused.
TAKEN = {
    ("train", "--seed", "0"),
    ("train", "--max-restarts", "0"),
    ("launch", "--max-restarts", "0"),
    ("launch", "--node-rank", "0"),
    ("launch", "--shutdown-timeout", "0"),
}


def _numeric_options() -> list[tuple[str, str]]:
    """(command, flag) of every option of ours whose value is a number."""
    found = []
    for name, command in sorted(cli.commands.items()):
        for param in command.params:
            numeric = isinstance(
                param.type, click.types.IntParamType | click.types.FloatParamType
            ) or param.type.name in ("integer", "float")
            if isinstance(param, click.Option) and numeric:
                found.append((name, param.opts[0]))
    return found


def test_the_sweep_covers_every_numeric_option():
    assert set(_numeric_options()) == {
        ("bench", "--steps"),
        ("bench", "--repeats"),
        ("doctor", "--nproc"),
        ("doctor", "--timeout"),
        *(
            ("train", flag)
            for flag in (
                "--steps", "--batch-size", "--lr", "--nproc", "--seed", "--timeout",
                "--checkpoint-every", "--stop-after", "--max-restarts", "--steps-per-replay",
            )
        ),
    }  # fmt: skip


@pytest.fixture
def stubs(monkeypatch, tmp_path) -> dict[str, Any]:
    """Each command's run, recorded instead of started."""
    seen: dict[str, Any] = {}

    def run_local(fn, config, **kwargs):
        seen["train"] = config
        return {}

    monkeypatch.setattr("ddpgraph.demo.launch.run_local", run_local)
    monkeypatch.setattr("ddpgraph.bench.run_bench", lambda *a, **kw: seen.update(bench=kw))
    monkeypatch.setattr("ddpgraph.doctor.env.collect_env", lambda: None)
    monkeypatch.setattr("ddpgraph.doctor.env.render", lambda report, results: None)
    monkeypatch.setattr(
        "ddpgraph.doctor.env.run_selftest", lambda nproc, timeout_s: seen.update(doctor=nproc)
    )
    monkeypatch.setattr("ddpgraph._typed_torch.torchrun", lambda args: seen.update(launch=args))
    monkeypatch.chdir(tmp_path)
    Path("ok.py").write_text("print('ok')\n")
    return seen


def _invoke(command: str, flag: str, value: str) -> Any:
    tail = {
        "train": ["--out", "run"],
        "bench": ["--quick", "--out", "b.json"],
        "doctor": [],
        "launch": ["ok.py"],
    }[command]
    return CliRunner().invoke(cli, [command, f"{flag}={value}", *tail])


def _check_outcome(command: str, flag: str, value: str, result: Any, seen: dict[str, Any]) -> None:
    where = f"{command} {flag} {value}: {result.output[-600:]}"
    assert "Traceback" not in result.output, where
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        where,
        result.exception,
    )
    if (command, flag, value) in TAKEN:
        assert result.exit_code == 0 and command in seen, where
        return
    assert result.exit_code == 2 and command not in seen, where
    (line,) = [text for text in result.output.splitlines() if text.startswith("Error: ")]
    assert flag in line, where
    assert any(text in line for text in _spellings(value)), where


def _spellings(value: str) -> set[str]:
    """How a message may show ``value``: as given, or as the number it parses to."""
    try:
        number = float(value)
    except ValueError:
        return {value}
    return {value, f"{number:g}", repr(number)}


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize(("command", "flag"), _numeric_options())
def test_every_number_is_taken_or_refused_at_parse_time_in_one_line(stubs, command, flag, value):
    _check_outcome(command, flag, value, _invoke(command, flag, value), stubs)


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("flag", TORCHRUN_NUMBERS)
def test_every_torchrun_number_of_launch_is_taken_or_refused_before_torchrun(stubs, flag, value):
    _check_outcome("launch", flag, value, _invoke("launch", flag, value), stubs)
