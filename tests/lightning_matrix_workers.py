"""Lightning's feature matrix: each row an unchanged LightningModule + Trainer set-up, trained
under ``strategy=DDPStrategy`` (Lightning's own run) and under ``GraphStrategy`` (eagerly and
capturing with CpuGraphs), on 2 gloo ranks. Lightning 2.6 (Apache-2.0)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .framework_workers import (
    classes,
    graph_safe_optimizer,
    mlp,
    rank,
    run_rows,
    step_options,
    tensors_of,
)

# 28 rows on 2 ranks, batches of 4: 7 batches a rank per epoch (odd: a tail with k=2 or 3)
ROWS: dict[str, dict[str, Any]] = {
    # features: max_steps, gradient_clip_val (norm), training_step returning a dict
    "max_steps_clip_norm_dict_output": {
        "trainer": {"max_steps": 14, "gradient_clip_val": 0.05},
        "module": {"dict_output": True},
    },
    # max_epochs, accumulate_grad_batches with an epoch tail (7 batches, k=2), self.log with
    # on_epoch=True, CSVLogger with log_every_n_steps
    "max_epochs_accumulate_tail_epoch_metrics_csv": {
        "trainer": {"max_epochs": 4, "accumulate_grad_batches": 2, "log_every_n_steps": 3},
        "module": {"on_epoch": True},
        "csv": True,
    },
    # max_steps ending inside an epoch of tails (k=3: windows of 3, 3, 1), a per-step scheduler
    "accumulate_k3_tail_max_steps_scheduler_per_step": {
        "trainer": {"max_steps": 20, "accumulate_grad_batches": 3},
        "module": {"scheduler": "step"},
    },
    # a per-epoch scheduler, validation every 3 batches (val_check_interval) with sync_dist
    "scheduler_per_epoch_validation_loop": {
        "trainer": {"max_epochs": 3, "val_check_interval": 3},
        "module": {"scheduler": "epoch", "validation": True},
    },
    # ReduceLROnPlateau on a logged metric
    "plateau_scheduler": {"trainer": {"max_epochs": 3}, "module": {"scheduler": "plateau"}},
    # limit_train_batches, precision="bf16-mixed"
    "limit_train_batches_bf16_mixed": {
        "trainer": {"max_epochs": 3, "limit_train_batches": 5, "precision": "bf16-mixed"}
    },
    # callbacks: LearningRateMonitor, EarlyStopping (stops after epoch 2)
    "callbacks_lr_monitor_early_stopping": {
        "trainer": {"max_epochs": 4},
        "module": {"scheduler": "epoch", "on_epoch": True},
        "callbacks": ["lr_monitor", "early_stopping"],
        "csv": True,
    },
    # ModelCheckpoint mid-epoch (step 5: inside a window's pair), resumed with ckpt_path
    "checkpoint_resume_mid_epoch": {
        "trainer": {"max_steps": 24, "accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
        "module": {"scheduler": "step"},
        "resume_at": 5,
    },
    # refused (listed in the guide): Lightning clips by value, the graphed step by norm
    "clip_value": {
        "trainer": {"max_steps": 14, "gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}
    },
}


def lightning_rows(names: list[str], tmp: str) -> dict[str, dict[str, Any]]:
    """Every named row, each variant; results by ``"row/variant"``."""
    return run_rows(ROWS, names, lambda variant, row, name: _fit_row(variant, row, f"{tmp}/{name}"))


def _fit_row(variant: str, row: dict[str, Any], tmp: str) -> dict[str, Any]:
    resume_at = row.get("resume_at")
    ckpt = None
    if resume_at is not None:  # the variant's own first run saves, its second resumes
        first = dict(row, trainer={**row["trainer"], "max_steps": resume_at})
        _fit(variant, first, f"{tmp}/{variant}/first", save=True)
        ckpt = f"{tmp}/{variant}/first/ckpt/last.ckpt"
    return _fit(variant, row, f"{tmp}/{variant}/run", ckpt=ckpt)


def _fit(
    variant: str, row: dict[str, Any], out: str, save: bool = False, ckpt: str | None = None
) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    module = classifier(**row.get("module", {}))
    record = recorder()
    callbacks: list[Any] = [record, *_callbacks(row.get("callbacks", []))]
    if save:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=f"{out}/ckpt", save_last=True))
    strategy = _strategy(variant)
    logger: Any = False
    if row.get("csv"):
        logger = pl.loggers.CSVLogger(f"{out}/logs", name="", version="")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, logger=logger,
        enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks, **row["trainer"],
    )  # fmt: skip
    loaders = [DataLoader(classes(56), batch_size=4)]
    if row.get("module", {}).get("validation"):
        loaders.append(DataLoader(classes(16, seed=2), batch_size=4))
    trainer.fit(module, *loaders, ckpt_path=ckpt)
    optimizer = trainer.optimizers[0]
    result = {
        "losses": record.losses,
        "lrs": record.lrs,
        "steps": record.steps,
        "val": record.val,
        "params": tensors_of(module.state_dict()),
        "optimizer": tensors_of(optimizer.state_dict()["state"]),
        "csv": _csv(f"{out}/logs/metrics.csv") if row.get("csv") and rank() == 0 else None,
        "report": None,
    }
    if variant != "framework":
        assert strategy.train_step is not None
        result["report"] = str(strategy.train_step.report())
    return result


def _strategy(variant: str) -> Any:
    import lightning.pytorch as pl

    if variant == "framework":
        return pl.strategies.DDPStrategy(process_group_backend="gloo")
    from ddpgraph.integrations.lightning import GraphStrategy

    return GraphStrategy(process_group_backend="gloo", step_options=step_options(variant))


def _callbacks(names: list[str]) -> list[Any]:
    import lightning.pytorch as pl

    made = {
        "lr_monitor": lambda: pl.callbacks.LearningRateMonitor(logging_interval="step"),
        "early_stopping": lambda: pl.callbacks.EarlyStopping(
            monitor="train_loss_epoch", patience=0, min_delta=0.2
        ),
    }
    return [made[name]() for name in names]


def _csv(path: str) -> str:
    with open(path) as f:
        return f.read()


def classifier(**options: Any) -> Any:
    """The row's LightningModule (Lightning is imported lazily: an optional extra)."""
    return _module_class()(**options)


def _module_class() -> Any:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(
            self, scheduler: str | None = None, validation: bool = False, on_epoch: bool = False,
            dict_output: bool = False,
        ) -> None:  # fmt: skip
            super().__init__()
            self.net = mlp()
            self.scheduler, self.on_epoch, self.dict_output = scheduler, on_epoch, dict_output
            if not validation:
                self.validation_step = None  # type: ignore[assignment]

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            logits = self.net(x)
            loss = nn.functional.cross_entropy(logits, y)
            self.log("train_loss", loss, on_epoch=self.on_epoch)
            return {"loss": loss, "logits": logits} if self.dict_output else loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

        def configure_optimizers(self) -> Any:
            # graph-safe as written: the framework's own run steps the optimizer the graphed port steps
            optimizer = graph_safe_optimizer(torch.optim.AdamW, self.parameters(), 0.02)
            if self.scheduler is None:
                return optimizer
            if self.scheduler == "plateau":
                plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
                scheduler = {"scheduler": plateau, "monitor": "train_loss"}
            else:
                decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
                scheduler = {"scheduler": decay, "interval": self.scheduler}
            return {"optimizer": optimizer, "lr_scheduler": scheduler}

    return Module


def recorder() -> Any:
    return _record_class()()


def _record_class() -> Any:
    import lightning.pytorch as pl

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.lrs: list[float] = []
            self.steps: list[int] = []
            self.val: list[float] = []

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))
            self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
            self.steps.append(trainer.global_step)

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            self.val.append(float(trainer.callback_metrics["val_loss"]))

    return Recorder


def refusals() -> dict[str, str]:
    """What GraphStrategy says (on one rank) to each set-up the guide lists as refused."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from ddpgraph.integrations.lightning import GraphStrategy

    base = _module_class()

    class TwoOptimizers(base):  # type: ignore[misc, valid-type]
        def configure_optimizers(self) -> Any:
            params = list(self.parameters())
            return [torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)]

    class HookModule(base):  # type: ignore[misc, valid-type]
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            pass

    class NoneStep(base):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None

    class HookCallback(pl.Callback):
        def on_after_backward(self, trainer: Any, module: Any) -> None:
            pass

    cases: dict[str, tuple[Any, dict[str, Any]]] = {
        "two_optimizers": (TwoOptimizers(), {}),
        "module_gradient_hook": (HookModule(), {}),
        "callback_gradient_hook": (base(), {"callbacks": [HookCallback()]}),
        "training_step_none": (NoneStep(), {}),
        "accumulation_scheduler": (
            base(),
            {"callbacks": [pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 2})]},
        ),
    }
    said = {}
    for name, (module, extra) in cases.items():
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=GraphStrategy(process_group_backend="gloo"),
            max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, **extra,
        )  # fmt: skip
        try:
            trainer.fit(module, DataLoader(classes(16), batch_size=4))
            said[name] = "trained"
        except Exception as exc:
            said[name] = f"{type(exc).__name__}: {exc}"
    return said
