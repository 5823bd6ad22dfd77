"""The pinned public scripts (../shared/upstream/) run as written and as the guides port them, on
2 gloo ranks with the same seed and data, compared at every optimizer step (loss, LR, every
parameter), at each evaluation (logits, the printed metric) and in every file their checkpoints
and final save wrote; the port graphed on the CPU engine (issue 52 item 1).

Run here: transformers' run_glue_no_trainer.py and Accelerate's
gradient_accumulation_for_autoregressive_models.py. Not here: torchvision's and timm's train.py and
Accelerate's complete_cv_example.py need torchvision, and the package index has no CPU build of
torchvision for torch 2.13 (its 0.28.0 wheel is the CUDA build: ``import torchvision`` fails
with "operator torchvision::nms does not exist" and takes transformers' image utilities with
it). No test runs those three as written yet, here or in tests/gpu: their habits are tested on
loops of their own shape (tests/test_recipes.py, tests/test_recipe_windows.py).
"""

from __future__ import annotations

import pytest
import torch

from ddpgraph.testing import run_distributed

from . import upstream, upstream_autoregressive, upstream_glue

pytestmark = pytest.mark.timeout(900)
RUN_S = 600  # a launch of 2 ranks importing transformers and datasets on a loaded machine


def _same(ours: object, theirs: object, where: str) -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and sorted(ours) == sorted(theirs), where
        for key in theirs:
            _same(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), (where, len(ours), len(theirs))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, (where, ours, theirs)


def _glue(tmp_path, variant: str, flags: list[str], **kwargs):
    for package in ("accelerate", "datasets", "evaluate", "transformers"):  # all in .[dev]
        pytest.importorskip(package)
    script = upstream.script(upstream_glue.FOLDER, upstream_glue.NAME)
    args = (str(tmp_path), str(script), variant, flags)
    return run_distributed(upstream_glue.run, 2, args=args, timeout=RUN_S, **kwargs)


def test_run_glue_no_trainer_ported_by_hand_accumulation_is_the_script_bit_for_bit(tmp_path):
    """``--gradient_accumulation_steps 2 --checkpointing_steps epoch``, 3 epochs of 12 batches a
    rank (windows of 1, 2, ..., 2, 1; 31 calls, the last 7 replayed after the 24-call warm-up):
    the guide's hand-accumulation port against the script, its AdamW stepping the graph's
    arithmetic (at ee225a8, against the untouched AdamW, the first checkpoint's model differed)."""
    upstream_glue.make_inputs(tmp_path)
    flags = ["--gradient_accumulation_steps", "2", "--num_train_epochs", "3"]
    flags += ["--checkpointing_steps", "epoch", "--lr_scheduler_type", "linear"]
    flags += ["--num_warmup_steps", "3", "--learning_rate", "1e-3"]
    # the script's AdamW made graph-safe outside it, where the port's TrainStep makes it: the
    # untouched one differs by its rounding (capturable/foreach AdamW against the for-loop)
    original = _glue(tmp_path, "graph_safe", flags)
    port = _glue(tmp_path, "hand", flags)
    files = upstream_glue.saved(tmp_path / "hand"), upstream_glue.saved(tmp_path / "graph_safe")
    assert {"epoch_0/model.safetensors", "epoch_1/optimizer.bin", "model.safetensors"} <= set(
        files[1]
    ), sorted(files[1])
    _same(*files, "saved files")
    for rank, (ours, theirs) in enumerate(zip(port, original)):
        # the script's updates: 7 in each epoch until its max_train_steps (3 * ceil(12 / 2))
        assert len(theirs["updates"]) == 18, len(theirs["updates"])
        assert len(theirs["metrics"]) == 3 and len(theirs["logits"]) == 3 * 2
        for key in ("losses", "lrs", "updates", "logits", "metrics"):
            _same(ours[key], theirs[key], f"rank {rank} {key}")
        assert "replays=0 " not in ours["report"], ours["report"]


def test_run_glue_no_trainer_ported_by_the_first_diff_alone_is_refused_at_k2(tmp_path):
    """The guide's first diff without accumulate_calls (issue 52 item 2): refused on every rank
    before the end of the script's first two-call window, naming the fix."""
    upstream_glue.make_inputs(tmp_path)
    flags = ["--gradient_accumulation_steps", "2", "--num_train_epochs", "1"]
    errors = _glue(tmp_path, "first_diff", flags, return_exceptions=True)
    texts = {str(e) for e in errors}
    assert len(texts) == 1, texts
    text = texts.pop()
    assert "(after call 1, not after call 2)" in text and "accumulate_calls=k" in text, text
    assert "first_diff_run_glue_no_trainer.py:" in text, text


def _autoregressive(tmp_path, variant: str, k: int):
    for package in ("accelerate", "datasets", "transformers", "tokenizers"):  # all in .[dev]
        pytest.importorskip(package)
    script = upstream.script(upstream_autoregressive.FOLDER, upstream_autoregressive.NAME)
    args = (str(tmp_path), str(script), variant, k)
    return run_distributed(upstream_autoregressive.run, 2, args=args, timeout=RUN_S)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_accelerates_autoregressive_accumulation_ported_is_the_script_bit_for_bit(tmp_path, k):
    """``--gradient_accumulation_steps k``, 3 epochs of 29 batches a rank (k = 2, 3, 4: each
    epoch ends with a short window of 1, 2, 1), the script's ``no_sync()`` and
    ``num_items_in_batch``, Accelerate's ``clip_grad_norm_``: every micro-batch's loss, the LR and
    every parameter after each update, the evaluation logits through the prepared model and
    through ``train_step.model``, every printed line (grad norm, train loss, eval perplexity), bit
    for bit, the port replaying. The script's AdamW is made graph-safe outside
    the script, as the port's TrainStep makes it (the next test measures the untouched one)."""
    upstream_autoregressive.make_inputs(tmp_path)
    script = _autoregressive(tmp_path, "graph_safe", k)
    port = _autoregressive(tmp_path, "port", k)
    updates = 3 * -(-29 // k)  # the script's optimizer steps: ceil(29 / k) an epoch
    for rank, (ours, theirs) in enumerate(zip(port, script)):
        assert len(theirs["updates"]) == updates and len(theirs["losses"]) == 3 * 29
        assert len([line for line in theirs["printed"] if "update step" in line]) == (
            updates if rank == 0 else 0
        )
        assert len(theirs["logits"]) == 3  # 50 texts in batches of 32: one a rank an epoch
        for key in ("losses", "lrs", "updates", "logits", "printed"):
            _same(ours[key], theirs[key], f"rank {rank} {key}")
        assert "replays=0 " not in ours["report"], ours["report"]


def test_accelerates_autoregressive_port_against_the_untouched_script(tmp_path):
    """k = 2 against the script as written, its AdamW untouched (the for-loop step on the CPU,
    its LR a Python float): the same updates, each parameter within 1e-6 of the script's (the
    graph-safe AdamW's rounding, which the step reports: 1.19e-07 measured after 45 updates)."""
    upstream_autoregressive.make_inputs(tmp_path)
    script = _autoregressive(tmp_path, "original", 2)
    port = _autoregressive(tmp_path, "port", 2)
    for ours, theirs in zip(port, script):
        assert len(ours["updates"]) == len(theirs["updates"]) == 45
        for mine, its in zip(ours["updates"], theirs["updates"]):
            assert max((a - b).abs().max().item() for a, b in zip(mine, its)) < 1e-6
        assert "optimizer changed: capturable=True (AdamW" in ours["report"], ours["report"]
