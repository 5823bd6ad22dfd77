"""Lightning's autoencoder example under LightningCLI, with ``GraphStrategy`` given through
``trainer_defaults`` or through the CLI's config file, against ``strategy=DDPStrategy``.

Source: https://github.com/Lightning-AI/pytorch-lightning at
215acdc3efa4b096c80ab2d0263cab20d2f06f54, ``examples/pytorch/basics/autoencoder.py`` (lightning
2.6 installed here), Apache-2.0, Copyright The Lightning AI team. ``LitAutoEncoder`` and
``cli_main`` are upstream's; shrunk: MNIST (a download) is 448 + 64 synthetic images split as
upstream splits, ``max_epochs`` 10 becomes 2, the ``ImageSampler`` callback (PNG files) is left
out, and the CLI gets its arguments as a list (``args=``) instead of ``sys.argv``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from .framework_workers import graph_safe_optimizer, tensors_of


def _classes() -> tuple[Any, Any]:
    import lightning.pytorch as pl

    class LitAutoEncoder(pl.LightningModule):
        def __init__(self, hidden_dim: int = 64, learning_rate: float = 10e-3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.encoder = nn.Sequential(
                nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3)
            )
            self.decoder = nn.Sequential(
                nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 28 * 28)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = self.encoder(x)
            return self.decoder(z)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self._common_step(batch, batch_idx, "train")

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self._common_step(batch, batch_idx, "val")

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self._common_step(batch, batch_idx, "test")

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: Any = None) -> Any:
            x = self._prepare_batch(batch)
            return self(x)

        def configure_optimizers(self) -> Any:
            # written graph-safe (capturable, the LR in a tensor; changed from the example's
            # plain Adam): DDPStrategy's run and GraphStrategy's, graphed or not, step one optimizer
            return graph_safe_optimizer(
                torch.optim.Adam, self.parameters(), self.hparams.learning_rate
            )

        def _prepare_batch(self, batch: Any) -> torch.Tensor:
            x, _ = batch
            return x.view(x.size(0), -1)

        def _common_step(self, batch: Any, batch_idx: int, stage: str) -> torch.Tensor:
            x = self._prepare_batch(batch)
            loss = F.mse_loss(x, self(x))
            self.log(f"{stage}_loss", loss, on_step=True)
            return loss

    class MyDataModule(pl.LightningDataModule):
        def __init__(self, batch_size: int = 32) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            dataset = TensorDataset(torch.rand(512, 1, 28, 28, generator=gen), torch.zeros(512))
            self.mnist_test = TensorDataset(
                torch.rand(64, 1, 28, 28, generator=gen), torch.zeros(64)
            )
            self.mnist_train, self.mnist_val = random_split(
                dataset, [448, 64], generator=torch.Generator().manual_seed(42)
            )
            self.batch_size = batch_size

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.mnist_train, batch_size=self.batch_size)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(self.mnist_val, batch_size=self.batch_size)

        def test_dataloader(self) -> DataLoader:
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

        def predict_dataloader(self) -> DataLoader:
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

    return LitAutoEncoder, MyDataModule


def cli_main(how: str, out: str) -> dict[str, Any]:
    """upstream's cli_main; ``how``: "framework" (``strategy`` DDPStrategy in trainer_defaults,
    as ``lazy_instance``), "defaults" (GraphStrategy with CpuGraphs in trainer_defaults, as
    ``lazy_instance``) or "config" (GraphStrategy
    named by class path in the CLI's YAML config file)."""
    import lightning.pytorch as pl
    from jsonargparse import lazy_instance
    from lightning.pytorch.cli import LightningCLI

    from ddpgraph.testing import CpuGraphs

    lit_auto_encoder, my_data_module = _classes()
    defaults: dict[str, Any] = {
        "max_epochs": 2, "accelerator": "cpu", "devices": 2, "default_root_dir": out,
        "enable_progress_bar": False, "logger": False,
    }  # fmt: skip
    args = ["--trainer.max_epochs=2"]
    if how == "framework":
        defaults["strategy"] = lazy_instance(
            pl.strategies.DDPStrategy, process_group_backend="gloo"
        )
    elif how == "defaults":
        from ddpgraph.integrations.lightning import GraphStrategy

        # jsonargparse takes a class and its arguments here, not an instance
        defaults["strategy"] = lazy_instance(
            GraphStrategy, process_group_backend="gloo", step_options={"engine": CpuGraphs()}
        )
    else:
        with open(f"{out}.yaml", "w") as f:
            f.write(CONFIG)
        args += [f"--config={out}.yaml"]
    cli = LightningCLI(
        lit_auto_encoder, my_data_module, seed_everything_default=1234, run=False,
        trainer_defaults=defaults, save_config_kwargs={"overwrite": True}, args=args,
    )  # fmt: skip
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    strategy = cli.trainer.strategy
    fitted = tensors_of(cli.model.state_dict())
    val = float(cli.trainer.callback_metrics["val_loss"])
    tested = cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule, verbose=False)
    predictions = cli.trainer.predict(ckpt_path="best", datamodule=cli.datamodule)
    return {
        "strategy": type(strategy).__name__,
        "params": fitted,
        "val": val,
        "test": tested,
        "predictions": [p.clone() for p in predictions],
        "report": None if how == "framework" else str(strategy.train_step.report()),
    }


# what a user writes in the CLI's config (``--config``); step_options as plain values
CONFIG = """\
trainer:
  strategy:
    class_path: ddpgraph.integrations.lightning.GraphStrategy
    init_args:
      process_group_backend: gloo
      step_options:
        graph: never
"""


def cli_runs(tmp: str) -> dict[str, dict[str, Any]]:
    """cli_main the three ways, in one process launch."""
    return {how: cli_main(how, f"{tmp}/{how}") for how in ("framework", "defaults", "config")}
