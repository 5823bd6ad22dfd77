"""A training call that runs eagerly: the warm-up (its last step with the host syncs recorded,
to name one if the capture fails), the first compiled step (agreed on by every rank), and every
call the graphs cannot serve.

Module-level functions over the step's :class:`~.run_context.RunContext`.
"""

from __future__ import annotations

import torch

from .batch import Batch, Role
from .body import StepOut
from .compiling import first_forward_failure
from .parallel import agree_over, failures_of_every_rank
from .policy import Phase
from .run_context import RunContext, detached, every_failure
from .streams import on_stream
from .syncs import record_host_syncs

__all__ = ["eager"]


def eager(run: RunContext, batch: Batch) -> torch.Tensor:
    """The call's ``run.call_steps`` training steps, run eagerly on the capture stream."""
    n = run.call_steps
    run.report.eager_steps += n
    warming_up = run.phase is Phase.WARMUP
    if warming_up:
        run.report.warmup_steps += n
    role = run.window.role()
    last_warmup = run.warmup * run.options.accumulate_calls
    check_syncs = (
        warming_up
        and run.report.eager_steps - n < last_warmup <= run.report.eager_steps
        and run.device.type == "cuda"
    )
    with on_stream(run.stream):
        batch = run.to_device(batch)
        if run.graphs is not None:
            run.graphs.plan.sync_lr()
        if run.compile_pending:
            out = _first_compiled_step(run, batch, role)
        elif check_syncs:
            syncs = record_host_syncs(lambda: run.body.run(batch, role))
            out = syncs.result
            if syncs.found:
                run.sync_hint = syncs.describe()
        else:
            out = run.body.run(batch, role)
    if run.window.syncs(role):
        run.gate.count_forwards(n)
    if run.state.hold_off:
        run.set(hold_off=max(0, run.state.hold_off - n))
        if run.follower.still_changing():
            run.set(hold_off=1)
    run.output = detached(out.output)
    run.grad_norm = out.grad_norm
    return out.loss


def _first_compiled_step(run: RunContext, batch: Batch, role: Role) -> StepOut:
    """Compile first, outside the wrapper, then agree: every rank runs compiled, or every
    rank plain.

    Building DDP is a collective, so a rank falling back alone would leave the ranks in
    different collectives; and inside DDP's forward a failing rank would already have joined
    the buffer broadcast. So the compiling forward runs on the compiled module itself (no
    DDP, no backward), with the RNG forked and the buffers put back: training sees no extra
    step. Then one tiny all-reduce decides, and every rank rebuilds the wrapper if any rank
    failed.
    """
    run.compile_pending = False
    failure = first_forward_failure(run.body, batch, run.device)
    ok, _ = agree_over(run.gate.group, run.device, failure is None, False)
    if not ok:
        reason = every_failure(failures_of_every_rank(run.gate.group, failure), "compile")
        run.warn_or_raise(f"torch.compile failed, so the model runs uncompiled: {reason}")
        run.use(run.rewrap())
    return run.body.run(batch, role)
