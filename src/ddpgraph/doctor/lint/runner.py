"""Reading files, running every rule, ``# noqa``."""

from __future__ import annotations

import ast
import re
import tokenize
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .astutil import Module, collect
from .capture_body import check_optimizer_capturable, check_sync_in_capture
from .capture_stream import check_capture_stream
from .core import Finding, LintError, Report
from .device import check_unbound_device
from .kept_outputs import check_kept_outputs
from .object_lists import check_object_list_size
from .replay import check_double_step, check_static_rebound
from .warmup import check_warmup_count
from .window_lr import check_lr_after_window

_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z0-9, ]+))?", re.IGNORECASE)

CHECKS: tuple[Callable[[Module, Report], None], ...] = (
    check_unbound_device,  # DG101
    check_object_list_size,  # DG102
    check_capture_stream,  # DG103
    check_warmup_count,  # DG104
    check_sync_in_capture,  # DG105
    check_optimizer_capturable,  # DG106
    check_double_step,  # DG107
    check_static_rebound,  # DG108
    check_lr_after_window,  # DG109
    check_kept_outputs,  # DG110
)


def lint_source(source: str, filename: str = "<string>", *, strict: bool = False) -> list[Finding]:
    """Every finding in ``source``, sorted by position; with ``strict=True`` also the cases a
    rule suspects but cannot prove, as findings of severity "note". Raises :class:`LintError`
    when the source cannot be parsed."""
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {strict!r}")
    tree = _parse(source.removeprefix("\ufeff"), filename)
    report = Report(filename, strict=strict)
    mod = collect(tree)
    for check in CHECKS:
        check(mod, report)
    lines = source.splitlines()
    kept = [f for f in report.items.values() if not _suppressed(lines, f.line, f.code)]
    return sorted(kept, key=lambda f: (f.line, f.col, f.code))


def _parse(source: str, filename: str) -> ast.Module:
    nul = source.find("\0")
    if nul >= 0:  # ast.parse would say only "source code string cannot contain null bytes"
        line = source.count("\n", 0, nul) + 1
        column = nul - (source.rfind("\n", 0, nul) + 1) + 1
        raise LintError(
            filename,
            f"cannot parse: NUL byte at line {line}, column {column}; this is not Python source "
            "(a binary or corrupted file)",
        )
    try:
        with warnings.catch_warnings():  # "invalid escape sequence" is the file's business
            warnings.simplefilter("ignore")
            return ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise LintError(
            filename, f"cannot parse: {exc.msg} at line {exc.lineno}, column {exc.offset}"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise LintError(filename, f"cannot parse: {exc}") from None


_PYTHON_SUFFIXES = frozenset({".py", ".pyw", ".pyi"})


def _is_python(path: Path) -> bool:
    """A .py name, or a script whose #! line runs python (``#!/usr/bin/env python3``)."""
    if path.suffix.lower() in _PYTHON_SUFFIXES:
        return True
    try:
        with path.open("rb") as handle:
            first = handle.readline(200)
    except OSError:
        return True  # reading it fails again, with the reason, where it is linted
    return first.startswith(b"#!") and b"python" in first


def _suppressed(lines: Sequence[str], line: int, code: str) -> bool:
    if not 1 <= line <= len(lines):
        return False
    match = _NOQA.search(lines[line - 1])
    if match is None:
        return False
    codes = match.group("codes")
    return codes is None or code in {c.strip().upper() for c in codes.split(",")}


def read_source(path: str | Path) -> str:
    """The text of a Python file as Python reads it: a UTF-8 BOM or a PEP 263 coding line
    decide the encoding (``tokenize.open``)."""
    name = str(path)
    try:
        with tokenize.open(path) as handle:
            return handle.read()
    except OSError as exc:
        raise LintError(name, f"cannot read: {exc.strerror or exc}") from None
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        reason = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        raise LintError(name, f"cannot read: {reason}") from None


def lint_file(path: str | Path, *, strict: bool = False) -> list[Finding]:
    """Findings of one file; :class:`LintError` if it cannot be read or parsed."""
    return lint_source(read_source(path), str(path), strict=strict)


def lint_paths(
    paths: Iterable[str | Path], *, strict: bool = False
) -> tuple[list[Finding], list[LintError]]:
    """Lint every file (directories: their ``*.py``); return the findings and the files that failed."""
    findings: list[Finding] = []
    errors: list[LintError] = []
    for path in map(Path, paths):
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        if not files:  # a wrong directory must not pass as "no findings"
            errors.append(LintError(str(path), "is a directory without any *.py file"))
        if path.is_file() and not _is_python(path):  # notes.txt must not pass as "no findings"
            errors.append(
                LintError(
                    str(path),
                    "is not a Python file (neither a .py name nor a #! line naming python); "
                    "pass the training script itself",
                )
            )
            continue
        for file in files:
            try:
                findings.extend(lint_file(file, strict=strict))
            except LintError as exc:
                errors.append(exc)
    return findings, errors
