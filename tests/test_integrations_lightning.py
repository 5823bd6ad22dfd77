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


@pytest.fixture(scope="module")
def lightnings(tmp_path_factory):
    """Lightning's own DDP run, a checkpoint at each epoch's end (every 8 steps)."""
    out = tmp_path_factory.mktemp("lightning")
    return out, run_distributed(workers.run_lightning, 2, args=(False, 24, str(out)), timeout=RUN_S)


def _same(ours, theirs, keys=("losses", "lrs", "steps")):
    for key in keys:
        assert ours[key] == theirs[key], key
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name


def test_graph_strategy_trains_bit_for_bit_as_lightnings_ddp(lightnings):
    _, theirs = lightnings
    ours = run_distributed(workers.run_lightning, 2, args=(True,), timeout=RUN_S)
    for rank in range(2):
        _same(ours[rank], theirs[rank])
    assert theirs[0]["steps"][-1] == 24  # max_steps, counted by Lightning
    report = ours[0]["report"]
    assert "mode=graphed" in report and "replays=24" in report, report


def test_resume_from_lightnings_own_checkpoint_is_exact(lightnings):
    """Resumed from the checkpoint Lightning's DDP run saved at step 8, GraphStrategy ends as
    Lightning's own resume does (GPT-2's dropout draws from the RNG of the resumed process)."""
    out, _ = lightnings
    resume = str(out / "step=8.ckpt")
    runs = [
        run_distributed(workers.run_lightning, 2, args=(g, 24, None, resume), timeout=RUN_S)
        for g in (False, True)
    ]
    theirs, ours = runs
    for rank in range(2):
        _same(ours[rank], theirs[rank])
    assert theirs[0]["steps"][0] == 8 and theirs[0]["steps"][-1] == 24
    assert "replays=8" in ours[0]["report"], ours[0]["report"]


def test_manual_optimization_is_refused_naming_the_fix():
    errors = run_distributed(workers.run_lightning_manual, 1, timeout=RUN_S, return_exceptions=True)
    assert isinstance(errors[0], ConfigError), errors
    assert "automatic_optimization=False call a ddpgraph.TrainStep" in str(errors[0])


def test_what_the_guide_lists_as_not_working_raises_naming_it():
    from . import lightning_matrix_workers as matrix

    said = run_distributed(matrix.refusals, 1, timeout=RUN_S)[0]
    assert "one optimizer" in said["two_optimizers"] or "manual" in said["two_optimizers"], said
    assert "overrides on_before_optimizer_step" in said["module_gradient_hook"], said
    assert "HookCallback overrides on_after_backward" in said["callback_gradient_hook"], said
    assert "training_step returned None" in said["training_step_none"], said
    assert "Keep accumulate_grad_batches fixed" in said["accumulation_scheduler"], said
