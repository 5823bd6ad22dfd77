"""The two diffs of every port, written next to it: ``baseline.diff`` (original → baseline: what
lets the script run on 2 CPU ranks and record its losses) and ``ported.diff`` (baseline → ported:
the port to ddpgraph). ``python examples/ports/port_diffs.py`` rewrites them; ``tests/test_ports.py``
checks that the committed ones are current and counts their lines.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from port_runner import PORTS, PORTS_BY_NAME


@dataclass(frozen=True)
class Diff:
    text: str
    added: int
    removed: int


def diff(old: Path, new: Path) -> Diff:
    """``git diff --no-index`` (its alignment of blank lines reads better than difflib's)."""
    proc = subprocess.run(
        [
            "git",
            "diff",
            "--no-index",
            "--no-color",
            "--no-prefix",
            "-U3",
            "--",
            old.name,
            new.as_posix(),
        ],
        cwd=old.parent,
        capture_output=True,
        text=True,
    )
    if proc.returncode not in (0, 1):  # 1: the files differ
        raise RuntimeError(f"git diff failed: {proc.stderr}")
    rel = lambda p: p.relative_to(PORTS).as_posix()  # noqa: E731
    hunks = proc.stdout[proc.stdout.index("\n@@") + 1 :] if "\n@@" in proc.stdout else ""
    body = hunks.splitlines()
    return Diff(
        f"--- {rel(old)}\n+++ {rel(new)}\n{hunks}",
        sum(line.startswith("+") for line in body),
        sum(line.startswith("-") for line in body),
    )


def port_diffs(name: str) -> dict[str, Diff]:
    """``{"baseline": original → baseline, "ported": baseline → ported}`` for one port."""
    port = PORTS_BY_NAME[name]
    folder = PORTS / name
    return {
        "baseline": diff(folder / "original" / port.original, folder / "baseline.py"),
        "ported": diff(folder / "baseline.py", folder / "ported.py"),
    }


def main() -> None:
    for name in PORTS_BY_NAME:
        for kind, d in port_diffs(name).items():
            (PORTS / name / f"{kind}.diff").write_text(d.text)
            print(f"{name:13} {kind:8} +{d.added} -{d.removed}")


if __name__ == "__main__":
    main()
