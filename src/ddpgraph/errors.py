"""The exception types every ddpgraph module raises.

Each message says what broke, the value seen and the fix. Types subclass the builtin that fits
(`ValueError` for bad input or configuration, `RuntimeError` for a bad state at run time) so that
existing ``except`` clauses keep working.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

from ._known_capture import CAPTURE_AND_DDP
from ._known_errors import Cause, Known
from ._known_runtime import RUNTIME

__all__ = [
    "CaptureError",
    "Cause",
    "CollectiveTimeout",
    "ConfigError",
    "DeviceConflictError",
    "DistributedStateError",
    "Explanation",
    "NonFiniteError",
    "ObjectArgumentError",
    "ObjectCollectiveError",
    "explain",
    "explain_exception",
    "first_line",
    "with_explanation",
]


class ConfigError(ValueError):
    """A launcher variable or an option has a value ddpgraph cannot use (e.g. ``LOCAL_RANK=x``)."""


class DistributedStateError(RuntimeError):
    """The process-group state does not allow the call (e.g. ``init`` again with other arguments)."""


class DeviceConflictError(RuntimeError):
    """Two ranks of one host are bound to the same GPU, or a rank's device is not the one it should use.

    Raised on every rank before any NCCL call, so the job fails with this message instead of
    ``ncclInvalidUsage`` or a hang.
    """


class ObjectCollectiveError(RuntimeError):
    """An object collective failed on at least one rank; raised identically on every rank.

    ``ranks`` lists the ranks (of the group) whose object, arguments or call caused the failure.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message, tuple(ranks))
        self.ranks: tuple[int, ...] = tuple(ranks)

    def __str__(self) -> str:
        return str(self.args[0])


class ObjectArgumentError(ObjectCollectiveError, ValueError):
    """A rank passed a bad argument (e.g. an output list of the wrong length) to an object
    collective; raised on every rank. A ``ValueError`` too, as torch raises for such arguments."""


class CollectiveTimeout(TimeoutError):
    """A rank did not arrive at a collective within its timeout; names the missing rank(s).

    ``missing`` lists the ranks that had not arrived or were behind (empty where unknown).
    """

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message, tuple(missing))
        self.missing: tuple[int, ...] = tuple(missing)

    def __str__(self) -> str:
        return str(self.args[0])


class CaptureError(RuntimeError):
    """A CUDA-graph capture precondition is unmet, or the captured state was invalidated."""


class NonFiniteError(RuntimeError):
    """Training diverged: an update's loss or gradients were NaN or inf (``check_finite=True``).

    Raised alike on every rank; ``step`` is the first such update (1-based).
    """

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message, step)
        self.step = step

    def __str__(self) -> str:
        return str(self.args[0])


# --- explain(): known error texts -> causes and fixes -----------------------------------------
# Kept here (not in doctor/) so that the core can attach explanations to what it raises without
# importing the CLI side; the table's rows live in _known_capture.py and _known_runtime.py (in
# this order: a specific root cause before the generic failure it leads to) and need only ``re``.
KNOWN: tuple[Known, ...] = (*CAPTURE_AND_DDP, *RUNTIME)


@dataclass(frozen=True)
class Explanation:
    """What a known error text means: a short ``title``, its most likely ``cause`` and its ``fix``.

    ``causes`` lists every cause the text can have, most likely first (a cause whose evidence
    shows in the text comes before those whose evidence does not), each with how to tell it
    apart; ``cause`` and ``fix`` are the first one's. ``id`` names the known error, ``pattern``
    is the regular expression that matched and ``matched`` the text it matched, its whitespace
    collapsed.
    """

    title: str
    cause: str
    fix: str
    pattern: str = ""
    matched: str = ""
    id: str = ""
    causes: tuple[Cause, ...] = ()

    def render(self) -> str:
        if len(self.causes) <= 1:
            return f"{self.title}\ncause: {self.cause}\nfix: {self.fix}"
        lines = [f"{self.title}: {len(self.causes)} possible causes, most likely first"]
        for number, cause in enumerate(self.causes, start=1):
            lines += [
                f"{number}. {cause.title}",
                f"   cause: {cause.cause}",
                f"   fix: {cause.fix}",
            ]
            if cause.tell:
                lines.append(f"   how to tell: {cause.tell}")
        return "\n".join(lines)


def explain(text: str) -> Explanation | None:
    """The explanation of the first known error in ``text`` (an exception message or a log), or None.

    Line wraps and whitespace do not matter: a message wrapped over lines, even inside a word,
    or framed by a rich traceback's box characters, is still recognised.
    """
    flat = _flatten(text)
    squeezed = flat.replace(" ", "").lower()  # as the table's patterns expect
    for known in KNOWN:
        match = known.pattern.search(squeezed)
        if match:
            causes = _most_likely_first(known.causes, squeezed)
            first = causes[0]
            title = known.title if len(causes) > 1 else first.title
            matched = _as_written(match.group(0), flat)
            return Explanation(
                title, first.cause, first.fix, known.pattern.pattern, matched, known.id, causes
            )
    return None


def explain_exception(exc: BaseException) -> Explanation | None:
    """The explanation of ``exc`` read with its traceback and chained exceptions, or None.

    The frames tell causes apart that the message alone cannot (an ``.item()`` call or DDP's
    ``_pre_forward`` on the way to "operation not permitted when stream is capturing").
    """
    frames = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return explain(f"{type(exc).__name__}: {exc}\n{frames}")


def with_explanation(exc: BaseException) -> str:
    """``str(exc)`` followed by the explanation of it when one is known (for the core to attach)."""
    message = str(exc)
    found = explain_exception(exc)
    if found is None:
        return message
    return f"{message}\n\nddpgraph explains: {found.render()}"


def first_line(exc: BaseException, *, with_type: bool = False) -> str:
    """The first line of ``str(exc)`` (its type's name when it has no text), to quote a cause
    inside one of ddpgraph's own messages. ``with_type``: ``"TypeName: first line"``."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if with_type:
        return f"{type(exc).__name__}: {line}"
    return line or type(exc).__name__


# Per-line decorations that split a message: rich's traceback frame, torchrun's rank prefix.
_LINE_DECORATION = re.compile(r"^\s*(?:\[(?:rank|default)\d+\]:\s*)*[│┃║]?|[│┃║]\s*$", re.M)
_WHITESPACE = re.compile(r"\s+")


def _flatten(text: str) -> str:
    """``text`` on one line: decorations removed, every whitespace run one space."""
    return _WHITESPACE.sub(" ", _LINE_DECORATION.sub("", text)).strip()


def _as_written(squeezed_match: str, flat: str) -> str:
    """The first stretch of ``flat`` that reads ``squeezed_match`` once its spaces are dropped."""
    spaced = " ?".join(re.escape(char) for char in squeezed_match)
    found = re.search(spaced, flat, re.IGNORECASE)
    return found.group(0) if found else squeezed_match


def _most_likely_first(causes: tuple[Cause, ...], squeezed: str) -> tuple[Cause, ...]:
    """Causes whose evidence shows in the text first, each group in the table's order."""
    shown = tuple(c for c in causes if c.evidence is not None and c.evidence(squeezed))
    return shown + tuple(c for c in causes if c not in shown)
