"""``step.evaluate(x)``: the forward in eval mode without gradients, graphed after
``EVAL_WARMUP`` eager calls per input signature, in the training graphs' pool; DDP's buffer
sync before the first evaluation after a training step; every module's own mode restored.

Module-level functions over the step's :class:`~.run_context.RunContext`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from .batch import Batch, GraphKey, describe
from .engine import CaptureFailure
from .run_context import RunContext, training_of
from .streams import on_stream

__all__ = ["EVAL_WARMUP", "evaluate"]

EVAL_WARMUP = 2  # eager evaluations per input signature before its capture (cuDNN/cuBLAS set-up)


def evaluate(run: RunContext, batch: Batch) -> Any:
    """The forward in eval mode, graphed after ``EVAL_WARMUP`` eager calls per signature,
    watched; every module's own mode restored after it."""
    run.recovery.before_call()
    with _eval_mode(run):
        settle, output = run.watched("eval", lambda: _evaluate(run, batch))
    if settle:
        run.settle()
    return output


@contextlib.contextmanager
def _eval_mode(run: RunContext) -> Iterator[None]:
    modes = tuple(map(training_of, run.submodules))  # as they are: restored after
    for module in run.submodules:
        module.training = False
    try:
        yield
    finally:
        for module, training in zip(run.submodules, modes):
            module.training = training


def _evaluate(run: RunContext, batch: Batch) -> tuple[bool, Any]:
    """(whether the guard's baseline is re-taken after it, the output)."""
    key = GraphKey("eval", (False,) * len(run.submodules), batch.signature)
    seen = run.guarded(training=False)
    run.window.warn_if_open("evaluate()")
    parallel = run.body.parallel
    if parallel.buffers_due:
        # DDP's eval forward after a training step starts with rank 0's buffers (later ones
        # do not: its no_grad forward turns that off until the next training forward)
        parallel.buffers_due = False
        with on_stream(run.stream):
            parallel.sync_buffers()
    if run.graphs is not None and key not in run.graphs.captured and _capture_due(run, key):
        _capture(run, key, batch)
    captured = None if run.graphs is None else run.graphs.captured.get(key)
    if captured is not None and run.graphs is not None:
        run.report.eval_replays += 1
        return seen is not None, run.graphs.replay(captured, batch)
    with on_stream(run.stream):
        return True, run.body.forward_eval(run.to_device(batch))


def _capture_due(run: RunContext, key: GraphKey) -> bool:
    if run.options.graph == "never" or key in run.graphs_or_fail().uncapturable:
        return False
    run.eval_calls[key] += 1
    return run.eval_calls[key] > EVAL_WARMUP


def _capture(run: RunContext, key: GraphKey, batch: Batch) -> None:
    started = time.perf_counter()
    result = run.capture_graph(key, run.to_device(batch), run.body.forward_eval)
    if isinstance(result, CaptureFailure):
        run.warn_or_raise(
            f"evaluation of {describe(batch.signature)} runs eagerly: {result.reason}"
        )
        return
    run.record_capture(key, started)
