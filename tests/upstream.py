"""The pinned public scripts in ``../shared/upstream/`` (beside the checkout; never copied into
the repository): where they are, each file checked against the SHA-256 its ``SOURCE.md`` lists,
and the port a guide tells a user to write, made from the script's own text by replacing the
lines the guide's diff names (each must be found exactly once, so a guide that no longer fits
the pinned script fails here)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = REPO_ROOT.parent / "shared" / "upstream"


def script(folder: str, name: str) -> Path:
    """``../shared/upstream/<folder>/<name>``, its SHA-256 checked; skipped (with the reason)
    only where ``../shared`` is absent."""
    if not (REPO_ROOT.parent / "shared").is_dir():
        pytest.skip(f"no ../shared beside the checkout ({REPO_ROOT.parent / 'shared'})")
    path = UPSTREAM / folder / name
    listed = dict(
        re.findall(r"^\| (\S+) \| ([0-9a-f]{64}) \|$", _read(UPSTREAM / folder / "SOURCE.md"), re.M)
    )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert listed.get(name) == digest, f"{path} is not the pinned file (sha256 {digest})"
    return path


def ported(text: str, edits: list[tuple[str, str]]) -> str:
    """``text`` with each ``(old, new)`` replaced; each ``old`` must occur exactly once."""
    for old, new in edits:
        count = text.count(old)
        assert count == 1, f"the guide's line occurs {count} times in the script: {old!r}"
        text = text.replace(old, new)
    return text


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")
