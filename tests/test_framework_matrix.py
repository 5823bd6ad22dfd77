"""Each framework's feature matrix and upstream examples, trained by the framework itself and by
the guide's port (eagerly, and capturing with CpuGraphs), on 2 gloo ranks: every row equal bit
for bit (losses, learning rates, grad norms, steps, logged metrics, evaluation outputs, final
parameters and optimizer state), or refused with the reason where the row is listed in the
guide's "what does not work yet". Rows and sources: tests/lightning_matrix_workers.py,
tests/accelerate_workers.py (+ accelerate_corpus.py), tests/fabric_workers.py,
tests/lightning_cli_workers.py. One process launch per framework: start-up costs more than
these tiny runs."""

from __future__ import annotations

import pytest
import torch

from ddpgraph.testing import run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(1500)

RUN_S = 1400  # a whole matrix on 2 ranks, on a loaded 2-core machine
COMPARED = ("losses", "lrs", "norms", "steps", "val", "csv", "predictions")

LIGHTNING_EQUAL = [
    "max_steps_clip_norm_dict_output", "max_epochs_accumulate_tail_epoch_metrics_csv",
    "accumulate_k3_tail_max_steps_scheduler_per_step", "scheduler_per_epoch_validation_loop",
    "plateau_scheduler", "limit_train_batches_bf16_mixed", "callbacks_lr_monitor_early_stopping",
    "checkpoint_resume_mid_epoch",
]  # fmt: skip
LIGHTNING_REFUSED = {"clip_value": "gradient_clip_algorithm='value'"}
# upstream's examples (accelerate_corpus.py), then the rows of habits; two launches, each under
# the timeout on a loaded machine
ACCELERATE_EXAMPLES = [
    "nlp_example", "gradient_accumulation_mrpc_size", "gradient_accumulation_k3",
    "checkpoint_epoch_resume", "checkpoint_step_resume_mid_epoch",
]  # fmt: skip
ACCELERATE_EQUAL = [
    "bf16", "fp16_on_cpu_trains_fp32_as_accelerate", "port_resumes_accelerates_own_checkpoint",
    "clip_on_sync_gradients",
]  # fmt: skip
FABRIC_EQUAL = [
    "image_classifier_example", "accumulate_epoch_tail", "accumulate_k3_clip_scheduler",
    "bf16_mixed", "save_load_resume",
]  # fmt: skip


def _check_equal(results: list[dict], name: str) -> None:
    for rank, rows in enumerate(results):
        theirs = rows[f"{name}/framework"]
        assert "error" not in theirs, (name, theirs)
        for variant in ("eager", "graphs"):
            ours = rows[f"{name}/{variant}"]
            assert "error" not in ours, (name, variant, ours)
            for key in COMPARED:
                assert ours.get(key) == theirs.get(key), (name, variant, rank, key)
            for what in ("params", "optimizer"):
                assert len(ours[what]) == len(theirs[what]), (name, what)
                for a, b in zip(ours[what], theirs[what]):
                    assert torch.equal(a, b), (name, variant, rank, what)
        report = rows[f"{name}/graphs"]["report"]
        assert "mode=graphed" in report and "replays=0 " not in report, (name, report)


def _matrix(rows_fn, names: list[str], equal: list[str], tmp_path) -> list[dict]:
    """Every named row on 2 ranks in one launch; the equal ones checked."""
    results = run_distributed(rows_fn, 2, args=(names, str(tmp_path)), timeout=RUN_S)
    for name in equal:
        _check_equal(results, name)
    return results


def test_lightning_matrix_is_equal_to_lightnings_own_ddp(tmp_path):
    pytest.importorskip("lightning")
    from . import lightning_matrix_workers as workers

    names = LIGHTNING_EQUAL + list(LIGHTNING_REFUSED)
    results = _matrix(workers.lightning_rows, names, LIGHTNING_EQUAL, tmp_path)
    for name, says in LIGHTNING_REFUSED.items():
        for rows in results:
            assert "error" not in rows[f"{name}/framework"]
            for variant in ("eager", "graphs"):
                assert says in rows[f"{name}/{variant}"].get("error", ""), rows[f"{name}/{variant}"]


def test_accelerates_own_examples_ported_are_equal_to_accelerates_own_ddp(tmp_path):
    pytest.importorskip("accelerate")
    from . import accelerate_workers as workers

    names = ACCELERATE_EXAMPLES
    results = _matrix(workers.accelerate_rows, names, names, tmp_path)
    # gradient_accumulation.py at MRPC's size: 115 batches a rank, k=2, the tail at index 114
    losses = results[0]["gradient_accumulation_mrpc_size/graphs"]["losses"]
    assert len(losses) == 115


def test_accelerate_matrix_is_equal_to_accelerates_own_ddp(tmp_path):
    pytest.importorskip("accelerate")
    from . import accelerate_workers as workers

    _matrix(workers.accelerate_rows, ACCELERATE_EQUAL, ACCELERATE_EQUAL, tmp_path)


def test_fabric_matrix_and_image_classifier_are_equal_to_fabrics_own_ddp(tmp_path):
    pytest.importorskip("lightning")
    from . import fabric_workers as workers

    _matrix(workers.fabric_rows, FABRIC_EQUAL, FABRIC_EQUAL, tmp_path)


def test_lightning_cli_takes_graph_strategy_from_trainer_defaults_and_from_its_config(tmp_path):
    """Lightning's autoencoder example under LightningCLI: GraphStrategy given in
    ``trainer_defaults`` (capturing with CpuGraphs) and by class path in the CLI's YAML config
    (eagerly) fits, tests and predicts as ``DDPStrategy`` does, bit for bit."""
    pytest.importorskip("jsonargparse")
    from . import lightning_cli_workers as workers

    results = run_distributed(workers.cli_runs, 2, args=(str(tmp_path),), timeout=RUN_S)
    for rows in results:
        theirs = rows["framework"]
        for how in ("defaults", "config"):
            ours = rows[how]
            assert ours["strategy"] == "GraphStrategy", how
            assert ours["val"] == theirs["val"] and ours["test"] == theirs["test"], how
            for a, b in zip(ours["params"], theirs["params"], strict=True):
                assert torch.equal(a, b), how
            for a, b in zip(ours["predictions"], theirs["predictions"], strict=True):
                assert torch.equal(a, b), how
        assert "replays=0 " not in rows["defaults"]["report"], rows["defaults"]["report"]
        assert "mode=eager" in rows["config"]["report"], rows["config"]["report"]
