"""Windows of any length (issue 52 item 3): a short last window divides its loss as the script
does, and a DDP script's sync coming back on (the call outside ``no_sync()``) ends a window, as
FSDP2's does. Workers: tests/window_workers.py; 2 gloo ranks."""

from __future__ import annotations

import pytest

from ddpgraph.testing import run_distributed

from . import window_workers as workers
from .test_recipes import _assert_ports_equal

pytestmark = pytest.mark.timeout(600)
RUN_S = 500  # a launch of 2 ranks on a loaded 2-core machine


def test_timms_short_last_window_divides_by_its_length_as_timm_does():
    """10 batches, ``--grad-accum-steps 3``: windows 3, 3, 3, 1 per epoch; the port keeps timm's
    ``no_sync`` and passes ``window=accum_steps``: losses, every update and the end state equal
    to timm's loop bit for bit, eagerly and replaying."""
    results = run_distributed(workers.timm_rows, world_size=2, timeout=RUN_S)
    _assert_ports_equal(results, ("losses", "updates", "params", "optimizer"))


def test_a_short_window_ended_by_the_scripts_sync_without_its_divisor_is_refused():
    """Without ``window=`` the step cannot tell timm's divisor (the window's length) from
    Accelerate's (k): refused on every rank at epoch 0's short window, naming both fixes."""
    results = run_distributed(workers.timm_without_window, world_size=2, timeout=RUN_S)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error.startswith(
        "ConfigError: the script turned the gradient sync back on at "
        "micro-batch 1 of accumulate_calls=3"
    ), error
    assert "window=accum_steps" in error and "last=True" in error, error


def _step(k: int):
    import torch
    from torch import nn

    from ddpgraph import TrainStep

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), accumulate_calls=k
    )


@pytest.mark.parametrize(
    ("calls", "says"),
    [
        ([{"window": 0}], "window=0): the window's number of micro-batches must be an int from 1"),
        ([{"window": 4}], "window=4): the window's number of micro-batches must be an int from 1"),
        ([{"window": 2.0}], "window=2.0)"),
        ([{}, {"window": 2}], "window=2) on micro-batch 2 of a window that began as 3"),
        ([{"window": 2}, {}], "step() without window= inside a window the script said has 2"),
        ([{"window": 3}, {"window": 3, "last": True}], "last=True on micro-batch 2 of a window"),
    ],
)
def test_a_window_length_the_step_cannot_follow_is_refused(calls, says):
    import torch

    from ddpgraph import ConfigError

    step = _step(3)
    x, y = torch.ones(2, 4), torch.zeros(2, 2)
    with pytest.raises(ConfigError) as caught:
        for kwargs in calls:
            step(x, y, **kwargs)
    assert says in str(caught.value)


def test_a_short_window_divides_by_its_length_on_one_rank():
    """``window=2`` under ``accumulate_calls=3``: each micro-batch's loss divided by 2, as a
    plain loop's ``loss / 2``; then a full window divides by 3 again."""
    import torch
    from torch import nn

    step = _step(3)
    torch.manual_seed(0)
    reference = nn.Linear(4, 2)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 4, generator=gen), torch.randn(2, 2, generator=gen)) for _ in range(5)]
    for i, (x, y) in enumerate(data):
        n = 2 if i < 2 else 3
        step(x, y, window=n)
        (nn.functional.mse_loss(reference(x), y) / n).backward()
        if i in (1, 4):
            opt.step()
            opt.zero_grad()
    for ours, theirs in zip(step.model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)
