"""Where does a K-step replay's time go? Per-step wall time and GPU-busy time of one model fed
pre-staged batches (K=1) and a DeviceData at K = 1, 2, 4, 8, 16, in one process, interleaved.

    python benchmarks/probes/steps_per_replay_probe.py --out /tmp/probe.json   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
from pathlib import Path

import torch
from torch import nn

import ddpgraph
from ddpgraph.bench import CONFIGS, _gpu_busy_ms, environment
from ddpgraph.demo.data import SAMPLE_SHAPES, synthetic_patterns
from ddpgraph.demo.models import build_model

KS = (1, 2, 4, 8, 16)


def build(name: str, k: int):
    torch.manual_seed(0)
    if name in CONFIGS:
        cfg = CONFIGS[name]
        model, shape, batch, conv = cfg.build(), cfg.sample_shape, cfg.batch_size, cfg.conv
    else:
        model, shape, batch, conv = build_model(name), SAMPLE_SHAPES[name], 64, name == "resnet"
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = ddpgraph.TrainStep(
        model, opt, nn.CrossEntropyLoss(), steps_per_replay=k, channels_last=conv
    )
    data_set = synthetic_patterns(shape, num_samples=32 * batch, seed=0)
    data = ddpgraph.DeviceData(
        *data_set.tensors, batch_size=batch, channels_last=conv, device="cuda"
    )
    return step, data


def timed(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet"])
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS))
    parser.add_argument(
        "--no-ddp", action="store_true", help="no process group: TrainStep without DDP"
    )
    args = parser.parse_args()
    results = {"environment": environment(), "ddp": not args.no_ddp, "models": {}}
    with contextlib.nullcontext() if args.no_ddp else ddpgraph.init():
        for name in args.models:
            runs = {}
            staged_step, data = build(name, 1)
            batches = [tuple(t.clone() for t in b) for b in itertools.islice(data, 8)]
            cycle = itertools.cycle(batches)
            runs["staged"] = (staged_step, lambda s=staged_step, c=cycle: s(*next(c)), 1)
            for k in args.ks:
                step, d = build(name, k)
                runs[f"data_k{k}"] = (step, lambda s=step, d=d: s(d), k)
            for _, fn, k in runs.values():
                for _ in range(max(3, 32 // k)):
                    fn()
            times = {key: [] for key in runs}
            for _ in range(args.repeats):
                for key, (_, fn, k) in runs.items():
                    times[key].append(timed(fn, args.steps // k) / (args.steps // k * k))
            row = {}
            for key, (step, fn, k) in runs.items():
                busy = _gpu_busy_ms(fn, max(1, 32 // k), torch.device("cuda"))
                row[key] = {
                    "ms_per_step": statistics.median(times[key]),
                    "gpu_busy_ms_per_step": busy / k if busy else None,
                    "mode": step.report().mode,
                }
                print(name, key, row[key], flush=True)
            results["models"][name] = row
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
