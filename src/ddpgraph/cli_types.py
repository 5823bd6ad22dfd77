"""Option types of the ``ddpgraph`` command line that click lacks: every number checked at parse
time against the range the run can really use, the error naming the value, the range, why, and
the fix (before any worker starts)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import click

__all__ = ["Bounded", "FiniteFloatRange", "InFolder", "OutPath", "ProcessCount"]


class FiniteFloatRange(click.FloatRange):
    """A float range that also refuses ``nan`` and ``inf`` (click's range lets nan through:
    every comparison with it is false); ``why`` says where the bounds come from."""

    name = "float"

    def __init__(self, *args: Any, why: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.why = why

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = 0.0  # not a number at all: click's own error below
        if not math.isfinite(number):
            self.fail(
                f"{value!r} is not a finite number; pass a number in the range "
                f"{self._describe_range()}.",
                param,
                ctx,
            )
        return _explained(super(), self, value, param, ctx)


class Bounded(click.IntRange):
    """click's IntRange with the reason for its bounds in the error: ``--steps 10**30`` is
    refused naming the range and why, not accepted and met by torch later."""

    name = "integer"

    def __init__(self, *args: Any, why: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.why = why

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return _explained(super(), self, value, param, ctx)


def _explained(
    base: Any,
    bounds: Bounded | FiniteFloatRange,
    value: Any,
    param: click.Parameter | None,
    ctx: click.Context | None,
) -> Any:
    """``base.convert``, its error completed with the range, why it is the range, and the fix."""
    try:
        return base.convert(value, param, ctx)
    except click.BadParameter as exc:
        message = exc.message.rstrip(".")
    if "not in the range" in message:
        reason = f" ({bounds.why})" if bounds.why else ""
        bounds.fail(f"{message}{reason}; pass a value in that range.", param, ctx)
    kind = "whole number" if isinstance(bounds, Bounded) else "number"  # not a number at all
    bounds.fail(f"{message}; pass a {kind} in the range {bounds._describe_range()}.", param, ctx)


class ProcessCount(click.ParamType[int, Any]):
    """--nproc: 1 up to :func:`local_capacity` (found when the option is given, not at import)."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from .distributed.launch import local_capacity

        count = click.IntRange(min=1).convert(value, param, ctx)
        most, what = local_capacity()
        if count > most:
            self.fail(
                f"{count} worker processes, more than this machine runs ({what}); pass --nproc "
                f"{most} or fewer.",
                param,
                ctx,
            )
        return count


class InFolder(NamedTuple):
    """A file --out given as a folder (``results/``, or an existing folder): the run names the
    file in it."""

    folder: Path


class OutPath(click.Path):
    """click's Path that refuses an empty value: ``Path("")`` is the working folder, so
    ``--out ''`` (an unset shell variable) would write there without a word.

    A folder option (``file_okay=False``) given a file, or a file option given a folder, is
    refused naming what the option writes; a file option with ``folders=True`` takes a folder
    (a trailing ``/`` or one that exists) as :class:`InFolder`, the file named by the run.
    """

    def __init__(self, *args: Any, example: str, writes: str, folders: bool = False,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.example = example
        self.writes = writes
        self.folders = folders

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, InFolder):
            return value
        if isinstance(value, str) and not value.strip():
            self.fail(f"empty; pass where to write, e.g. {self.example}.", param, ctx)
        if isinstance(value, (str, os.PathLike)):
            text = os.fspath(value)
            path = Path(text)
            if not self.file_okay and path.is_file():
                self.fail(
                    f"{text} is a file; this option names a folder ({self.writes} go in it). "
                    f"Pass a folder, e.g. {self.example}.",
                    param,
                    ctx,
                )
            if self.folders and (text.endswith(("/", os.sep)) or path.is_dir()):
                return InFolder(path)
            if not self.dir_okay and path.is_dir():
                self.fail(
                    f"{text} is a folder; this option names a file ({self.writes}). Pass a "
                    f"file, e.g. {self.example}.",
                    param,
                    ctx,
                )
        return super().convert(value, param, ctx)
