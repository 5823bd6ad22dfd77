"""TrainStep's capture policy on the CPU, through the stand-in graph engine (``fake_graphs``):
warm-up, capture, agreement, replay, fallback, new shapes, modes, the replay guard, close."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ddpgraph import CaptureError, TrainStep
from ddpgraph.step import Phase
from ddpgraph.step.optim import make_graph_safe
from ddpgraph.testing import CpuGraphs, run_distributed

from . import step_workers
from .step_workers import batches, make_model

pytestmark = pytest.mark.timeout(120)

WARMUP = 12


def build(fail=lambda key: False, model=None, opt=None, **kwargs):
    model = model if model is not None else make_model()
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), **kwargs, engine=CpuGraphs(fail=fail))
    return step, model


def reference(data, each=None):
    """The eager run with the optimizer the graphed step steps (fused SGD, the LR in a tensor),
    as tests/gpu compare: what else differs is the graph's doing."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    make_graph_safe(opt, torch.device("cpu"))
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), graph="never")
    for i, (x, y) in enumerate(data):
        if each is not None:
            each(i, step, model)
        step(x, y)
    return [p.detach().clone() for p in model.parameters()]


def train(step, model, data, each=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data):
            if each is not None:
                each(i, step, model)
            step(x, y)
    return [str(w.message) for w in caught]


def assert_same(model, params):
    for a, b in zip(model.parameters(), params):
        assert torch.equal(a, b)


def test_warm_up_then_one_capture_then_replays():
    data = batches(20, 8)
    step, model = build()
    phases = []
    for x, y in data:
        step(x, y)
        phases.append(step.phase)
    assert phases[: WARMUP - 1] == [Phase.WARMUP] * (WARMUP - 1)
    assert phases[WARMUP:] == [Phase.GRAPHED] * (20 - WARMUP)
    report = step.report()
    assert report.warmup_steps == WARMUP and len(report.captures) == 1
    assert report.replays == 20 - WARMUP and report.eager_steps == WARMUP
    assert_same(model, reference(data))


@pytest.mark.parametrize(
    ("policy", "captures", "eager"), [("capture", 2, WARMUP), ("eager", 1, WARMUP + 4)]
)
def test_new_shapes_follow_the_policy(policy, captures, eager):
    data = batches(16, 8) + batches(4, 4, seed=5)
    step, model = build(on_new_shape=policy)
    train(step, model, data)
    report = step.report()
    assert len(report.captures) == captures and report.eager_steps == eager, str(report)
    assert_same(model, reference(data))


def test_on_new_shape_error_names_the_entry_that_changed():
    step, model = build(on_new_shape="error")
    train(step, model, batches(14, 8))
    with pytest.raises(ValueError, match=r"batch element 0 \(4, 8\) float32 \(captured \(8, 8\)"):
        step(*batches(1, 4)[0])


def test_an_eval_mode_step_captures_its_own_graph_and_never_replays_the_other():
    data = batches(24, 8)

    def each(i, step, model):
        if i == 16:
            model.eval()
        if i == 20:
            model.train()

    step, model = build()
    train(step, model, data, each)
    report = step.report()
    assert [c.kind for c in report.captures] == ["train", "train (eval mode)"], str(report)
    assert report.replays == 24 - WARMUP
    assert_same(model, reference(data, each))


def test_a_failed_first_capture_falls_back_for_good_with_the_reason():
    data = batches(16, 8)
    step, model = build(fail=lambda key: True)
    messages = train(step, model, data)
    assert step.phase is Phase.EAGER and step.report().replays == 0
    assert any("FakeCaptureError" in m for m in messages)
    assert "FakeCaptureError" in step.report().fallbacks[0]
    assert_same(model, reference(data))
    step, model = build(fail=lambda key: True, graph="always")
    with pytest.raises(CaptureError, match="FakeCaptureError"):
        train(step, model, data)


def test_a_failed_later_capture_runs_that_shape_eagerly_and_keeps_the_rest_graphed():
    data = batches(16, 8) + batches(3, 4, seed=5) + batches(3, 8, seed=6)
    step, model = build(
        fail=lambda key: key.signature.leaves[0].shape == (4, 8), on_new_shape="capture"
    )
    train(step, model, data)
    report = step.report()
    assert step.phase is Phase.GRAPHED and report.replays == 16 - WARMUP + 3, str(report)
    assert report.eager_steps == WARMUP + 3
    assert_same(model, reference(data))


def test_optimizer_reload_is_copied_in_place_and_a_changed_group_value_recaptures():
    data = batches(30, 8)
    saved = {}

    def each(i, step, model):
        if i == 14:
            saved["opt"] = copy.deepcopy(step.optimizer.state_dict())
        if i == 18:
            step.optimizer.load_state_dict(saved["opt"])  # the script's own resume
        if i == 22:
            step.optimizer.param_groups[0]["momentum"] = 0.5

    step, model = build()
    messages = train(step, model, data, each)
    report = step.report()
    assert len(report.captures) == 2 and report.replays == 30 - WARMUP, str(report)
    assert any("param-group value changed" in r for r in report.recaptures)
    assert any("re-captures its 1 training graph" in m for m in messages)
    assert_same(model, reference(data, each))


def test_a_frozen_parameter_is_recaptured():
    def each(i, step, model):
        if i == 15:
            model[0].weight.requires_grad_(False)

    step, model = build()
    train(step, model, batches(20, 8), each)
    assert any("requires_grad" in r for r in step.report().recaptures)
    assert len(step.report().captures) == 2


def test_close_ends_in_the_closed_phase():
    step, model = build()
    train(step, model, batches(14, 8))
    step.close()
    assert step.phase is Phase.CLOSED and step.output is None
    with pytest.raises(CaptureError, match="after close"):
        step(*batches(1, 8)[0])


def test_evaluate_is_captured_after_its_warm_up_and_restores_modes():
    step, model = build()
    x = batches(1, 8)[0][0]
    outs = [step.evaluate(x).clone() for _ in range(4)]
    assert step.report().eval_replays == 2
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert model.training


def test_every_rank_replays_and_matches_eager_on_two_ranks():
    results = run_distributed(
        step_workers.every_rank_replays_with_the_fake_engine, world_size=2, args=(16,), timeout=90
    )
    for result in results:
        assert result["fake"]["mode"] == "graphed" and result["fake"]["replays"] == 16 - WARMUP
        for a, b in zip(result["fake"]["params"], result["never"]["params"]):
            assert torch.equal(a, b)


def test_one_rank_failing_its_capture_sends_every_rank_eager():
    results = run_distributed(
        step_workers.one_rank_fails_capture, world_size=2, args=(16,), timeout=90
    )
    assert [r["mode"] for r in results] == ["eager", "eager"]
    assert "another rank could not capture" in results[0]["fallbacks"][0]
    assert "FakeCaptureError" in results[1]["fallbacks"][0]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_a_compile_failing_on_one_rank_is_agreed_before_ddp_is_rebuilt():
    results = run_distributed(
        step_workers.compile_fails_on_rank_1, world_size=2, args=(4,), timeout=120
    )
    assert [r["inner"] for r in results] == ["Sequential", "Sequential"]
    assert any("failed on another rank" in f for f in results[0]["fallbacks"])
    assert any("injected backend failure" in f for f in results[1]["fallbacks"])
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
