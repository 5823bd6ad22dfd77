"""Each framework front-end runs graphed on one GPU: a small GPT-2 on padded, attention-masked
batches in bf16 (transformers' Trainer, Accelerate, Fabric) and a LightningModule; the report
shows replays and no eager step after warm-up, and the LR schedule reaches the graph."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from .. import fp16_workers  # noqa: E402
from .. import integration_workers as workers  # noqa: E402

pytestmark = pytest.mark.timeout(600)

STEPS = 40  # optimizer steps: 12 of warm-up, then replays


def _graphed_throughout(report, calls=None):
    """Graphed after the warm-up, no eager tail; ``calls``: every one of that many step calls
    (micro-batches) ran, all but the warm-up's replayed."""
    assert report.mode == "graphed", str(report)
    assert report.replays > 0 and report.fallbacks == [], str(report)
    assert report.eager_steps == report.warmup_steps, str(report)  # no eager tail
    if calls is not None:
        assert report.steps == calls, str(report)
        assert report.replays == calls - report.warmup_steps, str(report)


def _gpt2():
    torch.manual_seed(0)
    return workers.tiny_gpt2().cuda()


def test_graph_trainer_replays_in_bf16_and_the_schedule_drives_the_lr(tmp_path):
    from ddpgraph.integrations.transformers import GraphTrainer

    def train(cls):
        args = workers.trainer_args(
            str(tmp_path / cls.__name__), max_steps=STEPS, bf16=True, use_cpu=False,
            save_strategy="no",
        )  # fmt: skip
        trainer = cls(model=_gpt2(), args=args, train_dataset=workers.gpt2_data(640))
        trainer.train()
        return trainer, [e for e in trainer.state.log_history if "loss" in e]

    ours, logs = train(GraphTrainer)
    _graphed_throughout(ours.report().step, calls=2 * STEPS)
    assert "num_items_in_batch: ()" in str(ours.report())  # a graph input (int64 on CUDA)
    # the optimizer the graph updates holds the scheduler's last LR (a device tensor)
    real = ours.train_step.optimizer
    assert float(real.param_groups[0]["lr"]) == pytest.approx(logs[-1]["learning_rate"])
    _, plain_logs = train(transformers.Trainer)
    assert [e["learning_rate"] for e in logs] == [e["learning_rate"] for e in plain_logs]
    # capturable AdamW rounds differently from the Trainer's: close, not equal
    assert logs[-1]["loss"] == pytest.approx(plain_logs[-1]["loss"], rel=0.05)


def _masked_loader():
    from torch.utils.data import DataLoader

    return DataLoader(workers.gpt2_data(320), batch_size=4, drop_last=True)


def test_from_accelerator_replays_in_bf16(rt):
    accelerate = pytest.importorskip("accelerate")
    from ddpgraph.integrations.accelerate import from_accelerator

    accelerator = accelerate.Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = accelerator.prepare(_masked_loader())
    step = from_accelerator(accelerator, model, optimizer, clip_grad_norm=1.0)
    for _ in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                step(batch)
    torch.cuda.synchronize()
    _graphed_throughout(step.report(), calls=2 * len(loader))


def test_from_fabric_replays_in_bf16():
    fabric_module = pytest.importorskip("lightning.fabric")
    from ddpgraph.integrations.fabric import from_fabric

    fabric = fabric_module.Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = fabric.setup_dataloaders(_masked_loader())
    step = from_fabric(fabric, model, optimizer, accumulate_calls=2, clip_grad_norm=1.0)
    for _ in range(2):
        for batch in loader:
            step(batch)
    torch.cuda.synchronize()
    _graphed_throughout(step.report(), calls=2 * len(loader))


def test_graph_strategy_replays_a_lightning_module_in_bf16():
    pl = pytest.importorskip("lightning.pytorch")
    from ddpgraph.integrations.lightning import GraphStrategy

    class GPT2Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = workers.tiny_gpt2()

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
            schedule = workers._warmup_schedule(optimizer)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"},
            }

    strategy = GraphStrategy()
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed",
        max_steps=STEPS, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    try:
        trainer.fit(GPT2Module(), _masked_loader())
        torch.cuda.synchronize()
        _graphed_throughout(strategy.train_step.report(), calls=2 * STEPS)
        assert trainer.global_step == STEPS
        assert torch.isfinite(trainer.callback_metrics["train_loss"])
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _trainer_run(cls, out, rows=640, extra=None, **overrides):
    """A GraphTrainer or plain Trainer run on one GPU (``extra``: more Trainer arguments,
    ``overrides``: TrainingArguments'); its trainer and its log entries."""
    from ddpgraph.integrations.transformers import GraphTrainer

    options = {"max_steps": STEPS, "use_cpu": False, "save_strategy": "no", **overrides}
    args = workers.trainer_args(str(out / cls.__name__), **options)
    common = dict(model=_gpt2(), args=args, train_dataset=workers.gpt2_data(rows))
    if overrides.get("eval_strategy", "no") != "no":
        common["eval_dataset"] = workers.gpt2_data(32, seed=7)
    trainer = cls(**{**common, **(extra or {})})
    trainer.train()
    if cls is GraphTrainer:
        torch.cuda.synchronize()
    return trainer, trainer.state.log_history


def _lrs(logs):
    return [e["learning_rate"] for e in logs if "loss" in e]


def _counting_rows(n, seed, length=16, vocab=100):
    """Padded rows counting up from a random token (mod ``vocab``): learnable in 40 steps, so an
    eval loss moves by more than dropout's run-to-run noise when training goes wrong (on the
    CPU, seeds 0-3 end 3.7079-3.7120; dropout left on in evaluation 3.7292, no dropout in
    training 3.6844; random tokens cannot tell those apart)."""
    gen = torch.Generator().manual_seed(seed)
    ids = (torch.randint(vocab, (n, 1), generator=gen) + torch.arange(length)) % vocab
    lengths = torch.randint(4, length + 1, (n,), generator=gen)
    mask = (torch.arange(length) < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def test_graph_trainer_evaluates_every_n_steps_in_bf16_within_the_trainers_own_noise(tmp_path):
    """bf16, a GPT-2 with dropout (0.1, GPT2Config's default), evaluation every 8 steps: the
    LRs are the plain Trainer's, and each eval loss lies within the plain Trainer's own
    run-to-run spread (seeds 0-3: other dropout masks, the same data order; a graph draws
    its dropout masks from other RNG offsets than an eager run), graphed throughout."""
    # the Trainer's evaluation loop would prepare (and wrap the forward of) a model Accelerate
    # never saw; GraphTrainer prepares it before the step is built, so nothing moves mid-run
    from ddpgraph.integrations.transformers import GraphTrainer

    assert workers.tiny_gpt2().config.resid_pdrop > 0  # the noise below is dropout's
    data = {"train_dataset": _counting_rows(640, 3), "eval_dataset": _counting_rows(32, 7)}
    eval_args = {"bf16": True, "eval_strategy": "steps", "eval_steps": 8, "data_seed": 0}

    def run(cls, seed):
        return _trainer_run(cls, tmp_path / f"seed{seed}", extra=data, seed=seed, **eval_args)

    ours, logs = run(GraphTrainer, 0)
    _graphed_throughout(ours.report().step, calls=2 * STEPS)  # no eager step after an eval
    plain = [run(transformers.Trainer, seed)[1] for seed in (0, 1, 2, 3)]
    assert _lrs(logs) == _lrs(plain[0])
    evals = [e for e in logs if "eval_loss" in e]
    assert [e["step"] for e in evals] == [8, 16, 24, 32, 40]
    assert all("eval_model_preparation_time" not in e for e in evals)
    for i, ours_eval in enumerate(evals):
        runs = [[e for e in other if "eval_loss" in e][i]["eval_loss"] for other in plain]
        low, high = min(runs), max(runs)
        spread = high - low
        assert spread > 0, runs  # dropout is on: the plain runs differ
        # a fifth draw of the same (normal) noise lands outside this band about 0.2 % of times
        assert low - spread <= ours_eval["eval_loss"] <= high + spread, (ours_eval, runs)
    norms = [e["grad_norm"] for e in logs if "grad_norm" in e]
    assert max(norms) < 10 * min(norms), norms  # no grad norm doubling after an evaluation


@pytest.mark.parametrize(("optim", "overflow"), fp16_workers.TRAINER_CASES)
def test_graph_trainer_fp16_logs_the_plain_trainers_lrs_and_losses(tmp_path, optim, overflow):
    """The Trainer steps its scheduler unless Accelerate reports the update skipped, which it
    does only for an optimizer whose step GradScaler skips: the default fused AdamW's schedule
    advances through fp16 overflows, a foreach AdamW's is held back (measured on the H200 with
    transformers 5.17, accelerate 1.15: the plain Trainer's LR advanced while its grad norm
    was nan; tests/test_integrations_fp16_skips.py runs the same on the CPU, bitwise)."""
    # a loss times 1000 (overflow=True) overflows fp16's first loss scales: those updates are
    # skipped on the device
    from ddpgraph.integrations.transformers import GraphTrainer

    from .. import trainer_workers

    extra = {"compute_loss_func": trainer_workers._scaled_loss} if overflow else {}
    runs = [
        _trainer_run(cls, tmp_path, extra=extra, fp16=True, optim=optim)
        for cls in (GraphTrainer, transformers.Trainer)
    ]
    (ours, logs), (_, plain) = [(t, [e for e in log if "loss" in e]) for t, log in runs]
    _graphed_throughout(ours.report().step, calls=2 * STEPS)
    skipped = [not math.isfinite(e["grad_norm"]) for e in plain]
    assert [not math.isfinite(e["grad_norm"]) for e in logs] == skipped
    assert ours.report().step.skipped_steps == sum(skipped), str(ours.report())
    first_update = skipped.index(False) if False in skipped else len(skipped)
    assert not any(skipped[first_update:]), skipped  # the scale settles, then stays
    if overflow:
        assert first_update >= 4, plain
    assert _lrs(logs) == _lrs(plain)  # at every logged step, exactly
    held = [e["learning_rate"] for e in plain[:first_update]]
    if optim == "adamw_torch_fused":
        assert len(set(held)) == len(held), held  # advanced through the overflows
    else:
        assert held == [0.0] * len(held), held  # held at the warm-up's start
    # the losses: equal while no update has landed (the same model, the same batches); after,
    # GraphTrainer's optimizer is capturable (its LR a device tensor) and, with foreach AdamW,
    # fused: rounding apart, not equal (the CPU test shows them bitwise with the fused kernel)
    assert [e["loss"] for e in logs[: first_update + 1]] == [
        e["loss"] for e in plain[: first_update + 1]
    ]
    assert [e["loss"] for e in logs] == pytest.approx([e["loss"] for e in plain], rel=1e-3)


def test_graph_trainer_steps_on_an_epoch_tail_graphed(tmp_path):
    # 79 batches an epoch with gradient_accumulation_steps=2: every epoch ends in a window of 1
    from ddpgraph.integrations.transformers import GraphTrainer

    tail = {"bf16": True, "max_steps": -1, "num_train_epochs": 2}
    ours, logs = _trainer_run(GraphTrainer, tmp_path, rows=316, **tail)
    _graphed_throughout(ours.report().step, calls=2 * 79)
    _, plain = _trainer_run(transformers.Trainer, tmp_path, rows=316, **tail)
    assert ours.state.global_step == 80
    assert [e["learning_rate"] for e in logs if "loss" in e] == [
        e["learning_rate"] for e in plain if "loss" in e
    ]
