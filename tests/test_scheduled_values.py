"""A param-group value a scheduler rewrites before every step (issue 52 item 5):
``OneCycleLR(cycle_momentum=True)`` sets Adam's ``betas`` (and SGD's ``momentum``) at each
``scheduler.step()``. Adam/AdamW betas become device tensors written before each replay, as the
LR is (one re-capture, not one per step); SGD's momentum, which torch's SGD takes only as a
number, re-captures at each change and says so once, with the value and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ddpgraph import TrainStep
from ddpgraph.step.optim import describe_group_changes, hyperparameters, make_graph_safe
from ddpgraph.testing import CpuGraphs

STEPS = 24


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(17, 5)), nn.Parameter(torch.randn(5))]


def _adam_run(follow: bool) -> tuple[list[torch.Tensor], list[tuple[float, float]], list]:
    """AdamW under OneCycleLR (cycle_momentum=True: betas[0] rewritten every step), stepped
    eagerly as the script does; ``follow``: with the graph plan's device LR and betas (CPU:
    the plan's tensors, the optimizer's non-capturable path, which also takes tensor betas)."""
    params = _params()
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=STEPS + 1)
    plan = None
    if follow:
        plan = make_graph_safe(opt, torch.device("cpu"))
        opt.param_groups[0]["capturable"] = False  # a CPU step (capturable needs an accelerator)
    gen = torch.Generator().manual_seed(1)
    betas, groups = [], []
    for _ in range(STEPS):
        if plan is not None:
            plan.sync_lr()
            groups.append(hyperparameters(opt))
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        betas.append(tuple(float(b) for b in opt.param_groups[0]["betas"]))
        opt.step()
        sched.step()
    return [p.detach().clone() for p in params], betas, groups


def test_adam_betas_a_scheduler_rewrites_become_device_tensors_like_the_lr():
    ours, our_betas, groups = _adam_run(follow=True)
    theirs, their_betas, _ = _adam_run(follow=False)
    # the betas each step used are the scheduler's (as float32: the tensors' precision)
    assert our_betas[0] == their_betas[0]  # before the first change: the script's floats
    for a, b in zip(our_betas[1:], their_betas[1:]):
        assert a == pytest.approx(b, rel=1e-7)
    assert len(set(map(repr, groups[1:]))) == 1, "hyperparameters changed after the switch"
    assert repr(groups[0]) != repr(groups[1])  # the one change: floats to tensors
    # float32 betas: the same training within float32 rounding (measured: about 1e-7 here)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_switch_to_device_betas_is_described_once():
    params = _params()
    opt = torch.optim.Adam(params, lr=0.01, foreach=False)
    plan = make_graph_safe(opt, torch.device("cpu"))
    before = hyperparameters(opt)
    opt.param_groups[0]["betas"] = (0.85, 0.999)  # as OneCycleLR sets them
    plan.sync_lr()
    beta1, beta2 = opt.param_groups[0]["betas"]
    assert isinstance(beta1, torch.Tensor) and float(beta1) == pytest.approx(0.85)
    switched = hyperparameters(opt)
    said = describe_group_changes(opt, before, hyperparameters(opt))
    assert "param group 0's betas changed (now (0.85, 0.999)" in said
    assert "device tensors written before each replay" in said
    assert "betas on device (a scheduler changes them between steps)" in plan.changes
    opt.param_groups[0]["betas"] = (0.8, beta2)  # the next step's: no change to the graph
    plan.sync_lr()
    assert opt.param_groups[0]["betas"][0] is beta1 and float(beta1) == pytest.approx(0.8)
    assert hyperparameters(opt) == switched  # what the replay guard compares: unchanged


def _sgd_steps(graphed: bool) -> tuple[TrainStep | None, list[str], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
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


def test_sgd_momentum_a_scheduler_rewrites_each_step_is_said_once_with_value_and_fix():
    step, messages, params = _sgd_steps(graphed=True)
    assert step is not None
    first = [m for m in messages if "changed from" in m]
    assert len(first) == 1, messages
    assert "param group 0's 'momentum' changed from " in first[0]
    assert "one capture per step" in first[0] and "cycle_momentum=False" in first[0]
    assert len(step.report().recaptures) > 3  # it did re-capture at each change
    _, _, eager = _sgd_steps(graphed=False)
    for a, b in zip(params, eager):
        assert torch.equal(a, b)
