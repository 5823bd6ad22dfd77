"""Workers for the framework integration tests (run by ``run_distributed`` on 2 gloo ranks)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .framework_workers import graph_safe_arithmetic, graph_safe_optimizer


def gpt2_data(n: int = 128, length: int = 16, vocab: int = 100, seed: int = 3) -> list[dict]:
    """Padded, attention-masked rows: -100 labels on the padding, as a collator makes them."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (n, length), generator=gen)
    lengths = torch.randint(4, length + 1, (n,), generator=gen)
    mask = (torch.arange(length) < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def tiny_gpt2() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def trainer_args(output_dir: str, **overrides: Any) -> Any:
    import transformers

    options: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=4,
        max_steps=20,
        logging_steps=1,
        save_strategy="steps",
        save_steps=4,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def with_graph_safe_arithmetic(trainer_class: Any) -> Any:
    """``trainer_class`` whose optimizer steps with a graphed step's arithmetic
    (:func:`~.framework_workers.graph_safe_arithmetic`): the Trainer's own run, loop and
    optimizer, that a graphed run on the CPU engine equals to the bit."""

    class GraphSafeArithmetic(trainer_class):  # type: ignore[misc, valid-type]
        def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
            optimizer = super().create_optimizer(*args, **kwargs)
            real = optimizer
            while hasattr(real, "optimizer"):
                real = real.optimizer
            graph_safe_arithmetic(real)
            return optimizer

        def _clip_grad_norm(self, model: Any) -> Any:
            if not self.is_fsdp_enabled:
                return super()._clip_grad_norm(model)
            # Accelerate's FSDP2 clipping (Trainer._clip_grad_norm -> clip_grad_norm_) with
            # foreach, the path its foreach=None takes for CUDA tensors and the graphed step
            # takes; for CPU DTensors it picks the per-tensor loop (last bits apart)
            params = list(model.parameters())
            clip = self.accelerator._clip_grad_norm_dtensor_aware
            return clip(params, self.args.max_grad_norm, foreach=True)

    return GraphSafeArithmetic


def run_trainer(
    output_dir: str,
    graphed: bool,
    resume: str | None = None,
    rows: int = 128,
    safe: bool = True,
    on_the_cpu: Any = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train the tiny GPT-2 with the plain Trainer (``safe``: its optimizer with the graphed
    step's arithmetic) or GraphTrainer (``on_the_cpu``: a change to the Trainer class, as
    :func:`fsdp2_on_the_cpu`); what they logged and ended with."""
    import transformers

    from ddpgraph.testing import CpuGraphs

    args = trainer_args(output_dir, **overrides)
    common = dict(model=tiny_gpt2(), args=args, train_dataset=gpt2_data(rows))
    adapt = on_the_cpu or (lambda cls: cls)
    if graphed:
        from ddpgraph.integrations.transformers import GraphTrainer

        trainer = adapt(GraphTrainer)(**common, step_options={"engine": CpuGraphs()})
    elif safe:
        trainer = adapt(with_graph_safe_arithmetic(transformers.Trainer))(**common)
    else:
        trainer = adapt(transformers.Trainer)(**common)
    trainer.train(resume_from_checkpoint=resume)
    logs = [
        {k: v for k, v in entry.items() if k in ("step", "loss", "grad_norm", "learning_rate")}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    return {
        "logs": logs,
        "params": {k: _whole(v) for k, v in trainer.model.state_dict().items()},
        "optimizer": _optimizer_state(trainer.optimizer),
        "lr": [float(g["lr"]) for g in trainer.optimizer.param_groups],
        "report": str(trainer.report()) if graphed else None,
        "rank": int(os.environ.get("RANK", 0)),
        "sharded": _sharded_modules(trainer.model),
        # what Accelerate's no_sync branches on at every micro-batch (FSDP2: the model's
        # set_requires_gradient_sync), read after training
        "fsdp2_no_sync": bool(trainer.accelerator.is_fsdp2),
    }


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``; an FSDP2 shard (DTensor) gathered whole (every rank calls it)."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _optimizer_state(optimizer: Any) -> dict[int, dict[str, Any]]:
    """The real optimizer's state, each tensor gathered whole."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return {
        index: {k: _whole(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        for index, state in optimizer.state_dict()["state"].items()
    }


def _sharded_modules(model: Any) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


# the spelling; checkpoints as DCP shards: the Trainer's FULL_STATE_DICT save gathers on
# rank 0 alone and fails on gloo for the plain Trainer as for GraphTrainer (a collective
# mismatch in save_pretrained's tied-weight check on DTensors, transformers 5.25)
FSDP2_ARGS = {
    "fsdp": "full_shard",
    "fsdp_config": {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
}


def fsdp2_on_the_cpu(trainer_class: Any) -> Any:
    """``trainer_class`` with the Accelerator its FSDP arguments build on CUDA, on the CPU.

    ``AcceleratorState`` (accelerate 1.16, state.py) turns ``distributed_type`` to FSDP and
    keeps the Trainer's ``fsdp_plugin`` only in its branch for GPUs and other accelerators; on
    the CPU (MULTI_CPU) it drops the plugin and the Trainer trains with DDP. Set here what that
    branch sets, before anything is prepared, so the Trainer's real FSDP2 path runs on gloo:
    Accelerate's ``fully_shard`` of each block, the embeddings and the head, its ``no_sync``,
    its FSDP2 checkpoint save and load.

    The branch also writes the type into ``PartialState``'s shared state: every later
    ``AcceleratorState()`` copies that state over its own (``AcceleratedOptimizer`` makes one in
    the Trainer's ``prepare(model, optimizer)``), so a type set on ``AcceleratorState`` alone is
    MULTI_CPU again by the first micro-batch, and ``accelerator.no_sync`` leaves FSDP2's
    gradient sync on: the plain Trainer then reduce-scattered every micro-batch (8 reduces a
    window of 2 against 4), its gradients 1 ulp from FSDP2's accumulate-then-reduce."""

    class FSDP2OnTheCpu(trainer_class):  # type: ignore[misc, valid-type]
        def create_accelerator_and_postprocess(self) -> None:
            from accelerate.state import PartialState
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
            assert getattr(state, "fsdp_plugin", None) is None  # dropped on the CPU
            state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    return FSDP2OnTheCpu


def run_fsdp2_trainer(
    output_dir: str, graphed: bool, resume: str | None = None, **overrides: Any
) -> Any:
    """:func:`run_trainer` with the Trainer's own FSDP2 set-up (Accelerate shards each GPT-2
    block, the embeddings and the head with ``fully_shard``; :func:`fsdp2_on_the_cpu`)."""
    options = {**FSDP2_ARGS, **overrides}
    return run_trainer(output_dir, graphed, resume, on_the_cpu=fsdp2_on_the_cpu, **options)


def _warmup_schedule(optimizer: Any) -> Any:
    """A linear warm-up over 4 steps, then a linear decay."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 4) * max(0.1, 1 - s / 40)
    )


def run_accelerate(graphed: bool, epochs: int = 3) -> dict[str, Any]:
    """Accelerate's documented loop (prepare all, accumulate, backward, clip, step), or the
    same loop with ``from_accelerator``."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from ddpgraph.integrations.accelerate import from_accelerator
    from ddpgraph.testing import CpuGraphs

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_gpt2()
    # graph-safe as written (capturable, the LR in a tensor): the framework's own run steps the
    # optimizer the graphed port steps (framework_workers.graph_safe_optimizer)
    optimizer = graph_safe_optimizer(torch.optim.AdamW, model.parameters(), 1e-3)
    scheduler = _warmup_schedule(optimizer)
    loader = DataLoader(gpt2_data(), batch_size=4)
    if graphed:
        loader, scheduler = accelerator.prepare(loader, scheduler)
        step = from_accelerator(
            accelerator, model, optimizer, clip_grad_norm=0.5, engine=CpuGraphs()
        )
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )
    losses, norms, lrs = [], [], []
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                if graphed:
                    loss = step(batch)
                    norm = step.grad_norm
                else:
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                    optimizer.step()
                    optimizer.zero_grad()
                scheduler.step()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                norms.append(norm.item())
                lrs.append(float(scheduler.get_last_lr()[0]))
    return _loop_result(model, losses, norms, lrs, step if graphed else None)


def run_fabric(graphed: bool, epochs: int = 3, k: int = 2) -> dict[str, Any]:
    """Fabric's loop (setup, no_backward_sync, backward, clip_gradients, step), or the same loop
    with ``from_fabric``."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from ddpgraph.integrations.fabric import from_fabric
    from ddpgraph.testing import CpuGraphs

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision="32-true")
    fabric.launch()
    model = tiny_gpt2()
    # graph-safe as written (capturable, the LR in a tensor): the framework's own run steps the
    # optimizer the graphed port steps (framework_workers.graph_safe_optimizer)
    optimizer = graph_safe_optimizer(torch.optim.AdamW, model.parameters(), 1e-3)
    scheduler = _warmup_schedule(optimizer)
    loader = fabric.setup_dataloaders(DataLoader(gpt2_data(), batch_size=4))
    if graphed:
        step = from_fabric(
            fabric, model, optimizer, accumulate_calls=k, clip_grad_norm=0.5, engine=CpuGraphs()
        )
    else:
        model, optimizer = fabric.setup(model, optimizer)
    losses, norms, lrs = [], [], []
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            last = (i + 1) % k == 0
            if graphed:
                loss = step(batch)
            else:
                with fabric.no_backward_sync(model, enabled=not last):
                    loss = model(**batch).loss
                    fabric.backward(loss / k)
            losses.append(loss.item())
            if last:
                if graphed:
                    norm = step.grad_norm
                else:
                    norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
                    optimizer.step()
                    optimizer.zero_grad()
                scheduler.step()
                norms.append(norm.item())
                lrs.append(float(scheduler.get_last_lr()[0]))
    return _loop_result(model, losses, norms, lrs, step if graphed else None)


def _loop_result(model: Any, losses: list, norms: list, lrs: list, step: Any) -> dict[str, Any]:
    inner = getattr(model, "module", model)
    return {
        "losses": losses,
        "norms": norms,
        "lrs": lrs,
        "params": {k: v.detach().clone() for k, v in inner.state_dict().items()},
        "report": None if step is None else str(step.report()),
    }


def run_lightning(
    graphed: bool, max_steps: int = 24, checkpoints: str | None = None, resume: str | None = None
) -> dict[str, Any]:
    """An unchanged LightningModule (automatic optimization, ``self.log``, a warm-up schedule
    stepped per step) under ``strategy="ddp"`` or ``GraphStrategy``: accumulation and clipping
    set on the Trainer."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from ddpgraph.testing import CpuGraphs

    class GPT2Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            # graph-safe as written: Lightning's run steps the optimizer the graphed port steps
            optimizer = graph_safe_optimizer(torch.optim.AdamW, self.parameters(), 1e-3)
            scheduler = {"scheduler": _warmup_schedule(optimizer), "interval": "step"}
            return {"optimizer": optimizer, "lr_scheduler": scheduler}

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.lrs: list[float] = []
            self.steps: list[int] = []

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))
            self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
            self.steps.append(trainer.global_step)

    if graphed:
        from ddpgraph.integrations.lightning import GraphStrategy

        strategy: Any = GraphStrategy(
            process_group_backend="gloo", step_options={"engine": CpuGraphs()}
        )
    else:
        strategy = pl.strategies.DDPStrategy(process_group_backend="gloo")
    record = Record()
    callbacks: list[Any] = [record]
    if checkpoints is not None:  # every epoch's end (8 steps)
        save = pl.callbacks.ModelCheckpoint(
            dirpath=checkpoints, filename="{step}", every_n_train_steps=8, save_top_k=-1
        )
        callbacks.append(save)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps,
        accumulate_grad_batches=2, gradient_clip_val=0.5, callbacks=callbacks,
        logger=False, enable_checkpointing=checkpoints is not None, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = GPT2Module()
    trainer.fit(module, DataLoader(gpt2_data(), batch_size=4), ckpt_path=resume)
    step = strategy.train_step if graphed else None
    result = _loop_result(module.model, record.losses, [], record.lrs, step)
    result["steps"] = record.steps
    return result


def run_lightning_manual() -> None:
    """A LightningModule with automatic_optimization=False under GraphStrategy (refused)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from ddpgraph.integrations.lightning import GraphStrategy

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=GraphStrategy(process_group_backend="gloo"),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(Manual(), DataLoader(torch.randn(8, 4), batch_size=4))


def build_trainer_with_fsdp(output_dir: str, scale_fp16: bool = False, **fsdp: Any) -> None:
    """GraphTrainer with the Trainer's FSDP arguments ``fsdp`` and the Accelerator they build on
    CUDA (FSDP1: refused on every rank); ``scale_fp16``: with the GradScaler Accelerate builds
    for ``fp16=True`` on CUDA (none on the CPU)."""
    from ddpgraph.integrations.transformers import GraphTrainer

    class WithScaler(fsdp2_on_the_cpu(GraphTrainer)):  # type: ignore[misc]
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if scale_fp16:
                self.accelerator.scaler = torch.amp.GradScaler("cpu")

    args = trainer_args(output_dir, **fsdp)
    WithScaler(model=tiny_gpt2(), args=args, train_dataset=gpt2_data(16))


def build_trainer_with_sharded_model(output_dir: str) -> None:
    """GraphTrainer with a model the script sharded with fully_shard (refused on every rank)."""
    from torch.distributed.fsdp import fully_shard

    from ddpgraph.integrations.transformers import GraphTrainer

    model = tiny_gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    GraphTrainer(model=model, args=trainer_args(output_dir), train_dataset=gpt2_data(16))
