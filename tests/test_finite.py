"""TrainStep(check_finite=True): the first non-finite update stops every rank with one error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ddpgraph import ConfigError, NonFiniteError, TrainStep
from ddpgraph.testing import run_distributed

from . import finite_workers
from .step_workers import batches, make_model
from .test_objects import assert_same_error_everywhere

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("engine", "where", "calls", "bad_step", "clip"),
    [
        ("never", "input", 1, 5, None),
        ("fake", "input", 1, 16, None),  # after warm-up (12) and capture: a replay meets the NaN
        ("fake", "loss", 1, 16, None),  # the NaN reaches the loss only, on one rank
        ("fake", "input", 2, 15, None),  # accumulate_calls: the window's update names the step
        ("fake", "loss", 1, 16, 1.0),  # the probe reads the clipping's norm
    ],
)
def test_a_nan_on_one_rank_stops_every_rank_with_the_same_error_naming_the_step(
    engine, where, calls, bad_step, clip
):
    results = run_distributed(
        finite_workers.nan_at_step,
        2,
        args=(bad_step, 1, engine, where, calls, clip),
        timeout=240,
        return_exceptions=True,
    )
    message = assert_same_error_everywhere(results, NonFiniteError, f"at step {bad_step},")
    assert "not finite (NaN or inf)" in message and "check_finite=False" in message
    assert {exc.step for exc in results} == {bad_step}


@pytest.mark.parametrize("engine", ["never", "fake"])
def test_a_nan_in_one_ranks_fsdp2_shard_stops_every_rank_at_that_step(engine):
    """Issue 42: FSDP2 gives each rank its shard of a gradient; a NaN in one element of one
    rank's shard (not its first) is seen through the all-reduced norm by every rank, at the step
    it appeared (the probe of each shard's first element missed it until the NaN parameters made
    the next loss NaN)."""
    pytest.importorskip("torch.distributed.fsdp")
    results = run_distributed(
        finite_workers.nan_in_one_shard,
        2,
        args=(6, 1, engine),
        timeout=240,
        return_exceptions=True,
    )
    assert_same_error_everywhere(results, NonFiniteError, "at step 6,")
    assert {exc.step for exc in results} == {6}


def test_without_the_check_nothing_changes_bit_for_bit_and_a_nan_is_not_raised():
    data = batches(6, 8)
    runs = []
    for check in (False, True):
        model = make_model()
        step = TrainStep(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            nn.CrossEntropyLoss(),
            check_finite=check,
            clip_grad_norm=1.0,
        )
        losses = [step(x, y).clone() for x, y in data]
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses_a, params_a), (losses_b, params_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b))
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    x, y = data[0]
    assert torch.isnan(step(x * float("nan"), y))  # off by default in the library


def test_loading_a_checkpoint_after_the_error_goes_on_and_counts_from_its_step():
    data = batches(8, 8)
    model = make_model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        check_finite=True,
    )
    for x, y in data[:3]:
        step(x, y)
    saved = copy.deepcopy(step.state_dict())
    x, y = data[3]
    with pytest.raises(NonFiniteError, match="at step 4,"):
        step(x * float("inf"), y)
    with pytest.raises(NonFiniteError, match="at step 4,"):  # stays raised
        step(*data[4])
    step.load_state_dict(saved)
    step(*data[4])  # step 4 again, finite
    with pytest.raises(NonFiniteError, match="at step 5,"):
        step(data[5][0] * float("nan"), data[5][1])


@pytest.mark.parametrize("value", [1, "yes", None])
def test_check_finite_must_be_a_bool(value):
    model = make_model()
    with pytest.raises(ConfigError, match=f"check_finite={value!r} must be True or False"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), check_finite=value)


def test_check_finite_with_fp16_is_refused_with_the_reason():
    model = make_model()
    with pytest.raises(ConfigError, match="fp16's loss scaler expects overflowed"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), amp="fp16", check_finite=True)


def test_compile_given_as_a_dict_on_a_sharded_model_is_named_as_given():
    results = run_distributed(
        finite_workers.compile_dict_on_a_sharded_model, 2, timeout=120, return_exceptions=True
    )
    assert_same_error_everywhere(
        results, ConfigError, "compile={'mode': 'default'} with a model sharded by fully_shard"
    )
