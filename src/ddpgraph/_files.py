"""The one way the command line writes a result file (run.json, bench JSON, table and chart):
whole or not at all, and a failure said in one line, as the checkpoint writer says its own.

A file is written beside its final name and renamed over it only once every byte is on disk
(fsync), so a full disk, a read-only folder or a crash leaves the old file or none, never half
of one, and the partial file is removed.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["OutputWriteError", "why_not_written", "write_atomically", "write_file"]

# How a failed write reads in an OSError's text, or in the text of an error that wraps one
# (DCP's CheckpointException): ENOSPC and EDQUOT, torch's short-write check for a full disk.
_FULL = ("No space left", "Disk quota exceeded", "unexpected pos")
_DENIED = ("Permission denied", "Read-only file system", "Operation not permitted")


class OutputWriteError(RuntimeError):
    """A result file could not be written; nothing half-written was left."""


def write_file(path: Path, content: str | bytes | Callable[[Path], None], *, fix: str) -> Path:
    """Write ``content`` to ``path`` atomically; ``content`` is the text, the bytes, or a function
    that writes the file it is given (a chart's ``savefig``).

    Raises :class:`OutputWriteError` naming ``path``, the free space, the cause and the fix (``fix``
    says where else to write, e.g. "pass another --out") when any step fails.
    """
    try:
        write_atomically(path, content.encode() if isinstance(content, str) else content)
    except OSError as exc:
        cause = f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else str(exc)
        reason, remedy = why_not_written(path.parent, cause)
        raise OutputWriteError(
            f"could not write {path}: {reason}. {remedy} or {fix}; nothing half-written was left."
        ) from None
    return path


def write_atomically(path: Path, content: bytes | Callable[[Path], None]) -> None:
    """Write ``content`` (bytes, or a function that writes the file it is given) beside
    ``path``, fsync it and rename it over ``path``: a reader sees the old file or the new one.
    Raises the ``OSError``; the partial file is removed. The checkpoints' ``latest`` pointer and
    every result file are written here."""
    partial: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a name of its own (not mkstemp's: its files are private, 0600, unlike the umask's)
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
        if callable(content):
            content(partial)
        else:
            with open(partial, "xb") as file:
                file.write(content)
                file.flush()
                os.fsync(file.fileno())
        os.replace(partial, path)
    except OSError:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise


def why_not_written(folder: Path, cause: str) -> tuple[str, str]:
    """(the reason with the free space and ``cause``, the remedy in place) of a failed write into
    ``folder``: a full disk asks for space, a read-only folder for write access."""
    free = _free_mib(folder)
    room = "" if free is None else f"{free:.1f} MiB free; "
    if any(text in cause for text in _DENIED):
        return f"{folder} is not writable ({cause})", "Make it writable"
    if any(text in cause for text in _FULL) or (free is not None and free < 1):
        return f"no space left on the device ({room}{cause})", "Free space there"
    return f"the write failed ({room}{cause})", "Check the disk"


def _free_mib(folder: Path) -> float | None:
    for place in (folder, *folder.parents):  # the folder itself may not exist yet
        try:
            return shutil.disk_usage(place).free / 2**20
        except OSError:
            continue
    return None
