"""TRL's SFTTrainer through GraphTrainer (``graphed(SFTTrainer)``, or a class listing both in
either order) trains bit for bit as the plain SFTTrainer on 2 gloo ranks: eagerly (against the
plain run) and replayed by the CPU graph engine (against the plain run whose optimizer has the
graphed step's arithmetic: ``capturable``, the LR a float32 tensor): the same losses, grad norms,
learning rates, and SFT's own metrics (entropy, mean token accuracy, tokens seen), which its
``compute_loss`` computes with ``gather_for_metrics`` and ``.item()`` inside the step and which
GraphTrainer computes from the step's outputs after each call instead. With TRL's CUDA branch
chosen (the compact ``hidden_states[mask]``), the graphed step takes TRL's fixed-shape path and
equals the plain run on the CUDA branch bit for bit, plain text, ``completion_only_loss`` and
``assistant_only_loss``. DPOTrainer the same way. Tested with trl 1.16."""

from __future__ import annotations

import pytest

from ddpgraph.testing import run_distributed

from . import trainer_workers
from . import trl_workers as workers

pytest.importorskip("trl")

RUN_S = 2400  # ten short SFT runs on 2 ranks, on a loaded 2-core machine
# pad to multiples of 8 (3 shapes for 3-20 words plus eos) and capture each shape once
BUCKETS = {"pad_to_multiple_of": 8}

CASES = {
    "graphed(SFTTrainer)": {**BUCKETS},
    # pad-to-longest batches: GraphTrainer pads to multiples of 64 itself (the plain run is told)
    "variable lengths bucketed by default": {
        "plain_args": {"pad_to_multiple_of": 64},
        "modes": ("safe", "graphed"),
    },
    "class T(SFTTrainer, GraphTrainer)": {
        **BUCKETS,
        "order": "last",
        "modes": ("safe", "graphed"),
    },
    "class T(GraphTrainer, SFTTrainer)": {
        **BUCKETS,
        "order": "first",
        "modes": ("safe", "graphed"),
    },
}
# the plain run each mode equals: GraphTrainer's eager run the plain Trainer's, a graphed one the
# plain Trainer whose optimizer has the graph's arithmetic
REFERENCE = {"eager": "plain", "graphed": "safe"}

# TRL's CUDA branch chosen; one shape (padded to max_length), one micro-batch per step
CUDA_BRANCH = {"pad_to_multiple_of": 24, "gradient_accumulation_steps": 1, "max_steps": 16}
CUDA_BRANCH_CASES = {
    "text": {**CUDA_BRANCH},
    "completion_only_loss": {
        **CUDA_BRANCH, "data": "prompt-completion", "completion_only_loss": True,
    },
    "assistant_only_loss": {
        **CUDA_BRANCH, "data": "conversational", "assistant_only_loss": True,
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    return run_distributed(workers.run_sft_modes, 2, args=(str(out), CASES), timeout=RUN_S)


@pytest.mark.timeout(RUN_S + 60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_sft_trainer_through_graph_trainer_is_bit_for_bit_the_plain_sft_run(sft_runs, case):
    for rank in range(2):
        runs = sft_runs[rank][case]
        for mode in set(runs) & set(REFERENCE):
            reference = runs[REFERENCE[mode]]
            assert trainer_workers.differences(reference, runs[mode]) == [], (mode, rank)
    graphed = sft_runs[0][case]["graphed"]
    assert "mode=graphed" in graphed["report"] and "replays=0" not in graphed["report"]
    logged = graphed["logs"][0]
    # SFT's own metrics, computed with host syncs inside the step, were logged (and equal)
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(logged), logged


@pytest.mark.timeout(RUN_S + 60)
def test_dpo_trainer_through_graph_trainer_falls_back_at_its_host_reads_as_cuda_would(tmp_path):
    """DPOTrainer.compute_loss reads values on the host (``if total_tokens > 0``, ``.item()`` of
    its rewards; trl/trainer/dpo_trainer.py): a CUDA capture refuses them, and so does the CPU
    engine (the old stand-in re-ran the Python and replayed). The step falls back to eager at
    the capture, names the line, and DPO's metrics are still logged. Graphing DPO needs a
    metrics adapter like SFT's (not built)."""
    runs = run_distributed(workers.run_dpo_modes, 2, args=(str(tmp_path),), timeout=RUN_S)
    report = runs[0]["graphed"]["report"]
    assert "mode=eager" in report and "replays=0" in report, report
    assert "operation not permitted when stream is capturing" in report, report
    assert "dpo_trainer.py" in report, report
    assert {"rewards/margins", "logps/chosen"} <= set(runs[0]["graphed"]["logs"][0])


@pytest.fixture(scope="module")
def cuda_branch_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft-cuda-branch")
    return run_distributed(
        workers.run_sft_cases_on_the_cuda_branch, 2, args=(str(out), CUDA_BRANCH_CASES),
        timeout=RUN_S,
    )  # fmt: skip


def _counts(report: str) -> dict[str, int]:
    """steps, eager, replays and warm-up from a report's first line."""
    words = dict(w.split("=", 1) for w in report.splitlines()[0].split() if "=" in w)
    return {k: int(words[k]) for k in ("steps", "eager", "replays", "warm-up")}


@pytest.mark.timeout(RUN_S + 60)
@pytest.mark.parametrize("case", sorted(CUDA_BRANCH_CASES))
def test_sft_on_trls_cuda_branch_replays_every_step_after_warm_up_equal_to_the_plain_run(
    cuda_branch_runs, case
):
    """On the H100 (5713d53) graphed(SFTTrainer) replayed 0 of 200 steps: the capture failed at
    TRL's ``hidden_states[mask] if compact`` (trl/trainer/utils.py), taken on CUDA only. With
    that branch chosen here, the plain run takes it (it asks TRL's chooser), the graphed step
    takes TRL's fixed-shape path (it never asks), replays every step after the warm-up, and
    equals the plain run bit for bit: losses, grad norms, parameters, optimizer state, and the
    metrics TRL logs (entropy, mean_token_accuracy, num_tokens)."""
    for rank in range(2):
        runs = cuda_branch_runs[rank][case]
        assert runs["safe"]["compact_asked"] > 0, "the plain run did not take the CUDA branch"
        assert runs["graphed"]["compact_asked"] == 0
        assert trainer_workers.differences(runs["safe"], runs["graphed"]) == [], rank
    graphed = cuda_branch_runs[0][case]["graphed"]
    counts = _counts(graphed["report"])
    assert counts["steps"] == CUDA_BRANCH["max_steps"], graphed["report"]
    # every call after the warm-up replayed (the capture's call included): no fallback, no
    # re-capture; on a run of 20 warm-ups' length that is 95 % of its steps
    assert (
        counts["eager"] == counts["warm-up"]
        and counts["replays"] == counts["steps"] - counts["eager"]
    )
    assert counts["replays"] > 0 and "fallback" not in graphed["report"], graphed["report"]
    for logged in graphed["logs"][:-1]:
        assert {"loss", "entropy", "mean_token_accuracy", "num_tokens"} <= set(logged), logged


@pytest.mark.timeout(RUN_S + 60)
def test_a_loss_that_masks_by_itself_is_refused_at_capture_naming_its_boolean_mask_line(tmp_path):
    """Where the script's own loss selects tokens with a boolean mask (here a
    ``compute_loss_func``), there is no fixed-shape path to choose: the capture is refused with
    CUDA's error, the report names the line and the data-dependent shape, and the run goes on
    eagerly."""
    result = run_distributed(
        workers.run_sft_masking_itself, 1, args=(str(tmp_path),), timeout=RUN_S
    )[0]
    report = result["report"]
    assert "replays=0" in report and "mode=eager" in report, report
    assert "operation not permitted when stream is capturing" in report
    assert "trl_workers.py" in report and "logits[mask]" in report, report
    assert "data-dependent shape" in report
    assert result["global_step"] == 14


def _without_num_tokens(run: dict) -> dict:
    logs = [{k: v for k, v in entry.items() if k != "num_tokens"} for entry in run["logs"]]
    return {**run, "logs": logs}


@pytest.mark.timeout(RUN_S + 60)
def test_packed_sft_replays_one_graph_equal_to_the_plain_packed_run(tmp_path):
    """``packing=True``: every packed batch padded to one capacity (4 x max_length tokens), so
    one graph serves them all (one capture, no re-capture, every step after the warm-up
    replayed), with at most 5 % padding over an epoch. The graphed run equals, bit for bit, the
    plain packed run whose row TRL itself pads to that capacity (``pad_to_multiple_of``): losses,
    grad norms, parameters, optimizer state, entropy and token accuracy; its ``num_tokens``
    counts the real tokens, as the unpadded plain run's. Against the unpadded plain run: the
    first loss is equal to the bit (no update yet); after that the runs differ as TRL's own
    padded and unpadded runs do (sdpa over the longer row rounds differently; measured 3e-5
    relative on the loss after 16 steps on one rank)."""
    runs = run_distributed(workers.run_sft_packed, 2, args=(str(tmp_path),), timeout=RUN_S)
    for rank in range(2):
        plain, padded, graphed = (runs[rank][m] for m in ("plain", "padded", "graphed"))
        assert (
            trainer_workers.differences(_without_num_tokens(padded), _without_num_tokens(graphed))
            == []
        ), rank
        tokens = [[e.get("num_tokens") for e in run["logs"]] for run in (plain, graphed)]
        assert tokens[0] == tokens[1] and tokens[0][0] is not None, tokens
        assert plain["logs"][0]["loss"] == graphed["logs"][0]["loss"]
        assert runs[rank]["padding"] <= 0.05, runs[rank]["padding"]
    report = runs[0]["graphed"]["report"]
    counts = _counts(report)
    assert report.count("captured ") == 1 and "re-captured" not in report, report
    assert (
        counts["eager"] == counts["warm-up"]
        and counts["replays"] == counts["steps"] - counts["eager"]
    )
    assert counts["steps"] == workers.PACKED["max_steps"], report
