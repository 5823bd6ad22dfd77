"""torchtitan's own training against the same through TrainStep (issue 48 item 2), 2 gloo ranks.

torchtitan's llama3 debugmodel, its parallelize_llama (FSDP2 with bf16 parameters, selective
activation checkpointing every 2nd layer, as its debug_model.toml), its loss, AdamW and LR
schedule (5 warm-up steps, then linear decay), driven by its own ``Trainer.train_step`` (what the
CPU changes: tests/titan_workers.py): 50 steps of losses and grad norms as torchtitan logs them,
and every parameter, bit for bit; a checkpoint saved by torchtitan's CheckpointManager at step
25 and resumed by torchtitan, by TrainStep from torchtitan's checkpoint, and by TrainStep from
its own. Needs the pinned torchtitan: ``pip install -e '.[titan]'`` (torchtitan 0.2.2; the
versions that work: docs/guides/fsdp2.md).
"""

from __future__ import annotations

import pytest
import torch

from ddpgraph.testing import run_distributed

pytest.importorskip("torchtitan.train", reason="needs the titan extra: pip install -e '.[titan]'")

from . import titan_workers as w

pytestmark = pytest.mark.timeout(1200)
HALF = w.STEPS // 2


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """torchtitan's side and TrainStep's (one launch of 2 ranks each)."""
    root = tmp_path_factory.mktemp("titan")
    titan = run_distributed(w.titan_side, 2, args=(str(root / "titan"),), timeout=1000)
    args = (str(root / "titan"), str(root / "mine"))
    mine = run_distributed(w.train_step_side, 2, args=args, timeout=1000)
    return titan, mine


def test_train_step_is_bitwise_torchtitans_own_train_step_over_50_steps(runs):
    titan, mine = runs
    for rank in range(2):
        ours, theirs = mine[rank]["full"], titan[rank]["full"]
        assert ours["phase"] == "graphed", ours["fallbacks"]
        assert ours["replays"] == w.STEPS - 3  # every step after the warm-up replays
        assert len(theirs["logged"]) == w.STEPS
        # (global average loss, grad norm) per step, as torchtitan's train_step logs them
        assert ours["logged"] == theirs["logged"]
        assert ours["lr"] == theirs["lr"]
        _same(ours["params"], theirs["params"])
    losses = [loss for loss, _ in titan[0]["full"]["logged"]]
    assert losses[-1] < losses[0]


def test_a_checkpoint_resumes_bitwise_under_torchtitan_and_under_train_step(runs):
    titan, mine = runs
    for rank in range(2):
        expected = titan[rank]["full"]
        for name, run in [
            ("torchtitan resumed", titan[rank]["resumed"]),
            ("TrainStep from torchtitan's checkpoint", mine[rank]["from_titan"]),
            ("TrainStep from its own", mine[rank]["resumed"]),
        ]:
            assert run["logged"] == expected["logged"][HALF:], name
            assert run["lr"] == expected["lr"], name
            _same(run["params"], expected["params"])
