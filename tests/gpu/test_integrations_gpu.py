"""Each framework front-end runs graphed on one GPU: a small GPT-2 on padded, attention-masked
batches in bf16 (transformers' Trainer, Accelerate, Fabric) and a LightningModule; the report
shows replays and no eager step after warm-up, and the LR schedule reaches the graph."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from .. import integration_workers as workers  # noqa: E402

pytestmark = pytest.mark.timeout(600)

STEPS = 40  # optimizer steps: 12 of warm-up, then replays


def _graphed_throughout(report):
    assert report.mode == "graphed", str(report)
    assert report.replays > 0 and report.fallbacks == [], str(report)
    assert report.eager_steps == report.warmup_steps, str(report)  # no eager tail


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
    _graphed_throughout(ours.report().step)
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
    from ddpgraph import TrainStep

    accelerator = accelerate.Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = accelerator.prepare(_masked_loader())
    step = TrainStep.from_accelerator(accelerator, model, optimizer, clip_grad_norm=1.0)
    for _ in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                step(batch)
    torch.cuda.synchronize()
    _graphed_throughout(step.report())


def test_from_fabric_replays_in_bf16():
    fabric_module = pytest.importorskip("lightning.fabric")
    from ddpgraph import TrainStep

    fabric = fabric_module.Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = fabric.setup_dataloaders(_masked_loader())
    step = TrainStep.from_fabric(fabric, model, optimizer, accumulate_calls=2, clip_grad_norm=1.0)
    for _ in range(2):
        for batch in loader:
            step(batch)
    torch.cuda.synchronize()
    _graphed_throughout(step.report())


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
        _graphed_throughout(strategy.train_step.report())
        assert trainer.global_step == STEPS
        assert torch.isfinite(trainer.callback_metrics["train_loss"])
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _trainer_run(cls, out, rows=640, **overrides):
    """A GraphTrainer or plain Trainer run on one GPU; its trainer and its log entries."""
    from ddpgraph.integrations.transformers import GraphTrainer

    options = {"max_steps": STEPS, "use_cpu": False, "save_strategy": "no", **overrides}
    args = workers.trainer_args(str(out / cls.__name__), **options)
    common = dict(model=_gpt2(), args=args, train_dataset=workers.gpt2_data(rows))
    if overrides.get("eval_strategy", "no") != "no":
        common["eval_dataset"] = workers.gpt2_data(32, seed=7)
    trainer = cls(**common)
    trainer.train()
    if cls is GraphTrainer:
        torch.cuda.synchronize()
    return trainer, trainer.state.log_history


def test_graph_trainer_evaluates_every_n_steps_in_bf16_and_stays_graphed(tmp_path):
    # the Trainer's evaluation loop would prepare (and wrap the forward of) a model Accelerate
    # never saw; GraphTrainer prepares it before the step is built, so nothing moves mid-run
    from ddpgraph.integrations.transformers import GraphTrainer

    eval_args = {"bf16": True, "eval_strategy": "steps", "eval_steps": 8}
    ours, logs = _trainer_run(GraphTrainer, tmp_path, **eval_args)
    _graphed_throughout(ours.report().step)
    _, plain = _trainer_run(transformers.Trainer, tmp_path, **eval_args)
    evals = [e for e in logs if "eval_loss" in e]
    plain_evals = [e for e in plain if "eval_loss" in e]
    assert [e["step"] for e in evals] == [e["step"] for e in plain_evals] == [8, 16, 24, 32, 40]
    assert all("eval_model_preparation_time" not in e for e in evals)
    norms = [e["grad_norm"] for e in logs if "grad_norm" in e]
    assert max(norms) < 10 * min(norms), norms  # no grad norm doubling after an evaluation
    # the capturable optimizer rounds differently from the Trainer's: close, not equal
    assert evals[-1]["eval_loss"] == pytest.approx(plain_evals[-1]["eval_loss"], rel=0.05)


def test_graph_trainer_fp16_holds_the_scheduler_back_after_an_overflow(tmp_path):
    # a loss times 1e4 overflows fp16's first loss scales: those updates are skipped on the
    # device, and the Trainer's LR schedule must not advance for them (Accelerate's rule)
    from ddpgraph.integrations.transformers import GraphTrainer

    from .. import trainer_workers

    def run(cls):
        args = workers.trainer_args(
            str(tmp_path / cls.__name__), max_steps=STEPS, use_cpu=False, fp16=True,
            save_strategy="no",
        )  # fmt: skip
        trainer = cls(
            model=_gpt2(), args=args, train_dataset=workers.gpt2_data(640),
            compute_loss_func=trainer_workers._scaled_loss,
        )  # fmt: skip
        trainer.train()
        return trainer, [e["learning_rate"] for e in trainer.state.log_history if "loss" in e]

    ours, rates = run(GraphTrainer)
    assert ours.report().step.skipped_steps > 0, str(ours.report())
    _, plain_rates = run(transformers.Trainer)
    assert rates == plain_rates
    assert rates[0] == rates[1] == 0.0  # held at the warm-up's start while skipping


def test_graph_trainer_steps_on_an_epoch_tail_graphed(tmp_path):
    # 79 batches an epoch with gradient_accumulation_steps=2: every epoch ends in a window of 1
    from ddpgraph.integrations.transformers import GraphTrainer

    tail = {"bf16": True, "max_steps": -1, "num_train_epochs": 2}
    ours, logs = _trainer_run(GraphTrainer, tmp_path, rows=316, **tail)
    _graphed_throughout(ours.report().step)
    _, plain = _trainer_run(transformers.Trainer, tmp_path, rows=316, **tail)
    assert ours.state.global_step == 80
    assert [e["learning_rate"] for e in logs if "loss" in e] == [
        e["learning_rate"] for e in plain if "loss" in e
    ]
