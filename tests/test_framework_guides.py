"""The framework guides' headings say how many lines a port adds and deletes: their diffs
count the same (docs/guides/accelerate.md, fabric.md, lightning.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

GUIDES = Path(__file__).resolve().parent.parent / "docs" / "guides"


@pytest.mark.parametrize(
    ("guide", "added", "deleted"),
    [("accelerate", 5, 8), ("fabric", 4, 9), ("lightning", 2, 1)],
)
def test_the_port_heading_counts_the_lines_of_its_diff(guide, added, deleted):
    text = (GUIDES / f"{guide}.md").read_text()
    heading = re.search(r"^## What changes: (.*)$", text, re.M)
    assert heading is not None
    diff = re.search(r"```diff\n(.*?)```", text, re.S)
    assert diff is not None
    lines = diff.group(1).splitlines()
    assert sum(line.startswith("+") for line in lines) == added
    assert sum(line.startswith("-") for line in lines) == deleted
    words = heading.group(1)
    assert words.startswith(f"{added} lines"), words
    assert (f"{deleted} deleted" in words) == (guide != "lightning"), words
