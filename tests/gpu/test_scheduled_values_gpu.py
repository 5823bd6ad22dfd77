"""OneCycleLR(cycle_momentum=True) rewrites AdamW's betas before every step (issue 52 item 5).
With ``foreach=False`` the betas become device tensors at the first change (in warm-up here, so
before the first capture): no step re-captures for them, every later step replays, and it trains
as the eager loop does. The foreach and fused kernels take betas as numbers (a host read the
H100's capture refused at adam.py's ``_foreach_lerp_`` and ``_fused_adamw_``): there each change
re-captures, said once with the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpgraph import TrainStep

STEPS = 40


KERNELS = {
    "single-tensor": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def _run(graphed: bool, kernel: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **KERNELS[kernel])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=STEPS + 1)
    step = TrainStep(model, opt, nn.MSELoss(), graph="auto" if graphed else "never")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(16, 32, device="cuda", generator=gen)
        step(x, torch.randn(16, 8, device="cuda", generator=gen))
        sched.step()
    torch.cuda.synchronize()
    return step, [p.detach().clone() for p in model.parameters()]


def test_onecycle_betas_of_single_tensor_adamw_are_device_tensors_and_replay(rt):
    step, ours = _run(True, "single-tensor")
    report = step.report()
    assert report.recaptures == [], report.recaptures
    assert (
        "betas on device (a scheduler changes them between steps)"
        in step._policy.graphs.plan.changes
    )
    assert report.replays >= STEPS - 15, str(report)
    _, eager = _run(False, "single-tensor")
    for a, b in zip(ours, eager):  # float32 betas in the graph, the script's floats eagerly
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", ["foreach", "fused"])
def test_onecycle_betas_of_foreach_or_fused_adamw_recapture_and_say_so_once(rt, kernel):
    with pytest.warns(UserWarning, match="foreach=False") as caught:
        step, _ = _run(True, kernel)
    report = step.report()
    assert report.fallbacks == [], report.fallbacks
    assert len(report.recaptures) > 3 and report.replays > 0, str(report)
    assert sum("take betas as numbers" in str(w.message) for w in caught) == 1
