"""Scripts as people write them, on CPU: the model's own loss, step.output, modes, optimizer
checks and the rules that need no CUDA (a CPU dry run tells what the GPU run would do)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ddpgraph import ConfigError, TrainStep
from ddpgraph.testing import run_distributed

from . import step_workers
from .step_workers import batches, make_model

pytestmark = pytest.mark.timeout(240)  # 2-rank tests on a loaded 2-core machine


class NanoGPTLike(nn.Module):
    """nanoGPT's contract: ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, idx, targets=None):
        logits = self.net(idx)
        loss = None if targets is None else nn.functional.cross_entropy(logits, targets)
        return logits, loss


def test_nanogpt_style_model_trains_as_the_script_calls_it():
    data = batches(5, 8)
    model = NanoGPTLike()
    reference = copy.deepcopy(model)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        loss = step(x, y)  # was: logits, loss = model(X, Y); loss.backward(); optimizer.step()
        ref_opt.zero_grad()
        logits, ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(loss, ref_loss.detach())
        assert torch.equal(step.output[0], logits.detach())  # step.output: the forward's output
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


class TwoScalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x, y):
        logits = self.net(x)
        return logits, nn.functional.cross_entropy(logits, y), logits.mean()


def test_an_ambiguous_output_names_what_it_found_and_the_loss_fn_to_write():
    model = TwoScalars()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"scalar tensors at positions \[1, 2\].*loss_fn=lambda"):
        step(*batches(1, 8)[0])


def test_a_tuple_without_a_scalar_says_what_the_model_returned():
    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"returned a tensor of shape \(8, 4\).*give a loss_fn"):
        step(batches(1, 8)[0][0])


def test_step_output_with_a_loss_fn_is_the_logits_for_train_metrics():
    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    x, y = batches(1, 8)[0]
    expected = model(x).detach()
    step(x, y)
    assert torch.equal(step.output, expected)
    assert not step.output.requires_grad


def test_evaluate_restores_every_modules_own_mode():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model[1].eval()  # frozen BatchNorm, the rest training
    step.evaluate(batches(1, 8)[0][0])
    assert model.training and model[0].training and not model[1].training
    model.eval()
    step.evaluate(batches(1, 8)[0][0])
    assert not any(m.training for m in model.modules())


def test_an_eval_mode_step_keeps_batchnorm_statistics_as_eager_does():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.eval()
    before = model[1].running_mean.clone()
    step(*batches(1, 8)[0])
    assert torch.equal(model[1].running_mean, before)


@pytest.mark.parametrize(
    ("model", "optimizer", "match"),
    [
        ("resnet50", None, r"model is 'resnet50' \(str\), not a torch.nn.Module"),
        (None, None, r"optimizer is None \(NoneType\), not a torch.optim.Optimizer"),
        (None, "other", r"holds none of the model's 4 trainable parameters"),
    ],
)
def test_bad_model_or_optimizer_is_refused_at_construction(model, optimizer, match):
    real = make_model()
    if optimizer == "other":
        optimizer = torch.optim.SGD(make_model(1).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=match):
        TrainStep(model if model is not None else real, optimizer, nn.CrossEntropyLoss())


def test_an_optimizer_over_part_of_the_model_warns_naming_the_rest():
    model = make_model()
    with pytest.warns(UserWarning, match=r"does not hold 2 of .*\(2\.weight, 2\.bias\)"):
        TrainStep(model, torch.optim.SGD(model[0].parameters(), lr=0.1), nn.CrossEntropyLoss())


def test_an_optimizer_that_cannot_be_captured_is_named_on_cpu_too():
    model = make_model()
    with pytest.warns(UserWarning, match=r"on CUDA this TrainStep would run eagerly: Adagrad"):
        TrainStep(model, torch.optim.Adagrad(model.parameters()), nn.CrossEntropyLoss())


def test_on_new_shape_error_applies_on_cpu_after_the_warm_up():
    model = make_model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        on_new_shape="error",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in batches(12, 4):  # warm-up (12 steps, as on CUDA): any shape
            step(x, y)
        step(*batches(1, 8)[0])  # the step that would be captured: the reference
        step(*batches(1, 8)[0])
    with pytest.raises(ValueError, match=r"on_new_shape='error'.*\(4, 8\).*\(8, 8\)"):
        step(*batches(1, 4)[0])


def test_evaluate_gives_every_rank_what_ddps_own_eval_forward_gives():
    results = run_distributed(
        step_workers.evaluate_sees_rank0_buffers, world_size=2, args=(3,), timeout=90
    )
    for result in results:
        assert torch.equal(result["ours"], result["ddp"])
    assert torch.equal(results[0]["mean"], results[1]["mean"])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_batchnorm_training_on_two_ranks_matches_the_plain_ddp_loop(accumulate):
    """Each step starts with the buffer broadcast DDP's forward does, so every rank's state,
    running statistics included, is the plain DDP loop's (this test asserted rank 0's
    statistics on every rank while TrainStep broadcast at the end of each step instead)."""
    results = run_distributed(
        step_workers.batchnorm_vs_eager_ddp, world_size=2, args=(5, accumulate), timeout=200
    )
    for result in results:
        for name, value in result["theirs"].items():
            assert torch.equal(result["ours"][name], value), name
