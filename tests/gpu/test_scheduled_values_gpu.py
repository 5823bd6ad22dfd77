"""OneCycleLR(cycle_momentum=True) rewrites AdamW's betas before every step (issue 52 item 5).
Every Adam path takes betas as numbers inside its step (the H100 refused a capture with tensor
betas at adam.py's ``addcmul_(value=1 - beta2)``, ``_foreach_lerp_`` and ``_fused_adamw_``):
the first change re-captures, said once with the fix; from the second in a row the step runs
eagerly (a capture per step costs more than the eager step), said once; the run trains as the
eager loop does."""

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


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_onecycle_betas_of_adamw_recapture_once_then_run_eagerly_and_say_so_once(rt, kernel):
    with pytest.warns(UserWarning, match="cycle_momentum=False") as caught:
        step, ours = _run(True, kernel)
    report = step.report()
    assert report.fallbacks == [], report.fallbacks
    # warm-up 12, captured at 13, re-captured at the first change (14), eager from the second
    assert len(report.captures) == 2 and report.eager_steps == STEPS - 2, str(report)
    assert report.recaptures[-1].startswith("held eager"), report.recaptures
    assert sum("'betas' changed from" in str(w.message) for w in caught) == 1
    assert sum(str(w.message).startswith("TrainStep runs eagerly") for w in caught) == 1
    _, eager = _run(False, kernel)
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
