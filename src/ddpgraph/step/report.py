"""What a TrainStep did, for the script and for logs: its phase and :class:`StepReport`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .batch import Signature, describe
from .policy import Phase

__all__ = ["CaptureRecord", "Phase", "StepReport", "mode_words"]


@dataclass
class CaptureRecord:
    signature: Signature
    at_step: int
    seconds: float
    kind: str = "train"  # "train" or "eval"


@dataclass
class StepReport:
    """What a :class:`TrainStep` did: ``str(report)`` is a readable summary."""

    mode: str
    steps: int = 0
    eager_steps: int = 0
    replays: int = 0
    warmup_steps: int = 0
    evaluations: int = 0
    eval_replays: int = 0
    captures: list[CaptureRecord] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    # each change made to the script's optimizer (graph safety) that changes its numbers, with
    # the measured size; a change measured at 0 is not listed (optim_diff's docstring says why)
    optimizer_changes: list[str] = field(default_factory=list)
    recaptures: list[str] = field(default_factory=list)  # why training graphs were re-captured
    steps_per_replay: int = 1  # training steps in one replay (step(data) with steps_per_replay)
    skipped_steps: int | None = None  # fp16: optimizer steps skipped for inf/NaN gradients
    time_to_first_replay: float | None = None  # seconds from construction to the first replay
    # what captured and replayed: "cuda-graphs", the CPU engine's "cpu-recorded", None (eager)
    engine: str | None = None

    def __str__(self) -> str:
        lines = [
            f"mode={self.mode} steps={self.steps} eager={self.eager_steps} "
            f"replays={self.replays} warm-up={self.warmup_steps}"
        ]
        if self.engine is not None:
            lines[0] += f" engine={self.engine}"
        if self.steps_per_replay > 1:
            lines[0] += f" steps/replay={self.steps_per_replay}"
        if self.evaluations:
            lines[0] += f" evaluations={self.evaluations} (replayed {self.eval_replays})"
        if self.skipped_steps is not None:
            lines[0] += f" skipped (fp16 overflow)={self.skipped_steps}"
        lines += [
            f"captured {c.kind} {describe(c.signature)} at step {c.at_step} in "
            f"{c.seconds * 1e3:.0f} ms"
            for c in self.captures
        ]
        lines += [f"optimizer changed: {change}" for change in self.optimizer_changes]
        lines += [f"re-captured: {reason}" for reason in self.recaptures]
        lines += [f"fallback: {reason}" for reason in self.fallbacks]
        return "\n".join(lines)


def mode_words(mode: tuple[bool, ...]) -> str:
    """How a graph key's modes read in a report: nothing for train mode."""
    if all(mode):
        return ""
    if not any(mode):
        return " (eval mode)"
    return f" ({mode.count(False)} of {len(mode)} modules in eval mode)"
