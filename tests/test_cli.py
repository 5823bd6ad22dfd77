"""The console script's own behaviour: a ddpgraph error is its message unless --debug asks."""

from __future__ import annotations

import pytest

from .procs import run_python

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
