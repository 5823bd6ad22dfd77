"""Standard output that cannot be written: a reader that went away (``ddpgraph train | head -2``)
or a full disk (``> /dev/full``) must not stop a command whose results go to files.

:func:`guard` puts a wrapper around ``sys.stdout`` that catches the first failed write: from then
on the output goes to the null device (Python's own flush at exit too, which would otherwise
print "Exception ignored ... BrokenPipeError"), a closed pipe quietly, any other failure said in
one line on stderr. The command goes on; :func:`lost` tells the command line whether output that
was its product (lint's findings, explain's text; not train's progress) was lost.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, TextIO

__all__ = ["guard", "lost"]

# What the one line says happens next: set by a command whose results go to files.
_state: dict[str, Any] = {"error": None, "prefix": "ddpgraph", "then": "its output is lost"}


class _Guarded:
    """``stream`` whose writes and flushes never raise OSError (see the module)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if _state["error"] is None:
            try:
                return self._stream.write(text)
            except OSError as exc:
                _failed(self._stream, exc)
        return len(text)

    def flush(self) -> None:
        if _state["error"] is None:
            try:
                self._stream.flush()
            except OSError as exc:
                _failed(self._stream, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _failed(stream: TextIO, exc: OSError) -> None:
    _state["error"] = exc
    try:  # what is still buffered, and every later write, goes nowhere, without an error
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)
    except (OSError, ValueError):
        pass
    if exc.errno != errno.EPIPE:
        print(
            f"{_state['prefix']}: cannot write to standard output ({exc.strerror or exc}); "
            f"{_state['then']}.",
            file=sys.stderr,
            flush=True,
        )


def guard(prefix: str, then: str | None = None) -> None:
    """Guard ``sys.stdout`` of this process (again: only the message changes); ``prefix`` starts
    the one line and ``then`` says what happens next for a command whose results go to files
    ("training goes on ..."); None: the output was the product (:func:`lost` reports it)."""
    _state["prefix"], _state["then"] = prefix, then or "its output is lost"
    _state["product"] = then is None
    if not isinstance(sys.stdout, _Guarded) and sys.stdout is not None:
        sys.stdout = _Guarded(sys.stdout)


def lost() -> OSError | None:
    """The failure that lost standard output (not a closed pipe: its reader wanted no more)."""
    error: OSError | None = _state["error"]
    if error is None or error.errno == errno.EPIPE or not _state.get("product", True):
        return None
    return error
