"""``GraphStrategy``: an unchanged LightningModule (automatic optimization, ``self.log`` in
``training_step``, a warm-up schedule stepped per step) trains bit for bit as under Lightning's
own ``DDPStrategy`` (2 gloo ranks, the real capture policy on the CPU), with
``accumulate_grad_batches`` and ``gradient_clip_val`` set on the Trainer: the same logged loss,
learning rate, ``global_step`` and parameters."""

from __future__ import annotations

import pytest
import torch

from ddpgraph import ConfigError
from ddpgraph.testing import run_distributed

from . import integration_workers as workers

pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytestmark = pytest.mark.timeout(600)

RUN_S = 540  # one fit of 24 steps on 2 ranks, on a loaded 2-core machine


def test_graph_strategy_trains_bit_for_bit_as_lightnings_ddp():
    theirs = run_distributed(workers.run_lightning, 2, args=(False,), timeout=RUN_S)
    ours = run_distributed(workers.run_lightning, 2, args=(True,), timeout=RUN_S)
    for rank in range(2):
        for key in ("losses", "lrs", "steps"):
            assert ours[rank][key] == theirs[rank][key], key
        for name, value in theirs[rank]["params"].items():
            assert torch.equal(ours[rank]["params"][name], value), name
    assert theirs[0]["steps"][-1] == 24  # max_steps, counted by Lightning
    report = ours[0]["report"]
    assert "mode=graphed" in report and "replays=24" in report, report


def test_manual_optimization_is_refused_naming_the_fix():
    errors = run_distributed(workers.run_lightning_manual, 1, timeout=RUN_S, return_exceptions=True)
    assert isinstance(errors[0], ConfigError), errors
    assert "automatic_optimization=False call a ddpgraph.TrainStep" in str(errors[0])
