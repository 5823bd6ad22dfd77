"""Where a failure came from: the first error of a failed capture, and the line outside torch
and ddpgraph that did it (the script's, or a library's such as transformers').

Shared by both graph engines (:mod:`.graphs`, :mod:`.cpu_graphs`), by the host syncs found in
warm-up (:mod:`.syncs`) and by the integrations that name a script's own line.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Sequence

import torch

from .._frames import PACKAGE_DIR
from ..errors import explain_exception

__all__ = ["SKIPPED_DIRS", "TORCH_DIR", "first_capture_error", "library_frame"]


def first_capture_error(exc: BaseException) -> str:
    """The first CUDA error of a failed capture, not the 'previous error' that follows it."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    first = chain[-1]
    text = str(first).strip().splitlines()[0] if str(first).strip() else type(first).__name__
    frames = traceback.extract_tb(first.__traceback__)
    # the script's or a library's line; where torch's own code raised (FSDP2's hooks), its line
    where = library_frame(frames) or (
        f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    )
    at = f" at {where}" if where is not None else ""
    known = explain_exception(first)
    explained = f"\nddpgraph explains: {known.render()}" if known is not None else ""
    return f"capture failed: {type(first).__name__}: {text}{at}{explained}"


def library_frame(frames: Sequence[traceback.FrameSummary]) -> str | None:
    """The innermost frame of a traceback outside torch and ddpgraph: the line that did it (the
    user's, or a library's such as transformers'), as ``file:line `code```."""
    for frame in reversed(frames):
        if not os.path.abspath(frame.filename).startswith(SKIPPED_DIRS):
            return f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
    return None


# torch's and ddpgraph's directories by path (a virtual environment can be named torch), and
# the warnings module, through which a sync report arrives
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
SKIPPED_DIRS = (
    TORCH_DIR,
    PACKAGE_DIR,
    os.path.dirname(os.path.abspath(warnings.__file__)) + os.sep + "warnings.py",
)
