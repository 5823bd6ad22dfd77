"""The parts of one TrainStep built and wired together: the precision, the step body around its
data-parallel wrapper (on the capture stream), the graphs the engine builds (or the reason there
are none), the runner that carries each call out, and the ``step(data)`` feed.

:class:`~.train_step.TrainStep` validates its options, then holds what :func:`assemble` returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..data.device_data import on_epoch_end
from ..distributed import watchdog
from .body import LossFn, StepBody
from .engine import GraphEngine, NoCuda, build_graphs
from .feed import DataFeed
from .finite import FiniteCheck
from .graphs import Graphs, capture_stream
from .options import StepOptions
from .parallel import wrap
from .precision import Precision, precision_for
from .report import StepReport
from .runner import Runner
from .window import WindowEnds

__all__ = ["Parts", "assemble"]


@dataclass(frozen=True)
class Parts:
    """What a TrainStep holds of itself (each documented in its own module)."""

    precision: Precision
    body: StepBody
    finite: FiniteCheck | None
    report: StepReport
    runner: Runner
    feed: DataFeed


def assemble(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn | None,
    options: StepOptions,
    device: torch.device,
    *,
    ddp_kwargs: Mapping[str, Any] | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    engine: GraphEngine | None,
    window_ends: WindowEnds | None = None,
) -> Parts:
    """The parts of a TrainStep over ``model`` on ``device`` (options already validated)."""
    stream = capture_stream(device) if device.type == "cuda" else None
    if options.channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    kwargs = dict(ddp_kwargs or {})
    parallel = options.parallel
    precision = precision_for(options.amp, device, options.grad_scaler)
    wrapped = _compiled(model, options.compile) if options.compile else model
    body = StepBody(
        wrap(wrapped, device, stream, kwargs, parallel), optimizer, loss_fn, precision, options
    )
    finite = FiniteCheck(device) if options.check_finite else None
    body.finite = finite
    report = StepReport(mode="eager", steps_per_replay=options.steps_per_replay)
    graphs = build_graphs(engine, options, device, body.parallel, optimizer)
    runner = Runner(
        options, body, graphs if isinstance(graphs, Graphs) else None,
        device=device, stream=stream, submodules=list(model.modules()),
        rewrap=lambda: wrap(model, device, stream, kwargs, parallel), report=report,
        window_ends=window_ends,
    )  # fmt: skip
    on_epoch_end(runner.window.warn_at_epoch_end)
    lr_tensors = graphs.plan.lr_tensors if isinstance(graphs, Graphs) else []
    feed = DataFeed(optimizer, scheduler, lr_tensors or None, options, device)
    body.feed = feed
    if isinstance(graphs, Graphs):
        report.optimizer_changes = list(graphs.plan.described)
        report.engine = graphs.engine
    if isinstance(graphs, Graphs) and stream is not None:
        graphs.register_replay_hook(watchdog.replay_hook(report))
    if isinstance(graphs, str):
        runner.enter_eager(str(graphs), warn=not isinstance(graphs, NoCuda))
    report.mode = runner.phase.value
    return Parts(precision, body, finite, report, runner, feed)


def _compiled(model: nn.Module, options: bool | Mapping[str, Any]) -> nn.Module:
    # Inductor's default mode: its kernels, no CUDA graphs of its own (TrainStep captures the
    # whole step). DDP goes around the compiled module: torch.compile(DDP(m)) compiles nothing.
    kwargs = dict(options) if isinstance(options, Mapping) else {}
    return torch.compile(model, **kwargs)  # type: ignore[return-value]
