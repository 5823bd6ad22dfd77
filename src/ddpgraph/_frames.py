"""The user's line: the first frame of the call stack outside ddpgraph (or outside torch too).

One walker for every place that names or blames the caller's line: an object collective's call
site (compared across ranks), a warning issued at the user's line (``stacklevel``), the line
that made a host sync. Each passes what counts as *inside*: a set of module names, or of
directories (by path, not by a ``"/torch/"`` substring: a virtual environment can be named torch).
"""

from __future__ import annotations

import linecache
import os
import sys
from collections.abc import Callable, Collection
from types import FrameType

__all__ = ["PACKAGE_DIR", "frame_outside", "in_directories", "in_modules", "line_outside"]

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

Inside = Callable[[FrameType], bool]


def frame_outside(inside: Inside) -> tuple[FrameType, int]:
    """The innermost frame, starting at this function's caller, for which ``inside(frame)`` is
    False (the outermost frame if every one is inside), and its level as ``warnings.warn``'s
    ``stacklevel`` counts it from the caller (1: the caller itself). Costs one predicate call
    per frame walked: no stack is extracted and no source is read."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and inside(frame):
        frame = frame.f_back
        level += 1
    return frame, level


def in_modules(names: Collection[str]) -> Inside:
    """Inside: a frame of one of the modules ``names`` (``__name__`` as imported)."""
    frozen = frozenset(names)
    return lambda frame: frame.f_globals.get("__name__") in frozen


def in_directories(*paths: str) -> Inside:
    """Inside: a frame of a file whose absolute path starts with one of ``paths`` (a directory
    ending in ``os.sep``, such as :data:`PACKAGE_DIR`, or a file)."""
    return lambda frame: os.path.abspath(frame.f_code.co_filename).startswith(paths)


def line_outside(*paths: str) -> str:
    """``file:line `source``` of the innermost frame, from the caller out, outside the
    directories ``paths``: the line a message tells the user to change."""
    frame, _ = frame_outside(in_directories(*paths))
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno} `{line}`"
