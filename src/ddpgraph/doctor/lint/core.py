"""What lint reports: rules, findings, notes and the error for a file it cannot read."""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass, field
from typing import Literal

from ...facts import WARMUP_RULE

__all__ = ["RULES", "Finding", "LintError", "Report", "Rule", "Severity"]

Severity = Literal["error", "note"]


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    summary: str


RULES: dict[str, Rule] = {
    rule.code: rule
    for rule in (
        Rule(
            "DG101",
            "unbound-device",
            "object collective, barrier or CUDA collective before this rank's device is bound, "
            "or a device binding that does nothing",
        ),
        Rule(
            "DG102",
            "object-list-size",
            "all_gather_object / gather_object output list not sized by the world size of the "
            "group passed",
        ),
        Rule(
            "DG103",
            "ddp-capture-stream",
            "DDP model built on the default stream and captured in a CUDA graph",
        ),
        Rule("DG104", "ddp-warmup-count", f"eager DDP iterations before capture: {WARMUP_RULE}"),
        Rule("DG105", "sync-in-capture", "host synchronisation or data loading inside a capture"),
        Rule(
            "DG106",
            "optimizer-not-capturable",
            "Adam-family optimizer without capturable=True stepped inside a capture",
        ),
        Rule(
            "DG107",
            "double-optimizer-step",
            "optimizer stepped inside the graph and again after its replay",
        ),
        Rule(
            "DG108",
            "static-input-rebound",
            "static graph input re-bound by assignment instead of copy_() between replays",
        ),
        Rule(
            "DG109",
            "lr-after-window",
            "param group LR set after the window's calls of a TrainStep(accumulate_calls=k) "
            "without defer_update=True: applied one step late",
        ),
        Rule(
            "DG110",
            "graph-output-kept",
            "graph-owned tensor (a capture's output, TrainStep.output / grad_norm / evaluate()) "
            "kept across the loop's replays without a copy: every kept entry reads the last "
            "replay's values",
        ),
    )
}


@dataclass(frozen=True)
class Finding:
    """One report. ``severity`` is "error" for a proven bug, "note" for a case the rule could not
    prove (only with ``strict=True``)."""

    file: str
    line: int
    col: int
    code: str
    message: str
    fix: str
    severity: Severity = "error"

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "rule": RULES[self.code].name}

    def format_text(self) -> str:
        label = f"{self.code} note:" if self.severity == "note" else self.code
        return f"{self.file}:{self.line}:{self.col}: {label} {self.message}\n    fix: {self.fix}"


class LintError(Exception):
    """A file could not be read or parsed; ``path`` names it, the message says why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"{path}: {reason}")


@dataclass
class Report:
    """Where rules put what they found: ``finding`` for what they prove, ``note`` for what they
    suspect but cannot prove (kept only in strict mode)."""

    filename: str
    strict: bool = False
    items: dict[tuple[int, int, str], Finding] = field(default_factory=dict)

    def finding(self, node: ast.AST, code: str, message: str, fix: str) -> None:
        self._add(node, code, message, fix, "error")

    def note(self, node: ast.AST, code: str, message: str, fix: str) -> None:
        if self.strict:
            self._add(node, code, message, fix, "note")

    def _add(self, node: ast.AST, code: str, message: str, fix: str, severity: Severity) -> None:
        line, col = getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1
        key = (line, col, code)
        existing = self.items.get(key)
        if existing is None or (existing.severity == "note" and severity == "error"):
            self.items[key] = Finding(self.filename, line, col, code, message, fix, severity)
