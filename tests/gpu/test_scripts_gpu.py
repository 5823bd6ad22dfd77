"""Script habits on the GPU: eval-mode steps, step.output, evaluation before training, captures
that fail in each phase, frozen parameters, real transformers models fed attention masks."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ddpgraph import TrainStep
from ddpgraph.step.optim import make_graph_safe

from .test_step_gpu import REPLAYS, adamw, assert_bitwise, make_batches, mlp, resnet, sgd

pytestmark = pytest.mark.timeout(600)


def run(model_fn, opt_fn, batches, *, graph, loss_fn=None, each=None, **kwargs):
    """Train with ``each(i, step, model)`` called before step i; the outputs and state after."""
    torch.manual_seed(0)
    model = model_fn().cuda()
    opt = opt_fn(model.parameters())
    if graph == "never":
        make_graph_safe(opt, torch.device("cuda"))
    step = TrainStep(model, opt, loss_fn or nn.CrossEntropyLoss(), graph=graph, **kwargs)
    torch.manual_seed(1)
    losses, outputs = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, batch in enumerate(batches):
            if each is not None:
                each(i, step, model)
            losses.append(step(*batch).clone())
            outputs.append(step.output.clone())
    torch.cuda.synchronize()
    return {
        "losses": torch.stack(losses),
        "outputs": torch.stack(outputs),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": [
            (k, v.clone())
            for s in opt.state.values()
            for k, v in sorted(s.items())
            if isinstance(v, torch.Tensor)
        ],
        "report": step.report(),
        "step": step,
        "warnings": [str(w.message) for w in caught],
    }


def test_step_output_is_the_forward_output_of_each_step(rt):
    batches = make_batches(mlp, 12 + 1 + REPLAYS)
    graphed = run(mlp, sgd, batches, graph="always")
    eager = run(mlp, sgd, batches, graph="never")
    assert graphed["report"].replays == REPLAYS + 1
    assert torch.equal(graphed["outputs"], eager["outputs"])
    assert_bitwise(graphed, eager)


def _eval_between(start, stop):
    def each(i, step, model):
        if i == start:
            model.eval()
        if i == stop:
            model.train()

    return each


def test_steps_in_eval_mode_use_their_own_graph_and_match_eager(rt):
    """Frozen-BatchNorm steps (model.eval() between steps 20 and 25) keep BN's statistics, as
    eager DDP does; training mode comes back to its own graph."""
    batches = make_batches(resnet, 40)
    graphed = run(resnet, sgd, batches, graph="always", each=_eval_between(20, 25))
    eager = run(resnet, sgd, batches, graph="never", each=_eval_between(20, 25))
    report = graphed["report"]
    assert len(report.captures) == 2 and "eval mode" in report.captures[1].kind, str(report)
    assert report.replays == 40 - 12
    assert_bitwise(graphed, eager)


def test_evaluate_before_training_and_restores_the_modules_own_modes(rt):
    torch.manual_seed(0)
    model = resnet().cuda()
    step = TrainStep(model, sgd(model.parameters()), nn.CrossEntropyLoss())
    x, _ = make_batches(resnet, 1)[0]
    for _ in range(4):  # eager, eager, capture + replay, replay
        out = step.evaluate(x).clone()
    model.eval()
    with torch.no_grad():
        assert torch.equal(out, model(x))
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    model.train()
    bn.eval()  # the user's frozen BN
    step.evaluate(x)
    assert model.training and not bn.training


class FailWhileCapturing(Exception):
    pass


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


class _BackwardTrap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if _capturing():
            raise FailWhileCapturing("backward")
        return grad


def _injected(phase):
    """A model, loss and optimizer hook that raise only while capturing, in ``phase``."""

    def model_fn():
        model = mlp()
        if phase == "forward":
            model.register_forward_hook(lambda *a: _raise_if_capturing("forward"))
        return model

    def loss_fn(out, y):
        if phase == "loss":
            _raise_if_capturing("loss")
        if phase == "backward":
            out = _BackwardTrap.apply(out)
        return nn.functional.cross_entropy(out, y)

    def opt_fn(params):
        opt = adamw(params)
        if phase == "optimizer":
            opt.register_step_pre_hook(lambda *a: _raise_if_capturing("optimizer"))
        return opt

    return model_fn, loss_fn, opt_fn


def _raise_if_capturing(where):
    if _capturing():
        raise FailWhileCapturing(where)


@pytest.mark.parametrize("phase", ["forward", "loss", "backward", "optimizer"])
def test_a_capture_failing_in_any_phase_leaves_training_exactly_eager(rt, phase):
    model_fn, loss_fn, opt_fn = _injected(phase)
    batches = make_batches(mlp, 24)
    graphed = run(model_fn, opt_fn, batches, graph="auto", loss_fn=loss_fn)
    eager = run(model_fn, opt_fn, batches, graph="never", loss_fn=loss_fn)
    report = graphed["report"]
    assert report.mode == "eager" and report.replays == 0, str(report)
    assert any(f"FailWhileCapturing: {phase}" in w for w in graphed["warnings"])
    assert_bitwise(graphed, eager)


def _freeze_first_layer_at(i_freeze):
    def each(i, step, model):
        if i == i_freeze:
            model[0].weight.requires_grad_(False)
            model[0].bias.requires_grad_(False)

    return each


def test_a_parameter_frozen_after_capture_is_never_trained_by_a_stale_graph(rt):
    """airbench freezes a bias mid-run; DDP needs find_unused_parameters=True for that. The
    change is found before the next replay and the graph dropped; DDP's unused-parameter
    bookkeeping copies a pageable CPU map during the new capture (H200, torch 2.11), so those
    steps run eagerly, with the reason, and match eager DDP."""
    batches = make_batches(mlp, 40)
    kwargs = {"ddp_kwargs": {"find_unused_parameters": True}, "each": _freeze_first_layer_at(20)}
    graphed = run(mlp, adamw, batches, graph="auto", **kwargs)
    eager = run(mlp, adamw, batches, graph="never", **kwargs)
    report = graphed["report"]
    assert any("requires_grad" in r for r in report.recaptures), str(report)
    assert len(report.captures) == 2 or "capture failed" in report.fallbacks[-1], str(report)
    assert_bitwise(graphed, eager)


def test_a_changed_param_group_value_is_recaptured(rt):
    def each(i, step, model):
        if i == 25:
            step.optimizer.param_groups[0]["weight_decay"] = 0.5

    batches = make_batches(mlp, 40)
    graphed = run(mlp, adamw, batches, graph="always", each=each)
    eager = run(mlp, adamw, batches, graph="never", each=each)
    assert len(graphed["report"].captures) == 2, str(graphed["report"])
    assert_bitwise(graphed, eager)
