"""The classic "every rank gathers its metrics dict with all_gather_object" program, done right.

The hand-written version usually looks like::

    dist.init_process_group("nccl")                # no torch.cuda.set_device(LOCAL_RANK)
    out = [None] * torch.cuda.device_count()       # not the world size
    dist.all_gather_object(out, {"rank": rank, "loss": loss_tensor})

and hangs or fails with ``ncclInvalidUsage`` (every rank on cuda:0), silently leaves a ``None`` in
the list (wrong length), unpickles peers' CUDA tensors onto *their* GPU (extra CUDA contexts), and
runs whatever code a peer's pickle contains. With ddpgraph: ``init()`` binds the device first,
``all_gather_object(obj)`` returns a list of exactly world-size entries in rank order, tensors
arrive on the CPU, the default codec never runs a peer's code, and a failure on any rank (an object
it cannot encode, a rank that skipped the call) raises the same error on every rank instead of
hanging. ``gather_for_metrics`` gathers the per-sample results themselves, each sample exactly
once and in data-set order, so a metric over them equals one process's over the whole set.

Run (one process per GPU, or CPU processes on gloo where there is no GPU):

    torchrun --nproc-per-node 4 examples/gather_metrics.py
    ddpgraph launch --nproc-per-node 2 examples/gather_metrics.py --samples 4096
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

import torch
import torch.nn.functional as F

import ddpgraph
from ddpgraph.demo.data import NUM_CLASSES, SAMPLE_SHAPES, synthetic_patterns
from ddpgraph.demo.models import build_model

COLUMNS = ("rank", "host", "device", "samples", "loss", "accuracy")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, default=1024, help="evaluation samples in all (default: 1024)"
    )
    args = parser.parse_args()
    if args.samples < 1:
        parser.error(f"--samples {args.samples} must be >= 1")
    return args


@torch.no_grad()
def evaluate(rt: ddpgraph.Runtime, samples: int) -> dict[str, Any]:
    """This rank's metrics over its shard (every world_size-th sample) of a synthetic eval set."""
    torch.manual_seed(0)  # the same (untrained) model on every rank
    model = build_model("mlp").to(rt.device).eval()
    inputs, labels = synthetic_patterns(SAMPLE_SHAPES["mlp"], num_samples=samples, seed=0)[
        rt.rank :: rt.world_size
    ]
    logits = model(inputs.to(rt.device))
    labels = labels.to(rt.device)
    return {
        "rank": rt.rank,
        "host": socket.gethostname(),
        "device": str(rt.device),
        "samples": len(labels),
        # a 0-d tensor, possibly on this rank's GPU: it arrives on the CPU at every rank
        "loss": F.cross_entropy(logits, labels, reduction="sum").detach(),
        "correct": int((logits.argmax(dim=1) == labels).sum()),
        # one entry per sample of this rank's shard (a tensor stays a tensor on the way)
        "per_sample": logits.argmax(dim=1) == labels,
    }


def print_table(everyone: list[dict[str, Any]]) -> None:
    rows = [
        (
            str(m["rank"]),
            m["host"],
            m["device"],
            str(m["samples"]),
            f"{float(m['loss']) / max(m['samples'], 1):.4f}",
            f"{m['correct'] / max(m['samples'], 1):.3f}",
        )
        for m in everyone
    ]
    total = sum(m["samples"] for m in everyone)
    rows.append(
        (
            "all",
            "",
            "",
            str(total),
            f"{sum(float(m['loss']) for m in everyone) / total:.4f}",
            f"{sum(m['correct'] for m in everyone) / total:.3f}",
        )
    )
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    for row in (COLUMNS, *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"(chance accuracy is {1 / NUM_CLASSES:.3f}: the model is untrained)", flush=True)


def main() -> None:
    args = parse_args()
    with ddpgraph.init() as rt:  # binds the device, creates the group; shuts down on exit
        metrics = evaluate(rt, args.samples)
        # Every rank must make this call. The result has exactly world_size entries, rank order.
        per_sample = metrics.pop("per_sample")
        everyone = ddpgraph.all_gather_object(metrics)
        assert len(everyone) == rt.world_size
        # every sample once, in data-set order (this split, dataset[rank::world_size], has no
        # padding; with a DistributedSampler pass sampler= and its padding is dropped)
        correct = ddpgraph.gather_for_metrics(per_sample, total=args.samples)
        if rt.is_main:
            print_table(everyone)
            print(
                f"per sample: {len(correct)} samples, accuracy {float(correct.float().mean()):.3f}"
            )


if __name__ == "__main__":
    main()
