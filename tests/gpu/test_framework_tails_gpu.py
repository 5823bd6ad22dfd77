"""Epoch tails graphed on one GPU (bf16): each front-end steps on an epoch's leftover
micro-batches as its framework does, with the short window replayed from the training graph;
fp16 under Accelerate holds a prepared scheduler back after an overflowed update."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.timeout(600)

BATCHES = 13  # a rank's batches per epoch: odd, so k=2 leaves a tail of 1


def _data() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(BATCHES * 8, 32, generator=gen), torch.randint(4, (BATCHES * 8,), generator=gen)
    )
    return DataLoader(data, batch_size=8)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()


def _graphed_after_warmup(report) -> None:
    assert report.mode == "graphed" and report.replays > 0, str(report)
    assert report.eager_steps == report.warmup_steps, str(report)  # the tails replayed too


def test_accelerate_epoch_tails_step_graphed_in_bf16(rt):
    accelerate = pytest.importorskip("accelerate")
    from ddpgraph import TrainStep

    accelerator = accelerate.Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.99**s)
    loader, scheduler = accelerator.prepare(_data(), scheduler)
    step = TrainStep.from_accelerator(accelerator, model, optimizer, nn.CrossEntropyLoss())
    for _ in range(6):
        for x, y in loader:
            with accelerator.accumulate(model):
                step(x, y)
                scheduler.step()
    torch.cuda.synchronize()
    _graphed_after_warmup(step.report())
    assert scheduler.scheduler.last_epoch == 6 * 7  # 7 updates an epoch: 6 windows + the tail


def test_accelerate_fp16_overflow_holds_the_prepared_scheduler_back(rt):
    accelerate = pytest.importorskip("accelerate")
    from ddpgraph import TrainStep

    accelerator = accelerate.Accelerator(mixed_precision="fp16")
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s))
    step = TrainStep.from_accelerator(accelerator, model, optimizer, nn.CrossEntropyLoss())
    x, y = torch.randn(8, 32, device="cuda"), torch.randint(4, (8,), device="cuda")
    for _ in range(20):
        step(x, y)
        scheduler.step()
    stepped = scheduler.scheduler.last_epoch
    step(x * float("inf"), y)  # inf/NaN gradients: the update is skipped on the device
    scheduler.step()
    assert step.update_skipped and accelerator.optimizer_step_was_skipped
    assert scheduler.scheduler.last_epoch == stepped  # held back, as Accelerate holds it


def test_lightning_epoch_tails_step_graphed_in_bf16():
    pl = pytest.importorskip("lightning.pytorch")
    from ddpgraph.integrations.lightning import GraphStrategy

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    strategy = GraphStrategy()
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_epochs=6,
        accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False,
    )  # fmt: skip
    try:
        trainer.fit(Classifier(), _data())
        torch.cuda.synchronize()
        _graphed_after_warmup(strategy.train_step.report())
        assert trainer.global_step == 6 * 7  # Lightning steps on each epoch's tail
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
