"""timm's ``train.py`` (pinned in ../shared/upstream/timm_train/, timm v1.0.28) run as written and
as the graphed-training guide ports it, on 2 gloo CPU ranks with the same seed and data (issue 52
items 1, 3 and 6): every micro-batch's loss, the LR and every parameter after each optimizer
update and the LR after each epoch's scheduler step, each validation's outputs and the lines it
logs (loss, Acc@1, Acc@5), the training lines (loss, LR), and every checkpoint the ``--output``
folder holds (``checkpoint-N``, ``last``, ``model_best``: model, EMA and optimizer state) and
its ``summary.csv``, bit for bit; the port replaying on the CPU engine. Worker, and what it
patches outside the script on the CPU (DDP's ``device_ids``, the loader's
``persistent_workers``): tests/upstream_timm.py.

The script's run is ``graph_safe``: its optimizer made graph-safe where the port's TrainStep
makes it (fused SGD, capturable AdamW, the LR read from a float32 tensor); one test runs the
untouched script too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpgraph.testing import run_distributed

from . import upstream, upstream_timm
from .test_upstream_scripts import _guide_hunks, _layout_free, _replays, _same

pytestmark = pytest.mark.timeout(900)
RUN_S = 600  # a launch of 2 ranks importing torch, torchvision and timm on a loaded machine

# 10 batches of 4 a rank an epoch; every set runs past the step's warm-up (12 calls) and replays
BASE = ["--lr", "0.05", "--warmup-epochs", "1", "--checkpoint-hist", "2"]
FLAG_SETS = {
    # cosine per epoch, SGD (nesterov), label smoothing, --dist-bn reduce: timm's defaults
    "defaults": ["--epochs", "3"],
    "k2-sched-on-updates": ["--epochs", "4", "--grad-accum-steps", "2", "--sched-on-updates"],
    # windows of 3, 3, 3 and 1: the short one divides by 1 (timm's accum_steps = len % 3)
    "k3-short-window": ["--epochs", "6", "--grad-accum-steps", "3"],
    "bf16-autocast": ["--epochs", "3", "--amp", "--amp-dtype", "bfloat16"],
    "adamw-clip": [
        "--epochs", "3", "--opt", "adamw", "--weight-decay", "0.05", "--clip-grad", "0.5",
        "--lr", "2e-3",
    ],
    "ema": ["--epochs", "3", "--model-ema", "--model-ema-decay", "0.9"],
    "mixup-cutmix": ["--epochs", "3", "--mixup", "0.4", "--cutmix", "1.0"],
    "dist-bn-broadcast": ["--epochs", "3", "--dist-bn", "broadcast"],
    "dist-bn-off-step-sched": ["--epochs", "3", "--dist-bn", "", "--sched", "step",
                               "--decay-epochs", "1"],
}  # fmt: skip


def _timm(tmp_path: Path, variant: str, flags: list[str], out: str = "") -> list[dict]:
    for package in ("timm", "torchvision"):  # the CPU suite's venv has both (torch 2.14.1)
        pytest.importorskip(package)
    script = upstream.script(upstream_timm.FOLDER, upstream_timm.NAME)
    args = (str(tmp_path), str(script), variant, flags, out)
    # init=False: the script starts its own gloo group (--device cpu) from the environment
    return run_distributed(upstream_timm.run, 2, args=args, timeout=RUN_S, init=False)


def _timm_same(
    port, script, port_out: Path, script_out: Path, updates: int, epochs: int, ema=False
):
    """On each rank every loss, LR, parameter, validation output and logged line; the files of
    the two output folders; the port replayed."""
    files = upstream_timm.saved(port_out), upstream_timm.saved(script_out)
    assert "run/last.pth.tar" in files[1] and "run/model_best.pth.tar" in files[1], files[1]
    _same(*files, "output files")
    for rank, (ours, theirs) in enumerate(zip(port, script)):
        assert len(theirs["updates"]) == updates, len(theirs["updates"])
        # 3 validation batches an epoch, and as many through the EMA copy (--model-ema)
        validations = 3 * epochs * (2 if ema else 1)
        assert len(theirs["epoch_lrs"]) == epochs and len(theirs["outputs"]) == validations
        tests = [line for line in theirs["printed"] if line.startswith("Test:")]
        assert len(tests) == (3 * epochs if rank == 0 else 0), theirs["printed"]
        for key in ("losses", "lrs", "updates", "epoch_lrs", "outputs", "printed"):
            _same(ours[key], theirs[key], f"rank {rank} {key}")
        # torch.equal compares values across dtypes: the script logs in its loss's own
        assert [t.dtype for t in ours["losses"]] == [t.dtype for t in theirs["losses"]]
        assert _replays(ours["report"]) > 0, ours["report"]


def _updates(flags: list[str]) -> tuple[int, int]:
    epochs = int(flags[flags.index("--epochs") + 1])
    k = int(flags[flags.index("--grad-accum-steps") + 1]) if "--grad-accum-steps" in flags else 1
    return epochs * -(-10 // k), epochs


@pytest.mark.parametrize("flag_set", sorted(FLAG_SETS))
def test_timm_train_flag_matrix_ported_is_the_script_bit_for_bit(tmp_path, flag_set):
    """Each flag set of the script (its optimizer graph-safe) against the guide's port."""
    flags = [*BASE, *FLAG_SETS[flag_set]]
    upstream_timm.make_images(tmp_path / "data")
    script = _timm(tmp_path, "graph_safe", flags)
    port = _timm(tmp_path, "port", flags)
    updates, epochs = _updates(flags)
    ema = "--model-ema" in flags
    _timm_same(port, script, tmp_path / "port", tmp_path / "graph_safe", updates, epochs, ema)


def test_timm_train_resumed_ported_is_the_script_bit_for_bit(tmp_path):
    """``--resume .../checkpoint-1.pth.tar`` at k = 2 with per-update schedules, each run
    resumed from the checkpoint it wrote itself: the script loads model and optimizer (the
    port's TrainStep is built after the load) and steps its schedule to epoch 2; the resumed
    runs compared as the flag matrix's (their ``step_update`` calls: the script's at the
    start, to epoch 2's first update, then 5 in each of epochs 2 to 5; 40 step calls, past
    the warm-up)."""
    flags = [*BASE, "--epochs", "6", "--grad-accum-steps", "2", "--sched-on-updates"]
    flags += ["--checkpoint-hist", "10"]  # keep checkpoint-1 whatever its metric
    upstream_timm.make_images(tmp_path / "data")
    full = {variant: _timm(tmp_path, variant, flags) for variant in ("graph_safe", "port")}
    _timm_same(full["port"], full["graph_safe"], tmp_path / "port", tmp_path / "graph_safe", 30, 6)
    resumed = {}
    for variant in ("graph_safe", "port"):
        checkpoint = tmp_path / variant / "run" / "checkpoint-1.pth.tar"
        resumed[variant] = _timm(
            tmp_path, variant, [*flags, "--resume", str(checkpoint)], f"{variant}_resumed"
        )
    _timm_same(
        resumed["port"], resumed["graph_safe"],
        tmp_path / "port_resumed", tmp_path / "graph_safe_resumed", 1 + 4 * 5, 4,
    )  # fmt: skip


def test_timm_train_ported_against_the_untouched_script(tmp_path):
    """timm's defaults (SGD, cosine per epoch) against the script with its optimizer untouched
    (the for-loop SGD, its LR a Python float): every loss, parameter and validation output bit
    for bit; each LR read after the scheduler's ``step`` is the number the script's scheduler
    set, and after ``step_update`` (which sets none per epoch) the float32 the step copied it
    into. At
    7fde069 the port's LR after the warm-up epoch was 7.5e-06 instead of 0.0375: timm's
    scheduler, built after the TrainStep, kept the step's LR tensor as its base LR, which each
    LR the step copied in overwrote."""
    import torch

    flags = [*BASE, "--epochs", "3"]
    upstream_timm.make_images(tmp_path / "data")
    script = _timm(tmp_path, "original", flags)
    port = _timm(tmp_path, "port", flags)
    for rank, (ours, theirs) in enumerate(zip(port, script)):
        for key in ("losses", "updates", "outputs"):
            _same(ours[key], theirs[key], f"rank {rank} {key}")
        assert ours["epoch_lrs"] == theirs["epoch_lrs"]
        assert len(ours["lrs"]) == len(theirs["lrs"]) == 30
        for mine, its in zip(ours["lrs"], theirs["lrs"]):
            assert mine == [float(torch.tensor(lr, dtype=torch.float32)) for lr in its]
        assert _replays(ours["report"]) > 0, ours["report"]


def test_a_timm_scheduler_built_after_the_step_keeps_its_base_lr():
    """timm's schedulers keep ``group["lr"]`` as their base value without copying it; built
    after ``make_graph_safe`` they must find the script's float, not the LR tensor each LR is
    then copied into: every LR equals the plain optimizer's, to float32."""
    pytest.importorskip("timm")
    import torch
    from timm.scheduler import create_scheduler_v2

    from ddpgraph.step.optim import make_graph_safe

    def lrs(graph_safe: bool) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
        plan = make_graph_safe(optimizer, torch.device("cpu")) if graph_safe else None
        scheduler, _ = create_scheduler_v2(
            optimizer, sched="cosine", num_epochs=4, warmup_epochs=1, warmup_lr=1e-3,
            updates_per_epoch=5, step_on_epochs=False,
        )  # fmt: skip
        found = []
        for update in range(1, 16):
            scheduler.step_update(update)
            if plan is not None:
                plan.sync_lr()  # what the step does before each call
            found.append(float(optimizer.param_groups[0]["lr"]))
        return found

    expected = [float(torch.tensor(lr, dtype=torch.float32)) for lr in lrs(False)]
    assert lrs(True) == expected


# what each unfinished port is told (the refusal's first words, and the fix it names)
REFUSALS = {
    "port_no_window": (
        "the script turned the gradient sync back on at micro-batch 1 of accumulate_calls=3 "
        "micro-batches, ending a short window",
        "(timm: step(input, target, window=accum_steps))",
    ),
    "port_no_accumulate_calls": (
        "the script turned the gradient sync off for this call",
        "pass accumulate_calls=k (k micro-batches per optimizer step, one per call): the k-th "
        "call, or the first one with the sync on again, syncs and steps; where the script "
        "divides a short window's loss by its own length (timm's train.py: accum_steps becomes "
        "the epoch's last window's length), pass that length too: step(input, target, "
        "window=accum_steps).",
    ),
}


@pytest.mark.parametrize("variant", sorted(REFUSALS))
def test_timm_train_ported_without_its_window_is_refused_on_every_rank(tmp_path, variant):
    """The port without ``window=accum_steps``, or without ``accumulate_calls`` too, at
    ``--grad-accum-steps 3`` (windows 3, 3, 3, 1): ``ConfigError`` with the same text on every
    rank before an update runs short (without ``window=``: at epoch 0's short window, the
    script's sync back on after one call; without ``accumulate_calls``: at its first call, the
    script's sync off), so no validation or checkpoint is written from a wrong update; the
    advice names the fix (issue 52 items 2 and 3)."""
    for package in ("timm", "torchvision"):  # in .[dev]
        pytest.importorskip(package)
    flags = [*BASE, "--epochs", "2", "--grad-accum-steps", "3"]
    upstream_timm.make_images(tmp_path / "data")
    script = upstream.script(upstream_timm.FOLDER, upstream_timm.NAME)
    args = (str(tmp_path), str(script), variant, flags)
    errors = run_distributed(
        upstream_timm.run, 2, args=args, timeout=RUN_S, init=False, return_exceptions=True
    )
    assert [type(error).__name__ for error in errors] == ["ConfigError"] * 2, errors
    texts = {str(error) for error in errors}
    assert len(texts) == 1, texts
    text = texts.pop()
    starts, fix = REFUSALS[variant]
    assert text.startswith(starts) and fix in text, text
    assert not list((tmp_path / variant).rglob("checkpoint-0.pth.tar"))


def test_the_step_returns_a_bf16_loss_in_bf16():
    """Under ``amp="bf16"`` on the CPU a loss computed in bf16 (timm's label-smoothing cross
    entropy under the CPU's autocast) comes back in bf16, eager and replayed, as the script's
    own ``loss`` (at 7fde069 it came back as float32, and timm's logged running loss, averaged
    through ``loss.new([...])``, differed: "Loss: 2.33 (2.21)" against the script's "(2.22)")."""
    import torch
    from torch import nn

    from ddpgraph import TrainStep
    from ddpgraph.testing import CpuGraphs

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    reference = nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target.to(out.dtype)).square().mean()  # bf16 under autocast

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # LR 0: every call the same loss
    step = TrainStep(model, optimizer, loss_fn, amp="bf16", engine=CpuGraphs())
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = loss_fn(reference(x), y)
    assert expected.dtype == torch.bfloat16
    losses = [step(x, y) for _ in range(14)]
    assert "replays=" in str(step.report()) and _replays(str(step.report())) > 0
    for loss in losses:
        assert loss.dtype == torch.bfloat16 and torch.equal(loss, expected), loss


GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "graphed-training.md"
GUIDE_HEADING = "### timm's `train.py`\n"


def test_the_guides_diff_is_the_timm_port_as_tested():
    """What the graphed-training guide tells a user to change in timm's train.py is what these
    tests change in it (the port they run is made from the pinned script by its own edits)."""
    text = upstream.script(upstream_timm.FOLDER, upstream_timm.NAME).read_text(encoding="utf-8")
    applied = _layout_free(text.splitlines())
    for old, new in _guide_hunks(GUIDE_HEADING, GUIDE):
        assert applied.count(old) == 1, f"the guide's hunk is not once in the script: {old}"
        applied = applied.replace(old, new)
    assert applied == _layout_free(upstream.ported(text, upstream_timm.PORT).splitlines())
