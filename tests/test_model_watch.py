"""What a script or framework changes in the model between TrainStep calls (issue 31, item 7):
storage moved by ``model.to()`` / ``p.data = ...`` / ``module._apply``, a forward wrapped
mid-run (accelerate's autocast), gradients set to None, a new Parameter object. Each followed
(wrapper rebuilt, graphs captured again, with a warning) and equal bit for bit to the plain DDP
loop doing the same thing, on 2 gloo ranks, eagerly and graphed on the CPU stand-in engine; or
refused on every rank naming what changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpgraph import ConfigError, TrainStep
from ddpgraph.step.guard import Guard
from ddpgraph.testing import CpuGraphs, run_distributed

from . import watch_workers as workers
from .step_workers import as_the_step_steps, batches, make_model
from .test_objects import assert_same_error_everywhere

pytestmark = pytest.mark.timeout(240)  # 2 ranks on a loaded 2-core machine

AT, STEPS = 15, 34  # the change comes after the first capture (warm-up 12)


def _same_run(result: dict) -> None:
    ours, theirs = result["ours"], result["theirs"]
    assert ours["state"].keys() == theirs["state"].keys()
    for name in ours["state"]:
        assert torch.equal(ours["state"][name], theirs["state"][name]), name
    for i, (a, b) in enumerate(zip(ours["norms"], theirs["norms"], strict=True)):
        assert torch.equal(a, b), (i, a, b)
    for a, b in zip(ours["evals"], theirs["evals"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("graphed", [True, False], ids=["graphed", "eager"])
@pytest.mark.parametrize("how", ["to", "data", "apply"])
def test_storage_moved_mid_run_is_followed_like_the_plain_ddp_loop(how, graphed):
    """Before the fix the eager run's grad norm doubled every step after the move (DDP's
    gradient buckets were views of the old gradients) and the graphed run raised."""
    results = run_distributed(
        workers.changed_mid_run, 2, args=(how, graphed, AT, STEPS, True), timeout=220
    )
    for result in results:
        _same_run(result)
        assert any("moved to new memory" in w for w in result["warnings"]), result["warnings"]
        if graphed:
            assert result["mode"] == "graphed"
            assert result["recaptures"], "the graphs were dropped and captured again"
            replays = result["ours"]["replays_at"]
            assert replays[-1] > replays[AT + 12], "graphed again after the new DDP's warm-up"


@pytest.mark.parametrize("graphed", [True, False], ids=["graphed", "eager"])
def test_a_forward_wrapped_mid_run_is_captured_again_and_trains_like_the_plain_loop(graphed):
    results = run_distributed(
        workers.changed_mid_run, 2, args=("forward", graphed, AT, STEPS, False), timeout=220
    )
    for result in results:
        _same_run(result)
        assert any("forward replaced" in w for w in result["warnings"]), result["warnings"]
        if graphed:
            assert any("forward replaced" in r for r in result["recaptures"])
            replays = result["ours"]["replays_at"]
            assert replays[AT + 2] > replays[AT], "captured again at once (no new warm-up)"


@pytest.mark.parametrize("graphed", [True, False], ids=["graphed", "eager"])
def test_a_new_parameter_object_is_refused_on_every_rank_naming_it(graphed):
    results = run_distributed(
        workers.new_parameter_object, 2, args=(graphed,), timeout=200, return_exceptions=True
    )
    assert_same_error_everywhere(
        results, ConfigError, "parameter '0.weight'", "new nn.Parameter", "param.data.copy_"
    )


def test_zero_grad_set_to_none_between_graphed_calls_keeps_the_captured_gradients():
    """A script that keeps its own ``optimizer.zero_grad()`` (set_to_none=True) between graphed
    steps: the gradients the graph writes are put back (zeroed) and the run equals eager."""

    def run(engine):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        if engine is None:  # the eager reference steps the AdamW the graphed step steps
            as_the_step_steps(opt)
        step = TrainStep(model, opt, nn.CrossEntropyLoss(), engine=engine)
        for x, y in batches(20, 8):
            opt.zero_grad()
            step(x, y)
        return step, model

    step, model = run(CpuGraphs())
    kept = [p.grad for p in model.parameters()]
    _, eager = run(None)
    assert step.report().replays == 20 - 12 and not step.report().recaptures
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a, b)
    step(*batches(1, 8, seed=3)[0])
    assert all(p.grad is g for p, g in zip(model.parameters(), kept))


def test_a_model_moved_to_another_device_type_is_refused_naming_it(monkeypatch):
    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    step(*batches(1, 8)[0])
    model.to("meta")
    with pytest.raises(ConfigError, match=r"moved to \['meta'\].* trains on cpu"):
        step(*batches(1, 8)[0])


def test_the_watch_compares_flat_lists_without_walking_the_model(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2, bias=False))
    model(torch.randn(3, 4)).sum().backward()
    watch = Guard(lambda: (model,))
    watch.settle(keep_grads=True)  # as while graphed

    def walked(*args, **kwargs):
        raise AssertionError("check() walked the modules")

    monkeypatch.setattr(nn.Module, "named_modules", walked)
    monkeypatch.setattr(nn.Module, "modules", walked)
    assert not watch.check()
    model[1].running_mean = model[1].running_mean.clone()  # model.to() replaces buffer objects
    model[0].weight.grad = None
    model[2].forward = lambda x: x  # type: ignore[method-assign]
    found = watch.check()
    assert found.moved == ["buffer '1.running_mean'"]
    assert [name for name in found.forwards] == []  # a submodule's forward: not a root
    assert len(found.dropped_grads) == 1 and found.dropped_grads[0][0] is model[0].weight
    model.forward = lambda x: x  # type: ignore[method-assign]
    assert watch.check().forwards == ["Sequential"]


def _graphed_watch() -> tuple[nn.Module, Guard]:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    watch = Guard(lambda: (model,))
    watch.settle(keep_grads=True)  # as while graphed: the fast path is on
    return model, watch


# every change the watch's full check sees, made as scripts and torch make it; the fast path
# (one C-level pass per list, issue 51) must see each, or a replay would train on stale memory
_CHANGES = {
    "p.data = ...": lambda m: setattr(m[0].weight, "data", torch.randn(4, 4)),
    "swap_tensors (model.to with swapping)": lambda m: torch.utils.swap_tensors(
        m[0].weight, nn.Parameter(torch.randn(4, 4))
    ),
    "new Parameter on the same storage": lambda m: setattr(
        m[0], "weight", nn.Parameter(m[0].weight.data)
    ),
    "Parameter put in the module's dict": lambda m: m[2]._parameters.__setitem__(
        "bias", nn.Parameter(torch.zeros(2))
    ),
    "grad set to None": lambda m: setattr(m[2].bias, "grad", None),
    "grad replaced": lambda m: setattr(m[2].bias, "grad", torch.zeros(2)),
    "grad.data moved (model.to)": lambda m: setattr(m[0].weight.grad, "data", torch.zeros(4, 4)),
    "buffer replaced": lambda m: setattr(m[1], "running_var", torch.ones(4)),
    "buffer storage moved": lambda m: setattr(m[1].running_mean, "data", torch.zeros(4)),
    "forward re-wrapped": lambda m: setattr(m, "forward", lambda x: x),
    "compiled call": lambda m: m.__dict__.__setitem__("_compiled_call_impl", lambda x: x),
}


def test_the_watchs_fast_path_sees_nothing_when_nothing_changed():
    model, watch = _graphed_watch()
    assert watch.unchanged()
    with torch.no_grad():  # values written in place (what a replay does) are no change
        for p in model.parameters():
            p.add_(1)
            p.grad.mul_(0)
        model[1].running_mean.add_(1)
    assert watch.unchanged()
    assert not watch.check()


@pytest.mark.parametrize("change", list(_CHANGES), ids=list(_CHANGES))
def test_the_watchs_fast_path_misses_no_change_its_full_check_sees(change):
    model, watch = _graphed_watch()
    _CHANGES[change](model)
    assert not watch.unchanged(), change
    assert watch.check(), change  # and the full check names it
