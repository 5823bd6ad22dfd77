"""``TrainStep(guard="events")`` (issue 51): while graphed, a call reads nothing per tensor and
learns from torch's own hooks what a script changed (a parameter, buffer or submodule set on a
module), besides what costs the same at every size (the roots' forward and mode, the
optimizer's state dict, which ``load_state_dict`` replaces, and its param-group values). Checked against the
default ``guard="full"`` run of the same script on the CPU engine, bit for bit, and against the
full guard's own findings."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ddpgraph import ConfigError, TrainStep
from ddpgraph.step.guard import Guard
from ddpgraph.step.optim import make_graph_safe
from ddpgraph.testing import CpuGraphs

from .step_workers import batches, make_model

pytestmark = pytest.mark.timeout(240)


def _graphed_watch(events_only: bool) -> tuple[nn.Module, Guard]:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    watch = Guard(lambda: (model,), events_only=events_only)
    watch.settle(keep_grads=True)  # as while graphed
    return model, watch


# what the hooks see: torch's global registration hooks run for each
_SEEN_BY_HOOKS = {
    "new Parameter by setattr": lambda m: setattr(m[0], "weight", nn.Parameter(m[0].weight.data)),
    "buffer set": lambda m: setattr(m[1], "running_var", torch.ones(4)),
    "buffer registered": lambda m: m[0].register_buffer("extra", torch.zeros(1)),
    "submodule set": lambda m: setattr(m, "head", nn.Linear(2, 2)),
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(
        copy.deepcopy(m.state_dict()), assign=True
    ),
    "forward re-wrapped": lambda m: setattr(m, "forward", lambda x: x),
}


@pytest.mark.parametrize("change", list(_SEEN_BY_HOOKS), ids=list(_SEEN_BY_HOOKS))
def test_the_events_watch_sees_what_torchs_hooks_report(change):
    model, watch = _graphed_watch(events_only=True)
    assert watch.unchanged()
    _SEEN_BY_HOOKS[change](model)
    assert not watch.unchanged(), change
    watch.check()  # read in full: the count is the new baseline
    watch.settle(keep_grads=True)
    assert watch.unchanged()


def test_the_events_watch_reads_nothing_per_tensor_and_so_misses_what_it_documents():
    # StepOptions.guard names these as unseen by "events"; the full watch sees each
    for change in (
        lambda m: setattr(m[0].weight, "data", torch.randn(4, 4)),
        lambda m: setattr(m[2].bias, "grad", None),
    ):
        model, events = _graphed_watch(events_only=True)
        full = Guard(lambda model=model: (model,))
        full.settle(keep_grads=True)
        change(model)
        assert events.unchanged() and not full.unchanged()


def _guard(events_only: bool) -> tuple[torch.optim.Optimizer, Guard]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    make_graph_safe(opt, torch.device("cpu"))
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    guard = Guard(lambda: (model,), events_only=events_only)
    guard.watch_optimizer(list(model.parameters()), opt)  # as at the first capture
    return opt, guard


def test_the_events_replay_guard_sees_a_load_state_dict_by_the_state_dict_it_replaces():
    for events_only in (True, False):
        opt, guard = _guard(events_only)
        assert guard.check() is None
        saved = copy.deepcopy(opt.state_dict())
        kept = [opt.state[p]["momentum_buffer"] for p in opt.param_groups[0]["params"]]
        opt.load_state_dict(saved)  # new state tensors: the graphs read the old ones
        found = guard.check()
        assert found is not None
        assert found.optimizer == [
            "optimizer state loaded: values copied into the captured tensors"
        ]
        assert all(
            opt.state[p]["momentum_buffer"] is k
            for p, k in zip(opt.param_groups[0]["params"], kept)
        )
        assert guard.check() is None


def test_the_events_replay_guard_sees_a_changed_param_group_value():
    opt, guard = _guard(events_only=True)
    opt.param_groups[0]["momentum"] = 0.5
    found = guard.check()
    assert found is not None and found.recapture
    opt, guard = _guard(events_only=True)
    opt.param_groups[0]["momentum"] = float("0.9")  # a new object, the same value: no change
    assert guard.check() is None


def _run(guard: str, each) -> tuple[TrainStep, nn.Module, list[torch.Tensor]]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), engine=CpuGraphs(), guard=guard)
    losses = []
    for i, (x, y) in enumerate(batches(32, 8)):
        each(i, step, model)
        losses.append(step(x, y))
    return step, model, losses


def test_events_guard_trains_bit_for_bit_as_the_full_guard_through_what_it_sees():
    saved = {}

    def each(i, step, model):
        if i == 14:
            saved["opt"] = copy.deepcopy(step.optimizer.state_dict())
        if i == 18:
            step.optimizer.load_state_dict(saved["opt"])  # the script's own resume
        if i == 22:
            step.optimizer.param_groups[0]["momentum"] = 0.5
        if i == 25:
            model.eval()  # the whole model's mode: a graph of its own
        if i == 27:
            model.train()

    runs = {guard: _run(guard, each) for guard in ("full", "events")}
    (full_step, full_model, full_losses), (step, model, losses) = runs["full"], runs["events"]
    assert step.report().replays == full_step.report().replays > 0
    assert len(step.report().captures) == len(full_step.report().captures) == 3
    assert step.report().recaptures == full_step.report().recaptures
    for a, b in zip(model.parameters(), full_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(losses, full_losses, strict=True):
        assert torch.equal(a, b)


def test_events_guard_refuses_a_new_parameter_object_as_the_full_guard_does():
    def each(i, step, model):
        if i == 16:  # graphed by now
            model[0].weight = nn.Parameter(model[0].weight.detach().clone())

    for guard in ("full", "events"):
        with pytest.raises(ConfigError, match=r"'0\.weight' became new nn\.Parameter objects"):
            _run(guard, each)


def test_an_unknown_guard_is_named():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"guard='fast' must be one of 'full', 'events'"):
        TrainStep(model, opt, nn.CrossEntropyLoss(), guard="fast")  # type: ignore[arg-type]
