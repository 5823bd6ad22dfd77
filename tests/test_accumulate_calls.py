"""accumulate_calls=k: one micro-batch per call, as scripts' no_sync loops take them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpgraph import ConfigError, TrainStep
from ddpgraph.testing import run_distributed

from . import step_workers
from .step_workers import batches, make_model

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake-graphs"])
def test_accumulate_calls_matches_the_no_sync_loop_on_two_ranks(fake):
    k, steps = 3, 16  # with the fake engine: warm-up, a micro graph and a stepping graph
    results = run_distributed(
        step_workers.accumulate_calls_vs_no_sync, world_size=2, args=(k, steps, fake), timeout=120
    )
    for result in results:
        assert result["ours"] == result["theirs"]  # each call: its micro-batch's loss
        for a, b in zip(result["params"], result["reference"]):
            assert torch.equal(a, b)
        if fake:
            assert result["mode"] == "graphed" and result["replays"] == (steps - 12) * k
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_a_state_dict_between_micro_batches_is_refused():
    model = make_model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        accumulate_calls=2,
    )
    step(*batches(1, 4)[0])
    with pytest.raises(ConfigError, match=r"after 1 of 2 micro-batches"):
        step.state_dict()
    step(*batches(1, 4)[0])
    assert step.state_dict()["steps"] == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulate_calls": 0}, "accumulate_calls=0 must be an integer >= 1"),
        ({"accumulate_calls": 2, "accumulate": 2}, "both accumulate gradients"),
    ],
)
def test_bad_accumulate_calls_are_refused(kwargs, match):
    model = make_model()
    with pytest.raises(ConfigError, match=match):
        TrainStep(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), **kwargs
        )
