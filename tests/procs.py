"""Running ddpgraph in a subprocess: the same ddpgraph as this test process, with a timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import ddpgraph

# The folder holding the ddpgraph package under test (a src/ checkout or site-packages): put
# first on the children's PYTHONPATH so they import this very copy, not another installed one.
PACKAGE_ROOT = str(Path(ddpgraph.__file__).resolve().parent.parent)


def sigint_default() -> None:
    """``preexec_fn`` of every child a test starts: SIGINT's default disposition, so that Python
    in the child turns Ctrl-C into KeyboardInterrupt however the suite was started. A shell
    starts a background job (``cmd &``, ``nohup``, a CI runner) with SIGINT ignored, and an
    ignored signal stays ignored through exec: the child would never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
        preexec_fn=sigint_default,
    )


def tiny_filesystem_works(where: Path, size: str) -> bool:
    """Whether this machine lets a test mount a tmpfs of its own (in a user and mount namespace:
    no root needed where unprivileged user namespaces are allowed)."""
    import shutil

    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {where}"],
        capture_output=True,
    )
    return probe.returncode == 0


def on_tiny_disk(
    mount: Path, size: str, script: str, *, leave_free_kib: int | None = None, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``script`` (sh) run with a tmpfs of ``size`` mounted at ``mount``, filled first so that
    ``leave_free_kib`` KiB stay free (not filled: None); the test is skipped where no tmpfs
    can be mounted. Its exit status is the script's."""
    import pytest

    mount.mkdir(exist_ok=True)
    if not tiny_filesystem_works(mount, size):
        pytest.skip("cannot mount a tmpfs here (unshare -rm is not permitted)")
    fill = ""
    if leave_free_kib is not None:
        # fill the rest: a file as large as the free space less what is to be left
        fill = (
            f"free=$(df -k {mount} | awk 'NR==2 {{print $4}}'); "
            f"head -c $(( (free - {leave_free_kib}) * 1024 )) /dev/zero > {mount}/.fill; "
        )
    return subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f"mount -t tmpfs -o size={size} tmpfs {mount} && {fill}{script}",
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
