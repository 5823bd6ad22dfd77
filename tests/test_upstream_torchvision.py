"""torchvision's ``references/classification/train.py`` (pinned in ../shared/upstream/) run as
written and as the real-loops guide ports it (``model = step.model``), on 2 gloo CPU ranks with
the same seed and data, compared bit for bit (issue 52 items 1 and 6): every training loss, the
LRs and every tensor of the model's state dict after each update, each evaluation's logits
(through the step's DDP, and the EMA's), the Acc@1/Acc@5 lines it prints and every checkpoint
file; the port graphed on the CPU engine and replaying. The workers and the CPU snags patched
outside the script: tests/upstream_torchvision.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpgraph.testing import run_distributed

from . import upstream, upstream_torchvision
from .test_upstream_scripts import _guide_hunks, _layout_free, _replays, _same

pytestmark = pytest.mark.timeout(900)
RUN_S = 600  # a launch of 2 ranks importing torchvision on a loaded machine
GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "real-loops.md"


def _script():
    pytest.importorskip("torchvision")
    for name in upstream_torchvision.MODULES:  # what the script imports beside it
        upstream.script(upstream_torchvision.FOLDER, name)
    return upstream.script(upstream_torchvision.FOLDER, upstream_torchvision.NAME)


def _run(tmp_path, variant: str, flags: list[str], out: str):
    args = (str(tmp_path), str(_script()), variant, flags, out)
    return run_distributed(upstream_torchvision.run, 2, args=args, timeout=RUN_S, init=False)


def _compare(tmp_path, flags, resume: str = "", updates: int = 21, evaluations: int = 3):
    """The script and its port with ``flags`` (and ``--resume`` from the checkpoint file
    ``resume`` each run wrote itself before, into folders of their own): every recorded
    quantity on each rank and every checkpoint file, the port replaying."""
    out = "_resumed" if resume else ""
    runs = {}
    for variant in ("original", "port"):
        more = ["--resume", str(tmp_path / variant / resume)] if resume else []
        runs[variant] = _run(tmp_path, variant, [*flags, *more], f"{variant}{out}")
    original, port = runs["original"], runs["port"]
    for rank, (ours, theirs) in enumerate(zip(port, original)):
        assert len(theirs["updates"]) == updates, len(theirs["updates"])
        assert len(theirs["printed"]) == (evaluations if rank == 0 else 0), theirs["printed"]
        for key in ("losses", "lrs", "updates", "logits", "printed"):
            _same(ours[key], theirs[key], f"rank {rank} {key}")
        assert _replays(ours["report"]) > 0, ours["report"]
    files = [upstream_torchvision.saved(tmp_path / f"{v}{out}") for v in ("port", "original")]
    assert "checkpoint.pth" in files[1], sorted(files[1])
    if "--amp" in flags:  # the port's loss scale is its step's (the guide's port has no scaler)
        for name, checkpoint in files[1].items():
            assert "scaler" not in files[0][name], name
            assert checkpoint.pop("scaler")["scale"] < 2.0**16, name  # its overflows backed off
            _untouched_state_as_none(files[0][name]["optimizer"], checkpoint["optimizer"])
    _same(*files, "checkpoints")
    return port, original


def _untouched_state_as_none(ours: dict, theirs: dict) -> None:
    """Every update so far skipped (fp16 overflows; epoch 0's 7 batches here): the script's
    GradScaler skipped ``optimizer.step()`` on the host, so its optimizer has no state; the
    port's fused AdamW skipped inside its kernel, which made the state it takes at a first step
    (zeros, step 0): the same start for the next update. Asserted so, then compared as none."""
    if theirs["state"] or not ours["state"]:
        return
    for state in ours["state"].values():
        assert all(not t.any() for t in state.values()), state
    ours["state"] = {}


# train.py's flags, one set a test (3 epochs of 7 batches a rank, the last of 3 images: 21
# updates, the step's 12 warm-up calls among them, then captured and replayed; the short batch
# runs eagerly), on shufflenet_v2_x0_5 (BatchNorm) unless a set names the script's default
# resnet18 or mobilenet_v3_small (its classifier's Dropout replayed): each optimizer and
# scheduler it builds, warm-up epochs, label smoothing, mixup/cutmix (soft targets) with the v1
# and v2 transforms, automatic augmentation and random erasing, clipping, the EMA and its
# evaluation, norm and bias weight decay (--ra-sampler, which keeps a multiple of 256 images,
# has a test of its own); --amp on the CPU's fp16 autocast and GradScaler("cpu") (its first
# steps overflow and are skipped, as on a GPU: the fused SGD's momentum made before the first
# real update). Not here: --sync-bn (tests/upstream_torchvision.py says why)
FLAG_SETS = {
    "amp-sgd-momentum-skipped-first-steps": ["--amp", "--opt", "sgd", "--lr", "0.02"],
    "amp-adamw-clip": ["--amp", "--opt", "adamw", "--lr", "1e-3", "--clip-grad-norm", "0.5"],
    "resnet18-sgd-steplr-label-smoothing": [
        "--model", "resnet18", "--opt", "sgd", "--lr", "0.02", "--lr-scheduler", "steplr",
        "--lr-step-size", "1", "--lr-gamma", "0.5", "--label-smoothing", "0.1",
    ],
    "mobilenet-v3-dropout-sgd-nesterov-cosine-linear-warmup-norm-wd": [
        "--model", "mobilenet_v3_small", "--opt", "sgd_nesterov", "--lr", "0.02",
        "--lr-scheduler", "cosineannealinglr", "--lr-warmup-epochs", "1",
        "--lr-warmup-method", "linear", "--lr-warmup-decay", "0.1",
        "--norm-weight-decay", "0.0", "--bias-weight-decay", "0.0",
    ],
    "adamw-exponential-constant-warmup-clip": [
        "--opt", "adamw", "--lr", "1e-3", "--wd", "0.05", "--lr-scheduler", "exponentiallr",
        "--lr-gamma", "0.7", "--lr-warmup-epochs", "1", "--clip-grad-norm", "0.5",
    ],
    "rmsprop-mixup-cutmix": [
        "--opt", "rmsprop", "--lr", "1e-3", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
        "--label-smoothing", "0.1",
    ],
    "sgd-v2-transforms-mixup-cutmix-trivialaugment-random-erase": [
        "--opt", "sgd", "--lr", "0.02", "--use-v2", "--mixup-alpha", "0.2", "--cutmix-alpha",
        "1.0", "--auto-augment", "ta_wide", "--random-erase", "0.2",
    ],
    "sgd-ema-every-2-warmup": [
        "--opt", "sgd", "--lr", "0.02", "--model-ema", "--model-ema-steps", "2",
        "--model-ema-decay", "0.9", "--lr-warmup-epochs", "1",
    ],
}  # fmt: skip


@pytest.mark.parametrize("flag_set", sorted(FLAG_SETS))
def test_train_py_flag_matrix_ported_is_the_script_bit_for_bit(tmp_path, flag_set):
    """Each flag set of the script as written against the guide's port: every loss, LR and
    model tensor after each update, the evaluation logits through the DDP (and the EMA's), the
    printed Acc@1/Acc@5 and every checkpoint, on both ranks, the port replaying."""
    upstream_torchvision.make_images(tmp_path / "images")
    flags = ["--epochs", "3", *FLAG_SETS[flag_set]]
    ema = "--model-ema" in flags
    _compare(tmp_path, flags, evaluations=6 if ema else 3)


_ONE_SESSION = """
import json, sys
from ddpgraph.testing import run_distributed
from tests import upstream_torchvision as worker
folder, script = sys.argv[1], sys.argv[2]
flags = ["--epochs", "1", "--opt", "sgd", "--lr", "0.02"]
(record,) = run_distributed(
    worker.run, 1, args=(folder, script, "original", flags, sys.argv[3]), timeout=600, init=False
)
print(json.dumps(record["losses"]))
"""


def test_train_py_sees_the_same_data_in_every_test_session(tmp_path):
    """The script seeds nothing, and torch 2.14.1's default generator starts at a seed of its
    own in each interpreter, which run_distributed's workers inherit from its forkserver: each
    test session trained on other crops and another init (the H100's --amp adamw-clip test
    passed in some sessions only). Two fresh interpreters (two sessions) run the script as
    written on the same images: the same losses (the worker seeds torch as 0)."""
    script = _script()
    upstream_torchvision.make_images(tmp_path / "images", train=8)
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    losses = []
    for session in ("a", "b"):
        done = subprocess.run(
            [sys.executable, "-c", _ONE_SESSION, str(tmp_path), str(script), session],
            cwd=root, env=env, capture_output=True, text=True, timeout=RUN_S, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        losses.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses


def test_train_py_repeated_augmentation_ported_is_the_script_bit_for_bit(tmp_path):
    """``--ra-sampler --ra-reps 2`` (RASampler: each image twice, differently augmented, a rank
    keeping 256 // 2 = 128 of them an epoch) with ``--backend tensor`` over 256 images, one
    epoch of 32 batches a rank, compared as the flag matrix's."""
    upstream_torchvision.make_images(tmp_path / "images", train=256)
    flags = ["--epochs", "1", "--lr", "0.02", "--ra-sampler", "--ra-reps", "2"]
    _compare(tmp_path, [*flags, "--backend", "tensor"], updates=32, evaluations=1)


def test_train_py_resumed_ported_is_the_script_bit_for_bit(tmp_path):
    """``--resume model_0.pth``, each run from the checkpoint it wrote itself: the model,
    AdamW's state, the warm-up-then-cosine scheduler and the EMA loaded (``weights_only=True``,
    ``argparse.Namespace`` allowed outside the script), epochs 1 and 2 trained (14 updates, the
    step captured after its warm-up again), compared as the flag matrix's, and the full runs
    too; then ``--test-only`` from the last checkpoint: one evaluation through the model (the
    port's ``step.model``) before any training step, its logits and printed line."""
    upstream_torchvision.make_images(tmp_path / "images")
    flags = ["--epochs", "3", "--opt", "adamw", "--lr", "1e-3", "--lr-scheduler"]
    flags += ["cosineannealinglr", "--lr-warmup-epochs", "1", "--model-ema"]
    flags += ["--model-ema-steps", "1", "--model-ema-decay", "0.9", "--clip-grad-norm", "1.0"]
    _compare(tmp_path, flags, evaluations=6)
    _compare(tmp_path, flags, resume="model_0.pth", updates=14, evaluations=4)
    tested = {}
    plain = [flag for flag in flags if flag != "--model-ema"]  # evaluate(model, ...): the DDP's
    for variant in ("original", "port"):
        more = ["--test-only", "--resume", str(tmp_path / variant / "checkpoint.pth")]
        tested[variant] = _run(tmp_path, variant, [*plain, *more], f"{variant}_tested")
    for rank, (ours, theirs) in enumerate(zip(tested["port"], tested["original"])):
        assert not theirs["updates"] and len(theirs["logits"]) == 3, theirs  # 10 images a rank
        assert [line.split()[:2] for line in theirs["printed"]] == [["Test:", "Acc@1"]] * (1 - rank)
        for key in ("logits", "printed"):
            _same(ours[key], theirs[key], f"rank {rank} {key}")


def test_train_py_sync_bn_on_the_cpu_is_refused_alike(tmp_path):
    """``--sync-bn`` on CPU modules: torch's DDP refuses SyncBatchNorm there, for the script's
    DDP and the port's alike, with the same error on every rank (the port adds none of its
    own); on a GPU it runs (not tested here)."""
    upstream_torchvision.make_images(tmp_path / "images")
    flags = ["--epochs", "1", "--sync-bn"]
    errors = set()
    for variant in ("original", "port"):
        args = (str(tmp_path), str(_script()), variant, flags, variant)
        raised = run_distributed(
            upstream_torchvision.run, 2, args=args, timeout=RUN_S, init=False,
            return_exceptions=True,
        )  # fmt: skip
        errors |= {f"{type(e).__name__}: {e}" for e in raised}
    assert errors == {"ValueError: SyncBatchNorm layers only work with GPU modules"}, errors


def test_the_guides_diff_is_the_port_as_tested():
    """What the real-loops guide tells a user to change in ``train.py`` is what these tests
    change in it: its diff applied to the pinned script gives the port they run, up to layout
    (issue 52 item 6)."""
    text = _script().read_text(encoding="utf-8")
    applied = _layout_free(text.splitlines())
    for old, new in _guide_hunks("### A classic recipe's own evaluation loop\n", GUIDE):
        assert applied.count(old) == 1, f"the guide's hunk is not once in the script: {old}"
        applied = applied.replace(old, new)
    port = upstream.ported(text, upstream_torchvision.PORT)
    assert applied == _layout_free(port.splitlines())


# ---------------------------------------------------------------- the GPU probe's CPU run
def _amp_updates_probe():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "probes"))
    import torchvision_amp_updates

    return torchvision_amp_updates


def test_the_amp_updates_probe_finds_equal_runs_equal_on_the_cpu(tmp_path):
    """benchmarks/probes/torchvision_amp_updates.py on the CPU, one epoch: the script and its
    port (fp16 on the CPU's autocast, 12 of 14 updates skipped) part nowhere."""
    _script()
    out = tmp_path / "probe.json"
    proc = subprocess.run(
        [sys.executable, str(Path(_amp_updates_probe().__file__)), "--device", "cpu",
         "--epochs", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=RUN_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["updates"], result["first_differing_update"]) == (14, None), result
    assert "replays=1 " in result["port_report"], result["port_report"]


def test_the_amp_updates_probe_saves_and_reads_the_states_around_an_update(tmp_path, monkeypatch):
    """Its second half (run on the GPU where the two sides part) on the CPU, told that the first
    real update (the first not skipped for an overflow, from zero momentum buffers) parts: the
    three sides' states saved after it and the update before, each side's new parameters the
    fused kernel's arithmetic; the run without the warm-up's host-sync recording equal; each
    side's one write into the parameters in that batch, named."""
    _script()
    probe = _amp_updates_probe()
    found, first_real = probe._first_difference, []

    def told(ours, theirs):
        if not first_real:  # the first call: the original's and the port's whole runs
            changed = probe._changed(ours)
            first_real.append(changed.index(max(changed)) + 2)  # changed[i]: update i + 2
            return first_real[0]
        return found(ours, theirs)

    monkeypatch.setattr(probe, "_first_difference", told)
    result = probe.probe("sgd", 0, 1, "cpu")
    assert result["first_differing_update"] == first_real[0] > 1, result["tensors_changed"]
    assert result["no_sync_recording_first_differing_update"] is None
    for side, seen in result["sides"].items():
        matches = seen["matches"]
        assert matches["rounded_once"] > 100 and matches["neither"] == 0, (side, seen)
        assert sum(matches.values()) == seen["parameters"], (side, seen)
    assert result["kernel"] == {"skipped": "no parameter differs"}
    for side, writes in result["parameter_writes"].items():
        # the update's one write into the parameters, the graph-safe optimizer's fused kernel
        group, *ops = writes
        assert group["param_group"]["fused"] is True, (side, group)
        assert [w["op"] for w in ops] == ["aten._fused_sgd_.tensor_lr"], (side, writes)
        assert ops[0]["capturing"] is False and ops[0]["scalars"]["momentum"] == 0.9, ops
        assert ops[0]["tensors"]["lr"].startswith("torch.float32 = "), ops


def test_the_amp_updates_probe_records_each_sides_clipping_of_the_parting_batch(tmp_path):
    """With the AdamW set's clipping (its GPU difference is in the run's last update): each
    side's ``clip_grad_norm_`` of that batch (the script's own call and the step's, both torch's
    by that name) with the total norm it found, beside the fused AdamW write."""
    script = _script()
    probe = _amp_updates_probe()
    upstream_torchvision.make_images(tmp_path / "images")
    flags = ["--epochs", "1", "--amp", "--use-deterministic-algorithms", *probe.FLAG_SETS["adamw"]]
    env = {"DDPGRAPH_SCRIPT_SEED": "0"}
    seen = {
        # update 13 is real on this data (10, 12 and 13 are; the others overflow on the CPU's fp16)
        side: probe.param_writes(tmp_path, script, side, flags, "cpu", env, 13)
        for side in ("original", "port")
    }
    for side, writes in seen.items():
        clips = [w["clip"] for w in writes if "clip" in w]
        assert len(clips) == 1 and clips[0]["max_norm"] == 0.5, (side, writes)
        assert clips[0]["total_norm"] > 0 and clips[0]["tensors"] > 100, (side, clips)
        ops = [w["op"] for w in writes if "op" in w]
        assert ops == ["aten._fused_adamw_.tensor_lr"], (side, writes)
    clips = {side: writes[1]["clip"] for side, writes in seen.items()}
    # the script's own call, and the step's (foreach on every device, as on CUDA by default)
    assert (clips["original"]["kwargs"], clips["port"]["kwargs"]) == ({}, {"foreach": "True"})
    assert clips["original"]["total_norm"] == clips["port"]["total_norm"], clips
    compared = probe.compare_clips(seen)
    keys = ("digests", "digests_zero_sign_free", "foreach_norms", "vector_norms",
            "aligned_foreach_norms_vs_script")  # fmt: skip
    assert {key: compared[key] for key in keys} == {key: [] for key in keys}, compared
    assert clips["port"]["grads"]["count"] == clips["port"]["tensors"], clips["port"]["grads"]


def test_the_amp_updates_probe_tells_the_two_arithmetics_apart():
    """The two ways of computing ``p - lr * buf`` it names: rounded once (the fused CUDA kernel,
    double) and with the product rounded first (float ops), on values where they differ."""
    import torch

    probe = _amp_updates_probe()
    torch.manual_seed(0)
    p, buf, lr = torch.randn(1000), torch.randn(1000) * 30, torch.tensor(0.02)
    once, product = (p.double() - lr.double() * buf.double()).float(), p - lr * buf
    assert not torch.equal(once, product)
    before = {"model": {"w": p}, "state": {"w": {"momentum_buffer": torch.zeros(1000)}}}

    def after(new):
        group = {"lr": lr, "momentum": 0.9, "weight_decay": 0.0, "dampening": 0, "nesterov": False}
        state = {"w": {"momentum_buffer": buf}}
        return {"model": {"w": new}, "state": state, "groups": [group], "grads": {"w": buf}}

    assert probe.arithmetic_of(before, after(once))["matches"]["rounded_once"] == 1
    assert probe.arithmetic_of(before, after(product))["matches"]["product_rounded"] == 1
    kernel = probe.fused_sgd_kernel_probe(
        before, {"original": after(once), "port": after(product)}, "cpu"
    )
    # torch's SGD on the CPU rounds once (a fused multiply-add) on every path, whatever the LR
    assert set(kernel["gives"].values()) == {"original"}, kernel
