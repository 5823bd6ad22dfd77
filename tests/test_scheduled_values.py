"""A param-group value a scheduler rewrites before every step (issue 52 item 5):
``OneCycleLR(cycle_momentum=True)`` sets Adam's ``betas`` (and SGD's ``momentum``) at each
``scheduler.step()``. Both are taken by torch's optimizers only as numbers (a graph bakes them
in): a change re-captures, said once with the value and the fix; a change before every update
keeps the step eager until the values hold still (a capture per update costs more than the
eager step: on an H100, complete_cv_example.py captured each step ran at 0.59x the script)."""

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
) -> tuple[TrainStep | None, list[str], list[torch.Tensor], list[str]]:
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
    held = [str(w.message) for w in caught if str(w.message).startswith("TrainStep runs eagerly")]
    return step, messages, [p.detach().clone() for p in model.parameters()], held


def _held_eager_once_with_the_fix(
    step: TrainStep, messages: list[str], held: list[str], key: str
) -> None:
    """The second change in a row: no capture per step but eager steps, said once with the fix;
    nothing more is said while the scheduler keeps rewriting the value."""
    assert len(held) == 1, held
    assert (
        f"runs eagerly while the optimizer's param group 0's {key!r}, which its graphs" in held[0]
    )
    assert "cycle_momentum=False" in held[0]
    assert len(messages) == 1, messages  # the first change's re-capture: nothing more
    report = step.report()
    # warm-up 12, captured at 13, re-captured at the first change (14), eager from the second
    assert len(report.captures) == 2, str(report)
    assert report.eager_steps == STEPS - 2, str(report)
    assert report.recaptures[-1].startswith("held eager"), report.recaptures


def test_sgd_momentum_a_scheduler_rewrites_each_step_is_said_once_with_value_and_fix():
    step, messages, params, held = _sgd_steps(graphed=True)
    assert step is not None
    first = [m for m in messages if "changed from" in m]
    assert len(first) == 1, messages
    assert "param group 0's 'momentum' changed from " in first[0]
    assert "runs eagerly while it changes before every update" in first[0]
    assert "cycle_momentum=False" in first[0]
    assert "as OneCycleLR(cycle_momentum=True) does SGD's momentum" in first[0]
    _held_eager_once_with_the_fix(step, messages, held, "momentum")
    _, _, eager, _ = _sgd_steps(graphed=False)
    for a, b in zip(params, eager):
        assert torch.equal(a, b)


def test_adams_betas_a_scheduler_rewrites_each_step_are_said_once_with_value_and_fix():
    """Every Adam path reads betas as numbers inside its step (addcmul_(value=1 - beta2),
    _foreach_lerp_, the fused kernel's floats): the H100 refused a capture with tensor betas in
    each, so a change re-captures, and a change before every step keeps the step eager, as
    SGD's momentum does."""
    step, messages, params, held = _sgd_steps(graphed=True, adam=True)
    assert step is not None
    first = [m for m in messages if "changed from" in m]
    assert len(first) == 1, messages
    assert "param group 0's 'betas' changed from " in first[0]
    assert "cycle_momentum=False" in first[0]
    assert "as OneCycleLR(cycle_momentum=True) does Adam's betas" in first[0], first[0]
    _held_eager_once_with_the_fix(step, messages, held, "betas")
    _, _, eager, _ = _sgd_steps(graphed=False, adam=True)
    for a, b in zip(params, eager):
        assert torch.equal(a, b)


def _momentum_steps(
    graphed: bool, changed_at: set[int], accumulate: int = 1, graph: str = "auto"
) -> tuple[TrainStep, list[torch.Tensor]]:
    """SGD whose momentum the loop sets by hand before the updates in ``changed_at`` (counted
    from 1), ``accumulate`` calls an update."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if not graphed:
        make_graph_safe(opt, torch.device("cpu"))
    step = TrainStep(
        model, opt, nn.MSELoss(), engine=CpuGraphs() if graphed else None,
        accumulate_calls=accumulate, graph=graph if graphed else "auto",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for update in range(1, 41):
            if update in changed_at:
                opt.param_groups[0]["momentum"] = 0.9 - 0.01 * update
            for _ in range(accumulate):
                step(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen))
    return step, [p.detach().clone() for p in model.parameters()]


def _equal_to_eager(params: list[torch.Tensor], changed_at: set[int], accumulate: int = 1) -> None:
    _, eager = _momentum_steps(False, changed_at, accumulate)
    assert all(torch.equal(a, b) for a, b in zip(params, eager, strict=True))


def test_a_value_that_stops_changing_is_captured_again_and_replayed():
    """Changed before updates 15-24 (one at each), then left: eager from the second change
    (16) to the first update after the last (25, where it held still), then captured again."""
    changed_at = set(range(15, 25))
    step, params = _momentum_steps(True, changed_at)
    report = step.report()
    assert [c.at_step for c in report.captures] == [13, 15, 26], str(report)
    # 12 warm-up; 13, 14 and 15 replayed (each capture replays its call); 16-25 eager; 26-40
    assert (report.eager_steps, report.replays) == (12 + 10, 3 + 15), str(report)
    _equal_to_eager(params, changed_at)


def test_a_value_changed_now_and_then_re_captures_and_keeps_replaying():
    """Changed before updates 20 and 30 only (as an epoch-boundary schedule would): a
    re-capture at each, no eager steps after the warm-up."""
    changed_at = {20, 30}
    step, params = _momentum_steps(True, changed_at)
    report = step.report()
    assert [c.at_step for c in report.captures] == [13, 20, 30], str(report)
    assert (report.eager_steps, report.replays) == (12, 28), str(report)
    _equal_to_eager(params, changed_at)


def test_a_value_changed_at_every_update_of_accumulated_windows_is_held_eager():
    """accumulate_calls=2 and the value changed before every update from the 15th: the changes
    come two calls apart, which is still every update: eager from the second change on."""
    changed_at = set(range(15, 41))
    step, params = _momentum_steps(True, changed_at, accumulate=2)
    report = step.report()
    assert report.recaptures[-1].startswith("held eager"), report.recaptures
    # nothing captured after the hold began (the 16th update's first call, call 31)
    assert all(c.at_step < 31 for c in report.captures), str(report)
    assert report.eager_steps >= 2 * (40 - 15), str(report)
    _equal_to_eager(params, changed_at, accumulate=2)


def test_graph_always_re_captures_a_value_changed_at_every_update():
    """graph="always" asked for graphs: no eager hold, a capture at each change (as before the
    hold), and the same training."""
    changed_at = set(range(15, 41))
    step, params = _momentum_steps(True, changed_at, graph="always")
    report = step.report()
    assert [c.at_step for c in report.captures] == [13, *range(15, 41)], str(report)
    assert report.eager_steps == 12, str(report)
    assert not any(r.startswith("held eager") for r in report.recaptures), report.recaptures
    _equal_to_eager(params, changed_at)
