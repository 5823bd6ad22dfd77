"""What every path of a TrainStep's calls shares: the step's parts, its policy state, and the
few primitives each path uses (a new state, the guard's baseline re-taken, what a script changed
followed, a capture recorded, a fallback warned of).

:class:`~.runner.Runner` is one of these and carries the training call (the replayed path, in
one frame); its colder paths are module-level functions over a ``RunContext`` in their own
modules: capturing and its recovery (:mod:`.capturing`), the eager and compiled steps
(:mod:`.eager`), evaluation (:mod:`.evaluation`) and ``update()`` (:mod:`.updating`).
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
from .batch import Batch, GraphKey, Signature, describe, named
from .body import StepBody
from .engine import CapturedGraph, CaptureFailure, GraphSet
from .events import changes as _changes
from .follow import Follower
from .guard import Seen
from .options import StepOptions, warn_at_user_line
from .parallel import CaptureGate, DataParallel, Recovery
from .policy import Phase, Plan, PolicyState
from .report import CaptureRecord, StepReport, mode_words
from .window import Window

__all__ = ["RunContext", "detached", "every_failure", "naming_the_failure"]

training_of = attrgetter("training")


class RunContext:
    """The state of one TrainStep's calls and the primitives its paths share.

    ``graphs`` is None where no graph can be captured (``fallback`` says why); the wrapper
    given as ``parallel`` is held as :attr:`gate`, :attr:`recovery` and the body's ``parallel``
    (:meth:`use`); ``rewrap`` builds it again around the uncompiled module when ``compile``
    fails.
    """

    def __init__(
        self,
        options: StepOptions,
        body: StepBody,
        graphs: GraphSet | None,
        *,
        device: torch.device,
        stream: torch.cuda.Stream | None,
        submodules: list[nn.Module],
        parallel: DataParallel,
        rewrap: Callable[[], DataParallel],
        report: StepReport,
        window: Window,
    ) -> None:
        self.options = options
        self.body = body
        self.graphs = graphs
        self.device = device
        self.stream = stream
        self.submodules = submodules  # their modes key the graphs
        self.rewrap = rewrap
        # the one wrapper, held by each path as the protocol it needs (the body: GradSync)
        self.gate: CaptureGate
        self.recovery: Recovery
        self.use(parallel)
        self.report = report
        self.state = PolicyState()
        self.warmup = self._planned_warmup()
        k = options.accumulate_calls
        # up to three more windows for a batch like its predecessor (an epoch's tail is one)
        wait = 3 * k if options.on_new_shape == "eager" else 0
        self.plan = Plan(self.warmup * k, options.on_new_shape, first_capture_wait=wait)
        self.previous_signature: Signature | None = None  # the last call's that did not replay
        self.output: Any = None
        self.grad_norm: torch.Tensor | None = None  # the latest update's (graph-owned)
        self.call_steps = 1  # training steps in the current call (step(data): up to K)
        # accumulate_calls: where this call is in its window (and what a framework's loop says)
        self.window = window
        self.compile_pending = bool(options.compile)  # compiled, not yet past its first forward
        self.start = time.perf_counter()
        self.reference: Signature | None = None  # the signature on_new_shape compares against
        self.sync_hint: str | None = None  # a host sync seen in warm-up: named if capture fails
        self.eval_calls: Counter[GraphKey] = Counter()  # eager evaluations per key
        # what a script or framework changes in the model between calls
        events_only = options.guard == "events"
        self.follower = Follower(
            lambda: self.recovery, graphs, report, device, stream, events_only=events_only,
            calls_per_update=options.accumulate_calls,
            # graph="always" asked for graphs: a value changing each update re-captures each
            hold_changing_values=options.graph != "always",
        )  # fmt: skip
        # guard="events" while graphed: the submodules' modes re-read only when the events'
        # count moved since they were last read (any module's train() / eval(); the runner's own
        # snapshot: a check by evaluate() or update() in between must not hide it) or the
        # model's own mode changed; see step/events.py
        self.events_only = events_only
        self.seen_modes: tuple[bool, ...] = ()
        self.modes_at = -1  # the count when the modes were read

    def use(self, parallel: DataParallel) -> None:
        """``parallel`` as the step's wrapper: the body's :class:`~.parallel.GradSync`, the
        decision's :class:`~.parallel.CaptureGate` (:attr:`gate`), the recovery's
        :class:`~.parallel.Recovery` (:attr:`recovery`); one object, each path typed with the
        narrowest protocol it needs."""
        self.body.parallel = self.gate = self.recovery = parallel

    @property
    def phase(self) -> Phase:
        return self.state.phase

    def set(self, **changes: Any) -> None:
        """A new :class:`PolicyState` (frozen: every change is one of these)."""
        self.state = replace(self.state, **changes)

    def _planned_warmup(self) -> int:
        steps = self.options.warmup or DEFAULT_WARMUP
        allows = self.gate.count_allows_capture
        # one more step whose syncs are recorded, then capture at a count DDP does not time
        while not (allows(steps) and allows(steps - 1)):
            steps += 1
        return steps

    def to_device(self, batch: Batch) -> Batch:
        return batch.to(self.device, channels_last=self.options.channels_last)

    def graphs_or_fail(self) -> GraphSet:
        assert self.graphs is not None  # only the graphed phases get here
        return self.graphs

    def modes(self) -> tuple[bool, ...]:
        """Every submodule's ``training`` flag: part of each graph's key."""
        self.seen_modes = modes = tuple(map(training_of, self.submodules))
        self.modes_at = _changes[0]
        return modes

    # ----------------------------------------------------------------- the guard
    def guarded(self, *, training: bool) -> Seen | None:
        """At the start of a call (``training``: one that may run the wrapper's collectives):
        what the script changed since the last call, followed before anything runs (and
        returned). The common case is one check that finds nothing."""
        seen = self.follower.guard.check()
        self.follow(seen, training=training)
        return seen

    def settle(self) -> None:
        """After a call that ran anything eagerly, captured, or followed what the guard saw:
        the model as the step left it is the guard's new baseline. The one place it is
        re-taken; a call that only replayed keeps it (a replay changes no address)."""
        self.follower.guard.settle(keep_grads=self.state.phase is Phase.GRAPHED)

    def follow(self, seen: Seen | None, *, training: bool) -> None:
        follower = self.follower
        if seen is not None:
            follower.follow(seen, graphed=self.state.phase is Phase.GRAPHED)
            if follower.values_held is not None and not self.state.hold_off:
                self.set(hold_off=1)  # eager while the values change (Follower.still_changing)
        if training and follower.storage_moved:
            follower.follow_storage()

    # ----------------------------------------------------------------- captures
    def capture_graph(
        self, key: GraphKey, batch: Batch, body: Callable[[Batch], Any]
    ) -> CapturedGraph | CaptureFailure:
        """Capture ``body`` under ``key``; the first graph fixes the optimizer's baseline
        (what the graphs read: a reload is copied back into it)."""
        graphs = self.graphs_or_fail()
        result = graphs.capture(key, batch, body)
        if isinstance(result, CapturedGraph):
            # every parameter, frozen ones too: a graph reads them in the forward, and
            # unfreezing one must re-capture as freezing does
            parameters = list(self.body.parallel.module.parameters())
            self.follower.guard.watch_optimizer(parameters, graphs.plan.optimizer)
        return result

    def record_capture(self, key: GraphKey, started: float) -> None:
        seconds = time.perf_counter() - started
        if key.trains:
            self.set(signatures=self.state.signatures | {key.signature})
        words = mode_words(key.modes) if key.trains else ""
        self.report.captures.append(
            CaptureRecord(named(key.signature), self.report.steps, seconds, key.role + words)
        )
        get_logger().info(
            "TrainStep captured %s%s %s in %.0f ms",
            key.role,
            words,
            describe(key.signature),
            seconds * 1e3,
        )

    # ----------------------------------------------------------------- exits
    def watched(self, phase: str, run: Callable[[], Any]) -> Any:
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

    def enter_eager(self, reason: str, *, warn: bool = True) -> None:
        """Leave the graphed path for good: raise under graph='always', else warn once."""
        self.set(phase=Phase.EAGER)
        self.body.eager_for_good()
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
def naming_the_failure(reason: str) -> Iterator[None]:
    """A CaptureError raised while recovering from a failed capture carries that failure: the
    original error, its file:line and explain()'s causes."""
    try:
        yield
    except CaptureError as exc:
        if not reason:
            raise
        raise CaptureError(f"{exc}\nThe capture that failed: {reason}") from exc


def every_failure(failures: list[str | None], could_not: str = "capture its step") -> str:
    """The reason every rank reports when a capture (or compile) failed on some: each failing
    rank's own cause (one line per rank; a single process's is its cause as it is)."""
    if len(failures) == 1:
        return failures[0] or f"could not {could_not}"
    failed = [(rank, text) for rank, text in enumerate(failures) if text is not None]
    if not failed:  # agree() said one failed, yet none says so: name that, not nothing
        return f"a rank could not {could_not} and reported no cause"
    return "\n".join(f"rank {rank} could not {could_not}: {text}" for rank, text in failed)


def detached(output: Any) -> Any:
    """The model output without its autograd graph (kept as ``step.output`` after backward)."""
    try:
        from torch.utils._pytree import tree_map_only

        return tree_map_only(torch.Tensor, lambda t: t.detach(), output)
    except Exception:  # an output type pytree cannot rebuild: keep it as it is
        return output
