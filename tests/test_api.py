from __future__ import annotations

import subprocess
import sys

import pytest

import ddpgraph

PUBLIC = {
    "CaptureError",
    "CheckpointError",
    "CollectiveTimeout",
    "ConfigError",
    "DeviceConflictError",
    "DeviceData",
    "DistributedStateError",
    "Explanation",
    "NonFiniteError",
    "ObjectCollectiveError",
    "ResumableLoader",
    "Runtime",
    "StepReport",
    "TrainStep",
    "__version__",
    "all_gather_object",
    "broadcast_object",
    "explain",
    "gather_for_metrics",
    "gather_object",
    "get_runtime",
    "init",
    "pad_batch",
    "prefetch",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "save_checkpoint_async",
    "shutdown",
}


def test_public_names_are_pinned():
    assert set(ddpgraph.__all__) == PUBLIC
    for name in ddpgraph.__all__:
        assert hasattr(ddpgraph, name)


def test_core_import_stays_light():
    code = "import sys, ddpgraph; print(sorted(m for m in ('rich', 'click') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _subcommands() -> list[str]:
    from ddpgraph.cli import cli

    return sorted(cli.commands)


@pytest.mark.parametrize("args", [[], *[[name] for name in _subcommands()]])
def test_help_of_every_subcommand(args):
    out = subprocess.run(
        [sys.executable, "-m", "ddpgraph", *args, "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout
