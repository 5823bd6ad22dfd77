"""The runner: carries out each call of one TrainStep: eagerly, by capturing, or by replaying.

Which of them a training call takes is :func:`~ddpgraph.step.policy.decide`'s (pure, over the
step's :class:`~ddpgraph.step.policy.PolicyState`); the runner does it. A replayed
``step(x, y)`` is one frame here between ``TrainStep.__call__`` and the engine's ``replay``: the
guard's check (:class:`~ddpgraph.step.guard.Guard`: ``None`` when the script changed nothing),
the window (consulted only when accumulating), the key, ``decide``, the replay.

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

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from .._log import get_logger
from ..distributed import watchdog
from ..errors import CaptureError
from ..facts import DEFAULT_WARMUP
from .batch import (
    NO_BATCH,
    Batch,
    GraphKey,
    Role,
    Signature,
    describe,
    differences,
)
from .body import StepBody
from .compiling import first_forward_failure
from .events import changes as _changes
from .follow import Follower
from .graphs import (
    CapturedGraph,
    CaptureFailure,
    Graphs,
    on_stream,
)
from .guard import Seen
from .options import StepOptions, warn_at_user_line
from .parallel import DataParallel
from .policy import Action, Call, Phase, Plan, PolicyState, decide
from .report import CaptureRecord, StepReport, mode_words
from .syncs import record_host_syncs
from .window import Window

__all__ = ["Runner"]

_training = attrgetter("training")
_EVAL_WARMUP = 2  # eager evaluations per input signature before its capture (cuDNN/cuBLAS set-up)


class Runner:
    """Runs each call of one TrainStep: eagerly, by capturing, or by replaying its graph.

    ``graphs`` is None where no graph can be captured (``fallback`` says why); ``rewrap`` builds
    the wrapper again around the uncompiled module when ``compile`` fails.
    """

    def __init__(
        self,
        options: StepOptions,
        body: StepBody,
        graphs: Graphs | None,
        *,
        device: torch.device,
        stream: torch.cuda.Stream | None,
        submodules: list[nn.Module],
        rewrap: Callable[[], DataParallel],
        report: StepReport,
    ) -> None:
        self.options = options
        self.body = body
        self.graphs = graphs
        self.device = device
        self._stream = stream
        self._submodules = submodules  # their modes key the graphs
        self._rewrap = rewrap
        self.report = report
        self.state = PolicyState()
        self.warmup = self._planned_warmup()
        self.plan = Plan(self.warmup * options.accumulate_calls, options.on_new_shape)
        self.output: Any = None
        self.grad_norm: torch.Tensor | None = None  # the latest update's (graph-owned)
        self.call_steps = 1  # training steps in the current call (step(data): up to K)
        self.window = Window(options)  # accumulate_calls: where this call is in its window
        self._compile_pending = bool(options.compile)  # compiled, not yet past its first forward
        self._start = time.perf_counter()
        self._reference: Signature | None = None  # the signature on_new_shape compares against
        self._sync_hint: str | None = None  # a host sync seen in warm-up: named if capture fails
        self._eval_calls: Counter[GraphKey] = Counter()
        # what a script or framework changes in the model between calls
        events_only = options.guard == "events"
        self.follower = Follower(
            lambda: self.body.parallel, graphs, report, device, stream, events_only=events_only
        )
        # guard="events" while graphed: the submodules' modes re-read only when the events'
        # count moved since they were last read (any module's train() / eval(); the runner's own
        # snapshot: a check by evaluate() or update() in between must not hide it) or the
        # model's own mode changed; see step/events.py
        self._events_only = events_only
        self._seen_modes: tuple[bool, ...] = ()
        self._modes_at = -1  # the count when the modes were read

    @property
    def parallel(self) -> DataParallel:
        return self.body.parallel

    @property
    def phase(self) -> Phase:
        return self.state.phase

    def _set(self, **changes: Any) -> None:
        """A new :class:`PolicyState` (frozen: every change is one of these)."""
        self.state = replace(self.state, **changes)

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
        parallel = self.body.parallel
        if parallel.checks_before_call:  # FSDP2: undo the script's unshard() first
            parallel.before_call()
        wd = watchdog.ACTIVE.value  # watchdog.active(), read without a call
        if wd is not None:  # a hang in this call becomes the watchdog's verdict
            graphed = self.state.phase is Phase.GRAPHED
            wd.enter("replay" if graphed else self.watch_phase(), self.report.steps)
        try:
            follower = self.follower
            seen = follower.guard.check()
            if seen is not None or follower.storage_moved:
                self._follow(seen, training=True)
            win = self.window
            role: Role = "train"
            loss: torch.Tensor
            if win.plain and window is None:  # accumulate_calls=1: every call is a window
                if False in map(dict.get, parallel.sync_dicts, parallel.sync_keys):
                    # the script turned a sync off: begin raises, naming its sync control
                    win.begin(batch, last, parallel.script_sync(), None)
                starts = False
            else:
                starts = win.begin(batch, last, parallel.script_sync(), window)
                role = win.role()
            body = self.body
            body.divisor = win.length
            if self.state.phase is not Phase.GRAPHED or follower.trainable_changed:
                self._follow_trainable()
            if starts and not body.sync_every_call:
                # a window starts as DDP's forward does: rank 0's buffers first; outside the
                # graphs, so that one "micro" graph serves every other position of the window
                # (with sync_every_call every call's graph starts with them)
                with on_stream(self._stream):
                    body.parallel.sync_buffers()
            submodules, modes = self._submodules, self._seen_modes
            if not (
                self._events_only
                and _changes[0] == self._modes_at
                and self.state.phase is Phase.GRAPHED
                and modes[:1] == (submodules[0].training,)
            ):  # every submodule's mode keys the graphs (C-level: no frame each)
                self._seen_modes = modes = tuple(map(_training, submodules))
                self._modes_at = _changes[0]
            key = GraphKey(role, modes, batch.signature, body.divisor)
            graphs = self.graphs
            action = decide(
                self.plan,
                self.state,
                Call(
                    key.signature,
                    graphs is not None and key in graphs.captured,
                    graphs is not None and key in graphs.uncapturable,
                    self.report.eager_steps,
                    win.micro_batches != 0,
                    self._ready,
                ),
            )
            if action is Action.REPLAY and graphs is not None:
                loss, self.output, self.grad_norm = graphs.replay(key, batch).output
                self.report.replays += 1
                # a copy the script may keep (as an eager step's): the next replay overwrites
                # the graph's own, and scripts append losses to a list
                loss = loss.clone()
            else:
                loss = self._run(action, key, batch)
            if not (win.plain and window is None):
                win.end(role)
            # as DDP's post-forward sets require_forward_param_sync (an attribute: no call)
            body.parallel.buffers_due = role in ("train", "sync") or body.sync_every_call
            if action is not Action.REPLAY or seen is not None:
                self._settle()
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
        return self.body.parallel.allows_capture(self.call_steps)

    def _run(self, action: Action, key: GraphKey, batch: Batch) -> torch.Tensor:
        """A training call that does not replay: the first capture, a new key's, or eager."""
        if action is Action.FIRST_CAPTURE:
            return self._first_capture(batch, key)
        if action is Action.CAPTURE:
            loss = self._capture_and_replay(key, batch)
            if loss is not None:
                return loss
        return self._eager(batch)

    def update(self) -> None:
        """``step.update()`` (``defer_update=True``), watched: the optimizer step on the window
        the calls since the last update synced, with the param-group values (the LR) the script
        set since; graphed once the window's training graphs are."""
        self.parallel.before_call()
        self._watched(self.watch_phase(), self._update)

    def _update(self) -> None:
        seen = self._guarded(training=True)
        self.window.take_update()
        self.parallel.buffers_due = True
        key = GraphKey("update", self._modes(), NO_BATCH.signature)
        if self.phase is Phase.GRAPHED and self._update_graphed(key):
            if seen is not None:
                self._settle()
            return
        with on_stream(self._stream):
            if self.graphs is not None:
                self.graphs.plan.sync_lr()  # the LR the script just set
            self.body.update()
        self.grad_norm = self.body.grad_norm
        self._settle()

    def _update_graphed(self, key: GraphKey) -> bool:
        """Replay the update graph, capturing it first once the window's "sync" graph exists
        (the update reads the gradients that graph writes); False: run it eagerly."""
        graphs = self._graphs()
        due = key not in graphs and key not in graphs.uncapturable and graphs.keys_of("sync")
        if due and self.state.hold_off == 0:
            started = time.perf_counter()
            result = self._capture_graph(key, NO_BATCH, lambda _: self._updated())
            if isinstance(result, CaptureFailure):
                self.warn_or_raise(f"the optimizer update runs eagerly: {result.reason}")
                return False
            self._record_capture(key, started)
        replayed = graphs.replay(key, NO_BATCH)
        if not replayed.replayed:
            return False
        self.grad_norm = replayed.output
        return True

    def _updated(self) -> torch.Tensor | None:
        self.body.update()
        return self.body.grad_norm

    def _guarded(self, *, training: bool) -> Seen | None:
        """At the start of a call (``training``: one that may run the wrapper's collectives):
        what the script changed since the last call, followed before anything runs (and
        returned). The common case is one check that finds nothing."""
        seen = self.follower.guard.check()
        self._follow(seen, training=training)
        return seen

    def _settle(self) -> None:
        """After a call that ran anything eagerly, captured, or followed what the guard saw:
        the model as the step left it is the guard's new baseline. The one place it is
        re-taken; a call that only replayed keeps it (a replay changes no address)."""
        self.follower.guard.settle(keep_grads=self.state.phase is Phase.GRAPHED)

    def _follow(self, seen: Seen | None, *, training: bool) -> None:
        follower = self.follower
        if seen is not None:
            follower.follow(seen, graphed=self.state.phase is Phase.GRAPHED)
        if training and follower.storage_moved:
            follower.follow_storage()

    def _follow_trainable(self) -> None:
        """A script that froze or unfroze parameters (``requires_grad``): the wrapper rebuilt
        over the new set and the training graphs dropped, so the step captures again after the
        new wrapper's warm-up. Checked by the replay guard while graphed (no cost here), on
        every call otherwise."""
        if self.phase is Phase.GRAPHED and not self.follower.trainable_changed:
            return
        self.follower.trainable_changed = False
        if not self.parallel.follow_trainable():
            return
        for param in self.parallel.inner.parameters():
            if not param.requires_grad:
                param.grad = None  # as the eager loop's zero_grad(set_to_none=True) leaves it
        self.follower.drop_training()
        if self.graphs is not None:
            self.graphs.parameters_changed()
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
        self._set(phase=Phase.CLOSED)

    def _watched(self, phase: str, run: Callable[[], Any]) -> Any:
        """``run()`` as a watched call: a hang in it becomes the watchdog's verdict."""
        wd = watchdog.active()
        if wd is None:
            return run()
        wd.enter(phase, self.report.steps)
        try:
            result = run()
        except BaseException as exc:
            wd.leave()
            wd.on_error(exc)
            raise
        wd.leave()
        return result

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
        if self._reference is None:
            self._reference = signature
        elif signature != self._reference:
            # "its graph" only where there is one: on the CPU the step runs eagerly, and the
            # check holds the batches to the first shape after warm-up all the same
            graphed = self.graphs is not None
            held = "its graph is for" if graphed else "it holds batches of"
            raise ValueError(
                f"TrainStep(on_new_shape='error') got a batch of {describe(signature)}, but "
                f"{held} {describe(self._reference)} (the first after warm-up; changed: "
                f"{differences(signature, self._reference, known_as='captured' if graphed else 'was')}"
                "); pad batches to one shape "
                "(ddpgraph.pad_batch, drop_last=True), or pass on_new_shape='eager' or 'capture'."
            )

    def _warmup_done(self) -> bool:
        """Warm-up counts optimizer steps; with accumulate_calls it ends at a window's start."""
        calls = self.warmup * self.options.accumulate_calls
        return (
            self.report.eager_steps >= calls
            and self.window.micro_batches == 0
            and self.parallel.allows_capture(self.call_steps)
        )

    def _modes(self) -> tuple[bool, ...]:
        """Every submodule's ``training`` flag: part of each graph's key."""
        self._seen_modes = modes = tuple(map(_training, self._submodules))
        self._modes_at = _changes[0]
        return modes

    # ----------------------------------------------------------------- capture
    def _first_capture(self, batch: Batch, key: GraphKey) -> torch.Tensor:
        """Capture on every rank, then agree; every rank replays, or every rank runs eagerly.

        Ranks that disagreed (one's capture failed) would otherwise carry on with a graph on some
        ranks and a failed step on others; and with graph="always" every rank raises, not only
        the one that failed. Every rank reaches this call at the same step (the warm-up length is
        the same everywhere). Costs one tiny all-reduce, once per run.
        """
        started = time.perf_counter()
        result = self._capture(key, batch)
        ok, any_dirty = self.parallel.agree(
            isinstance(result, CapturedGraph), self.parallel.dirty()
        )
        if ok:
            if any_dirty:
                self._reset_wrapper("")
        else:
            mine = (
                self._explain_failure(result.reason) if isinstance(result, CaptureFailure) else None
            )
            reason = _every_failure(self.parallel.failures_of_every_rank(mine))
            if any_dirty:
                self._reset_wrapper(reason)  # on every rank: DDP's bucket rebuild is collective
            self.follower.drop_training()
            self.enter_eager(reason)
            return self._eager(batch)
        self._set(phase=Phase.GRAPHED)
        self._record_capture(key, started)
        loss = self._replay(key, batch)
        assert loss is not None
        self.report.time_to_first_replay = time.perf_counter() - self._start
        return loss

    def _capture_and_replay(self, key: GraphKey, batch: Batch) -> torch.Tensor | None:
        """Capture a new key's graph while graphed (as :func:`~.policy.decide` said), then
        replay it; None when the capture failed (the call runs eagerly).

        A later capture needs no agreement: capturing runs nothing, and a graph's all-reduces
        pair with a peer's eager ones like eager ones do (same buckets, same order).
        """
        started = time.perf_counter()
        result = self._capture(key, batch)
        if isinstance(result, CaptureFailure):
            reason = self._explain_failure(result.reason)
            if self.parallel.dirty():
                with _naming_the_failure(reason):
                    self.parallel.check_reset_alone()  # no agreement: peers may be replaying
                self._reset_wrapper(reason)
            self.warn_or_raise(
                f"the batch of {describe(batch.signature)}{mode_words(key.modes)} runs eagerly: "
                f"{reason}"
            )
            return None
        self._record_capture(key, started)
        return self._replay(key, batch)

    def _capture(self, key: GraphKey, batch: Batch) -> CapturedGraph | CaptureFailure:
        """Capture the step for this key on the device copy of ``batch``."""
        found = self.parallel.before_capture()  # e.g. an earlier loss's graph still alive
        if found is not None:
            warn_at_user_line(f"TrainStep: {found}")
        device_batch = self.to_device(batch)
        result = self._capture_graph(key, device_batch, lambda b: self._captured(b, key.role))
        if self.body.syncs(key.role):
            self.parallel.count_forwards(self.call_steps)  # its host code ran once per step
        return result

    def _capture_graph(
        self, key: GraphKey, batch: Batch, body: Callable[[Batch], Any]
    ) -> CapturedGraph | CaptureFailure:
        """Capture ``body`` under ``key``; the first graph fixes the optimizer's baseline
        (what the graphs read: a reload is copied back into it)."""
        graphs = self._graphs()
        result = graphs.capture(key, batch, body)
        if isinstance(result, CapturedGraph):
            self.follower.guard.watch_optimizer(graphs.watched(), graphs.plan.optimizer)
        return result

    def _captured(self, batch: Batch, role: Role) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
        loss, output = self.body.run(batch, role)
        return loss, _detached(output), self.body.grad_norm

    def _record_capture(self, key: GraphKey, started: float) -> None:
        seconds = time.perf_counter() - started
        if key.trains:
            self._set(signatures=self.state.signatures | {key.signature})
        words = mode_words(key.modes) if key.trains else ""
        self.report.captures.append(
            CaptureRecord(key.signature, self.report.steps, seconds, key.role + words)
        )
        get_logger().info(
            "TrainStep captured %s%s %s in %.0f ms",
            key.role,
            words,
            describe(key.signature),
            seconds * 1e3,
        )

    def _explain_failure(self, reason: str) -> str:
        wrapper = self.parallel.explain_capture_failure(reason)
        if wrapper is not None:
            return f"{reason}\ncause: {wrapper}"
        if self._sync_hint is None:
            return reason
        return f"{reason}\nlikely cause, seen in warm-up: {self._sync_hint}"

    def _reset_wrapper(self, reason: str) -> None:
        """After a backward that never finished: the wrapper reset (it may rebuild what the
        training graphs read, so they go) and two eager steps before the next capture. A reset
        that cannot be done raises with the capture's own failure (``reason``) named."""
        with _naming_the_failure(reason):
            self.parallel.reset()
        self.follower.drop_training()
        self._set(hold_off=2)

    def _graphs(self) -> Graphs:
        assert self.graphs is not None  # only the graphed phases get here
        return self.graphs

    # ----------------------------------------------------------------- replay and eager
    def _replay(self, key: GraphKey, batch: Batch) -> torch.Tensor | None:
        """Replay ``key``'s graph (the one call into the graphs per replayed step); None when
        it has none, or when what the script changed asks for a re-capture."""
        replayed = self._graphs().replay(key, batch)
        if not replayed.replayed:
            return None
        loss: torch.Tensor
        loss, self.output, self.grad_norm = replayed.output
        self.report.replays += 1
        # a copy the script may keep (as an eager step's): the next replay overwrites the graph's
        # own, and scripts append losses to a list and average them at the end of a window
        return loss.clone()

    def _eager(self, batch: Batch) -> torch.Tensor:
        n = self.call_steps
        self.report.eager_steps += n
        warming_up = self.phase is Phase.WARMUP
        if warming_up:
            self.report.warmup_steps += n
        role = self.window.role()
        last_warmup = self.warmup * self.options.accumulate_calls
        check_syncs = (
            warming_up
            and self.report.eager_steps - n < last_warmup <= self.report.eager_steps
            and self.device.type == "cuda"
        )
        with on_stream(self._stream):
            batch = self.to_device(batch)
            if self.graphs is not None:
                self.graphs.plan.sync_lr()
            if self._compile_pending:
                loss, output = self._first_compiled_step(batch, role)
            elif check_syncs:
                syncs = record_host_syncs(lambda: self.body.run(batch, role))
                loss, output = syncs.result
                if syncs.found:
                    self._sync_hint = syncs.describe()
            else:
                loss, output = self.body.run(batch, role)
        if self.body.syncs(role):
            self.parallel.count_forwards(n)
        if self.state.hold_off:
            self._set(hold_off=max(0, self.state.hold_off - n))
        self.output = _detached(output)
        self.grad_norm = self.body.grad_norm
        return loss

    def to_device(self, batch: Batch) -> Batch:
        return batch.to(self.device, channels_last=self.options.channels_last)

    # ----------------------------------------------------------------- compile
    def _first_compiled_step(self, batch: Batch, role: Role) -> tuple[torch.Tensor, Any]:
        """Compile first, outside the wrapper, then agree: every rank runs compiled, or every
        rank plain.

        Building DDP is a collective, so a rank falling back alone would leave the ranks in
        different collectives; and inside DDP's forward a failing rank would already have joined
        the buffer broadcast. So the compiling forward runs on the compiled module itself (no
        DDP, no backward), with the RNG forked and the buffers put back: training sees no extra
        step. Then one tiny all-reduce decides, and every rank rebuilds the wrapper if any rank
        failed.
        """
        self._compile_pending = False
        failure = first_forward_failure(self.body, batch, self.device)
        ok, _ = self.parallel.agree(failure is None, False)
        if not ok:
            reason = _every_failure(self.parallel.failures_of_every_rank(failure), "compile")
            self.warn_or_raise(f"torch.compile failed, so the model runs uncompiled: {reason}")
            self.body.parallel = self._rewrap()
            if self.graphs is not None:
                self.graphs.parameters_changed()
        return self.body.run(batch, role)

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, batch: Batch) -> Any:
        """The forward in eval mode, graphed after ``_EVAL_WARMUP`` eager calls per signature,
        watched; every module's own mode restored after it."""
        self.parallel.before_call()
        with self._eval_mode():
            settle, output = self._watched("eval", lambda: self._evaluate(batch))
        if settle:
            self._settle()
        return output

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        modes = tuple(map(_training, self._submodules))  # as they are: restored after
        for module in self._submodules:
            module.training = False
        try:
            yield
        finally:
            for module, training in zip(self._submodules, modes):
                module.training = training

    def _evaluate(self, batch: Batch) -> tuple[bool, Any]:
        """(whether the guard's baseline is re-taken after it, the output)."""
        key = GraphKey("eval", (False,) * len(self._submodules), batch.signature)
        seen = self._guarded(training=False)
        self.window.warn_if_open("evaluate()")
        if self.parallel.buffers_due:
            # DDP's eval forward after a training step starts with rank 0's buffers (later ones
            # do not: its no_grad forward turns that off until the next training forward)
            self.parallel.buffers_due = False
            with on_stream(self._stream):
                self.parallel.sync_buffers()
        if self.graphs is not None and key not in self.graphs and self._eval_capture_due(key):
            self._capture_eval(key, batch)
        if self.graphs is not None and key in self.graphs:
            replayed = self.graphs.replay(key, batch)
            if replayed.replayed:
                self.report.eval_replays += 1
                return seen is not None, replayed.output
        with on_stream(self._stream):
            return True, self.body.forward_eval(self.to_device(batch))

    def _eval_capture_due(self, key: GraphKey) -> bool:
        if self.options.graph == "never" or key in self._graphs().uncapturable:
            return False
        self._eval_calls[key] += 1
        return self._eval_calls[key] > _EVAL_WARMUP

    def _capture_eval(self, key: GraphKey, batch: Batch) -> None:
        started = time.perf_counter()
        result = self._capture_graph(key, self.to_device(batch), self.body.forward_eval)
        if isinstance(result, CaptureFailure):
            self.warn_or_raise(
                f"evaluation of {describe(batch.signature)} runs eagerly: {result.reason}"
            )
            return
        self._record_capture(key, started)

    # ----------------------------------------------------------------- plan and exits
    def _planned_warmup(self) -> int:
        steps = self.options.warmup or DEFAULT_WARMUP
        allows = self.parallel.count_allows_capture
        # one more step whose syncs are recorded, then capture at a count DDP does not time
        while not (allows(steps) and allows(steps - 1)):
            steps += 1
        return steps

    def enter_eager(self, reason: str, *, warn: bool = True) -> None:
        """Leave the graphed path for good: raise under graph='always', else warn once."""
        self._set(phase=Phase.EAGER)
        self.body.set_to_none = True
        if self.options.graph == "never":
            return
        if self.options.graph == "always":
            raise CaptureError(f"TrainStep(graph='always') cannot capture: {reason}.")
        if warn:
            warn_at_user_line(f"TrainStep runs eagerly: {reason}")
        self.report.fallbacks.append(reason)

    def warn_or_raise(self, message: str) -> None:
        if self.options.graph == "always":
            raise CaptureError(message)
        warn_at_user_line(f"TrainStep continues eagerly; {message}")
        self.report.fallbacks.append(message)


@contextlib.contextmanager
def _naming_the_failure(reason: str) -> Iterator[None]:
    """A CaptureError raised while recovering from a failed capture carries that failure: the
    original error, its file:line and explain()'s causes."""
    try:
        yield
    except CaptureError as exc:
        if not reason:
            raise
        raise CaptureError(f"{exc}\nThe capture that failed: {reason}") from exc


def _every_failure(failures: list[str | None], could_not: str = "capture its step") -> str:
    """The reason every rank reports when a capture (or compile) failed on some: each failing
    rank's own cause (one line per rank; a single process's is its cause as it is)."""
    if len(failures) == 1:
        return failures[0] or f"could not {could_not}"
    failed = [(rank, text) for rank, text in enumerate(failures) if text is not None]
    if not failed:  # agree() said one failed, yet none says so: name that, not nothing
        return f"a rank could not {could_not} and reported no cause"
    return "\n".join(f"rank {rank} could not {could_not}: {text}" for rank, text in failed)


def _detached(output: Any) -> Any:
    """The model output without its autograd graph (kept as ``step.output`` after backward)."""
    try:
        from torch.utils._pytree import tree_map_only

        return tree_map_only(torch.Tensor, lambda t: t.detach(), output)
    except Exception:  # an output type pytree cannot rebuild: keep it as it is
        return output
