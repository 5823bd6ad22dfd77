"""Epoch tails graphed on one GPU (bf16): each front-end steps on an epoch's leftover
micro-batches as its framework does, with the short window replayed from the training graph;
fp16 under Accelerate steps a prepared scheduler through overflowed updates as Accelerate's own
loop does (held back for an optimizer whose step GradScaler skips, advancing for a fused one)."""

from __future__ import annotations

import math

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


def _graphed_after_warmup(report, calls: int) -> None:
    """All ``calls`` step calls ran, every one after the warm-up replayed (the tails too)."""
    assert report.mode == "graphed" and report.replays > 0, str(report)
    assert report.eager_steps == report.warmup_steps, str(report)
    assert report.steps == calls and report.replays == calls - report.warmup_steps, str(report)


def test_accelerate_epoch_tails_step_graphed_in_bf16(rt):
    accelerate = pytest.importorskip("accelerate")
    from ddpgraph.integrations.accelerate import from_accelerator

    accelerator = accelerate.Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.99**s)
    loader, scheduler = accelerator.prepare(_data(), scheduler)
    step = from_accelerator(accelerator, model, optimizer, nn.CrossEntropyLoss())
    for _ in range(6):
        for x, y in loader:
            with accelerator.accumulate(model):
                step(x, y)
                scheduler.step()
    torch.cuda.synchronize()
    _graphed_after_warmup(step.report(), calls=6 * BATCHES)
    assert scheduler.scheduler.last_epoch == 6 * 7  # 7 updates an epoch: 6 windows + the tail


STEPS = 40  # fp16 steps: the warm-up, then replays
OVERFLOWS = (2, 3, 30)  # steps whose targets are inf: inf/NaN gradients, eager and replayed


def _fp16_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd-fused":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=kind == "adamw-fused")


def _accelerate_fp16_loop(accelerate, kind: str, graphed: bool) -> dict[str, list]:
    """Accelerate's own fp16 loop or from_accelerator's (:func:`fp16_workers.accelerate_fp16_loop`),
    the inputs of steps ``OVERFLOWS`` inf (inf/NaN activations and gradients)."""
    from .. import fp16_workers

    accelerator = accelerate.Accelerator(mixed_precision="fp16")
    model = _mlp()
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [
        (torch.randn(8, 32, device="cuda", generator=gen),
         torch.randint(4, (8,), device="cuda", generator=gen))
        for _ in range(STEPS)
    ]  # fmt: skip
    for i in OVERFLOWS:
        batches[i] = (batches[i][0] * float("inf"), batches[i][1])
    run, step = fp16_workers.accelerate_fp16_loop(
        accelerator, model, _fp16_optimizer(kind, model), nn.CrossEntropyLoss(), batches,
        graphed=graphed,
    )  # fmt: skip
    if step is not None:
        torch.cuda.synchronize()
        _graphed_after_warmup(step.report(), calls=STEPS)
        assert step.report().skipped_steps == len(OVERFLOWS), str(step.report())
    return run


@pytest.mark.parametrize("kind", ["adamw", "adamw-fused", "sgd-fused"])
def test_accelerate_fp16_overflow_steps_the_prepared_scheduler_as_accelerate_does(rt, kind):
    """Accelerate holds a prepared scheduler back after an overflow only where GradScaler
    skipped the optimizer's step (a foreach AdamW); a fused optimizer skips inside its kernel,
    Accelerate reports no skip, the schedule advances. from_accelerator does what Accelerate's
    own loop does, step by step."""
    accelerate = pytest.importorskip("accelerate")
    theirs = _accelerate_fp16_loop(accelerate, kind, graphed=False)
    ours = _accelerate_fp16_loop(accelerate, kind, graphed=True)
    expected = [kind == "adamw" and i in OVERFLOWS for i in range(STEPS)]
    assert theirs["skipped"] == expected  # Accelerate's own verdicts
    assert ours["skipped"] == theirs["skipped"]
    assert ours["lrs"] == theirs["lrs"]
    assert not any(math.isfinite(theirs["losses"][i]) for i in OVERFLOWS), theirs["losses"]
    # capturable (and, for foreach AdamW, fused) in the graph: rounding apart, not equal
    finite = [i for i in range(STEPS) if i not in OVERFLOWS]
    assert [ours["losses"][i] for i in finite] == pytest.approx(
        [theirs["losses"][i] for i in finite], rel=1e-3
    )


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
        _graphed_after_warmup(strategy.train_step.report(), calls=6 * BATCHES)
        assert trainer.global_step == 6 * 7  # Lightning steps on each epoch's tail
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
