"""The rows of :func:`ddpgraph.errors.explain`'s table: how a known error text, its causes and
fixes are written (the rows themselves: ``_known_capture``, ``_known_runtime``).

Data only, kept apart from ``errors.py`` so the exception types stay readable. Each row names an
error by a regular expression and lists its causes, most likely first; a cause whose ``evidence``
shows in the text moves ahead of those whose evidence does not. Rows are ordered so that a
specific root cause wins over the generic failure it leads to (a peer that exited or a network
fault before a collective timeout; the first capture error before "previous error during
capture").

Patterns and evidence are matched against the text with all whitespace removed and its letters
lowered (so a message wrapped over lines, even inside a word, still matches), so they are written
without ``\\s`` or ``\\b``: their spaces are only for reading and are dropped when compiled.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .facts import WARMUP_RULE

__all__ = ["Cause", "Known", "squeezed_regex"]


def squeezed_regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled to match text whose whitespace was removed and letters lowered.

    Its own spaces are dropped and its letters lowered too: matching lowered text is several
    times faster than ``re.IGNORECASE``, which matters for long logs.
    """
    if re.search(r"\\[A-Z]", pattern):  # lowering \D, \S, \W, ... would invert them
        raise ValueError(f"pattern {pattern!r} uses an upper-case escape; write it another way")
    return re.compile(pattern.replace(" ", "").lower())


def _seen(pattern: str) -> Callable[[str], bool]:
    regex = squeezed_regex(pattern)
    return lambda squeezed: regex.search(squeezed) is not None


@dataclass(frozen=True)
class Cause:
    """One cause of a known error: ``title``, what happened (``cause``), the ``fix``, and ``tell``,
    how to recognise this cause among the error's others."""

    id: str
    title: str
    cause: str
    fix: str
    tell: str = ""
    evidence: Callable[[str], bool] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Known:
    """A known error: ``id``, the ``pattern`` that recognises it, its ``title`` and its causes."""

    id: str
    pattern: re.Pattern[str]
    title: str
    causes: tuple[Cause, ...]


def _known(id: str, pattern: str, title: str, *causes: Cause) -> Known:
    return Known(id, squeezed_regex(pattern), title, causes)


def _single(id: str, pattern: str, title: str, cause: str, fix: str) -> Known:
    return _known(id, pattern, title, Cause(id, title, cause, fix))


def _more_workers_than_world_size(squeezed: str) -> bool:
    # torch prints "(world_size=2, worker_count=4, timeout=0:30:00)": more arrivals than ranks
    # means two launches share one store; fewer means some rank never arrived.
    found = re.search(r"world_size=(\d+),worker_count=(\d+)", squeezed)
    return found is not None and int(found.group(2)) > int(found.group(1))


_WARMUP_FIX = f"{WARMUP_RULE}; ddpgraph.TrainStep does this for you"
_NCCL_ANY = _seen(r"ProcessGroupNCCL|watchdog|WorkNCCL|NCCL")
