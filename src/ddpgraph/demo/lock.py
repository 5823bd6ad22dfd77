"""One ``ddpgraph train`` per --out folder at a time: two runs writing one folder would leave one
run.json of the two and interleaved checkpoints, each saying it succeeded.

The launcher (never a worker: they run inside its lock) holds an exclusive ``flock`` on
``OUT/.ddpgraph-train.lock``, which holds its pid. The kernel releases the lock when the process
ends however it ends (SIGKILL, a crash), so a lock file left behind by a dead run is stale by
construction and is taken over (said); a live one is refused naming its pid.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["LOCK_NAME", "OutLock", "OutLockError"]

LOCK_NAME = ".ddpgraph-train.lock"


class OutLockError(Exception):
    """--out cannot be locked: another run holds it, or the folder cannot be written."""


class OutLock:
    """The held lock of one --out folder; :meth:`release` (or leaving ``with``) gives it back."""

    def __init__(self, out: Path, fd: int, created: Path | None, stale_pid: int | None) -> None:
        self.out = out
        self.path = out / LOCK_NAME
        self._fd: int | None = fd
        self._created = created  # the topmost folder this run made (None: it existed)
        self.stale_pid = stale_pid  # the pid in a lock file left by a run that died

    @classmethod
    def take(cls, out: Path) -> OutLock:
        """Create ``out`` if needed and lock it; :class:`OutLockError` names the pid of the run
        that holds it, or why the folder cannot be written."""
        created = _first_missing(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutLockError(_unwritable(out, exc)) from None
        try:
            for _ in range(10):  # another run may remove the file between our open and lock
                fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
                holder = _lock_or_holder(fd)
                if holder is not None:
                    os.close(fd)
                    raise OutLockError(
                        f"--out {out} is in use by another ddpgraph train (pid {holder}): two "
                        "runs in one folder would overwrite each other's run.json and "
                        "checkpoints. Wait for it to end, or pass another --out."
                    )
                if _is_the_file(fd, out / LOCK_NAME):
                    break
                os.close(fd)  # locked a file another run had just removed: take the new one
            else:
                raise OutLockError(f"--out {out}: its lock file keeps changing; try again.")
            stale = _pid_in(fd)
            with contextlib.suppress(OSError):  # a full disk: the lock holds without the pid
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            raise OutLockError(_unwritable(out, exc)) from None
        return cls(out, fd, created, stale if stale != os.getpid() else None)

    def release(self, *, remove_folder_if_new: bool = False) -> None:
        """Remove the lock file and unlock; with ``remove_folder_if_new`` the folders this run
        created go too, where nothing else was put in them."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # still holding the lock: no run can be between open and lock
        os.close(self._fd)
        self._fd = None
        if remove_folder_if_new and self._created is not None:
            folder = self.out
            while True:
                try:
                    folder.rmdir()  # only an empty one
                except OSError:
                    break
                if folder == self._created:
                    break
                folder = folder.parent

    def __enter__(self) -> OutLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _first_missing(out: Path) -> Path | None:
    """The topmost folder of ``out`` that does not exist yet (``out`` itself, or a parent)."""
    if out.exists():
        return None
    missing = out
    for parent in out.parents:
        if parent.exists():
            break
        missing = parent
    return missing


def _lock_or_holder(fd: int) -> int | str | None:
    """Lock ``fd`` (None), or the pid held in the file of the run that holds it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _pid_in(fd) or "unknown"
    return None


def _pid_in(fd: int) -> int | None:
    text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _is_the_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _unwritable(out: Path, exc: OSError) -> str:
    return f"--out {out} is not a writable directory ({exc.strerror or exc}); pick another."
