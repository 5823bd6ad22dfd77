"""The pinned public scripts (../shared/upstream/) run as written and as the guides port them, on
2 gloo ranks with the same seed and data, compared at every optimizer step (loss, LR, every
parameter), at each evaluation (logits, the printed metric) and in every file their checkpoints
and final save wrote; the port graphed on the CPU engine and replaying (issue 52 item 1): each
script's flags (accumulation with short windows, bf16, schedules, checkpoints and resume), one
set a run, and the guide's diff of each port checked against the port these tests run (item 6).

Run here: transformers' run_glue_no_trainer.py, Accelerate's
gradient_accumulation_for_autoregressive_models.py and complete_cv_example.py (its ResNet-50d
replaced by timm's test_resnet here; its own model in tests/gpu/test_upstream_scripts_gpu.py,
passed on H100s). torchvision's references/classification train.py and timm's train.py run as
written in tests/test_upstream_torchvision.py and tests/test_upstream_timm.py (torch 2.14.1 with
torchvision 0.29.1 and timm 1.0.28 import on the CPU).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ddpgraph.testing import run_distributed

from . import upstream, upstream_autoregressive, upstream_cv, upstream_glue

pytestmark = pytest.mark.timeout(900)
RUN_S = 600  # a launch of 2 ranks importing transformers and datasets on a loaded machine


def _same(ours: object, theirs: object, where: str) -> None:
    if isinstance(theirs, torch.Tensor):  # torch.equal alone would pass a float32 for a bf16
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype, (where, ours.dtype)
        assert torch.equal(ours, theirs), where
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


def _replays(report: str) -> int:
    """The replays a TrainStep's report counts ("... replays=7 warm-up=12 ..."), on the CPU
    engine."""
    assert "engine=cpu-recorded" in report, report
    found = re.search(r"\breplays=(\d+) ", report)
    assert found, report
    return int(found.group(1))


def _glue(tmp_path, variant: str, flags: list[str], precision="no", out="", pad=True, **kwargs):
    for package in ("accelerate", "datasets", "evaluate", "transformers"):  # all in .[dev]
        pytest.importorskip(package)
    script = upstream.script(upstream_glue.FOLDER, upstream_glue.NAME)
    args = (str(tmp_path), str(script), variant, flags, precision, out, pad)
    return run_distributed(upstream_glue.run, 2, args=args, timeout=RUN_S, **kwargs)


def _glue_same(port, original, port_out, original_out, updates: int, evaluations: int) -> None:
    """The port's run against the script's: every file the two wrote, and on each rank every
    micro-batch's loss, the LR and parameters after each update, the evaluation logits, each
    ``metric.compute()`` and the line the script logs with it; the port replayed."""
    files = upstream_glue.saved(port_out), upstream_glue.saved(original_out)
    assert "model.safetensors" in files[1], sorted(files[1])
    _same(*files, "saved files")
    for rank, (ours, theirs) in enumerate(zip(port, original)):
        counts = [len(theirs[key]) for key in ("losses", "updates", "metrics")]
        assert len(theirs["updates"]) == updates, counts
        assert len(theirs["metrics"]) == evaluations and len(theirs["logits"]) == 2 * evaluations
        assert len(theirs["printed"]) == (evaluations if rank == 0 else 0), theirs["printed"]
        for key in ("losses", "lrs", "updates", "logits", "metrics", "printed"):
            _same(ours[key], theirs[key], f"rank {rank} {key}")
        assert _replays(ours["report"]) > 0, ours["report"]


# run_glue_no_trainer.py's flags, one set a test (12 batches of 4 a rank an epoch; the step's
# default warm-up is 12 updates, so each set runs past it): accumulation 1, 2 and 3 (its windows
# start with one call, ``step % k == 0``, and end short at the epoch's last batch: 1, 3, 3, 3, 2
# at k = 3), each of its schedules' shapes, checkpoints per epoch and every N updates, and bf16
# (the script has no precision flag: ``accelerate launch --mixed_precision bf16`` exports it)
GLUE_FLAG_SETS = {
    "k1-cosine-warmup-checkpoint-every-5": (
        [
            "--gradient_accumulation_steps", "1", "--num_train_epochs", "2",
            "--lr_scheduler_type", "cosine", "--num_warmup_steps", "4",
            "--checkpointing_steps", "5", "--weight_decay", "0.01",
        ],
        "no", 24, 2,
    ),
    "k3-short-window-constant-warmup-checkpoint-epoch": (
        [
            "--gradient_accumulation_steps", "3", "--num_train_epochs", "6",
            "--lr_scheduler_type", "constant_with_warmup", "--num_warmup_steps", "3",
            "--checkpointing_steps", "epoch",
        ],
        # 5 updates an epoch against the 4 its max_train_steps (24) counts: the 24th ends
        # epoch 4 at its 10th batch, and epoch 5 (of ceil(24 / 4)) still updates once, on its
        # first batch, before its own check breaks out: 25 updates, 6 evaluations
        "no", 25, 6,
    ),
    "k2-bf16-polynomial-checkpoint-epoch": (
        [
            "--gradient_accumulation_steps", "2", "--num_train_epochs", "3",
            "--lr_scheduler_type", "polynomial", "--num_warmup_steps", "2",
            "--checkpointing_steps", "epoch",
        ],
        "bf16", 18, 3,
    ),
}  # fmt: skip


@pytest.mark.parametrize("flag_set", sorted(GLUE_FLAG_SETS))
def test_run_glue_no_trainer_flag_matrix_ported_is_the_script_bit_for_bit(tmp_path, flag_set):
    """Each flag set of the script as written against the guide's hand-accumulation port, its
    AdamW made graph-safe outside the script as the port's TrainStep makes it: every loss, LR
    and parameter after each update, the evaluation logits and the accuracy the script logs
    each epoch, every file its checkpoints and final save wrote (RNG states included), the port
    replaying on the CPU engine. Under bf16 the evaluation runs through ``train_step.model``,
    under Accelerate's autocast as the prepared model's forward did (issue 52 item 4)."""
    flags, precision, updates, evaluations = GLUE_FLAG_SETS[flag_set]
    flags = [*flags, "--learning_rate", "1e-3"]
    upstream_glue.make_inputs(tmp_path)
    original = _glue(tmp_path, "graph_safe", flags, precision)
    port = _glue(tmp_path, "hand", flags, precision)
    _glue_same(port, original, tmp_path / "hand", tmp_path / "graph_safe", updates, evaluations)


def test_run_glue_no_trainer_dynamic_padding_ported_is_the_script_bit_for_bit(tmp_path):
    """The script's default padding (no ``--pad_to_max_length``: ``DataCollatorWithPadding``
    pads each batch to its longest sentence) on sentences of 2 to 8 words, k = 2: batches of
    several lengths; the step captures the first length after its warm-up and replays it where
    it comes back, and runs the others eagerly (``on_new_shape="eager"``, the default; measured:
    41 calls, 24 warm-up, 3 replayed, 14 eager); compared as the flag matrix's."""
    flags = ["--gradient_accumulation_steps", "2", "--num_train_epochs", "4"]
    flags += ["--lr_scheduler_type", "linear", "--learning_rate", "1e-3"]
    upstream_glue.make_inputs(tmp_path, varied=True)
    original = _glue(tmp_path, "graph_safe", flags, pad=False)
    port = _glue(tmp_path, "hand", flags, pad=False)
    _glue_same(port, original, tmp_path / "hand", tmp_path / "graph_safe", 24, 4)
    report = port[0]["report"]
    eager, warmup = (int(re.search(rf"\b{k}=(\d+)", report)[1]) for k in ("eager", "warm-up"))
    assert eager > warmup, report  # batches of another length than the captured one ran eagerly


def test_run_glue_no_trainer_resumed_mid_epoch_ported_is_the_script_bit_for_bit(tmp_path):
    """``--checkpointing_steps 8 --resume_from_checkpoint .../step_8`` at k = 2, each run
    resumed from the checkpoint it wrote itself: the script skips ``8 * k`` batches of epoch 1
    (``skip_first_batches``), more than its 8 updates took (its windows start with one call),
    so its resumed epoch ends inside a window that the next epoch's first batch closes; the
    port follows that too. The full runs and the resumed ones compared as the flag matrix's."""
    flags = ["--gradient_accumulation_steps", "2", "--num_train_epochs", "5"]
    flags += ["--lr_scheduler_type", "linear", "--num_warmup_steps", "3"]
    flags += ["--learning_rate", "1e-3", "--checkpointing_steps", "8"]
    upstream_glue.make_inputs(tmp_path)
    original = _glue(tmp_path, "graph_safe", flags)
    port = _glue(tmp_path, "hand", flags)
    _glue_same(port, original, tmp_path / "hand", tmp_path / "graph_safe", 30, 5)
    resumed = {}
    for variant in ("graph_safe", "hand"):
        resume = ["--resume_from_checkpoint", str(tmp_path / variant / "step_8")]
        resumed[variant] = _glue(tmp_path, variant, flags + resume, out=f"{variant}_resumed")
    # the script's resumed run: epochs 1 (8 batches) to 4, 22 updates (the last window of
    # epoch 1 closed in epoch 2), 4 evaluations
    _glue_same(
        resumed["hand"], resumed["graph_safe"],
        tmp_path / "hand_resumed", tmp_path / "graph_safe_resumed", 22, 4,
    )  # fmt: skip


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
        assert _replays(ours["report"]) > 0, ours["report"]


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


def _autoregressive(tmp_path, variant: str, k: int, flags: tuple[str, ...] = ()):
    for package in ("accelerate", "datasets", "transformers", "tokenizers"):  # all in .[dev]
        pytest.importorskip(package)
    script = upstream.script(upstream_autoregressive.FOLDER, upstream_autoregressive.NAME)
    args = (str(tmp_path), str(script), variant, k, flags)
    return run_distributed(upstream_autoregressive.run, 2, args=args, timeout=RUN_S)


def _autoregressive_same(port, script, k: int) -> None:
    """Every micro-batch's loss, the LR and parameters after each update, the evaluation logits
    and every printed line, on each rank, the port replaying."""
    updates = 3 * -(-29 // k)  # the script's optimizer steps: ceil(29 / k) an epoch
    for rank, (ours, theirs) in enumerate(zip(port, script)):
        assert len(theirs["updates"]) == updates and len(theirs["losses"]) == 3 * 29
        assert len([line for line in theirs["printed"] if "update step" in line]) == (
            updates if rank == 0 else 0
        )
        assert len(theirs["logits"]) == 3  # 50 texts in batches of 32: one a rank an epoch
        for key in ("losses", "lrs", "updates", "logits", "printed"):
            _same(ours[key], theirs[key], f"rank {rank} {key}")
        assert _replays(ours["report"]) > 0, ours["report"]


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
    _autoregressive_same(port, script, k)


def test_accelerates_autoregressive_bf16_ported_is_the_script_bit_for_bit(tmp_path):
    """``--mixed_precision bf16 --gradient_accumulation_steps 3`` (short last windows of 2):
    training under Accelerate's autocast and the port's ``amp`` from the Accelerator, and the
    script's evaluation forwards through ``train_step.model`` (``model = train_step.model``)
    under the autocast the prepared model's forward ran in (issue 52 item 4): the logits
    compared bit for bit, as every printed line. (The script's printed eval perplexity and
    eval_loss are computed from ``loss``, the last training micro-batch's, not from the
    evaluation's ``eval_loss``: an upstream slip; the logits are what evaluation compares.)"""
    upstream_autoregressive.make_inputs(tmp_path)
    flags = ("--mixed_precision", "bf16")
    script = _autoregressive(tmp_path, "graph_safe", 3, flags)
    port = _autoregressive(tmp_path, "port", 3, flags)
    for theirs in script:  # the script's evaluation ran under autocast: bf16 values (upcast)
        logits = theirs["logits"][0]
        assert torch.equal(logits, logits.to(torch.bfloat16).to(logits.dtype)), logits
    _autoregressive_same(port, script, 3)


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


# the guide's diff of each script's port (issue 52 item 6), applied to the pinned script, gives
# the port these tests run, up to layout (the guide wraps long lines with "\\" and indents
# less to fit 80 columns): each stretch between "..." lines is a hunk whose context and "-"
# lines occur once in the script, replaced by its context and "+" lines
GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "accelerate.md"
GUIDE_PORTS = {
    "### A loop that accumulates by hand\n": (upstream_glue, upstream_glue.HAND_PORT),
    "### A loop that accumulates by hand with `no_sync`\n": (
        upstream_autoregressive, upstream_autoregressive.PORT,
    ),
}  # fmt: skip


def _layout_free(lines: list[str]) -> str:
    return re.sub(r"\s|\\", "", "".join(lines))


def _guide_hunks(heading: str, guide: Path = GUIDE) -> list[tuple[str, str]]:
    """Each hunk (old side, new side) of the first diff block after ``heading`` in ``guide``."""
    text = guide.read_text(encoding="utf-8")
    assert text.count(heading) == 1, heading
    block = text.split(heading, 1)[1].split("```diff\n", 1)[1].split("\n```", 1)[0]
    hunks: list[tuple[list[str], list[str]]] = [([], [])]
    for line in block.splitlines():
        if line.strip() == "...":
            hunks.append(([], []))
            continue
        old, new = hunks[-1]
        if not line.startswith("+"):
            old.append(line[1:])
        if not line.startswith("-"):
            new.append(line[1:])
    return [(_layout_free(old), _layout_free(new)) for old, new in hunks]


@pytest.mark.parametrize("heading", sorted(GUIDE_PORTS), ids=["glue", "autoregressive"])
def test_the_guides_diff_is_the_port_as_tested(heading):
    """What the Accelerate guide tells a user to change in each script is what these tests
    change in it (the port the tests run is made from the pinned script by their own edits)."""
    module, edits = GUIDE_PORTS[heading]
    text = upstream.script(module.FOLDER, module.NAME).read_text(encoding="utf-8")
    applied = _layout_free(text.splitlines())
    for old, new in _guide_hunks(heading):
        assert applied.count(old) == 1, f"the guide's hunk is not once in the script: {old}"
        applied = applied.replace(old, new)
    assert applied == _layout_free(upstream.ported(text, edits).splitlines())


# on each of 2 ranks: 7 batches of 64 to train an epoch (21 updates), 2 to evaluate
CV_IMAGES = 1120


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_complete_cv_example_ported_is_the_script_bit_for_bit_on_two_ranks(tmp_path, precision):
    """``complete_cv_example.py`` as written (``--cpu``, Accelerate's own gloo group of 2 ranks)
    against the Accelerate guide's port, with timm's ``test_resnet`` built where the script asks
    timm for its ResNet-50d (the one change to its run, made outside it: the script's 224-px
    batches of 64 through a ResNet-50d are too heavy for a 2-core machine; the GPU test runs
    its own model): on each rank every step's loss, the LR and every parameter after each
    update, the evaluation logits and the accuracy it prints, bit for bit, the script's Adam
    made graph-safe as the port's is. Its ``OneCycleLR`` rewrites Adam's betas before every
    update: the port re-captures once, then runs eagerly while they keep changing (issue 52
    item 5), and replays on the CPU engine before that."""
    for package in ("accelerate", "timm", "torchvision"):
        pytest.importorskip(package)
    script = upstream.script(upstream_cv.FOLDER, upstream_cv.NAME)
    upstream_cv.make_images(tmp_path / "images", CV_IMAGES)
    flags = ["--mixed_precision", precision, "--checkpointing_steps", "epoch", "--cpu"]
    runs = {}
    for variant in ("graph_safe", "port"):
        args = (str(tmp_path), str(script), variant, flags, "cpu", "test_resnet")
        runs[variant] = run_distributed(upstream_cv.run, 2, args=args, timeout=RUN_S)
    for rank, (ours, theirs) in enumerate(zip(runs["port"], runs["graph_safe"])):
        assert len(theirs["updates"]) == 3 * 7 and len(theirs["logits"]) == 3 * 2, rank
        assert len(theirs["printed"]) == (3 if rank == 0 else 0), theirs["printed"]
        for key in ("losses", "lrs", "updates", "logits", "printed"):
            _same(ours[key], theirs[key], f"rank {rank} {key}")
        assert _replays(ours["report"]) > 0, ours["report"]
        assert "held eager" in ours["report"], ours["report"]
        # two processes: prepare() wraps the model in DDP, and the step wraps it likewise
        assert (ours["ddp_wrappers"], theirs["ddp_wrappers"]) == (1, 1), rank


def test_the_gpu_tests_port_of_complete_cv_example_applies_to_the_pinned_script():
    """``complete_cv_example.py`` fixes its run in its ``main()`` (ResNet-50d, 224 px, batches
    of 64): its own model runs as written in tests/gpu/test_upstream_scripts_gpu.py (passed on
    an H100 at 3b37dd6, float32 and bf16; the test above runs it on the CPU with a small timm
    model). Here: that test's port is made from the pinned script (each edit found once) and
    compiles, the script's backward, update and zeroing gone and its scheduler kept."""
    text = upstream.script(upstream_cv.FOLDER, upstream_cv.NAME).read_text(encoding="utf-8")
    port = upstream.ported(text, upstream_cv.PORT)
    compile(port, upstream_cv.NAME, "exec")
    for gone in ("accelerator.backward(loss)", "optimizer.step()", "optimizer.zero_grad()"):
        assert gone not in port, gone
    assert port.count("lr_scheduler.step()") == 1 and "model = train_step.model" in port
