"""The pinned public scripts (../shared/upstream/) run as written and as the guides port them, on
2 gloo ranks with the same seed and data, compared at every optimizer step (loss, LR, every
parameter), at each evaluation (logits, the printed metric) and in every file their checkpoints
and final save wrote; the port graphed on the CPU engine (issue 52 item 1).

Run here: transformers' run_glue_no_trainer.py. Not here: torchvision's and timm's train.py and
Accelerate's complete_cv_example.py need torchvision, and the package index has no CPU build of
torchvision for torch 2.13 (its 0.28.0 wheel is the CUDA build: ``import torchvision`` fails
with "operator torchvision::nms does not exist" and takes transformers' image utilities with
it); the GPU receipt runs them.
"""

from __future__ import annotations

import pytest
import torch

from ddpgraph.testing import run_distributed

from . import upstream, upstream_glue

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
    the guide's hand-accumulation port against the script."""
    upstream_glue.make_inputs(tmp_path)
    flags = ["--gradient_accumulation_steps", "2", "--num_train_epochs", "3"]
    flags += ["--checkpointing_steps", "epoch", "--lr_scheduler_type", "linear"]
    flags += ["--num_warmup_steps", "3", "--learning_rate", "1e-3"]
    original = _glue(tmp_path, "original", flags)
    port = _glue(tmp_path, "hand", flags)
    files = upstream_glue.saved(tmp_path / "hand"), upstream_glue.saved(tmp_path / "original")
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
