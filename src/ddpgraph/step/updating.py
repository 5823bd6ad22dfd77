"""``step.update()`` (``defer_update=True``): the optimizer step on the window the calls since
the last update synced, with the param-group values (the LR) the script set since; graphed once
the window's training graphs are (its graph captured after the window's "sync" graph, whose
gradients it reads).

Module-level functions over the step's :class:`~.run_context.RunContext`.
"""

from __future__ import annotations

import time

import torch

from .batch import NO_BATCH, GraphKey
from .engine import CaptureFailure
from .policy import Phase
from .run_context import RunContext
from .streams import on_stream

__all__ = ["update"]


def update(run: RunContext) -> None:
    """The optimizer step of a deferred update, watched."""
    seen = run.guarded(training=True)
    run.window.take_update()
    run.body.parallel.buffers_due = True
    key = GraphKey("update", run.modes(), NO_BATCH.signature)
    if run.phase is Phase.GRAPHED and _update_graphed(run, key):
        if seen is not None:
            run.settle()
        return
    with on_stream(run.stream):
        if run.graphs is not None:
            run.graphs.plan.sync_lr()  # the LR the script just set
        run.grad_norm = run.body.update()
    run.settle()


def _update_graphed(run: RunContext, key: GraphKey) -> bool:
    """Replay the update graph, capturing it first once the window's "sync" graph exists
    (the update reads the gradients that graph writes); False: run it eagerly."""
    graphs = run.graphs_or_fail()
    due = key not in graphs.captured and key not in graphs.uncapturable and graphs.keys_of("sync")
    if due and run.state.hold_off == 0:
        started = time.perf_counter()
        result = run.capture_graph(key, NO_BATCH, lambda _: _updated(run))
        if isinstance(result, CaptureFailure):
            run.warn_or_raise(f"the optimizer update runs eagerly: {result.reason}")
            return False
        run.record_capture(key, started)
    captured = graphs.captured.get(key)
    if captured is None:
        return False
    run.grad_norm = graphs.replay(captured, NO_BATCH)
    return True


def _updated(run: RunContext) -> torch.Tensor | None:
    return run.body.update()
