"""torchvision's ``references/classification/train.py`` (pinned in ../shared/upstream/) as written
against the real-loops guide's port on one GPU, with ``--amp`` (issue 52 items 1 and 6): the
script's ``torch.cuda.amp`` autocast and ``GradScaler`` against the port's ``amp="fp16"`` (the
step's loss scaling inside the graph); the CPU tests compare the same on the CPU's fp16. First
run at 86db3d3 on an H100: both sets differed from the 10th update on (the port's SGD NaN: torch's
fused SGD left its momentum uninitialized after the skipped first steps; the original's AdamW
was not the port's fused one); fixed in 52's stop 58. The worker is
tests/upstream_torchvision.py with ``device="cuda"``: the script's own nccl group and CUDA
graphs, nothing patched but the seeds (torch's 0, Python's ``random`` the rank: torch 2.14.1's
default generator starts at a seed of its own in each test session, so before they were seeded
each session trained on other data, and this test's adamw-clip set failed in 2 of 6 sessions,
first at ``losses[11]``) and the resume's ``Namespace``; the script's optimizer made graph-safe
where the port's TrainStep makes it;
``--use-deterministic-algorithms`` (else the script turns on cuDNN's benchmark, whose choice of
kernels may differ from run to run).

Command on the GPU machine (which gets the checkout without ../shared: copy the script's folder
into one that ``.git/info/exclude`` ignores, e.g. ``.upstream/``, and carry it)::

    DDPGRAPH_UPSTREAM=.upstream python -m pytest -q tests/gpu/test_upstream_torchvision_gpu.py
"""

from __future__ import annotations

import pytest

from ddpgraph.testing import run_distributed

from .. import upstream, upstream_torchvision
from ..test_upstream_scripts import _same
from ..test_upstream_torchvision import _untouched_state_as_none

pytestmark = pytest.mark.timeout(900)

AMP_SETS = {
    "sgd": ["--opt", "sgd", "--lr", "0.02"],
    "adamw-clip": ["--opt", "adamw", "--lr", "1e-3", "--clip-grad-norm", "0.5"],
}


# the data seed 2 (torch's generator, $DDPGRAPH_SCRIPT_SEED): on one H100 at f039cd8, twice, only
# the last update differed (the third epoch's short batch of 2 images, eager in the port), every
# loss and the 11 skipped steps (the loss scale) alike; seeds 0, 1 and 3 passed. The probe's
# clip record (benchmarks/probes/torchvision_amp_updates.py, H100, d77237d) named it: the
# clipping's total norm 116.18121337890625 (script) against 116.18120574951172 (port); the
# port's gradients are DDP's bucket views (the step's gradient_as_bucket_view=True), 30 of 170
# not aligned to the foreach norm kernel's vectors, which sums those in another order; copied
# to aligned allocations, all 170 norms equal the script's. The step now takes the norm so
# (``parallel.ddp.norm_as_unbucketed``); this seed is expected to pass: not yet run on a GPU
# with it (the next receipt says).


# the SGD set, data seeds 0 and 1: on an H100 at b726f90 and 3833ada the first real update (the
# 12th; the 11 before skipped for an overflow on both sides) parted, 65 of 170 parameters 1 ulp
# apart. The probe's ``parameter_writes`` (benchmarks/probes/torchvision_amp_updates.py, H100,
# fb2ebbd) named it: both sides step torch's fused SGD with the same LR tensor, but the port's
# loss scaler handed the kernel ``grad_scale`` (as GradScaler does for an optimizer built fused)
# where the script's GradScaler, its SGD built unfused, unscales the gradients before the step;
# on CUDA the kernel's own unscaling rounds the update differently (804 of 1M parameters,
# benchmarks/probes/fused_sgd_grad_scale.py). The step now unscales where the script's
# GradScaler does (``optim.unscales_in_kernel``); both seeds pass on the H100.


@pytest.mark.parametrize(
    ("flag_set", "seed"),
    [
        ("adamw-clip", 0),
        ("adamw-clip", 2),
        ("sgd", 0),
        ("sgd", 1),
    ],
)
def test_train_py_amp_ported_is_the_script_on_the_gpu(tmp_path, flag_set, seed):
    """Every loss, LR and model tensor after each update, the evaluation logits, the printed
    Acc@1/Acc@5 and the checkpoints' model and optimizer, bit for bit, the port replaying (the
    port's checkpoint has no ``"scaler"`` entry: its loss scale is the step's)."""
    pytest.importorskip("torchvision")
    for name in upstream_torchvision.MODULES:
        upstream.script(upstream_torchvision.FOLDER, name)
    script = upstream.script(upstream_torchvision.FOLDER, upstream_torchvision.NAME)
    upstream_torchvision.make_images(tmp_path / "images")
    flags = ["--epochs", "3", "--amp", "--use-deterministic-algorithms", *AMP_SETS[flag_set]]
    runs = {}
    for variant in ("original", "port"):
        args = (str(tmp_path), str(script), variant, flags, variant, "cuda")
        (runs[variant],) = run_distributed(
            upstream_torchvision.run, 1, args=args, timeout=600, init=False,
            env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "DDPGRAPH_SCRIPT_SEED": str(seed)},
        )  # fmt: skip
    ours, theirs = runs["port"], runs["original"]
    print(ours["report"])
    # 54 images on one rank: 14 batches an epoch, the last of 2
    assert len(theirs["updates"]) == 3 * 14 and len(theirs["printed"]) == 3, theirs["printed"]
    for key in ("losses", "lrs", "updates", "logits", "printed"):
        _same(ours[key], theirs[key], key)
    assert "replays=0 " not in ours["report"], ours["report"]
    files = {v: upstream_torchvision.saved(tmp_path / v) for v in ("port", "original")}
    for name, checkpoint in files["original"].items():
        assert "scaler" in checkpoint and "scaler" not in files["port"][name], name
        _untouched_state_as_none(files["port"][name]["optimizer"], checkpoint["optimizer"])
        for key in ("model", "optimizer", "lr_scheduler", "epoch"):
            _same(files["port"][name][key], checkpoint[key], f"{name}/{key}")
