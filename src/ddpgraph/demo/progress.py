"""``ddpgraph train``'s progress on the main rank: a rich progress bar and the lines above it."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Progress"]


class Progress:
    """A rich progress bar on the main rank (loss, steps/s, mode); a no-op elsewhere."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._enabled = enabled
        self._total = total
        self._bar: Any = None
        self._started = time.perf_counter()
        self._first = 0  # the step this run started from (resumed runs start later)

    def __enter__(self) -> Progress:
        if self._enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "loss {task.fields[loss]}  {task.fields[rate]} steps/s  {task.fields[mode]}"
                ),
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=self._total, loss="-", rate="-", mode="")
        return self

    def start_at(self, done: int) -> None:
        self._first = done
        self._started = time.perf_counter()
        if self._bar is not None:
            self._bar.update(self._task, completed=done)

    def note(self, text: str) -> None:
        """A line above the bar on the main rank (checkpoints saved, resumes)."""
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.console.print(
                f"ddpgraph train: {text}", markup=False, highlight=False, soft_wrap=True
            )
        else:
            print(f"ddpgraph train: {text}", flush=True)

    def __call__(self, done: int, loss: float, mode: str) -> None:
        if self._bar is None:
            return
        rate = (done - self._first) / (time.perf_counter() - self._started)
        self._bar.update(
            self._task, completed=done, loss=f"{loss:.4f}", rate=f"{rate:.0f}", mode=mode
        )

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self._bar is not None:
            if kind is not None:
                # a failed run: a bar left at "0/300" would read as a run that never started,
                # or as one still going; the failure is said instead
                self._bar.update(self._task, visible=False)
            self._bar.stop()
