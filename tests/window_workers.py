"""Workers of tests/test_recipe_windows.py (run by ``run_distributed`` on 2 gloo ranks): windows
of any length, each micro-batch dividing its loss as the script does.

timm's ``train.py`` (pinned in ../shared/upstream/timm_train/train.py, ``train_one_epoch``):
``need_update = last_batch or (batch_idx + 1) % accum_steps == 0``; from the epoch's last
window on, ``accum_steps = last_accum_steps`` (``len(loader) % accum_steps``), so a short last
window divides its loss by its own length; micro-batches that do not update run under
``with model.no_sync():``, the updating one outside it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ddpgraph import TrainStep

from .framework_workers import graph_safe_optimizer, outcome, step_options, tensors_of
from .recipe_workers import bn_net, rank_batches

BATCHES, ACCUM, EPOCHS = 10, 3, 5  # windows of 3, 3, 3 and 1 in each epoch


def timm_epochs(variant: str, window: bool = True) -> dict[str, Any]:
    """timm's ``train_one_epoch`` accumulation, as timm runs it (``framework``: DDP, ``no_sync``
    and ``loss /= accum_steps``) and as its port does (``with step.model.no_sync():`` kept,
    ``window=accum_steps`` unless ``window`` is False); SGD with momentum, BatchNorm."""
    model = bn_net()
    # written graph-safe (fused, the LR in a tensor): timm's run and both ports step one optimizer
    optimizer = graph_safe_optimizer(torch.optim.SGD, model.parameters(), 0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    if variant == "framework":
        ddp: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        step = TrainStep(model, optimizer, loss_fn, accumulate_calls=ACCUM, **step_options(variant))
        ddp = step.model
    data = rank_batches(BATCHES * EPOCHS)
    losses: list[float] = []
    updates: list[torch.Tensor] = []
    for epoch in range(EPOCHS):
        loader = data[epoch * BATCHES : (epoch + 1) * BATCHES]
        accum_steps = ACCUM
        last_accum_steps = len(loader) % accum_steps
        last_batch_idx = len(loader) - 1
        last_batch_idx_to_accum = len(loader) - last_accum_steps
        optimizer.zero_grad()
        for batch_idx, (x, y) in enumerate(loader):
            last_batch = batch_idx == last_batch_idx
            need_update = last_batch or (batch_idx + 1) % accum_steps == 0
            if batch_idx >= last_batch_idx_to_accum:
                accum_steps = last_accum_steps
            with contextlib.nullcontext() if need_update else ddp.no_sync():
                if variant == "framework":
                    loss = loss_fn(ddp(x), y)
                    losses.append(float(loss.detach()))
                    if accum_steps > 1:
                        loss /= accum_steps
                    loss.backward()
                    if need_update:
                        optimizer.step()
                else:
                    n = accum_steps if window else None
                    losses.append(float(step(x, y, window=n)))
            if need_update:
                if variant == "framework":
                    optimizer.zero_grad()
                updates += tensors_of(model.state_dict())
    return {
        "losses": losses,
        "updates": updates,
        "params": tensors_of(model.state_dict()),
        "optimizer": tensors_of(optimizer.state_dict()["state"]),
        "report": None if variant == "framework" else str(step.report()),
    }


def timm_rows() -> dict[str, dict[str, Any]]:
    return {v: outcome(timm_epochs, v) for v in ("framework", "eager", "graphs")}


def timm_without_window() -> dict[str, Any]:
    """The port without ``window=``: refused at the first short window, before it runs."""
    return outcome(timm_epochs, "graphs", False)
