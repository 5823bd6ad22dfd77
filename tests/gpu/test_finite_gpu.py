"""check_finite on the GPU: the error within two calls of a NaN in a replay, naming its step;
no change to what a graphed step computes. Its cost per replayed step is measured by
benchmarks/finite_check_cost.py (timings belong to benchmarks, not to tests)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpgraph import NonFiniteError, TrainStep
from ddpgraph.demo.models import build_model

pytestmark = pytest.mark.timeout(600)


def _step(check: bool, clip: float | None = None) -> TrainStep:
    torch.manual_seed(0)
    model = build_model("mlp").cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return TrainStep(model, opt, nn.CrossEntropyLoss(), check_finite=check, clip_grad_norm=clip)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    return [
        (torch.randn(32, 64, device="cuda", generator=gen),
         torch.randint(10, (32,), device="cuda", generator=gen))
        for _ in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize("clip", [None, 1.0], ids=["gradients", "clip-norm"])
def test_a_nan_in_a_replay_raises_within_two_calls_naming_its_step(rt, clip):
    """Both probes: every gradient (no norm measured), and the clipping's total norm."""
    step = _step(True, clip)
    data = _batches(60)
    bad = 40  # long after capture
    raised_at = None
    for call, (x, y) in enumerate(data, start=1):
        if call == bad:
            x = x.clone()
            x[0, 0] = float("nan")
        try:
            step(x, y)
        except NonFiniteError as exc:
            assert exc.step == bad and f"at step {bad}," in str(exc)
            raised_at = call
            break
        if call >= bad:
            torch.cuda.synchronize()  # the next call finds the flag's copy done
    assert step.report().replays > 0
    assert raised_at is not None and bad <= raised_at <= bad + 2, raised_at


@pytest.mark.parametrize("clip", [None, 1.0], ids=["gradients", "clip-norm"])
def test_the_check_changes_no_bit_of_a_graphed_run(rt, clip):
    """The probe writes every gradient (or the norm) back unchanged: no bit moves."""
    runs = []
    for check in (False, True):
        step = _step(check, clip)
        losses = [step(x, y).clone() for x, y in _batches(30)]
        assert step.mode == "graphed"
        runs.append((torch.stack(losses), [p.detach().clone() for p in step.model.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
