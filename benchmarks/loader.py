"""Does the main job's loop keep up with its TrainStep? Loader feeds against pre-staged batches.

For each demo model (``ddpgraph train --model mlp|resnet|transformer``, batch 64, the demo's
synthetic data set, optimizer and TrainStep options), one graphed TrainStep is fed, in turns
within one process:

* ``staged``: batches already on the device (the step's own rate: the reference);
* ``loader``: the demo's DataLoader (per-sample ``__getitem__`` + collate, ``pin_memory``, the
  demo's ``num_workers``) with ``.to(device, non_blocking=True)`` in the loop;
* ``prefetch``: the same DataLoader through ``ddpgraph.prefetch``;
* ``batched_prefetch``: batch-level sampling (a ``BatchSampler`` as the sampler and
  ``batch_size=None``: one indexing call per batch instead of 64 plus a collate), no workers,
  through ``ddpgraph.prefetch`` (which pins);
* ``batched_workers_prefetch``: the same sampling in ``--fast-workers`` persistent worker
  processes, pinned by the loader's pin thread, through ``ddpgraph.prefetch``: the main process
  only takes finished batches from a queue;
* ``index_prefetch``: no DataLoader: a per-epoch shuffled index tensor (sharded by rank as
  DistributedSampler does) gathers each batch from the in-memory tensors, through
  ``ddpgraph.prefetch``: what a data set that fits in host memory needs at least;
* ``device_index``: the data set copied to the device once, batches gathered there by a shuffled
  device index tensor (no loader, no copy per step): for a data set that fits in device memory,
  as the demo's synthetic one does.
* ``device_data``: what ``ddpgraph train`` runs now: ``ddpgraph.DeviceData`` holds the data set on
  the device and a TrainStep with ``steps_per_replay=--k`` (its own model, optimizer and
  scheduler, same config) gathers the batches inside its graph: ``losses = step(data)``, the
  losses summed on the device; the TrainStep steps the scheduler. Its rate counts training steps.

Each loader alone is timed too (``loader_alone_batches_per_s``: batches per second with no
step), which shows whether the loader is the bottleneck. The loop body is the demo's:
``loss = step(x, y)``, the loss summed on the device, ``scheduler.step()``. Each rate is steps per wall-clock second over
``--steps`` steps between two device syncs (the host runs ahead, as in training); the modes take
turns, ``--repeats`` times, and the median is reported with the ratios to ``staged``.

    python benchmarks/loader.py --out benchmarks/results/loader-h200.json      # on a GPU
    python benchmarks/loader.py --quick --out /tmp/loader.json                  # CPU smoke test
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

import ddpgraph
from ddpgraph.bench import environment
from ddpgraph.demo.data import SAMPLE_SHAPES, synthetic_patterns
from ddpgraph.demo.models import build_model

MODELS = ("mlp", "resnet", "transformer")
BATCH_SIZE = 64
TRAIN_SAMPLES = 8192  # the demo's data set size (ddpgraph.demo.train.TRAIN_SAMPLES)
DEMO_NUM_WORKERS = 0  # the demo's DataLoader leaves num_workers at its default
WARMUP_STEPS = 20  # eager warm-up, capture and first replays, before anything is timed
STAGED_BATCHES = 8  # rotating device batches for the reference
LOOP_WARMUP = 5  # untimed steps of each mode first: its iterator and pin thread start
FAST_WORKERS = 2
MODES = (
    "staged",
    "loader",
    "prefetch",
    "batched_prefetch",
    "batched_workers_prefetch",
    "index_prefetch",
    "device_index",
    "device_data",
)
DEVICE_DATA_K = 2  # ddpgraph train's default --steps-per-replay
Batch = tuple[torch.Tensor, torch.Tensor]


def demo_dataset(model: str, num_samples: int) -> TensorDataset:
    return synthetic_patterns(SAMPLE_SHAPES[model], num_samples=num_samples, seed=0)


def demo_loader(data: TensorDataset, rt: ddpgraph.Runtime, num_workers: int) -> DataLoader:
    """The DataLoader ``ddpgraph train`` builds for training (one sample per __getitem__)."""
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=rt.world_size, rank=rt.rank, shuffle=True, seed=0, drop_last=True
    )
    return DataLoader(
        data,
        batch_size=BATCH_SIZE,
        sampler=sampler,
        drop_last=True,
        pin_memory=rt.device.type == "cuda",
        num_workers=num_workers,
    )


def batched_loader(data: TensorDataset, rt: ddpgraph.Runtime, num_workers: int) -> DataLoader:
    """Batch-level sampling: the sampler yields index lists, the data set indexes once per batch.

    ``TensorDataset[list_of_indices]`` is one gather per tensor, and ``batch_size=None`` skips
    the per-sample collate: the loader's cost per batch no longer grows with the batch size.
    With workers, they persist across epochs and the loader's thread pins; without, prefetch
    pins (the same work, with less Python around it).
    """
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=rt.world_size, rank=rt.rank, shuffle=True, seed=0, drop_last=True
    )
    return DataLoader(
        data,
        sampler=BatchSampler(sampler, BATCH_SIZE, drop_last=True),
        batch_size=None,
        pin_memory=num_workers > 0 and rt.device.type == "cuda",
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )


def forever(loader: DataLoader) -> Iterator[Batch]:
    """Epoch after epoch, as the demo's loop does (set_epoch reshuffles)."""
    for epoch in itertools.count():
        sampler = loader.sampler
        sampler = getattr(sampler, "sampler", sampler)  # the one inside a BatchSampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        yield from loader


def index_batches(data: TensorDataset, rt: ddpgraph.Runtime) -> Iterator[Batch]:
    """Endless shuffled batches gathered by index tensors: two index_select calls per batch."""
    x, y = data.tensors
    gen = torch.Generator().manual_seed(0)
    usable = len(x) // (rt.world_size * BATCH_SIZE) * rt.world_size * BATCH_SIZE
    while True:
        order = torch.randperm(len(x), generator=gen)[:usable]
        for idx in order[rt.rank :: rt.world_size].reshape(-1, BATCH_SIZE):
            yield x[idx], y[idx]


def device_index_batches(data: TensorDataset, rt: ddpgraph.Runtime) -> Iterator[Batch]:
    """Endless shuffled batches gathered on the device: two index_select launches per batch."""
    x, y = (t.to(rt.device) for t in data.tensors)
    gen = torch.Generator(device=rt.device).manual_seed(0)
    usable = len(x) // (rt.world_size * BATCH_SIZE) * rt.world_size * BATCH_SIZE
    while True:
        order = torch.randperm(len(x), generator=gen, device=rt.device)[:usable]
        for idx in order[rt.rank :: rt.world_size].reshape(-1, BATCH_SIZE).unbind(0):
            yield x.index_select(0, idx), y.index_select(0, idx)


def build_step(model_name: str, rt: ddpgraph.Runtime, steps_per_replay: int = 1) -> tuple[Any, Any]:
    """The demo's model, optimizer, scheduler and TrainStep options."""
    torch.manual_seed(0)
    model = build_model(model_name).to(rt.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1_000_000)
    step = ddpgraph.TrainStep(
        model,
        optimizer,
        loss_fn=nn.CrossEntropyLoss(),
        scheduler=scheduler,
        channels_last=model_name == "resnet",
        steps_per_replay=steps_per_replay,
    )
    return step, scheduler


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_loop(batches: Iterator[Batch], steps: int, step: Any, scheduler: Any, rt: Any) -> float:
    """Steps per second of the demo's loop body over ``steps`` batches from ``batches``."""
    total = torch.zeros((), device=rt.device)
    sync(rt.device)
    started = time.perf_counter()
    for _, (x, y) in zip(range(steps), batches):
        loss = step(x, y)
        total += loss.detach()  # the demo's _LossLog.add
        scheduler.step()
    sync(rt.device)
    return steps / (time.perf_counter() - started)


def run_data_loop(data: ddpgraph.DeviceData, steps: int, step: Any, rt: Any) -> float:
    """Training steps per second of the main job's device-data loop (``steps`` rounded down to
    whole calls)."""
    k = step.options.steps_per_replay
    calls = max(1, steps // k)
    total = torch.zeros((), device=rt.device)
    sync(rt.device)
    started = time.perf_counter()
    for _ in range(calls):
        total += step(data).sum()  # the demo's _LossLog.add
    sync(rt.device)
    return calls * k / (time.perf_counter() - started)


def loader_only(batches: Iterator[Batch], steps: int, warmup: int) -> float:
    """Batches per second from ``batches`` alone, after its first few (workers starting)."""
    for _, _batch in zip(range(warmup), batches):
        pass
    started = time.perf_counter()
    for _, _batch in zip(range(steps), batches):
        pass
    return steps / (time.perf_counter() - started)


def to_device(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    for x, y in batches:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def feeds(
    data: TensorDataset, rt: ddpgraph.Runtime, num_workers: int, fast_workers: int
) -> dict[str, Iterator[Batch]]:
    """One endless batch iterator per mode, kept across repeats (epochs roll over inside)."""
    staged = [
        (x.to(rt.device), y.to(rt.device))
        for x, y in itertools.islice(demo_loader(data, rt, 0), STAGED_BATCHES)
    ]
    demo = demo_loader(data, rt, num_workers)
    return {
        "staged": itertools.cycle(staged),
        "loader": to_device(forever(demo), rt.device),
        "prefetch": iter(ddpgraph.prefetch(forever(demo), rt.device)),
        "batched_prefetch": iter(
            ddpgraph.prefetch(forever(batched_loader(data, rt, 0)), rt.device)
        ),
        "batched_workers_prefetch": iter(
            ddpgraph.prefetch(forever(batched_loader(data, rt, fast_workers)), rt.device)
        ),
        "index_prefetch": iter(ddpgraph.prefetch(index_batches(data, rt), rt.device)),
        "device_index": device_index_batches(data, rt),
    }


def measure_model(
    model_name: str, rt: ddpgraph.Runtime, args: argparse.Namespace
) -> dict[str, Any]:
    steps, repeats = args.steps, args.repeats
    data = demo_dataset(model_name, args.samples)
    step, scheduler = build_step(model_name, rt)
    sources = feeds(data, rt, args.num_workers, args.fast_workers)
    run_loop(sources["staged"], args.warmup, step, scheduler, rt)
    data_step, _ = build_step(model_name, rt, steps_per_replay=min(args.k, len(data) // BATCH_SIZE))
    device_data = ddpgraph.DeviceData(
        *data.tensors, batch_size=BATCH_SIZE, seed=0, channels_last=model_name == "resnet"
    )
    run_data_loop(device_data, args.warmup * args.k, data_step, rt)
    for name, s in (("staged", step), ("device_data", data_step)):
        if rt.device.type == "cuda" and s.mode != "graphed":
            raise RuntimeError(f"{model_name} {name}: not graphed after warm-up:\n{s.report()}")

    def run_mode(mode: str, n: int) -> float:
        if mode == "device_data":
            return run_data_loop(device_data, n, data_step, rt)
        return run_loop(sources[mode], n, step, scheduler, rt)

    for mode in MODES:  # start every iterator (pin threads, workers) before timing
        run_mode(mode, args.loop_warmup)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(repeats):
        # rotate the order: the mode after another one pays for its leftovers
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            rates[mode].append(run_mode(mode, steps))
    alone = {
        "loader": forever(demo_loader(data, rt, args.num_workers)),
        "batched": forever(batched_loader(data, rt, 0)),
        "batched_workers": forever(batched_loader(data, rt, args.fast_workers)),
        "index": index_batches(data, rt),
    }
    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    report = step.report()
    return {
        "steps_per_s": medians,
        "ratio_to_staged": {
            mode: medians[mode] / medians["staged"] for mode in MODES if mode != "staged"
        },
        "ms_per_step": {mode: 1e3 / rate for mode, rate in medians.items()},
        "loader_alone_batches_per_s": {
            name: loader_only(batches, steps, args.loop_warmup) for name, batches in alone.items()
        },
        "all_repeats_steps_per_s": rates,
        "step_mode": report.mode,
        "replays": report.replays,
        "eager_steps": report.eager_steps,
        "device_data": {
            "steps_per_replay": data_step.options.steps_per_replay,
            "data_mib": device_data.nbytes / 2**20,
            "step_mode": data_step.report().mode,
            "replays": data_step.report().replays,
            "peak_memory_mib": (
                torch.cuda.max_memory_allocated(rt.device) / 2**20
                if rt.device.type == "cuda"
                else None
            ),
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = False  # as the demo
    with ddpgraph.init() as rt:
        results = {name: measure_model(name, rt, args) for name in args.models}
        world_size = rt.world_size
        device = str(rt.device)
    return {
        "benchmark": "main-job loop feeds vs pre-staged device batches (benchmarks/loader.py)",
        "environment": environment(),
        "device": device,
        "world_size": world_size,
        "cpu_count": os.cpu_count(),
        "config": {
            "batch_size": BATCH_SIZE,
            "samples": args.samples,
            "steps": args.steps,
            "repeats": args.repeats,
            "num_workers": args.num_workers,
            "fast_workers": args.fast_workers,
            "loop_body": "loss = step(x, y); total += loss.detach(); scheduler.step()",
            "device_data_loop_body": "total += step(data).sum()  (K steps a call)",
            "k": args.k,
            "quick": args.quick,
        },
        "models": results,
    }


def print_table(results: dict[str, Any]) -> None:
    print(f"{'model':>12} {'staged/s':>9} " + " ".join(f"{m:>22}" for m in MODES[1:]))
    for name, r in results["models"].items():
        cells = [
            f"{r['steps_per_s'][m]:9.0f} ({r['ratio_to_staged'][m]:.2f}x)".rjust(22)
            for m in MODES[1:]
        ]
        print(f"{name:>12} {r['steps_per_s']['staged']:9.0f} " + " ".join(cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=300, help="timed steps per mode and repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--warmup", type=int, default=WARMUP_STEPS, help="steps before timing (warm-up, capture)"
    )
    parser.add_argument(
        "--loop-warmup", type=int, default=LOOP_WARMUP, help="untimed steps of each feed first"
    )
    parser.add_argument(
        "--num-workers", type=int, default=DEMO_NUM_WORKERS, help="the demo loader's workers"
    )
    parser.add_argument(
        "--fast-workers", type=int, default=FAST_WORKERS, help="batched_workers_prefetch's workers"
    )
    parser.add_argument("--samples", type=int, default=TRAIN_SAMPLES)
    parser.add_argument(
        "--k", type=int, default=DEVICE_DATA_K, help="device_data's steps per replay"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few steps on the CPU: a smoke test of the script"
    )
    args = parser.parse_args(argv)
    if args.quick:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch touches CUDA: the CPU path
        args.steps, args.repeats, args.samples, args.fast_workers = 2, 2, 4 * BATCH_SIZE, 1
        args.k = 2
        args.warmup, args.loop_warmup = 1, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
