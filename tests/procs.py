"""Running ddpgraph in a subprocess: the same ddpgraph as this test process, with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import ddpgraph

# The folder holding the ddpgraph package under test (a src/ checkout or site-packages): put
# first on the children's PYTHONPATH so they import this very copy, not another installed one.
PACKAGE_ROOT = str(Path(ddpgraph.__file__).resolve().parent.parent)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_python(
    args: Sequence[str],
    *,
    cwd: Path | str | None = None,
    timeout: float,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with this interpreter, ``env`` added to ours; stdout, stderr as text."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=child_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
