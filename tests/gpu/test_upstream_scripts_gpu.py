"""Accelerate's ``complete_cv_example.py`` (pinned in ../shared/upstream/) as written against
the Accelerate guide's port on one GPU (issue 52 items 1 and 4): timm's ResNet-50d, its frozen
backbone, OneCycleLR over Adam, evaluation through ``train_step.model``, in float32 and bf16.
The script fixes its run in its ``main()`` (ResNet-50d, 224 px, batches of 64), too heavy for
the 2-core CPU suite, so it runs on the GPU only; both precisions passed on an H100 at 3b37dd6
(28 and 21 s). The worker is tests/upstream_cv.py.

Command on the GPU machine (which gets the checkout without ../shared: copy the script's folder
into one that ``.git/info/exclude`` ignores, e.g. ``.upstream/``, and carry it; the GPU image
has timm and torchvision)::

    DDPGRAPH_UPSTREAM=.upstream python -m pytest -q tests/gpu/test_upstream_scripts_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from ddpgraph.testing import run_distributed

from .. import upstream, upstream_cv

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_complete_cv_example_ported_is_the_script_on_the_gpu(tmp_path, precision):
    """Every step's loss, the LR and every parameter after each update, the evaluation logits
    and the accuracy it prints each epoch, bit for bit, the script's Adam made graph-safe as
    the port's is. (OneCycleLR rewrites Adam's betas every step; the report says what the step
    did with them and is printed.)"""
    for package in ("accelerate", "timm", "torchvision"):
        pytest.importorskip(package)
    script = upstream.script(upstream_cv.FOLDER, upstream_cv.NAME)
    upstream_cv.make_images(tmp_path / "images")
    flags = ["--mixed_precision", precision, "--checkpointing_steps", "epoch"]
    runs = {}
    for variant in ("graph_safe", "port"):
        args = (str(tmp_path), str(script), variant, flags)
        (runs[variant],) = run_distributed(
            upstream_cv.run, 1, backend="nccl", args=args, timeout=600
        )
    ours, theirs = runs["port"], runs["graph_safe"]
    print(ours["report"])
    assert len(theirs["updates"]) == 3 * 7 and len(theirs["printed"]) == 3, theirs["printed"]
    assert theirs["logits"], "the script's evaluation ran no forward through the model"
    assert ours["printed"] == theirs["printed"] and ours["lrs"] == theirs["lrs"]
    for key in ("losses", "updates", "logits"):
        _all_equal(ours[key], theirs[key], key)
    # one GPU process: prepare() leaves the model unwrapped, and so does the step
    assert (ours["ddp_wrappers"], theirs["ddp_wrappers"]) == (0, 0)


def _all_equal(ours: object, theirs: object, where: str) -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs), where
    else:
        assert isinstance(ours, list) and isinstance(theirs, list), where
        assert len(ours) == len(theirs), (where, len(ours), len(theirs))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _all_equal(a, b, f"{where}[{i}]")
