"""Fabric's feature matrix: Fabric's own image classifier example and loops of Fabric's
documented habits (accumulation with an epoch tail, clipping, schedulers, precision,
``fabric.save`` / ``fabric.load`` resume), each run as Fabric's own DDP loop and as the guide's
port (eagerly and capturing with CpuGraphs), on 2 gloo ranks.

The image classifier: https://github.com/Lightning-AI/pytorch-lightning at
17c3d0bc8af7179d187457bd9f3ba34d57240fbb, ``examples/fabric/image_classifier/train_fabric.py``
(lightning 2.6 installed here), Apache-2.0, Copyright The Lightning AI team. Shrunk: MNIST (a
download) is 256 + 64 synthetic 28x28 images, 2 epochs, batches of 16; the ``Net`` is
upstream's; torchmetrics' Accuracy is the predictions themselves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .framework_workers import (
    classes,
    graph_safe_optimizer,
    mlp,
    run_rows,
    step_options,
    tensors_of,
)

ROWS: dict[str, dict[str, Any]] = {
    "image_classifier_example": {"example": True},
    "accumulate_epoch_tail": {"loop": {"k": 2}},
    "accumulate_k3_clip_scheduler": {"loop": {"k": 3, "clip": 0.05, "scheduler": True}},
    "bf16_mixed": {"loop": {"k": 2, "precision": "bf16-mixed"}},
    "save_load_resume": {"loop": {"k": 2, "scheduler": True, "resume": True}},
}


def fabric_rows(names: list[str], tmp: str) -> dict[str, dict[str, Any]]:
    return run_rows(ROWS, names, lambda variant, row, name: _row(variant, row, f"{tmp}/{name}"))


def _row(variant: str, row: dict[str, Any], tmp: str) -> dict[str, Any]:
    ported = variant != "framework"
    options = step_options(variant) if ported else {}
    if row.get("example"):
        return image_classifier(ported, options)
    return habits_loop(ported, options, f"{tmp}/{variant}", **row["loop"])


class Net(nn.Module):  # upstream's, unchanged
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def _mnist(n: int, seed: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    images = (torch.rand(n, 1, 28, 28, generator=gen) - 0.1307) / 0.3081
    return torch.utils.data.TensorDataset(images, torch.randint(10, (n,), generator=gen))


def image_classifier(ported: bool, options: dict[str, Any]) -> dict[str, Any]:
    """train_fabric.py's run(): Adadelta, StepLR per epoch, a test loop after each epoch."""
    import torch.optim as optim
    from lightning.fabric import Fabric, seed_everything
    from torch.optim.lr_scheduler import StepLR

    from ddpgraph.integrations.fabric import from_fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    seed_everything(1)
    train_loader = torch.utils.data.DataLoader(_mnist(256, 0), batch_size=16)
    test_loader = torch.utils.data.DataLoader(_mnist(64, 1), batch_size=16)
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)
    model = Net()
    # graph-safe as written: the framework's own run steps the optimizer the graphed port steps
    optimizer = graph_safe_optimizer(optim.Adadelta, model.parameters(), 1.0)
    if ported:  # port: the step takes the model and optimizer as built
        step = from_fabric(fabric, model, optimizer, F.nll_loss, **options)
    else:
        model, optimizer = fabric.setup(model, optimizer)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    losses: list[float] = []
    predictions: list[list[int]] = []
    for _epoch in range(1, 3):
        model.train()
        for _batch_idx, (data, target) in enumerate(train_loader):
            if ported:  # port
                loss = step(data, target)
            else:
                optimizer.zero_grad()
                output = model(data)
                loss = F.nll_loss(output, target)
                fabric.backward(loss)
                optimizer.step()
            losses.append(loss.item())
        scheduler.step()
        model.eval()
        with torch.no_grad():
            predictions.append([int(i) for d, _ in test_loader for i in model(d).argmax(1)])
    return _result(model, optimizer, losses, [], predictions, step if ported else None)


def habits_loop(
    ported: bool, options: dict[str, Any], out: str, k: int, clip: float | None = None,
    scheduler: bool = False, precision: str = "32-true", resume: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Fabric's documented accumulation loop: ``no_backward_sync`` on the micro-batches, a step
    every k batches and at the epoch's last (its leftover), ``clip_gradients``, a scheduler per
    step; 13 batches a rank, 3 epochs. ``resume``: after the first epoch ``fabric.save``, and a
    fresh model loaded with ``fabric.load`` trains the other two."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from ddpgraph.integrations.fabric import from_fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision=precision)
    fabric.launch()
    loader = fabric.setup_dataloaders(DataLoader(classes(104), batch_size=4))
    loss_fn = nn.CrossEntropyLoss()

    def build(seed: int) -> tuple[Any, Any, Any, Any]:
        model = mlp(seed)
        # graph-safe as written: the framework's own run steps the optimizer the graphed port steps
        optimizer = graph_safe_optimizer(torch.optim.AdamW, model.parameters(), 0.02)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.95**s)
        if ported:
            step = from_fabric(
                fabric, model, optimizer, loss_fn, accumulate_calls=k, clip_grad_norm=clip,
                grad_norm=True, **options,
            )  # fmt: skip
            return model, optimizer, decay, step
        model, optimizer = fabric.setup(model, optimizer)
        return model, optimizer, decay, None

    model, optimizer, decay, step = build(0)
    losses, norms = [], []
    for epoch in range(3):
        if resume and epoch == 1:  # a new process would do this: fresh objects, then load
            state = {"model": model, "optimizer": optimizer, "scheduler": decay}
            fabric.save(f"{out}/state.ckpt", state)
            model, optimizer, decay, step = build(1)
            fabric.load(
                f"{out}/state.ckpt", {"model": model, "optimizer": optimizer, "scheduler": decay}
            )
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % k == 0 or i + 1 == len(loader)
            if ported:  # port: last= where the epoch ends
                loss = step(x, y, last=i + 1 == len(loader))
            else:
                with fabric.no_backward_sync(model, enabled=not last):
                    loss = loss_fn(model(x), y)
                    fabric.backward(loss / k)
            losses.append(loss.item())
            if last:
                if ported:
                    norm = step.grad_norm
                else:
                    norm = _clip(fabric, model, optimizer, clip)
                    optimizer.step()
                    optimizer.zero_grad()
                if scheduler:
                    decay.step()
                norms.append(float(norm))
    return _result(model, optimizer, losses, norms, [], step)


def _clip(fabric: Any, model: Any, optimizer: Any, clip: float | None) -> torch.Tensor:
    if clip is not None:
        return fabric.clip_gradients(model, optimizer, max_norm=clip)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, foreach=True)


def _result(
    model: Any, optimizer: Any, losses: list, norms: list, predictions: list, step: Any
) -> dict[str, Any]:
    inner = getattr(model, "module", model)
    inner = getattr(inner, "module", inner)  # Fabric's wrapper around DDP
    return {
        "losses": losses,
        "norms": norms,
        "predictions": predictions,
        "params": tensors_of(inner.state_dict()),
        "optimizer": tensors_of(optimizer.state_dict()["state"]),
        "report": None if step is None else str(step.report()),
    }
