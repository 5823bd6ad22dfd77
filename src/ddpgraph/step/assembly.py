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
from .engine import GraphEngine, GraphSet
from .feed import DataFeed
from .finite import FiniteCheck
from .graphs import CUDA_GRAPHS
from .optim import graph_safety_problem, plan_graph_safety, seed_momentum_buffers, skips_on_device
from .options import StepOptions, warn_at_user_line
from .parallel import CaptureGate, wrap
from .precision import Precision, precision_for
from .report import StepReport
from .runner import Runner
from .streams import capture_stream
from .window import Window, WindowEnds

__all__ = ["Graphing", "Parts", "assemble", "build_graphs"]


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
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload, unused-ignore]
    kwargs = dict(ddp_kwargs or {})
    parallel = options.parallel
    precision = precision_for(options.amp, device, options.grad_scaler)
    wrapped = _compiled(model, options.compile) if options.compile else model
    wrapper = wrap(wrapped, device, stream, kwargs, parallel)
    wrapper.take_optimizer(optimizer)  # FSDP2's sharding replaced the parameters
    finite = FiniteCheck(device) if options.check_finite else None
    report = StepReport(mode="eager", steps_per_replay=options.steps_per_replay)
    graphing = build_graphs(engine, options, device, wrapper, optimizer)
    graphs = graphing.graphs
    if graphs is None and options.amp == "fp16" and skips_on_device(optimizer):
        seed_momentum_buffers(optimizer)  # a user's fused SGD, eager (graphed: in the plan)
    lr_tensors = graphs.plan.lr_tensors if graphs is not None else []
    feed = DataFeed(optimizer, scheduler, lr_tensors or None, options, device)
    window = Window(options, window_ends)
    body = StepBody(
        wrapper, optimizer, loss_fn, precision, options, window=window, feed=feed, finite=finite
    )
    runner = Runner(
        options, body, graphs,
        device=device, stream=stream, submodules=list(model.modules()), parallel=wrapper,
        rewrap=lambda: wrap(model, device, stream, kwargs, parallel), report=report,
        window=window,
    )  # fmt: skip
    on_epoch_end(window.warn_at_epoch_end)
    if graphs is not None:
        report.optimizer_changes = list(graphs.plan.described)
        report.engine = graphs.engine
    if graphs is not None and stream is not None:
        graphs.register_replay_hook(watchdog.replay_hook(report))
    if graphs is None:
        runner.enter_eager(graphing.reason, warn=graphing.warn)
    report.mode = runner.phase.value
    return Parts(precision, body, finite, report, runner, feed)


def _compiled(model: nn.Module, options: bool | Mapping[str, Any]) -> nn.Module:
    # Inductor's default mode: its kernels, no CUDA graphs of its own (TrainStep captures the
    # whole step). DDP goes around the compiled module: torch.compile(DDP(m)) compiles nothing.
    kwargs = dict(options) if isinstance(options, Mapping) else {}
    return torch.compile(model, **kwargs)  # type: ignore[return-value]


@dataclass(frozen=True)
class Graphing:
    """What :func:`build_graphs` decided, read once by :func:`assemble`: the step's graph set,
    or (``graphs`` None) the ``reason`` it runs eagerly, warned of unless ``warn`` is False (a
    CPU step without an engine: eager by design, the reason only in the report)."""

    graphs: GraphSet | None
    reason: str = ""
    warn: bool = True


def _inductor(compile_option: object) -> bool:
    """Whether TrainStep's ``compile=`` option compiles with Inductor (torch.compile's default)."""
    backend = compile_option.get("backend") if isinstance(compile_option, Mapping) else None
    return backend in (None, "inductor")


def build_graphs(
    engine: GraphEngine | None,
    options: StepOptions,
    device: torch.device,
    gate: CaptureGate,
    optimizer: torch.optim.Optimizer,
) -> Graphing:
    """The step's graph set (``engine``'s, CUDA graphs by default), or why it runs eagerly.

    Without CUDA and without an engine the optimizer is left as it is, but one that could not
    be captured is named in a warning, so a CPU dry run tells what the GPU run would do.
    """
    if options.graph == "never":
        return Graphing(None, "graph='never'")
    fp16 = options.amp == "fp16"
    # what the wrapper cannot capture (FSDP2: CPU offload, SGD on DTensors), before the
    # optimizer is made graph-safe
    problem = gate.capture_problem(optimizer, fp16=fp16, accumulate_calls=options.accumulate_calls)
    if problem is not None:
        return Graphing(None, problem)
    if (
        options.compile
        and _inductor(options.compile)
        and not getattr(engine, "sees_inductor", True)
    ):
        return Graphing(
            None,
            "the CPU graph engine cannot record torch.compile's Inductor kernels (they run below "
            "the dispatcher, so a replay would skip them); pass compile={'backend': 'aot_eager'} "
            "to test the compiled, graphed path on the CPU",
        )
    if device.type != "cuda":
        problem = graph_safety_problem(optimizer)
        if problem is not None:
            warn_at_user_line(f"on CUDA this TrainStep would run eagerly: {problem}")
        if engine is None or problem is not None:
            return Graphing(None, f"the model is on {device}, not CUDA", warn=False)
    plan = plan_graph_safety(optimizer, device, fp16=fp16)
    if isinstance(plan, str):
        return Graphing(None, plan)
    return Graphing((engine or CUDA_GRAPHS).build(plan, device))
