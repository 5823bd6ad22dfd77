"""Capturing a training call's graph, and recovering when a capture fails: the first capture
agreed on by every rank, a new key's capture while graphed, the wrapper reset after a backward
that never finished, and the failure explained (a host sync seen in warm-up, the wrapper's own
cause, each rank's reason).

Module-level functions over the step's :class:`~.run_context.RunContext`; the runner calls them
only on a call that does not replay.
"""

from __future__ import annotations

import time

import torch

from .batch import Batch, GraphKey, Role, describe
from .body import StepOut
from .engine import CapturedGraph, CaptureFailure
from .options import warn_at_user_line
from .parallel import agree_over, failures_of_every_rank
from .policy import Phase
from .report import mode_words
from .run_context import RunContext, detached, every_failure, naming_the_failure

__all__ = ["capture_and_replay", "first_capture", "replay"]


def first_capture(run: RunContext, key: GraphKey, batch: Batch) -> torch.Tensor | None:
    """Capture on every rank, then agree; every rank replays, or every rank goes eager (None:
    the call runs eagerly).

    Ranks that disagreed (one's capture failed) would otherwise carry on with a graph on some
    ranks and a failed step on others; and with graph="always" every rank raises, not only
    the one that failed. Every rank reaches this call at the same step (the warm-up length is
    the same everywhere). Costs one tiny all-reduce, once per run.
    """
    started = time.perf_counter()
    result = _capture(run, key, batch)
    captured, dirty = isinstance(result, CapturedGraph), run.recovery.dirty()
    ok, any_dirty = agree_over(run.gate.group, run.device, captured, dirty)
    if ok:
        if any_dirty:
            _reset_wrapper(run, "")
    else:
        mine = _explain_failure(run, result.reason) if isinstance(result, CaptureFailure) else None
        reason = every_failure(failures_of_every_rank(run.gate.group, mine))
        if any_dirty:
            _reset_wrapper(run, reason)  # on every rank: DDP's bucket rebuild is collective
        run.follower.drop_training()
        run.enter_eager(reason)
        return None
    run.set(phase=Phase.GRAPHED)
    run.record_capture(key, started)
    loss = replay(run, key, batch)
    assert loss is not None
    run.report.time_to_first_replay = time.perf_counter() - run.start
    return loss


def capture_and_replay(run: RunContext, key: GraphKey, batch: Batch) -> torch.Tensor | None:
    """Capture a new key's graph while graphed (as :func:`~.policy.decide` said), then
    replay it; None when the capture failed (the call runs eagerly).

    A later capture needs no agreement: capturing runs nothing, and a graph's all-reduces
    pair with a peer's eager ones like eager ones do (same buckets, same order).
    """
    started = time.perf_counter()
    result = _capture(run, key, batch)
    if isinstance(result, CaptureFailure):
        reason = _explain_failure(run, result.reason)
        if run.recovery.dirty():
            with naming_the_failure(reason):
                run.recovery.check_reset_alone()  # no agreement: peers may be replaying
            _reset_wrapper(run, reason)
        run.warn_or_raise(
            f"the batch of {describe(batch.signature)}{mode_words(key.modes)} runs eagerly: "
            f"{reason}"
        )
        return None
    run.record_capture(key, started)
    return replay(run, key, batch)


def replay(run: RunContext, key: GraphKey, batch: Batch) -> torch.Tensor | None:
    """Replay ``key``'s graph just captured; None when it has none, or when what the script
    changed asks for a re-capture."""
    graphs = run.graphs_or_fail()
    captured = graphs.captured.get(key)
    if captured is None:
        return None
    loss: torch.Tensor
    loss, run.output, run.grad_norm = graphs.replay(captured, batch)
    run.report.replays += 1
    # a copy the script may keep (as an eager step's): the next replay overwrites the graph's
    # own, and scripts append losses to a list and average them at the end of a window
    return loss.clone()


def _capture(run: RunContext, key: GraphKey, batch: Batch) -> CapturedGraph | CaptureFailure:
    """Capture the step for this key on the device copy of ``batch``."""
    found = run.gate.before_capture()  # e.g. an earlier loss's graph still alive
    if found is not None:
        warn_at_user_line(f"TrainStep: {found}")
    device_batch = run.to_device(batch)
    result = run.capture_graph(key, device_batch, lambda b: _captured(run, b, key.role))
    if run.window.syncs(key.role):
        run.gate.count_forwards(run.call_steps)  # its host code ran once per step
    return result


def _captured(run: RunContext, batch: Batch, role: Role) -> StepOut:
    loss, output, grad_norm = run.body.run(batch, role)
    return StepOut(loss, detached(output), grad_norm)


def _explain_failure(run: RunContext, reason: str) -> str:
    wrapper = run.recovery.explain_capture_failure(reason)
    if wrapper is not None:
        return f"{reason}\ncause: {wrapper}"
    if run.sync_hint is None:
        return reason
    return f"{reason}\nlikely cause, seen in warm-up: {run.sync_hint}"


def _reset_wrapper(run: RunContext, reason: str) -> None:
    """After a backward that never finished: the wrapper reset (it may rebuild what the
    training graphs read, so they go) and two eager steps before the next capture. A reset
    that cannot be done raises with the capture's own failure (``reason``) named."""
    with naming_the_failure(reason):
        run.recovery.reset()
    run.follower.drop_training()
    run.set(hold_off=2)
