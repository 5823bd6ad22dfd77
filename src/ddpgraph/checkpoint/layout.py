"""Where checkpoints lie: the folder layout, the manifest, which step directory is committed."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeAlias

from ..errors import ConfigError

MANIFEST = "ddpgraph.json"
LATEST = "latest"
FORMAT_VERSION = 1
_DCP_METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_RESERVED_EXTRA = frozenset({"path"})  # keys load_checkpoint's result already uses


class CheckpointError(ConfigError):
    """A checkpoint cannot be saved or does not fit the job loading it (world size, model)."""


class Stateful(Protocol):
    """What a checkpoint takes besides the model and optimizer: an LR scheduler, a data position
    (:class:`ResumableLoader`), anything with these two methods. The shape of DCP's own
    ``torch.distributed.checkpoint.stateful.Stateful``, so either one fits the other."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


# What save_checkpoint's extra values may be (checked at run time: json.dumps must take them).
JSON: TypeAlias = bool | int | float | str | Sequence["JSON"] | Mapping[str, "JSON"] | None


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint under ``directory`` (or ``directory`` itself), or None.

    Committed: both metadata files exist. Whether it still loads is :func:`checkpoint_problem`'s
    question; :func:`load_checkpoint` skips one that does not.
    """
    root = Path(directory)
    if _is_committed(root):
        return root
    found = sorted(_committed(root), key=lambda item: item[0])
    return found[-1][1] if found else None


def _committed(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    result = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and _is_committed(entry):
            result.append((int(match.group(1)), entry))
    return result


def _is_committed(path: Path) -> bool:
    return (path / _DCP_METADATA).is_file() and (path / MANIFEST).is_file()


def step_dirs(directory: str | os.PathLike[str]) -> list[Path]:
    """Every ``step-N`` directory under ``directory``, newest first, whole or damaged; or
    ``[directory]`` when it is a checkpoint directory itself."""
    root = Path(directory)
    if _STEP_DIR.match(root.name) or (root / MANIFEST).exists() or (root / _DCP_METADATA).exists():
        return [root]
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), e) for e in root.iterdir() if (m := _STEP_DIR.match(e.name))]
    return [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]


def read_manifest(path: Path) -> dict[str, Any]:
    """``path``'s ddpgraph.json; :class:`CheckpointError` naming the file and what is wrong."""
    manifest = path / MANIFEST
    try:
        data = json.loads(manifest.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest} is missing") from None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise CheckpointError(f"{manifest} is not readable JSON ({exc})") from None
    if not isinstance(data, dict) or not all(
        isinstance(data.get(key), int) for key in ("step", "world_size")
    ):
        raise CheckpointError(f"{manifest} lacks its integer step and world_size")
    return data


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint ``path`` cannot load, found from its files without loading it, or None.

    Reads the manifest and DCP's ``.metadata`` (small), and compares each data file's size with
    the bytes the metadata places in it: a truncated or missing shard is found without reading it.
    """
    from .._typed_torch import filesystem_reader

    try:
        read_manifest(path)
    except CheckpointError as exc:
        return str(exc)
    if not (path / _DCP_METADATA).is_file():
        return f"{path / _DCP_METADATA} (DCP's index of the saved values) is missing"
    try:
        metadata = filesystem_reader(str(path)).read_metadata()
    except Exception as exc:  # an unpickling error of any type: the file is damaged
        return f"{path / _DCP_METADATA} is not readable ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"{shard} is missing"
        have = shard.stat().st_size
        if have < size:
            return f"{shard} is truncated ({have} of its {size} bytes)"
    return None


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _first_cause(exc: BaseException, *, name_rank: bool = True) -> str:
    """The first underlying error of a DCP failure (it wraps each rank's), as ``[rank N: ]Type:
    text`` on one line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        rank, inner = min(failures.items(), key=lambda item: item[0])
        inner = getattr(inner, "exc", inner)  # a _WrappedException holds the real one
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            inner = inner[0]  # torch 2.13: (the exception, its FrameSummary list)
        return f"rank {rank}: {_one_line(inner)}" if name_rank else _one_line(inner)
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    """``Type: text`` on one line (an unpickling error's text has line breaks)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())
