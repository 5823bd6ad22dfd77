"""Checkpoints with graphed TrainSteps on one GPU: in-place loads keep graphs valid; exact resume.

A resumed run builds a new TrainStep, so it warms up eagerly again (12 steps) before it captures,
where the uninterrupted run was already replaying: equal hashes rest on the graphed step being
bitwise equal to the eager one (REFERENCES.md) and on deterministic kernels (the demo turns
cuDNN's deterministic mode on).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpgraph import TrainStep, load_checkpoint, save_checkpoint
from ddpgraph.demo.models import build_model
from ddpgraph.demo.train import TrainConfig, run_worker
from ddpgraph.testing import run_distributed

pytestmark = pytest.mark.timeout(600)

STEPS = 60


def run_job(out: Path, model: str, **options: object) -> dict:
    config = TrainConfig(model=model, steps=STEPS, out=str(out), **options)  # type: ignore[arg-type]
    run_distributed(run_worker, 1, init=False, args=(config,), timeout=300)
    return json.loads((out / "run.json").read_text())


@pytest.mark.parametrize("model", ["mlp", "resnet", "transformer"])
@pytest.mark.parametrize("stop", [5, 30])  # before the first capture, and while replaying
def test_graphed_run_resumed_ends_bitwise_identical(tmp_path, model, stop):
    whole = run_job(tmp_path / "whole", model)
    assert whole["ranks"][0]["mode"] == "graphed", whole["ranks"][0]["fallbacks"]
    run_job(tmp_path / "parts", model, stop_after=stop)
    resumed = run_job(tmp_path / "parts", model, resume=True)
    rank = resumed["ranks"][0]
    assert rank["resumed_from"] == stop and rank["mode"] == "graphed", rank["fallbacks"]
    assert resumed["params_sha256"] == whole["params_sha256"]


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(5)
    return [
        (torch.randn(32, 16, 32, device="cuda", generator=gen),
         torch.randint(10, (32,), device="cuda", generator=gen))
        for _ in range(n)
    ]  # fmt: skip


def _job() -> tuple[nn.Module, TrainStep, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = build_model("transformer").cuda()  # dropout: the CUDA RNG state matters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
    step = TrainStep(model, optimizer, nn.CrossEntropyLoss(), scheduler=scheduler)
    return model, step, scheduler


def _pointers(model: nn.Module, step: TrainStep) -> list[int]:
    state = [v.data_ptr() for s in step.optimizer.state.values() for v in s.values()]
    lrs = [g["lr"].data_ptr() for g in step.optimizer.param_groups]
    return [p.data_ptr() for p in model.parameters()] + state + lrs


def test_loading_into_a_captured_step_keeps_its_graph(rt, tmp_path):
    batches = _batches(40)
    model, step, scheduler = _job()
    for x, y in batches[:20]:  # warm-up, capture, replays
        step(x, y)
        scheduler.step()
    assert step.mode == "graphed"
    save_checkpoint(tmp_path, step=20, train_step=step)
    for x, y in batches[20:]:
        step(x, y)
        scheduler.step()
    reference = [t.clone() for t in model.state_dict().values()]

    pointers = _pointers(model, step)
    assert load_checkpoint(tmp_path, train_step=step)["step"] == 20
    assert _pointers(model, step) == pointers  # the graph's tensors, refilled in place
    for x, y in batches[20:]:
        step(x, y)
        scheduler.step()
    report = step.report()
    # one capture, and every step after it replayed: loading needed no re-capture
    assert len(report.captures) == 1 and report.eager_steps == report.warmup_steps
    assert all(torch.equal(a, b) for a, b in zip(reference, model.state_dict().values()))
