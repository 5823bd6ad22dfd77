"""The fp16 loops whose skipped updates tests/test_integrations_fp16_skips.py (on the CPU, the
Accelerator given torch's CPU GradScaler) and tests/gpu check against each framework's own."""

from __future__ import annotations

from typing import Any

import pytest
import torch

# (TrainingArguments.optim, a loss that overflows fp16's first loss scales)
TRAINER_CASES = [
    pytest.param("adamw_torch_fused", True, id="fused-overflowing"),
    pytest.param("adamw_torch_fused", False, id="fused-normal"),
    pytest.param("adamw_torch", True, id="foreach-overflowing"),
]


def accelerate_fp16_loop(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Any,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    graphed: bool,
    **step_options: Any,
) -> tuple[dict[str, list], Any]:
    """Accelerate's documented loop (everything prepared, ``accelerator.backward``,
    ``optimizer.step()``, a prepared scheduler's ``step()``), or the same loop with
    ``from_accelerator``; per batch the loss, ``accelerator.optimizer_step_was_skipped``
    and the LR after the scheduler's step; and the TrainStep (None for Accelerate's own)."""
    from ddpgraph.integrations.accelerate import from_accelerator

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    step = None
    if graphed:
        scheduler = accelerator.prepare(scheduler)
        step = from_accelerator(accelerator, model, optimizer, loss_fn, **step_options)
    else:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    run: dict[str, list] = {"losses": [], "skipped": [], "lrs": []}
    for x, y in batches:
        if step is not None:
            loss = step(x, y)
        else:
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
        run["losses"].append(float(loss.detach()))
        run["skipped"].append(accelerator.optimizer_step_was_skipped)
        run["lrs"].append(scheduler.get_last_lr()[0])
    return run, step
