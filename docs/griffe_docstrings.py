"""A griffe extension that lets ddpgraph's docstrings render as Markdown in the API reference.

The docstrings are written to read well in ``help()``: Sphinx roles (``:class:`CaptureError```)
and indented blocks of definitions under a line ending in a colon::

    Options (keyword-only, validated here):
        graph: "auto" captures where CUDA is available ...
            continued ...
        amp: None or "bf16" ...

Markdown would show the roles literally and run the indented lines into one paragraph. This
extension rewrites both when the docs are built (the source is not changed): a role becomes a
code span, and each block becomes a bulleted list, one item per definition.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:class|func|meth|attr|data|mod|exc|obj|py:\w+):`(~?)([^`]+)`"
)
# Section titles griffe's Google-style parser handles itself; their blocks are left alone.
GOOGLE_SECTIONS = re.compile(
    r"^(Args|Arguments|Params|Parameters|Keyword Args|Keyword Arguments|Other Parameters|"
    r"Raises|Exceptions|Returns|Yields|Receives|Examples?|Attributes|Functions|Methods|"
    r"Classes|Modules|Warns|Warnings|Notes?|References|Deprecated)\s*:\s*$"
)
DEFINITION = re.compile(r"^(``[^`]+``|`[^`]+`|[\w.\"'=]+):\s")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"  # ~a.b.c shows c, as Sphinx


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def blocks_to_lists(text: str) -> str:
    """Indented blocks under a line ending in ':' become bulleted lists: a line at the block's
    first indent starts an item (unless it continues the previous line's sentence), deeper
    lines continue it."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        header = line.rstrip()
        if (
            not header.endswith(":")
            or header.endswith("::")
            or GOOGLE_SECTIONS.match(header)
        ):
            continue
        if (
            i >= len(lines)
            or _indent(lines[i]) <= _indent(line)
            or not lines[i].strip()
        ):
            continue
        base = _indent(lines[i])
        items: list[str] = []
        while i < len(lines) and lines[i].strip() and _indent(lines[i]) >= base:
            body = lines[i].strip()
            # a line at the block's indent starts an item unless it continues a sentence
            starts = (
                not items
                or items[-1].endswith((".", ":", ";"))
                or DEFINITION.match(body)
            )
            if _indent(lines[i]) == base and starts:
                term = DEFINITION.match(body)
                if term and not term.group(1).startswith("`"):
                    body = f"`{term.group(1)}`:{body[term.end(1) + 1 :]}"
                items.append(f"- {body}")
            else:
                items.append(f"  {body}")
            i += 1
        out += ["", *items, ""]
    return "\n".join(out)


class MarkdownDocstrings(griffe.Extension):
    """Rewrite each docstring before griffe parses its sections."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            value = ROLE.sub(_role, obj.docstring.value)
            obj.docstring.value = blocks_to_lists(value)
