"""A param-group value a scheduler rewrites before every step (issue 52 item 5):
``OneCycleLR(cycle_momentum=True)`` sets Adam's ``betas`` (and SGD's ``momentum``) at each
``scheduler.step()``. Both are taken by torch's optimizers only as numbers (a graph bakes them
in): each change re-captures, and is said once, with the value and the fix."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ddpgraph import TrainStep
from ddpgraph.step.optim import make_graph_safe
from ddpgraph.testing import CpuGraphs

STEPS = 24


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(17, 5)), nn.Parameter(torch.randn(5))]


def _sgd_steps(
    graphed: bool, adam: bool = False
) -> tuple[TrainStep | None, list[str], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=0.05)
        if adam
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 1)
    if not graphed:  # the eager reference steps the optimizer the graphed step steps
        make_graph_safe(opt, torch.device("cpu"))
    step = TrainStep(model, opt, nn.MSELoss(), engine=CpuGraphs() if graphed else None)
    gen = torch.Generator().manual_seed(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per text and line
        for _ in range(STEPS):
            step(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen))
            sched.step()
    messages = [str(w.message) for w in caught if "re-captures" in str(w.message)]
    return step, messages, [p.detach().clone() for p in model.parameters()]


def _again_said_once_with_the_fix(messages: list[str], key: str) -> None:
    """The later changes (one each step): one more warning, saying that each re-captures, that
    a per-step rewrite means a capture per step and no replay, and the fix."""
    again = [m for m in messages if "changed again" in m]
    assert len(again) == 1, messages
    assert f"param group 0's {key!r} changed again, and each change re-captures" in again[0]
    assert "a capture per step and no replay" in again[0] and "cycle_momentum=False" in again[0]
    assert len(messages) == 2, messages  # the first change's and this one: nothing more


def test_sgd_momentum_a_scheduler_rewrites_each_step_is_said_once_with_value_and_fix():
    step, messages, params = _sgd_steps(graphed=True)
    assert step is not None
    first = [m for m in messages if "changed from" in m]
    assert len(first) == 1, messages
    assert "param group 0's 'momentum' changed from " in first[0]
    assert "one capture per step" in first[0] and "cycle_momentum=False" in first[0]
    assert "as OneCycleLR(cycle_momentum=True) does SGD's momentum" in first[0]
    _again_said_once_with_the_fix(messages, "momentum")
    assert len(step.report().recaptures) > 3  # it did re-capture at each change
    _, _, eager = _sgd_steps(graphed=False)
    for a, b in zip(params, eager):
        assert torch.equal(a, b)


def test_adams_betas_a_scheduler_rewrites_each_step_are_said_once_with_value_and_fix():
    """Every Adam path reads betas as numbers inside its step (addcmul_(value=1 - beta2),
    _foreach_lerp_, the fused kernel's floats): the H100 refused a capture with tensor betas in
    each, so a change re-captures, as SGD's momentum does, and is said once with the fix."""
    step, messages, params = _sgd_steps(graphed=True, adam=True)
    assert step is not None
    first = [m for m in messages if "changed from" in m]
    assert len(first) == 1, messages
    assert "param group 0's 'betas' changed from " in first[0]
    assert "cycle_momentum=False" in first[0]
    assert "as OneCycleLR(cycle_momentum=True) does Adam's betas" in first[0], first[0]
    _again_said_once_with_the_fix(messages, "betas")
    assert len(step.report().recaptures) > 3
    _, _, eager = _sgd_steps(graphed=False, adam=True)
    for a, b in zip(params, eager):
        assert torch.equal(a, b)
