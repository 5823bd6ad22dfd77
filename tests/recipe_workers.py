"""Workers of the classic-recipe tests (run by ``run_distributed`` on 2 gloo ranks).

Evaluation through the wrapped model: torchvision's ``references/classification/train.py``
evaluates through the DDP model it trains (``evaluate(model, ...)`` under ``model.eval()`` and
``torch.inference_mode()``); after the port that model is ``step.model``. Each rank trains on its
own data, so BatchNorm's running statistics differ between ranks and the eval outputs show
whose buffers the forward used. Plain DDP (or FSDP2) trains and evaluates the same way as the
reference; the port runs eagerly and with CpuGraphs capturing and replaying.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpgraph import TrainStep
from ddpgraph.integrations.accelerate import from_accelerator
from ddpgraph.integrations.fabric import from_fabric

from .accelerate_corpus import end_training
from .framework_workers import graph_safe_optimizer, outcome, step_options, tensors_of

VARIANTS = ("framework", "eager", "graphs")
EPOCHS, STEPS = 3, 8  # 24 training steps: evaluations in warm-up and after the capture (12)


def bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
        nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4),
    )  # fmt: skip


class BNBlocks(nn.Module):
    """Blocks with BatchNorm, for FSDP2 (each block sharded, then the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()) for _ in range(2)
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _sharded_bn_net() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = BNBlocks()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def rank_batches(n: int, size: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's own data: its BatchNorm statistics drift apart from the other rank's."""
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    scale = 1.0 + dist.get_rank()
    return [
        (torch.randn(size, 8, generator=gen) * scale, torch.randint(4, (size,), generator=gen))
        for _ in range(n)
    ]


def evaluate(model: nn.Module, batches: list[torch.Tensor], how: str) -> list[torch.Tensor]:
    """torchvision's ``evaluate``: ``model.eval()``, then every batch under inference_mode."""
    model.eval()
    outputs = []
    with torch.inference_mode() if how == "inference_mode" else torch.no_grad():
        for x in batches:
            outputs.append(model(x).clone())
    return outputs


def eval_through_the_model(
    variant: str, how: str = "inference_mode", fsdp2: bool = False
) -> dict[str, Any]:
    """Train ``EPOCHS`` epochs, evaluating after each through the model the script keeps (the
    DDP, or FSDP2's root)."""
    model = _sharded_bn_net() if fsdp2 else bn_net()
    # SGD cannot step FSDP2's DTensor shards inside a graph (TrainStep says so); AdamW can.
    # Written graph-safe: the framework's run and both ports step the graphed step's optimizer
    opt: torch.optim.Optimizer = (
        graph_safe_optimizer(torch.optim.AdamW, model.parameters(), 0.01)
        if fsdp2
        else graph_safe_optimizer(torch.optim.SGD, model.parameters(), 0.05, momentum=0.9)
    )
    loss_fn = nn.CrossEntropyLoss()
    if fsdp2 and variant == "framework":
        train: Callable[..., torch.Tensor] = _eager_step(model, opt, loss_fn)
        held: nn.Module = model
    elif variant == "framework":
        ddp = nn.parallel.DistributedDataParallel(model)
        train, held = _eager_step(ddp, opt, loss_fn), ddp
    else:
        step = TrainStep(model, opt, loss_fn, **step_options(variant))
        train, held = step, step.model  # the port: model = step.model
    data, evals = rank_batches(EPOCHS * STEPS), [x for x, _ in rank_batches(3, 5)]
    losses, outputs, own = [], [], []
    for epoch in range(EPOCHS):
        held.train()
        for x, y in data[epoch * STEPS : (epoch + 1) * STEPS]:
            losses.append(float(train(x, y)))
        if not fsdp2:
            own += evaluate(copy.deepcopy(model), evals, how)  # this rank's own buffers
        outputs += evaluate(held, evals, how)
        outputs += evaluate(held, evals, how)  # a second evaluation: no broadcast in DDP either
    return {
        "losses": losses,
        "outputs": outputs,
        "own_outputs": own,
        "params": tensors_of(_full(model.state_dict())),
        "report": None if variant == "framework" else str(step.report()),
    }


def _eager_step(
    ddp: nn.Module, opt: torch.optim.Optimizer, loss_fn: nn.Module
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return train


def _full(state: dict[str, Any]) -> dict[str, Any]:
    """FSDP2's DTensor shards as whole tensors (plain tensors as they are)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def eval_rows(how: str, fsdp2: bool = False) -> dict[str, dict[str, Any]]:
    return {v: outcome(eval_through_the_model, v, how, fsdp2) for v in VARIANTS}


def lightning_validation(variant: str) -> dict[str, Any]:
    """A LightningModule with BatchNorm validated every epoch: Lightning's own DDP run sends
    its validation through the DDP (``_forward_redirection``), so rank 0's buffers first."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from .framework_workers import classes
    from .lightning_matrix_workers import _strategy

    outputs: list[torch.Tensor] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = bn_net()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x * (1.0 + self.global_rank)), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            outputs.append(self.net(batch[0]).clone())

        def configure_optimizers(self) -> Any:  # graph-safe: Lightning's run steps it too
            return graph_safe_optimizer(torch.optim.SGD, self.parameters(), 0.05, momentum=0.9)

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=_strategy(variant), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, max_epochs=3,
    )  # fmt: skip
    trainer.fit(
        module, DataLoader(classes(64), batch_size=4), DataLoader(classes(12, 2), batch_size=4)
    )
    strategy = trainer.strategy
    return {
        "outputs": outputs,
        "params": tensors_of(module.state_dict()),
        "report": None if variant == "framework" else str(strategy.train_step.report()),
    }


def lightning_rows() -> dict[str, dict[str, Any]]:
    return {v: outcome(lightning_validation, v) for v in VARIANTS}


# ------------------------------------------------------------------- a script's own accumulation
def glue_style_loop(
    variant: str, k: int = 2, epochs: int = 3, precision: str = "no"
) -> dict[str, Any]:
    """transformers' ``run_glue_no_trainer.py`` loop (a plain ``Accelerator()``, the script's own
    accumulation: ``loss / k``, ``if step % k == 0 or step == len(loader) - 1: optimizer.step();
    lr_scheduler.step(); optimizer.zero_grad()``, then ``model.eval()`` and the eval loop through
    the prepared model), as Accelerate runs it and as the Accelerate guide ports it."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from .framework_workers import classes

    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    model = bn_net()
    # graph-safe as written: Accelerate's run and both ports step the one optimizer
    optimizer = graph_safe_optimizer(torch.optim.AdamW, model.parameters(), 0.02)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    loader = DataLoader(classes(104), batch_size=4)  # 13 batches a rank: a window of 1 at the end
    eval_loader = DataLoader(classes(16, seed=2), batch_size=4)
    if variant == "framework":
        model, optimizer, loader, eval_loader, lr_scheduler = accelerator.prepare(
            model, optimizer, loader, eval_loader, lr_scheduler
        )
    else:
        loader, eval_loader, lr_scheduler = accelerator.prepare(loader, eval_loader, lr_scheduler)
        train_step = from_accelerator(
            accelerator, model, optimizer, nn.CrossEntropyLoss(), accumulate_calls=k,
            **step_options(variant),
        )  # fmt: skip
        model = train_step.model  # the DDP: the script's evaluation runs through it
    losses, lrs, outputs, updates = [], [], [], []
    for _ in range(epochs):
        model.train()
        for step, (x, y) in enumerate(loader):
            steps = step % k == 0 or step == len(loader) - 1
            if variant == "framework":
                loss = nn.functional.cross_entropy(model(x), y)
                losses.append(float(loss))
                accelerator.backward(loss / k)
                if steps:
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            else:
                losses.append(float(train_step(x, y, last=steps)))
                if steps:
                    lr_scheduler.step()
            if steps:
                lrs.append(float(lr_scheduler.get_last_lr()[0]))
                updates.append(tensors_of(_inner(model).state_dict()))
        model.eval()
        with torch.no_grad():
            outputs += [model(x).clone() for x, _ in eval_loader]
    end_training(accelerator)
    return {
        "losses": losses,
        "lrs": lrs,
        "outputs": outputs,
        "updates": [t for state in updates for t in state],
        "params": tensors_of(_inner(model).state_dict()),
        "optimizer": tensors_of(optimizer.state_dict()["state"]),
        "report": None if variant == "framework" else str(train_step.report()),
    }


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def glue_rows(k: int, precision: str = "no") -> dict[str, dict[str, Any]]:
    return {v: outcome(glue_style_loop, v, k, 3, precision) for v in VARIANTS}


def refused_script_accumulation(case: str) -> None:
    """Ports that keep what the step cannot follow: each must raise, on every rank."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from .framework_workers import classes

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2 if case == "no_block" else 1)
    model = bn_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    loader = accelerator.prepare(DataLoader(classes(32), batch_size=4))
    options = {"accumulate_calls": 2} if case == "optimizer_step" else {}
    step = from_accelerator(
        accelerator, model, optimizer, nn.CrossEntropyLoss(), graph="never", **options
    )
    try:
        for i, (x, y) in enumerate(loader):
            if case == "no_block":
                step(x, y)  # no accumulate() block, no last=, no no_sync(): refused at k = 2
            else:
                step(x, y, last=i % 2 == 0)
            if case == "optimizer_step" and i % 2 == 0:
                optimizer.step()  # the line the port forgot to remove
    finally:
        end_training(accelerator)


def fabric_eval(variant: str, precision: str = "32-true") -> dict[str, Any]:
    """A Fabric loop evaluating its BatchNorm model each epoch through the model it keeps: the
    one ``fabric.setup`` returned (its DDP inside), or after the port ``step.model``."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from .framework_workers import classes

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    loader, eval_loader = fabric.setup_dataloaders(
        DataLoader(classes(104), batch_size=4), DataLoader(classes(16, seed=2), batch_size=4)
    )
    model = bn_net()
    # graph-safe as written: Fabric's run and both ports step the one optimizer
    optimizer = graph_safe_optimizer(torch.optim.SGD, model.parameters(), 0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    if variant == "framework":
        model, optimizer = fabric.setup(model, optimizer)
    else:
        train_step = from_fabric(fabric, model, optimizer, loss_fn, **step_options(variant))
        model = train_step.model
    losses, outputs = [], []
    for _ in range(2):
        model.train()
        for x, y in loader:
            if variant == "framework":
                optimizer.zero_grad()
                loss = loss_fn(model(x * (1.0 + fabric.global_rank)), y)
                fabric.backward(loss)
                optimizer.step()
            else:
                loss = train_step(x * (1.0 + fabric.global_rank), y)
            losses.append(float(loss))
        model.eval()
        with torch.no_grad():
            outputs += [model(x).clone() for x, _ in eval_loader]
    return {
        "losses": losses,
        "outputs": outputs,
        "params": tensors_of(_inner(getattr(model, "_forward_module", model)).state_dict()),
        "report": None if variant == "framework" else str(train_step.report()),
    }


def fabric_eval_rows(precision: str = "32-true") -> dict[str, dict[str, Any]]:
    return {v: outcome(fabric_eval, v, precision) for v in VARIANTS}


def fabric_script_steps() -> None:
    """A Fabric port that kept its ``if not is_accumulating: optimizer.step()``."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from .framework_workers import classes

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    loader = fabric.setup_dataloaders(DataLoader(classes(32), batch_size=4))
    model = bn_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    step = from_fabric(
        fabric, model, optimizer, nn.CrossEntropyLoss(), accumulate_calls=2, graph="never"
    )
    for i, (x, y) in enumerate(loader):
        step(x, y)
        if i % 2 == 1:
            optimizer.step()  # the line the port forgot to remove


def unsaid_accumulation(case: str) -> dict[str, Any]:
    """run_glue_no_trainer.py ported by the Accelerate guide's first diff alone (``loss =
    train_step(batch)``, the scheduler still under ``if step % k == 0 or step == len(loader) -
    1:``, no accumulate_calls): refused. ``per_epoch``: a scheduler stepped once per epoch after
    the loop, ``per_step``: after every call; both update on every call and are followed."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from .framework_workers import classes

    accelerator = Accelerator(cpu=True)
    model = bn_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    loader = DataLoader(classes(40), batch_size=4)  # 5 batches a rank
    loader, lr_scheduler = accelerator.prepare(loader, lr_scheduler)
    train_step = from_accelerator(
        accelerator, model, optimizer, nn.CrossEntropyLoss(), **step_options("graphs")
    )
    k, calls = 2, 0
    try:
        for _ in range(3):
            for step, (x, y) in enumerate(loader):
                loss = train_step(x, y)  # the port's line  # noqa: F841
                calls += 1
                steps = step % k == 0 or step == len(loader) - 1  # the script's condition
                if (case == "glue13" and steps) or case == "per_step":
                    lr_scheduler.step()
            if case == "per_epoch":
                lr_scheduler.step()
    finally:
        end_training(accelerator)
    return {"calls": calls, "report": str(train_step.report())}
