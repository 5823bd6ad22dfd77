"""The ``accumulate_calls`` window: which call of it this is, and what ends it.

k calls take one micro-batch each; the k-th (or one with ``last=True``, or one where the
script's own sync control says so) syncs the gradients and steps the optimizer; with
``defer_update=True`` the step waits for ``step.update()``. Every decision here is made from
what each rank was given, so every rank decides the same and raises the same.

A window's loss divisor is the script's: ``accumulate_calls`` (Accelerate, run_glue: a window
cut short by ``last=True`` still divides by k), or with ``step(..., window=n)`` the window's own
length n (timm's ``train.py`` divides its short last window by its length). A window the
script's sync control ends short, with neither said, is refused: the step cannot know which.

A framework whose own loop says where a window ends (Accelerate's ``sync_gradients`` in its
``accumulate()`` blocks) gives the window its answer as ``ends`` (a TrainStep's
``window_ends=``), asked on every call: :meth:`Window.loop_ends`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .batch import Batch, Role
from .options import StepOptions, warn_at_user_line

__all__ = ["Window", "WindowEnds", "check_window_ends"]

# a framework's loop state, asked on each call whether it ends the window, told whether the
# script says so itself (last= passed, or its DDP's no_sync() in use): True (it ends), False (it
# only accumulates) or None (the window counts its calls, last= and the script's sync control)
WindowEnds = Callable[[bool], "bool | None"]


def check_window_ends(window_ends: object) -> None:
    """TrainStep's ``window_ends=``: a callable or None, refused at construction otherwise."""
    if window_ends is not None and not callable(window_ends):
        raise ConfigError(
            f"window_ends={window_ends!r} must be a callable (the framework's loop state, asked "
            "on each call whether it ends the window) or None."
        )


class Window:
    """Where a TrainStep is in its accumulation window (one call per micro-batch)."""

    def __init__(self, options: StepOptions, ends: WindowEnds | None = None) -> None:
        self.calls = options.accumulate_calls
        self.ends = ends  # the framework's loop state, if it has a say
        # every micro-batch syncs its gradients (and starts with rank 0's buffers), as a
        # script's DDP does when it accumulates without no_sync()
        self.sync_every_call = options.sync_every_call
        self.defer_update = options.defer_update
        # accumulate_calls=1 without defer_update: every call is a whole window ("train"), so a
        # call without window= consults nothing here but the script's sync control
        self.plain = self.calls == 1 and not self.defer_update
        self.micro_batches = 0  # micro-batches taken since the last update
        self.update_due = False  # defer_update: a synced window waits for step.update()
        self._ends_early = False  # this call ends its window early
        self.length = self.calls  # micro-batches in the current window (window=n: n)
        self._length_given = False  # the script said this window's length (window=n)
        self._last_input: int | None = None  # id of the latest batch's first tensor

    @property
    def divisor(self) -> int:
        """What each micro-batch of the current window divides its loss by: the window's length
        (``accumulate_calls``, or the script's ``window=n``)."""
        return self.length

    def begin(
        self, batch: Batch, last: bool, script_sync: bool | None, length: int | None = None
    ) -> bool:
        """Check a call before anything runs; whether it starts a window (k > 1)."""
        if self.update_due:
            raise ConfigError(
                "step() after a window's last micro-batch without step.update(): with "
                "TrainStep(defer_update=True) the optimizer steps where the script calls "
                "step.update() (its optimizer.step() line); call it once per window, after the "
                "last micro-batch and after setting the LR."
            )
        before = self.length, self._length_given
        try:
            self._take_length(length)
            self._ends_early = self._end_asked(last, script_sync)
            if self._ends_early and self.micro_batches < self.length - 1:
                self._check_short_end(last)
        except ConfigError:
            self.length, self._length_given = before  # a refused call changes nothing
            raise
        self._last_input = id(batch.tensors[0]) if batch.tensors else None
        return self.calls > 1 and self.micro_batches == 0

    def loop_ends(self, last: bool | None, script_sync: bool | None) -> bool:
        """``last``, or where the framework's loop state (:attr:`ends`) says this call syncs and
        steps; the state is told whether the script says where its windows end itself (``last=``
        passed, or its DDP's ``no_sync()`` in use: ``script_sync`` not None). A loop that says
        "accumulate" on the window's last call would take more micro-batches per update than
        the graphs hold: refused, naming both counts."""
        assert self.ends is not None
        syncs = self.ends(last is not None or script_sync is not None)
        last = bool(last)
        if syncs is None:
            return last
        if not syncs and not last and self.micro_batches == self.calls - 1:
            raise ConfigError(
                f"Accelerate says this call only accumulates (sync_gradients=False), but it "
                f"is call {self.calls} of the TrainStep's window (accumulate_calls="
                f"{self.calls}), which syncs and steps: call the step once inside each "
                "`with accelerator.accumulate(model):` block, the same number of times as "
                "gradient_accumulation_steps says."
            )
        return last or syncs

    def syncs(self, role: Role) -> bool:
        """Whether a call of ``role`` syncs its gradients (DDP's forward then counts an
        iteration, and the next forward starts with rank 0's buffers)."""
        return role in ("train", "sync") or self.sync_every_call

    def role(self) -> Role:
        """ "micro" for a call that only accumulates, "train" for one that steps the optimizer
        ("sync" where the step waits for ``step.update()``): each has its own graphs."""
        last = self.micro_batches == self.length - 1
        if not (last or self._ends_early):
            return "micro"
        return "sync" if self.defer_update else "train"

    def end(self, role: Role) -> None:
        """After a call of ``role`` ran."""
        self.micro_batches = 0 if role in ("train", "sync") else self.micro_batches + 1
        self.update_due = role == "sync"
        if not self.micro_batches:
            self.length, self._length_given = self.calls, False

    def take_update(self) -> None:
        """``step.update()``: check it applies a synced window, then mark it applied."""
        if not self.defer_update:
            raise ConfigError(
                "step.update() is for TrainStep(defer_update=True), where the script keeps its "
                "optimizer.step() line as step.update(); without it the call that ends a window "
                "steps the optimizer itself: remove step.update()."
            )
        if not self.update_due:
            raise ConfigError(
                f"step.update() with no synced window to apply ({self.micro_batches} of "
                f"{self.calls} micro-batches taken): call it after the window's last "
                "micro-batch (the accumulate_calls-th call, or one with last=True), once per "
                "window."
            )
        self.update_due = False

    def check_closed(self, what: str) -> None:
        """Refuse ``what`` between the micro-batches of a window (or before its update)."""
        if self.update_due:
            raise ConfigError(
                f"{what} after a window's last micro-batch without step.update() "
                "(defer_update=True): its gradients are not in any state dict; save after "
                "step.update()."
            )
        if self.micro_batches:
            raise ConfigError(
                f"{what} after {self.micro_batches} of {self.calls} micro-batches "
                "(accumulate_calls): their gradients are not in any state dict; save after the "
                "call that steps the optimizer (calls % accumulate_calls == 0)."
            )

    def warn_if_open(self, what: str) -> None:
        """``what`` (an evaluation) inside an open window sees the model before it."""
        if self.micro_batches or self.update_due:
            warn_at_user_line(
                f"{what} inside an open accumulate_calls window ({self.micro_batches} of "
                f"{self.calls} micro-batches taken, not yet applied"
                f"{'; step.update() not called' if self.update_due else ''}): the model "
                "evaluated is the one before them; end the window first (step(..., last=True) "
                "where the epoch ends early)."
            )

    def warn_at_epoch_end(self, data: Any) -> None:
        """At the end of an epoch of the DeviceData whose batches this step took: a window
        still open carries its micro-batches into the next epoch's first step (accelerate
        steps on them instead)."""
        last = getattr(data, "last_batch", None)
        if not (self.micro_batches or self.update_due) or not last:
            return
        if id(last[0]) != self._last_input:
            return  # another DeviceData's epoch, or another step's
        warn_at_user_line(
            f"a DeviceData epoch ended with an accumulate_calls window open ({self.micro_batches}"
            f" of {self.calls} micro-batches taken): they count towards the next epoch's first "
            "step. To step on them at the epoch's end, as accelerate does, pass last=True with "
            "the epoch's last batch: for i, (x, y) in enumerate(data): step(x, y, "
            "last=i == len(data) - 1)."
        )

    def _end_asked(self, last: bool, asked: bool | None) -> bool:
        """Whether this call ends its window early: ``last=True``, or the script's own sync
        control (``require_backward_grad_sync`` / ``no_sync``; ``asked``) read as the window's
        end. Raises where that control contradicts the window."""
        if asked is None or asked:
            return last or bool(asked and self.calls > 1)
        if self.calls == 1:
            raise ConfigError(
                "the script turned the gradient sync off for this call (require_backward_grad_sync"
                " = False, no_sync(), or FSDP2's set_requires_gradient_sync(False)), but "
                "TrainStep(accumulate_calls=1) syncs and steps the optimizer on every call, so "
                "its accumulation would be ignored; pass accumulate_calls=k (k micro-batches per "
                "optimizer step, one per call): the k-th call, or the first one with the sync "
                "on again, syncs and steps; where the script divides a short window's loss by "
                "its own length (timm's train.py: accum_steps becomes the epoch's last window's "
                "length), pass that length too: step(input, target, window=accum_steps)."
            )
        if last or self.micro_batches == self.length - 1:
            position = "step(..., last=True)" if last else f"call {self.length} of {self.length}"
            raise ConfigError(
                f"the script turned the gradient sync off (require_backward_grad_sync = False, "
                f"no_sync() or set_requires_gradient_sync(False)) on the window's last micro-batch ({position}, accumulate_calls="
                f"{self.calls}{self._length_words()}): TrainStep syncs and steps there, but the "
                "script keeps accumulating; pass accumulate_calls= the script's micro-batches "
                "per optimizer step (and window=n where one window is shorter, e.g. an epoch's "
                "last)."
            )
        return False

    def _take_length(self, length: int | None) -> None:
        """``step(..., window=n)``: the script's length of this window (its loss divisor)."""
        if length is None:
            if self._length_given and self.micro_batches:
                raise ConfigError(
                    f"step() without window= inside a window the script said has "
                    f"{self.length} micro-batches ({self.micro_batches} taken): pass the same "
                    "window= on each of its calls."
                )
            return
        if (
            isinstance(length, bool)
            or not isinstance(length, int)
            or not (1 <= length <= self.calls)
        ):
            raise ConfigError(
                f"step(..., window={length!r}): the window's number of micro-batches must be an "
                f"int from 1 to accumulate_calls={self.calls} (the script's micro-batches in "
                "this window, e.g. timm's accum_steps, which is shorter in an epoch's last "
                "window)."
            )
        if self.micro_batches and (length != self.length or not self._length_given):
            raise ConfigError(
                f"step(..., window={length}) on micro-batch {self.micro_batches + 1} of a window "
                f"that began as {self.length} micro-batches: its first micro-batches already "
                "divided their loss by that. Pass the window's length from its first call on "
                "(timm: accum_steps becomes the last window's length at that window's first "
                "batch)."
            )
        if self.micro_batches >= length:
            raise ConfigError(  # unreachable while each window= agrees; kept as a guard
                f"step(..., window={length}) after {self.micro_batches} micro-batches."
            )
        self.length, self._length_given = length, True

    def _length_words(self) -> str:
        return f", window={self.length}" if self._length_given else ""

    def _check_short_end(self, last: bool) -> None:
        """A window ends before its length: with ``last=True`` (its divisor stays k), unless the
        script said another length; by the script's sync control alone, whose divisor (its
        length or k) the step cannot tell."""
        taken = self.micro_batches + 1
        if self._length_given:
            how = "last=True" if last else "the gradient sync turned back on"
            raise ConfigError(
                f"{how} on micro-batch {taken} of a window the script said has {self.length} "
                f"(window={self.length}): its micro-batches divided their loss by "
                f"{self.length}. Pass window={taken} from the window's first call on, or end it "
                f"on its {self.length}th call."
            )
        if last:
            return
        raise ConfigError(
            f"the script turned the gradient sync back on at micro-batch {taken} of "
            f"accumulate_calls={self.calls} micro-batches, ending a short window (an epoch's "
            "last?), and said nothing of its loss divisor: TrainStep cannot tell whether the "
            "script divides that window's loss by its length (timm's train.py: accum_steps "
            "becomes the last window's length) or by accumulate_calls (Accelerate, "
            "run_glue_no_trainer.py). Pass window=<the window's length> on each of its calls "
            "(timm: step(input, target, window=accum_steps)) for the first, last=True on its "
            "last call for the second."
        )
