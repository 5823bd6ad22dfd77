"""The worker side of ``ddpgraph train``: one rank's training loop, metrics and report.

The loop only ever calls ``step(x, y)``: TrainStep decides whether that is an eager step, a
warm-up step, a capture or a replay, so the same loop runs on CPU ranks and on graphed GPUs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpgraph

from ..step import TrainStep
from .data import SAMPLE_SHAPES, synthetic_patterns
from .models import build_model

TRAIN_SAMPLES = 8192
EVAL_SAMPLES = 2048
LOG_EVERY = 20  # steps between loss read-backs: the only host syncs in the loop


@dataclass(frozen=True)
class TrainConfig:
    model: str = "mlp"
    steps: int = 300
    batch_size: int = 64
    lr: float = 0.05
    seed: int = 0
    out: str = "runs/latest"


def run_worker(config: TrainConfig) -> dict[str, Any]:
    """Train on this rank (launched by torch.distributed's elastic agent); return its metrics."""
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = False
    else:
        # each CPU rank gets its share of the cores instead of all ranks fighting over all of them
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    with ddpgraph.init() as rt:
        metrics = _train(config, rt)
        everyone = _gather(metrics)
        if rt.is_main:
            _report(config, everyone)
    return metrics


def _train(config: TrainConfig, rt: ddpgraph.Runtime) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    model = build_model(config.model).to(rt.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.steps)
    step = TrainStep(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        scheduler=scheduler,
        channels_last=config.model == "resnet",  # conv kernels run faster in NHWC
    )
    loader = _loader(config, rt, split="train")
    losses = _LossLog(rt.device)
    curve: list[float] = []
    started = time.perf_counter()
    with _Progress(rt.is_main, config.steps) as progress:
        for i, (x, y) in zip(range(config.steps), _forever(loader)):
            losses.add(step(x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)))
            scheduler.step()
            if (i + 1) % LOG_EVERY == 0 or i + 1 == config.steps:
                curve.append(losses.read())
                progress(i + 1, curve[-1], step.mode)
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    report = step.report()
    return {
        "rank": rt.rank,
        "device": str(rt.device),
        "backend": rt.backend,
        "mode": report.mode,
        "samples_seen": config.steps * config.batch_size,
        "final_loss": curve[-1],
        "loss_curve": curve,
        "accuracy": _evaluate(step.model, config, rt),
        "steps_per_s": config.steps / seconds,
        "time_to_first_replay_s": report.time_to_first_replay,
        "fallbacks": report.fallbacks,
    }


def _loader(config: TrainConfig, rt: ddpgraph.Runtime, *, split: str) -> DataLoader:
    size = TRAIN_SAMPLES if split == "train" else EVAL_SAMPLES
    data: TensorDataset = synthetic_patterns(
        SAMPLE_SHAPES[config.model], num_samples=size, seed=config.seed, split=split
    )
    sampler: DistributedSampler[Any] = DistributedSampler(
        data,
        num_replicas=rt.world_size,
        rank=rt.rank,
        shuffle=split == "train",
        seed=config.seed,
        drop_last=split == "train",  # equal batch shapes on every rank: one graph serves all
    )
    return DataLoader(
        data,
        batch_size=config.batch_size,
        sampler=sampler,
        drop_last=split == "train",
        pin_memory=rt.device.type == "cuda",
    )


def _forever(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    epoch = 0
    while True:
        sampler: Any = loader.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


class _LossLog:
    """Sums losses on the device; :meth:`read` (a host sync) averages the ones since the last."""

    def __init__(self, device: torch.device) -> None:
        self._sum = torch.zeros((), device=device)
        self._count = 0
        self._last = float("nan")

    def add(self, loss: torch.Tensor) -> None:
        self._sum += loss.detach()  # the graph overwrites `loss` next step: fold it in now
        self._count += 1

    def read(self) -> float:
        if self._count:
            self._last = float(self._sum) / self._count
            self._sum.zero_()
            self._count = 0
        return self._last


@torch.no_grad()
def _evaluate(model: nn.Module, config: TrainConfig, rt: ddpgraph.Runtime) -> float:
    model.eval()
    correct = total = 0
    for x, y in _loader(config, rt, split="eval"):
        logits = model(x.to(rt.device))
        correct += int((logits.argmax(dim=1).cpu() == y).sum())
        total += len(y)
    model.train()
    return correct / max(total, 1)


def _gather(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    # ddpgraph's checked collective: safe codec, every rank fails alike, no hang on a bad rank
    return ddpgraph.all_gather_object(metrics, timeout=60.0)


class _Progress:
    """A rich progress bar on the main rank (loss, steps/s, mode); a no-op elsewhere."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._enabled = enabled
        self._total = total
        self._bar: Any = None
        self._started = time.perf_counter()

    def __enter__(self) -> _Progress:
        if self._enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "loss {task.fields[loss]}  {task.fields[rate]} steps/s  {task.fields[mode]}"
                ),
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=self._total, loss="-", rate="-", mode="")
        return self

    def __call__(self, done: int, loss: float, mode: str) -> None:
        if self._bar is None:
            return
        rate = done / (time.perf_counter() - self._started)
        self._bar.update(
            self._task, completed=done, loss=f"{loss:.4f}", rate=f"{rate:.0f}", mode=mode
        )

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _report(config: TrainConfig, everyone: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ddpgraph train: {config.model}, {config.steps} steps")
    columns = (
        "rank",
        "device",
        "mode",
        "first replay",
        "samples",
        "final loss",
        "accuracy",
        "steps/s",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for m in everyone:
        table.add_row(
            str(m["rank"]),
            m["device"],
            m["mode"],
            "-" if m["time_to_first_replay_s"] is None else f"{m['time_to_first_replay_s']:.2f} s",
            str(m["samples_seen"]),
            f"{m['final_loss']:.4f}",
            f"{m['accuracy']:.1%}",
            f"{m['steps_per_s']:.1f}",
        )
    console = Console()
    console.print(table)
    path = write_run_json(Path(config.out), config, everyone)
    console.print(f"wrote {path}")


def write_run_json(out: Path, config: TrainConfig, everyone: list[dict[str, Any]]) -> Path:
    """Write ``out/run.json`` atomically: a crash leaves the old file or none, never half of one."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "run.json"
    accuracy = sum(m["accuracy"] for m in everyone) / len(everyone)
    payload = {
        "config": asdict(config),
        "world_size": len(everyone),
        "torch": torch.__version__,
        "accuracy": accuracy,
        "ranks": everyone,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
    return path
