"""The classic "ResNet on 4 GPUs with DDP, whole step in one CUDA graph" program, done right.

The hand-written version of this program usually breaks in one of these ways (see
``ddpgraph lint`` DG101-DG108 and ``ddpgraph explain``):

- no ``torch.cuda.set_device(LOCAL_RANK)``: every rank runs on cuda:0 (``ncclInvalidUsage``, or a
  hang);
- DDP built on the default stream, the graph captured on another one: "operation would make the
  legacy stream depend on a capturing blocking stream";
- 3 or 10 (or 100) eager iterations before the capture: DDP's runtime statistics call a host sync
  inside the capture, "operation not permitted when stream is capturing";
- Adam/AdamW without ``capturable=True``; ``.item()`` or ``print(loss)`` inside the capture;
- a smaller last batch replayed into the graph's static input of the old shape.

Here ``ddpgraph.init()`` binds the device and creates the process group, ``TrainStep`` builds DDP on
the stream it captures with, warms up for long enough, makes the optimizer graph-safe, and checks
every batch's shape before it replays; the data loader drops the ragged last batch so every step
has one shape. On the CPU (gloo) the same program runs eagerly.

Run (one process per GPU, or CPU processes on gloo where there is no GPU):

    torchrun --nproc-per-node 4 examples/resnet_graphed_ddp.py --steps 200 --batch-size 64
    ddpgraph launch --nproc-per-node 2 examples/resnet_graphed_ddp.py

Uses torchvision's ResNet (random weights) when torchvision is installed, else ddpgraph's small
built-in ResNet.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import ddpgraph
from ddpgraph.demo.data import NUM_CLASSES, SAMPLE_SHAPES, synthetic_patterns
from ddpgraph.demo.models import build_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank (default: 16)")
    parser.add_argument(
        "--arch",
        choices=["resnet18", "resnet50"],
        default="resnet50",
        help="torchvision architecture, when torchvision is installed (default: resnet50)",
    )
    parser.add_argument(
        "--image-size", type=int, default=32, help="torchvision input side (default: 32)"
    )
    parser.add_argument("--log-every", type=int, default=10, help="steps between loss prints")
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="SGD learning rate (default: 0.1 x global batch / 256, the linear scaling rule)",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.batch_size < 1:
        parser.error(f"--steps {args.steps} and --batch-size {args.batch_size} must be >= 1")
    return args


def make_model(arch: str, image_size: int) -> tuple[nn.Module, tuple[int, ...], str]:
    """(model, per-sample input shape, description): torchvision's ResNet, or the built-in one."""
    try:
        import torchvision  # type: ignore[import-not-found]
    except ImportError:
        return build_model("resnet"), SAMPLE_SHAPES["resnet"], "built-in small ResNet"
    model = getattr(torchvision.models, arch)(weights=None, num_classes=NUM_CLASSES)
    return model, (3, image_size, image_size), f"torchvision {arch}"


def batches(loader: DataLoader, sampler: DistributedSampler) -> Iterator[Any]:
    """Endless batches, reshuffled each epoch (set_epoch: every rank draws the same permutation)."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        # CPU ranks share the cores instead of each starting one thread per core
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    rt = ddpgraph.init()  # binds cuda:LOCAL_RANK before any CUDA work, checks GPUs are unique
    train(args, rt)
    # after train() returned: shutdown frees the DDP model and its process group while the
    # interpreter is fully alive, instead of leaving them to the exit
    ddpgraph.shutdown()


def train(args: argparse.Namespace, rt: ddpgraph.Runtime) -> None:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model, sample_shape, described = make_model(args.arch, args.image_size)
    model = model.to(rt.device)
    on_gpu = rt.device.type == "cuda"
    # ResNet-50 from scratch with small batches diverges at a large LR (loss 44 at lr=0.05, b16)
    lr = args.lr if args.lr is not None else 0.1 * args.batch_size * rt.world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    # channels_last: convolutions run in NHWC on tensor cores, about twice as fast for ResNet
    step = ddpgraph.TrainStep(model, optimizer, nn.CrossEntropyLoss(), channels_last=on_gpu)

    data = synthetic_patterns(
        sample_shape, num_samples=max(args.batch_size * rt.world_size * 4, 256), seed=0
    )
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=rt.world_size, rank=rt.rank, shuffle=True, seed=0, drop_last=True
    )
    # drop_last: a ragged last batch would be a new shape, i.e. an eager step or a new capture
    loader = DataLoader(
        data, batch_size=args.batch_size, sampler=sampler, drop_last=True, pin_memory=on_gpu
    )
    if rt.is_main:
        print(
            f"{described} on {rt.world_size} rank(s) ({rt.backend}, rank 0 on {rt.device}), "
            f"batch {args.batch_size} per rank, {args.steps} steps",
            flush=True,
        )

    started = time.perf_counter()
    loss = torch.zeros(())
    for i, (x, y) in zip(range(args.steps), batches(loader, sampler)):
        loss = step(x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True))
        # float(loss) waits for the GPU: only every --log-every steps. The loss tensor belongs to
        # the graph and is overwritten by the next step, so read it now.
        if rt.is_main and ((i + 1) % args.log_every == 0 or i + 1 == args.steps):
            print(f"step {i + 1:4d}  loss {float(loss):.4f}  ({step.mode})", flush=True)
    final_loss = float(loss)
    seconds = time.perf_counter() - started

    if rt.is_main:
        print(f"final loss {final_loss:.4f}; {args.steps / seconds:.1f} steps/s on rank 0")
        print(step.report(), flush=True)


if __name__ == "__main__":
    main()
