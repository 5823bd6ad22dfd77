"""What makes a TrainStep's graphs: the engine passed in (CUDA graphs by default, or the CPU
stand-in), or the reason the step runs eagerly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from .graphs import Graphs, capture_stream
from .optim import graph_safety_problem, plan_graph_safety
from .options import StepOptions, warn_at_user_line
from .parallel import DataParallel

__all__ = ["CUDA_GRAPHS", "CudaGraphEngine", "GraphEngine", "NoCuda", "build_graphs"]


class NoCuda(str):
    """The reason a step on the CPU has no graphs: recorded in the report, not warned about (a
    CPU run is eager by design), unlike a reason that would hold on CUDA too."""


class GraphEngine(Protocol):
    """Makes the :class:`Graphs` of one TrainStep, or says why its optimizer cannot be graphed."""

    def build(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        fp16: bool,
    ) -> Graphs | str: ...


class CudaGraphEngine:
    """Real CUDA graphs on the device's capture stream; the optimizer made graph-safe first."""

    def build(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        fp16: bool,
    ) -> Graphs | str:
        plan = plan_graph_safety(optimizer, device, fp16=fp16)
        if isinstance(plan, str):
            return plan
        return Graphs(capture_stream(device), plan)


CUDA_GRAPHS = CudaGraphEngine()


def _inductor(compile_option: object) -> bool:
    """Whether TrainStep's ``compile=`` option compiles with Inductor (torch.compile's default)."""
    backend = compile_option.get("backend") if isinstance(compile_option, Mapping) else None
    return backend in (None, "inductor")


def build_graphs(
    engine: GraphEngine | None,
    options: StepOptions,
    device: torch.device,
    parallel: DataParallel,
    optimizer: torch.optim.Optimizer,
) -> Graphs | str:
    """The step's graphs, or why it runs eagerly.

    Without CUDA and without an engine the optimizer is left as it is, but one that could not
    be captured is named in a warning, so a CPU dry run tells what the GPU run would do.
    """
    if options.graph == "never":
        return "graph='never'"
    fp16 = options.amp == "fp16"
    # what the wrapper cannot capture (FSDP2: CPU offload, SGD on DTensors), before the
    # optimizer is made graph-safe
    problem = parallel.capture_problem(
        optimizer, fp16=fp16, accumulate_calls=options.accumulate_calls
    )
    if problem is not None:
        return problem
    if (
        options.compile
        and _inductor(options.compile)
        and not getattr(engine, "sees_inductor", True)
    ):
        return (
            "the CPU graph engine cannot record torch.compile's Inductor kernels (they run below "
            "the dispatcher, so a replay would skip them); pass compile={'backend': 'aot_eager'} "
            "to test the compiled, graphed path on the CPU"
        )
    if device.type != "cuda":
        problem = graph_safety_problem(optimizer)
        if problem is not None:
            warn_at_user_line(f"on CUDA this TrainStep would run eagerly: {problem}")
        if engine is None or problem is not None:
            return NoCuda(f"the model is on {device}, not CUDA")
    return (engine or CUDA_GRAPHS).build(optimizer, device, fp16=fp16)
