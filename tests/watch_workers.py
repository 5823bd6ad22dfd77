"""Module-level workers for tests/test_model_watch.py: TrainStep (eager, or graphed on the CPU
stand-in engine) and the plain DDP loop, each with the same change made to the model mid-run
from outside (a storage move, a wrapped forward), on the same data."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpgraph import TrainStep
from ddpgraph.testing import CpuGraphs

from .step_workers import as_the_step_steps, batches


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def move_storage(model: nn.Module, how: str) -> None:
    """What a framework does between two steps: ``model.to(device)`` where the device differs
    by name only (transformers' evaluation loop on CPU ranks: every parameter, gradient and
    buffer to new memory), or the same by hand (``p.data = p.data.clone()``)."""
    if how == "to":
        model.to(torch.device("cpu:0"))
    elif how == "data":
        for p in model.parameters():
            p.data = p.data.clone()
            if p.grad is not None:
                p.grad.data = p.grad.data.clone()
    elif how == "apply":
        model._apply(lambda t: t.clone())
    else:
        raise AssertionError(how)


def wrap_forward(model: nn.Module) -> None:
    """accelerate's ``prepare_model`` under bf16: ``model.forward`` replaced by an autocast
    wrapper of itself (an instance attribute), outputs back to float32."""
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return original(*args, **kwargs).float()

    model.forward = forward  # type: ignore[method-assign]


def _change(kind: str) -> Callable[[nn.Module], None]:
    if kind == "forward":
        return wrap_forward
    return functools.partial(move_storage, how=kind)


def changed_mid_run(kind: str, graphed: bool, at: int, steps: int, evaluate: bool) -> dict:
    """``kind`` done to the model before step ``at`` (then, with ``evaluate``, one evaluation,
    as transformers' evaluation loop runs right after moving the model), by TrainStep's script
    and by the plain DDP loop's; their states, grad norms and evaluations."""
    rank = torch.distributed.get_rank()
    data = batches(steps, 8, seed=60 + rank)
    probe = batches(1, 6, seed=7)[0][0]
    change = _change(kind)
    model = _bn_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = TrainStep(
        model,
        opt,
        nn.CrossEntropyLoss(),
        grad_norm=True,
        engine=CpuGraphs() if graphed else None,
    )
    ours: dict[str, Any] = {"norms": [], "evals": [], "replays_at": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data):
            if i == at:
                change(model)
                if evaluate:
                    ours["evals"].append(step.evaluate(probe).clone())
            step(x, y)
            ours["norms"].append(step.grad_norm.clone())  # type: ignore[union-attr]
            ours["replays_at"].append(step.report().replays)
    reference = _bn_model()
    ddp = DDP(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    if graphed:  # the AdamW the graphed step steps (capturable, the LR in a tensor)
        as_the_step_steps(ref_opt)
    theirs: dict[str, Any] = {"norms": [], "evals": []}
    for i, (x, y) in enumerate(data):
        if i == at:
            change(reference)
            if evaluate:
                ddp.eval()
                with torch.no_grad():
                    theirs["evals"].append(ddp(probe))
                ddp.train()
        nn.functional.cross_entropy(ddp(x), y).backward()
        theirs["norms"].append(
            torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], foreach=True)
        )
        ref_opt.step()
        ref_opt.zero_grad()
    report = step.report()
    return {
        "ours": {**ours, "state": _state(model)},
        "theirs": {**theirs, "state": _state(reference)},
        "recaptures": list(report.recaptures),
        "mode": report.mode,
        "warnings": [str(w.message) for w in caught],
    }


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def new_parameter_object(graphed: bool) -> None:
    """A script that assigns a new ``nn.Parameter`` between steps: refused on every rank."""
    model = _bn_model()
    step = TrainStep(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        nn.CrossEntropyLoss(),
        engine=CpuGraphs() if graphed else None,
    )
    for i, (x, y) in enumerate(batches(16, 8)):
        if i == 14:
            model[0].weight = nn.Parameter(model[0].weight.detach().clone())
        step(x, y)
