"""Host syncs inside the step, found in the last warm-up step so a failed capture can name them.

A host sync cannot happen inside a graph; transformers >= 5 and others skip theirs while a stream
is capturing, so a sync seen in warm-up does not stop the capture: only a capture that fails
names the line found here as the likely cause.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._frames import line_outside
from .capture_errors import SKIPPED_DIRS

__all__ = ["SyncReport", "record_host_syncs"]


@dataclass
class SyncReport:
    result: Any
    found: list[tuple[str, str]]  # (message, user source line)

    def describe(self) -> str:
        message, where = self.found[0]
        return (
            f"a host sync inside the step ({message}) at {where}; the CPU cannot wait for the GPU "
            "inside a graph. Move .item(), .cpu(), printing or data-dependent shapes "
            "(nonzero, boolean masks) out of the model, loss and optimizer."
        )


def record_host_syncs(fn: Callable[[], Any]) -> SyncReport:
    """Run ``fn`` with CUDA sync debugging on, recording each synchronising op and its caller.

    "warn" rather than "error": the step runs to the end, so the model is never left half-updated.
    """
    found: list[tuple[str, str]] = []
    previous_mode = torch.cuda.get_sync_debug_mode()

    def record(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        if "called a synchronizing CUDA operation" in str(message):
            found.append((str(message).splitlines()[0], _user_frame()))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # type: ignore[assignment]
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
    return SyncReport(result, found)


def _user_frame() -> str:
    """The innermost stack frame outside torch and ddpgraph: the line that synced (the user's, or
    a library's such as transformers')."""
    return line_outside(*SKIPPED_DIRS)
