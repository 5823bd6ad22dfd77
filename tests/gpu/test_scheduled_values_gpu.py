"""OneCycleLR(cycle_momentum=True) rewrites AdamW's betas before every step (issue 52 item 5):
graphed on CUDA, the betas become device tensors at the first change (in warm-up here, so
before the first capture), so no step re-captures for them and every later step replays, and trains as the eager loop with the same device LR and
betas does. Written on a CPU machine; not run there (needs CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpgraph import TrainStep

STEPS = 40


def _run(graphed: bool, fused: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=STEPS + 1)
    step = TrainStep(model, opt, nn.MSELoss(), graph="auto" if graphed else "never")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(16, 32, device="cuda", generator=gen)
        step(x, torch.randn(16, 8, device="cuda", generator=gen))
        sched.step()
    torch.cuda.synchronize()
    return step, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_onecycle_betas_recapture_once_and_replay_after(rt, fused):
    step, ours = _run(True, fused)
    report = step.report()
    assert report.recaptures == [], report.recaptures
    assert (
        "betas on device (a scheduler changes them between steps)"
        in step._policy.graphs.plan.changes
    )
    assert report.replays >= STEPS - 15, str(report)
    _, eager = _run(False, fused)
    for a, b in zip(ours, eager):  # float32 betas in the graph, the script's floats eagerly
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
