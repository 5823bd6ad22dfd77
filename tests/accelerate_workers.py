"""Accelerate's feature matrix: upstream examples (tests/accelerate_corpus.py) and a few loops
of Accelerate's documented habits, each run as Accelerate's own DDP loop and as the guide's
port (eagerly and capturing with CpuGraphs), on 2 gloo ranks. accelerate 1.16 (Apache-2.0)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import accelerate_corpus as corpus
from .framework_workers import (
    classes,
    graph_safe_optimizer,
    mlp,
    run_rows,
    step_options,
    tensors_of,
)

BASE = {"lr": 1e-3, "num_epochs": 2, "seed": 42, "batch_size": 16}
SMALL = 400  # rows: 13 batches a rank (a tail with k=2 or 3), where the full size adds nothing

ROWS: dict[str, dict[str, Any]] = {
    "nlp_example": {"example": "nlp_example", "config": {"rows": SMALL}},
    "gradient_accumulation_mrpc_size": {
        "example": "gradient_accumulation",
        # one epoch: its tail (index 114) steps the optimizer, the final state shows it
        "config": {"gradient_accumulation_steps": 2, "num_epochs": 1},
    },
    "gradient_accumulation_k3": {
        "example": "gradient_accumulation",
        # 25 batches a rank (a tail of 1): past the warm-up of 12 windows of 3 calls
        "config": {"gradient_accumulation_steps": 3, "rows": 800},
    },
    "bf16": {
        "example": "gradient_accumulation",
        "config": {"gradient_accumulation_steps": 2, "rows": SMALL, "mixed_precision": "bf16"},
    },
    "fp16_on_cpu_trains_fp32_as_accelerate": {
        "example": "nlp_example",
        "config": {"rows": SMALL, "mixed_precision": "fp16"},
    },
    "checkpoint_epoch_resume": {
        "example": "checkpointing",
        "config": {"rows": SMALL, "args": {"checkpointing_steps": "epoch"}},
        "resume": "epoch_0",
    },
    "checkpoint_step_resume_mid_epoch": {
        "example": "checkpointing",
        "config": {"rows": SMALL, "args": {"checkpointing_steps": "9"}},
        "resume": "step_9",
    },
    "port_resumes_accelerates_own_checkpoint": {
        "example": "checkpointing",
        "config": {"rows": SMALL, "args": {"checkpointing_steps": "epoch"}},
        "resume": "epoch_0",
        "from_framework": True,
    },
    "clip_on_sync_gradients": {"loop": {"k": 2, "clip": 0.05}},
}


def accelerate_rows(names: list[str], tmp: str) -> dict[str, dict[str, Any]]:
    """Every named row, each variant; results by ``"row/variant"``."""
    return run_rows(ROWS, names, lambda variant, row, name: _row(variant, row, f"{tmp}/{name}"))


def _row(variant: str, row: dict[str, Any], tmp: str) -> dict[str, Any]:
    ported = variant != "framework"
    options = step_options(variant) if ported else {}
    if "loop" in row:
        return habits_loop(ported, options, **row["loop"])
    example = getattr(corpus, row["example"])
    config = {**BASE, **row["config"]}
    if "resume" not in row:
        return example(config, ported, options)
    # the first run saves (its own checkpoints; Accelerate's for from_framework, which the
    # framework variant, run first, saved), the second resumes from one
    saved = f"{tmp}/framework" if row.get("from_framework") else f"{tmp}/{variant}"
    if not (row.get("from_framework") and ported):
        example({**config, "args": {**config["args"], "output_dir": saved}}, ported, options)
    resumed = {
        **config["args"],
        "output_dir": f"{tmp}/{variant}-resumed",
        "resume_from_checkpoint": f"{saved}/{row['resume']}",
    }
    return example({**config, "args": resumed}, ported, options)


def habits_loop(
    ported: bool, options: dict[str, Any], k: int, clip: float | None = None
) -> dict[str, Any]:
    """Accelerate's documented accumulation loop (accumulate(), backward, clip_grad_norm_ when
    sync_gradients, step, a prepared scheduler): 13 batches a rank."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from ddpgraph.integrations.accelerate import from_accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
    model = mlp()
    # graph-safe as written: the framework's own run steps the optimizer the graphed port steps
    optimizer = graph_safe_optimizer(torch.optim.AdamW, model.parameters(), 0.02)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.95**s)
    loader = DataLoader(classes(104), batch_size=4)
    loss_fn = nn.CrossEntropyLoss()
    if ported:
        loader, scheduler = accelerator.prepare(loader, scheduler)
        step = from_accelerator(
            accelerator, model, optimizer, loss_fn, clip_grad_norm=clip, grad_norm=True, **options
        )
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )
    losses, norms, lrs = [], [], []
    for _ in range(3):
        for x, y in loader:
            with accelerator.accumulate(model):
                if ported:
                    loss = step(x, y)
                    norm = step.grad_norm
                else:
                    loss = loss_fn(model(x), y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        norm = _clip(accelerator, model, clip)
                    optimizer.step()
                    optimizer.zero_grad()
                scheduler.step()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                norms.append(float(norm))
                lrs.append(float(scheduler.get_last_lr()[0]))
    corpus.end_training(accelerator)
    return {
        "losses": losses,
        "norms": norms,
        "lrs": lrs,
        "params": tensors_of(getattr(model, "module", model).state_dict()),
        "optimizer": tensors_of(optimizer.state_dict()["state"]),
        "report": str(step.report()) if ported else None,
    }


def _clip(accelerator: Any, model: nn.Module, clip: float | None) -> torch.Tensor:
    if clip is not None:
        return accelerator.clip_grad_norm_(model.parameters(), clip)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, foreach=True)
