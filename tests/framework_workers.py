"""Workers of the framework feature matrices (run by ``run_distributed`` on 2 gloo ranks).

Each worker trains every row of its matrix three ways in one process launch (start-up costs
more than these tiny runs): the framework's own DDP run, the ddpgraph port run eagerly
(``graph="never"``), and the port with :class:`ddpgraph.testing.CpuGraphs` capturing. A row
returns what the tests compare bit for bit (per-batch losses, learning rates, grad norms, steps,
final parameters and optimizer state) or the error it raised.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VARIANTS = ("framework", "eager", "graphs")


def step_options(variant: str) -> dict[str, Any]:
    """The TrainStep options of a port variant."""
    from ddpgraph.testing import CpuGraphs

    return {"graph": "never"} if variant == "eager" else {"engine": CpuGraphs()}


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def classes(n: int, seed: int = 1) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 8, generator=gen), torch.randint(4, (n,), generator=gen)
    )


def tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) state dict, in a stable order."""
    if isinstance(state, torch.Tensor):
        return [state.detach().clone()]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in tensors_of(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in tensors_of(item)]
    return []


def outcome(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """A row's result, ``run(*args)``, or the error it raised (its type and message)."""
    try:
        return run(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def rank() -> int:
    return int(os.environ.get("RANK", 0))


def run_rows(
    rows: dict[str, Any], names: list[str], run_row: Callable[[str, Any, str], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``run_row(variant, row, name)`` for each named row and variant: results by
    ``"row/variant"``."""
    results = {}
    for name in names:
        for variant in VARIANTS:
            results[f"{name}/{variant}"] = outcome(run_row, variant, rows[name], name)
            if os.environ.get("DDPGRAPH_MATRIX_PROGRESS") and rank() == 0:
                print(f"matrix row {name}/{variant} done", flush=True)
    return results


def graph_safe_optimizer(
    kind: type[torch.optim.Optimizer], params: Any, lr: float, **options: Any
) -> torch.optim.Optimizer:
    """The script's optimizer as a graphed step steps it (``make_graph_safe``: SGD fused; Adam,
    AdamW capturable on the foreach path; the LR in a float32 tensor), so that the framework's
    own run and both ports step one optimizer: on the CPU engine, as on CUDA, the graphed port
    cannot step the optimizer's default CPU path (tests/gpu build their references alike)."""
    from ddpgraph.step.optim import make_graph_safe

    optimizer = kind(params, lr=lr, **options)
    make_graph_safe(optimizer, torch.device("cpu"))
    return optimizer


def graph_safe_arithmetic(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer steps as a graphed step's does (``capturable=True``, on the
    foreach path, the LR a float32 tensor during the step, as
    ``ddpgraph.step.optim.make_graph_safe`` sets them; SGD fused) while the Trainer and its
    scheduler keep reading float LRs: the plain run a graphed one equals (the reference of the
    Trainer, SFTTrainer and Accelerate tests on the CPU engine)."""
    from ddpgraph.step.optim import allow_capturable_on_cpu, take_the_foreach_path

    allow_capturable_on_cpu()
    for group in optimizer.param_groups:
        if "capturable" in group:
            group["capturable"] = True
            take_the_foreach_path(group)  # foreach, as make_graph_safe sets it
        else:  # SGD: its fused kernel, as make_graph_safe sets it
            group["fused"], group["foreach"] = True, False
    floats: list[Any] = []

    def lr_as_tensor(opt: Any, *args: Any) -> None:
        floats[:] = [group["lr"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)

    def lr_as_float(opt: Any, *args: Any) -> None:
        for group, lr in zip(opt.param_groups, floats):
            group["lr"] = lr

    optimizer.register_step_pre_hook(lr_as_tensor)
    optimizer.register_step_post_hook(lr_as_float)
