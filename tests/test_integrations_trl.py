"""TRL's SFTTrainer through GraphTrainer (``graphed(SFTTrainer)``, or a class listing both in
either order) trains bit for bit as the plain SFTTrainer on 2 gloo ranks, eagerly and with the
CPU stand-in engine capturing: the same losses, grad norms, learning rates, and SFT's own metrics
(entropy, mean token accuracy, tokens seen), which its ``compute_loss`` computes with
``gather_for_metrics`` and ``.item()`` inside the step; DPOTrainer the same way. Tested with
trl 1.16."""

from __future__ import annotations

import pytest

from ddpgraph.testing import run_distributed

from . import trainer_workers
from . import trl_workers as workers

pytest.importorskip("trl")

RUN_S = 1500  # five SFT runs on 2 ranks, on a loaded 2-core machine
# pad to multiples of 8 (3 shapes for 3-20 words plus eos) and capture each shape once
BUCKETS = {"pad_to_multiple_of": 8}

CASES = {
    "graphed(SFTTrainer)": {**BUCKETS},
    # pad-to-longest batches: GraphTrainer pads to multiples of 64 itself (the plain run is told)
    "variable lengths bucketed by default": {
        "plain_args": {"pad_to_multiple_of": 64},
        "modes": ("plain", "graphed"),
    },
    "class T(SFTTrainer, GraphTrainer)": {
        **BUCKETS,
        "order": "last",
        "modes": ("plain", "graphed"),
    },
    "class T(GraphTrainer, SFTTrainer)": {
        **BUCKETS,
        "order": "first",
        "modes": ("plain", "graphed"),
    },
}


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    return run_distributed(workers.run_sft_modes, 2, args=(str(out), CASES), timeout=RUN_S)


@pytest.mark.timeout(RUN_S + 60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_sft_trainer_through_graph_trainer_is_bit_for_bit_the_plain_sft_run(sft_runs, case):
    for rank in range(2):
        runs = sft_runs[rank][case]
        for mode in set(runs) - {"plain"}:
            assert trainer_workers.differences(runs["plain"], runs[mode]) == [], (mode, rank)
    graphed = sft_runs[0][case]["graphed"]
    assert "mode=graphed" in graphed["report"] and "replays=0" not in graphed["report"]
    logged = graphed["logs"][0]
    # SFT's own metrics, computed with host syncs inside the step, were logged (and equal)
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(logged), logged


@pytest.mark.timeout(RUN_S + 60)
def test_dpo_trainer_through_graph_trainer_is_bit_for_bit_the_plain_dpo_run(tmp_path):
    runs = run_distributed(workers.run_dpo_modes, 2, args=(str(tmp_path),), timeout=RUN_S)
    for rank in range(2):
        assert trainer_workers.differences(runs[rank]["plain"], runs[rank]["graphed"]) == []
    report = runs[0]["graphed"]["report"]
    assert "mode=graphed" in report and "replays=0" not in report, report
    # DPO's own metrics (rewards, log-probabilities), gathered inside the step, were logged
    assert {"rewards/margins", "logps/chosen"} <= set(runs[0]["graphed"]["logs"][0])


@pytest.mark.timeout(RUN_S + 60)
def test_sft_on_trls_cuda_branch_is_refused_at_capture_naming_the_boolean_mask_line(tmp_path):
    """On the H100 (5713d53) graphed(SFTTrainer) replayed 0 of 200 steps: the capture failed at
    TRL's ``hidden_states[mask] if compact`` (trl/trainer/utils.py), taken on CUDA only. The CPU
    engine refuses it the same way once the test takes that branch."""
    result = run_distributed(
        workers.run_sft_on_the_cuda_branch, 1, args=(str(tmp_path),), timeout=RUN_S
    )[0]
    report = result["report"]
    assert "replays=0" in report and "mode=eager" in report, report
    assert "operation not permitted when stream is capturing" in report
    assert "trl/trainer/utils.py" in report and "hidden_states[mask] if compact" in report
    assert "data-dependent shape" in report
