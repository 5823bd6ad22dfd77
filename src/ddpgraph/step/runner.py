"""The runner: carries out each call of one TrainStep: eagerly, by capturing, or by replaying.

Which of them a training call takes is :func:`~ddpgraph.step.policy.decide`'s (pure, over the
step's :class:`~ddpgraph.step.policy.PolicyState`); the runner does it. A replayed
``step(x, y)`` is one frame here between ``TrainStep.__call__`` and the engine's ``replay``: the
guard's check (:class:`~ddpgraph.step.guard.Guard`: ``None`` when the script changed nothing),
the window (consulted only when accumulating), the key, ``decide``, the replay. The colder paths
are functions over the runner's :class:`~.run_context.RunContext` in their own modules: the
captures and their recovery (:mod:`.capturing`), the eager and first compiled steps
(:mod:`.eager`), evaluation (:mod:`.evaluation`) and ``update()`` (:mod:`.updating`).

A capture that fails falls back to ``EAGER`` on every rank (the reason in
``report().fallbacks``), naming a host sync seen in the last warm-up step as the likely cause.
What a script changed between calls is found by the guard before anything of the call runs and
followed by :class:`~ddpgraph.step.follow.Follower`: ``optimizer.load_state_dict`` (copied into
the tensors the graph reads), a param-group value or ``requires_grad`` (the training graphs are
captured again, with a warning; a freeze or unfreeze also rebuilds the data-parallel wrapper
over the new trainable set), storage moved by ``model.to()`` or a replaced ``forward`` (the
wrapper is rebuilt and every graph captured again, with a warning); a new ``nn.Parameter``
object the optimizer does not hold raises ``ConfigError``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._log import get_logger
from ..distributed import watchdog
from ..errors import CaptureError
from . import evaluation, updating
from .batch import Batch, GraphKey, Role, describe, differences
from .capturing import capture_and_replay, first_capture
from .eager import eager
from .events import changes as _changes
from .parallel import agree_over
from .policy import Action, Call, Phase, decide
from .run_context import RunContext, training_of
from .streams import on_stream

__all__ = ["Runner"]

# A named tuple's own constructor is a Python frame (0.1-0.2 us each); tuple.__new__ builds the
# same tuple in C (GraphKey and Call are made on every replayed call; watchdog.enter does this too)
_record = tuple.__new__


class Runner(RunContext):
    """Runs each call of one TrainStep: eagerly, by capturing, or by replaying its graph (built
    as its :class:`~.run_context.RunContext`)."""

    # ----------------------------------------------------------------- a training call
    def train(
        self, batch: Batch, steps: int, *, last: bool = False, window: int | None = None
    ) -> torch.Tensor:
        """One call, watched: ``steps`` training steps (``step(data)``) or one (micro-)step;
        ``last`` ends an ``accumulate_calls`` window at this call (sync and update on what it
        holds); ``window`` is the script's length of this call's window (its loss divisor).

        A replayed call runs in this one frame: each step below that has nothing to do is an
        attribute test, and the engine's ``replay`` is called from here."""
        self.call_steps = steps
        recovery = self.recovery
        if recovery.checks_before_call:  # FSDP2: undo the script's unshard() first
            recovery.before_call()
        wd = watchdog.ACTIVE.value  # watchdog.active(), read without a call
        if wd is not None:  # a hang in this call becomes the watchdog's verdict
            graphed = self.state.phase is Phase.GRAPHED
            wd.enter("replay" if graphed else self.watch_phase(), self.report.steps)
        try:
            follower = self.follower
            seen = follower.guard.check()
            if seen is not None or follower.storage_moved:
                self.follow(seen, training=True)
            win = self.window
            role: Role = "train"
            loss: torch.Tensor
            gate = self.gate
            if win.plain and window is None:  # accumulate_calls=1: every call is a window
                if False in map(dict.get, gate.sync_dicts, gate.sync_keys):
                    # the script turned a sync off: begin raises, naming its sync control
                    win.begin(batch, last, gate.script_sync(), None)
                starts = False
            else:
                starts = win.begin(batch, last, gate.script_sync(), window)
                role = win.role()
            body = self.body
            if self.state.phase is not Phase.GRAPHED or follower.trainable_changed:
                self._follow_trainable()
            if starts and not win.sync_every_call:
                # a window starts as DDP's forward does: rank 0's buffers first; outside the
                # graphs, so that one "micro" graph serves every other position of the window
                # (with sync_every_call every call's graph starts with them)
                with on_stream(self.stream):
                    body.parallel.sync_buffers()
            submodules, modes = self.submodules, self.seen_modes
            if not (
                self.events_only
                and _changes[0] == self.modes_at
                and self.state.phase is Phase.GRAPHED
                and modes[:1] == (submodules[0].training,)
            ):  # every submodule's mode keys the graphs (C-level: no frame each)
                self.seen_modes = modes = tuple(map(training_of, submodules))
                self.modes_at = _changes[0]
            key = _record(GraphKey, (role, modes, batch.signature, win.length))
            graphs = self.graphs
            # the one lookup of the key: the graph found is the one replayed
            captured = None if graphs is None else graphs.captured.get(key)
            action = decide(
                self.plan,
                self.state,
                _record(
                    Call,
                    (
                        key.signature,
                        captured is not None,
                        captured is None and graphs is not None and key in graphs.uncapturable,
                        self.report.eager_steps,
                        win.micro_batches != 0,
                        self._ready,
                        self.previous_signature,
                        self._agree,
                    ),
                ),
            )
            if action is Action.REPLAY and captured is not None and graphs is not None:
                loss, self.output, self.grad_norm = graphs.replay(captured, batch)
                self.report.replays += 1
                # a copy the script may keep (as an eager step's): the next replay overwrites
                # the graph's own, and scripts append losses to a list
                loss = loss.clone()
            else:
                loss = self._run(action, key, batch)
            if not (win.plain and window is None):
                win.end(role)
            # as DDP's post-forward sets require_forward_param_sync (an attribute: no call)
            body.parallel.buffers_due = role in ("train", "sync") or win.sync_every_call
            if action is not Action.REPLAY or seen is not None:
                self.settle()
        except BaseException as exc:
            if wd is not None:
                wd.leave()
                wd.on_error(exc)
            raise
        if wd is not None:
            wd.leave()
        return loss

    def _ready(self) -> bool:
        """The wrapper's answer: may the next forwards of this call be captured?"""
        return self.gate.allows_capture(self.call_steps)

    def _agree(self, mine: bool) -> bool:
        """Every rank's ``mine``: asked by the decision on every rank at the same call (before
        the first capture, whether each rank's batch is shaped like its previous one)."""
        every, _ = agree_over(self.gate.group, self.device, mine, False)
        if not every:
            get_logger().info(
                "TrainStep holds its first capture: a batch unlike the one before it (an "
                "epoch's short last batch?) would fix the graph's shape; it waits for one like "
                f"its predecessor, at most {self.plan.first_capture_wait} steps past the warm-up"
            )
        return every

    def _run(self, action: Action, key: GraphKey, batch: Batch) -> torch.Tensor:
        """A training call that does not replay: the first capture, a new key's, or eager (also
        where a capture failed)."""
        self.previous_signature = key.signature
        loss: torch.Tensor | None = None
        if action is Action.FIRST_CAPTURE:
            loss = first_capture(self, key, batch)
        elif action is Action.CAPTURE:
            loss = capture_and_replay(self, key, batch)
        if loss is not None:
            return loss
        return eager(self, batch)

    def update(self) -> None:
        """``step.update()`` (``defer_update=True``), watched: the optimizer step on the window
        the calls since the last update synced, with the param-group values (the LR) the script
        set since; graphed once the window's training graphs are (:mod:`.updating`)."""
        self.recovery.before_call()
        self.watched(self.watch_phase(), lambda: updating.update(self))

    def evaluate(self, batch: Batch) -> Any:
        """The forward in eval mode, graphed after its own warm-up (:mod:`.evaluation`)."""
        return evaluation.evaluate(self, batch)

    def _follow_trainable(self) -> None:
        """A script that froze or unfroze parameters (``requires_grad``): the wrapper rebuilt
        over the new set and the training graphs dropped, so the step captures again after the
        new wrapper's warm-up. Checked by the replay guard while graphed (no cost here), on
        every call otherwise."""
        if self.phase is Phase.GRAPHED and not self.follower.trainable_changed:
            return
        self.follower.trainable_changed = False
        if not self.recovery.follow_trainable():
            return
        for param in self.recovery.inner.parameters():
            if not param.requires_grad:
                param.grad = None  # as the eager loop's zero_grad(set_to_none=True) leaves it
        self.follower.drop_training()
        get_logger().info("TrainStep rebuilt its data-parallel wrapper over the trainable set")

    def check_open(self, what: str) -> None:
        if self.phase is Phase.CLOSED:
            raise CaptureError(
                f"{what} on a TrainStep after close(): its graphs and their memory are gone; "
                "build a new TrainStep to keep training."
            )

    def close(self) -> None:
        """Free every graph and the pool; later calls raise."""
        if self.graphs is not None:
            self.graphs.close()
        self.follower.guard.forget_optimizer()
        self.output = self.grad_norm = None
        self.set(phase=Phase.CLOSED)

    def watch_phase(self) -> str:
        """The watchdog's name for this call (its heartbeat says where each rank is)."""
        if self.phase is Phase.WARMUP:
            return "capture" if self._warmup_done() else "warmup"
        return "replay" if self.phase is Phase.GRAPHED else "eager"

    def check_shape(self, batch: Batch) -> None:
        """on_new_shape="error", on every device: the signature must stay the captured one."""
        warmup_calls = self.warmup * self.options.accumulate_calls
        if self.options.on_new_shape != "error" or self.report.steps <= warmup_calls:
            return  # before the signature is built: this runs on every call
        signature = batch.signature
        if self.reference is None:
            self.reference = signature
        elif signature != self.reference:
            # "its graph" only where there is one: on the CPU the step runs eagerly, and the
            # check holds the batches to the first shape after warm-up all the same
            graphed = self.graphs is not None
            held = "its graph is for" if graphed else "it holds batches of"
            raise ValueError(
                f"TrainStep(on_new_shape='error') got a batch of {describe(signature)}, but "
                f"{held} {describe(self.reference)} (the first after warm-up; changed: "
                f"{differences(signature, self.reference, known_as='captured' if graphed else 'was')}"
                "); pad batches to one shape "
                "(ddpgraph.pad_batch, drop_last=True), or pass on_new_shape='eager' or 'capture'."
            )

    def _warmup_done(self) -> bool:
        """Warm-up counts optimizer steps; with accumulate_calls it ends at a window's start."""
        calls = self.warmup * self.options.accumulate_calls
        return (
            self.report.eager_steps >= calls
            and self.window.micro_batches == 0
            and self.gate.allows_capture(self.call_steps)
        )
