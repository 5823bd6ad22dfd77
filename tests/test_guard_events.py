"""``TrainStep(guard="events")`` (issue 51): while graphed, a call reads nothing per tensor and
learns from torch's own hooks what a script changed (a parameter, buffer or submodule set on a
module), besides what costs the same at every size (the roots' forward and mode, the
optimizer's state dict, which ``load_state_dict`` replaces, and its param-group values). Checked against the
default ``guard="full"`` run of the same script on the CPU engine, bit for bit, and against the
full guard's own findings."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ddpgraph import ConfigError, TrainStep
from ddpgraph.step.guard import Guard
from ddpgraph.step.optim import make_graph_safe
from ddpgraph.step.options import StepOptions
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


def _set_storage(tensor: torch.Tensor, source: torch.Tensor) -> None:
    with torch.no_grad():  # as FSDP1 and checkpoint loaders do on a leaf that requires grad
        tensor.set_(source)


# what torch's registration hooks never saw, and the old "events" guard missed (issue 51): each
# now moves the count of step/events.py, so the default guard's one comparison sees it
_SEEN_BY_THE_COUNT = {
    "p.data = ...": lambda m: setattr(m[0].weight, "data", torch.randn(4, 4)),
    "swap_tensors": lambda m: torch.utils.swap_tensors(
        m[0].weight, nn.Parameter(torch.randn(4, 4))
    ),
    "grad set to None": lambda m: setattr(m[2].bias, "grad", None),
    "zero_grad()": lambda m: torch.optim.SGD(m.parameters(), lr=0.1).zero_grad(),
    "grad replaced": lambda m: setattr(m[2].bias, "grad", torch.zeros(2)),
    "grad.data moved": lambda m: setattr(m[0].weight.grad, "data", torch.zeros(4, 4)),
    "buffer storage moved": lambda m: setattr(m[1].running_mean, "data", torch.zeros(4)),
    "model.to(float64)": lambda m: m.to(torch.float64),
    "requires_grad_(False)": lambda m: m[0].weight.requires_grad_(False),
    "set_() to other storage": lambda m: _set_storage(m[0].weight, torch.randn(4, 4)),
    "requires_grad = False": lambda m: setattr(m[2].bias, "requires_grad", False),
    "a submodule's eval()": lambda m: m[1].eval(),
    "a submodule's train() again": lambda m: m[1].train(),
}


_SEEN = {**_SEEN_BY_HOOKS, **_SEEN_BY_THE_COUNT}


@pytest.mark.parametrize("change", list(_SEEN), ids=list(_SEEN))
def test_the_events_guard_sees_every_public_change_by_one_count(change):
    model, watch = _graphed_watch(events_only=True)
    assert watch.unchanged()
    _SEEN[change](model)
    assert not watch.unchanged(), change
    watch.check()  # the slow path reads everything and takes the count as it is now
    watch.settle(keep_grads=True)
    assert watch.unchanged()


def test_the_default_guard_is_events_and_what_moves_no_count_is_seen_by_full():
    assert StepOptions().guard == "events"
    # documented in StepOptions.guard and step/events.py as seen only by guard="full"
    for change in (
        lambda m: m[2]._parameters.__setitem__("bias", nn.Parameter(torch.zeros(2))),
        lambda m: m[1]._buffers.__setitem__("running_var", torch.ones(4)),
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


_MID_RUN = {  # what the old "events" guard missed while graphed, made by a script mid-run
    "a submodule's eval() and train()": lambda i, step, model: (
        model[0].eval() if i == 16 else model[0].train() if i == 20 else None
    ),
    # the guard's check in evaluate() sees the count move first: the next call must still
    # read the modes
    "a submodule's eval(), then step.evaluate()": lambda i, step, model: (
        (model[0].eval(), step.evaluate(torch.randn(8, 8)))
        if i == 16
        else (model[0].train(), step.evaluate(torch.randn(8, 8)))
        if i == 20
        else None
    ),
    "a layer frozen with requires_grad_()": lambda i, step, model: (
        model[0].weight.requires_grad_(False) if i == 16 else None
    ),
    "p.data = a copy": lambda i, step, model: (
        setattr(model[2].weight, "data", model[2].weight.detach().clone()) if i == 16 else None
    ),
    "the script's zero_grad()": lambda i, step, model: step.optimizer.zero_grad(),
}


@pytest.mark.parametrize("change", list(_MID_RUN), ids=list(_MID_RUN))
def test_events_guard_trains_bit_for_bit_as_the_full_guard_through_each_public_change(change):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the re-capture warnings: the same in both runs
        runs = {guard: _run(guard, _MID_RUN[change]) for guard in ("full", "events")}
    (full_step, full_model, full_losses), (step, model, losses) = runs["full"], runs["events"]
    assert step.report().replays == full_step.report().replays > 0
    assert len(step.report().captures) == len(full_step.report().captures)
    assert step.report().recaptures == full_step.report().recaptures
    for a, b in zip(model.parameters(), full_model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert (a.grad is None) == (b.grad is None)  # zero_grad(): the graph's put back
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


@pytest.mark.parametrize(
    "options",
    [{}, {"accumulate_calls": 2}, {"clip_grad_norm": 1.0, "grad_norm": True}],
    ids=["plain", "accumulate_calls=2", "clip"],
)
def test_a_replayed_call_moves_no_count_so_the_default_guard_reads_nothing_per_tensor(options):
    # were the step's own work between replays to move the count (a .grad or .data set, a
    # train()), every call would take the slow path and read every tensor, as "full" does
    from ddpgraph.step import events

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), engine=CpuGraphs(), **options)
    moved = []
    for i, (x, y) in enumerate(batches(40, 8)):
        before = events.changes[0]
        replays = step.report().replays
        step(x, y)
        if i % 5 == 4:
            step.evaluate(x)  # a graphed evaluation in between
        if step.report().replays > replays and i > 30:
            moved.append(events.changes[0] - before)
    assert moved and moved == [0] * len(moved)
