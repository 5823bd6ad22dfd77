"""DeviceData and steps_per_replay on one GPU: K steps per replay train the bits of K replays of
one step, and of the eager step; a run stopped at a K boundary resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpgraph import DeviceData, TrainStep
from ddpgraph.demo.data import SAMPLE_SHAPES, synthetic_patterns
from ddpgraph.demo.models import build_model
from ddpgraph.demo.train import TrainConfig, run_worker
from ddpgraph.testing import run_distributed

pytestmark = pytest.mark.timeout(600)

STEPS = 48


def _run(model_name: str, k: int, *, graph: str = "auto") -> dict:
    torch.manual_seed(0)
    model = build_model(model_name).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    data_set = synthetic_patterns(SAMPLE_SHAPES[model_name], num_samples=1024, seed=0)
    data = DeviceData(*data_set.tensors, batch_size=64, seed=0)  # 16 batches an epoch
    step = TrainStep(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        scheduler=scheduler,
        steps_per_replay=k,
        graph=graph,
        channels_last=model_name == "resnet",
    )
    losses = torch.cat([step(data).clone() for _ in range(STEPS // k)])
    return {
        "losses": losses.cpu(),
        "params": [p.detach().cpu() for p in model.parameters()],
        "report": step.report(),
    }


@pytest.mark.parametrize("model", ["mlp", "resnet", "transformer"])
def test_k_steps_per_replay_equal_one_step_replays_and_the_eager_step_bitwise(rt, model):
    eight, one = _run(model, 8), _run(model, 1)
    eager = _run(model, 8, graph="never")
    assert eight["report"].mode == one["report"].mode == "graphed", str(eight["report"])
    assert eight["report"].replays == (STEPS - 16) // 8, str(eight["report"])
    for other in (one, eager):
        assert torch.equal(eight["losses"], other["losses"])
        for a, b in zip(eight["params"], other["params"]):
            assert torch.equal(a, b)


def _job(out: Path, **options: object) -> dict:
    config = TrainConfig(model="mlp", steps=64, out=str(out), **options)  # type: ignore[arg-type]
    run_distributed(run_worker, 1, init=False, args=(config,), timeout=300)
    return json.loads((out / "run.json").read_text())


def test_the_main_job_on_device_data_resumes_at_a_k_boundary_exactly(tmp_path):
    whole = _job(tmp_path / "whole")
    rank = whole["ranks"][0]
    assert (rank["data"], rank["steps_per_replay"], rank["mode"]) == ("device", 2, "graphed")
    _job(tmp_path / "parts", stop_after=32)
    resumed = _job(tmp_path / "parts", resume=True)
    assert resumed["ranks"][0]["resumed_from"] == 32
    assert resumed["ranks"][0]["mode"] == "graphed", resumed["ranks"][0]["fallbacks"]
    assert resumed["params_sha256"] == whole["params_sha256"]
    loader = _job(tmp_path / "loader", data="loader")
    assert loader["ranks"][0]["data"] == "loader" and loader["ranks"][0]["mode"] == "graphed"
