"""The ``ddpgraph`` console script. Each subcommand is a thin wrapper over a library function."""

from __future__ import annotations

from pathlib import Path

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddpgraph")
def cli() -> None:
    """Fast PyTorch data-parallel training that never fails silently."""


@cli.command()
@click.option(
    "--model",
    type=click.Choice(["mlp", "resnet", "transformer"]),
    default="mlp",
    show_default=True,
    help="Built-in model to train.",
)
@click.option("--steps", type=click.IntRange(min=1), default=300, show_default=True)
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=64, show_default=True, help="Per rank."
)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=0.05, show_default=True)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes [default: one per local GPU, or 2 CPU workers on gloo without GPU].",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/latest"),
    show_default=True,
    help="Directory for run.json.",
)
def train(
    model: str, steps: int, batch_size: int, lr: float, nproc: int | None, seed: int, out: Path
) -> None:
    """Train a built-in model on a synthetic data set, on every local GPU (or 2 CPU ranks)."""
    from .demo.launch import launch_training
    from .demo.train import TrainConfig

    config = TrainConfig(
        model=model, steps=steps, batch_size=batch_size, lr=lr, seed=seed, out=str(out)
    )
    raise SystemExit(launch_training(config, nproc=nproc))


@cli.command()
@click.option(
    "--config",
    "configs",
    type=click.Choice(["mlp", "transformer", "resnet50"]),
    multiple=True,
    help="Configs to run [default: all].",
)
@click.option("--steps", type=click.IntRange(min=5), default=60, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--quick", is_flag=True, help="A tiny CPU-friendly smoke run.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("benchmarks/results/bench.json"),
    show_default=True,
)
def bench(configs: tuple[str, ...], steps: int, repeats: int, quick: bool, out: Path) -> None:
    """Eager DDP vs TrainStep (whole-step graph), same run; JSON with versions and commit."""
    from .bench import CONFIGS, run_bench

    run_bench(list(configs) or list(CONFIGS), steps=steps, repeats=repeats, quick=quick, out=out)


def main() -> None:
    cli()
