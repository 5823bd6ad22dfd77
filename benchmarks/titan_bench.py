"""torchtitan's own step against TrainStep on CUDA (issue 48 item 3); run by titan_gpu.sh.

One (config, mode) per process, launched by ``torchrun`` on every visible GPU (world size 1 on
one GPU: torchtitan then applies no FSDP, as its own run on one GPU does):

* ``titan``: torchtitan's ``Trainer.train_step`` as its debug config runs it (llama3, its
  ``parallelize_llama``: FSDP2 with bf16 parameters where there are 2+ ranks, selective
  activation checkpointing every 2nd layer; AdamW, warm-up + linear decay, clipping at 1.0), the
  loss and grad norm read on the host every ``log_freq`` steps as its MetricsProcessor does;
* ``titan-compile``: the same with its ``compile.enable`` (each block and the loss compiled);
* ``titan-cudagraph``: torchtitan 0.2.2's only CUDA-graph path, its experimental
  ``compiler_toolkit.llama3`` (SimpleFSDP, not FSDP2) with ``compile.passes=["cudagraph"]``;
  recorded with its error if it does not run;
* ``trainstep``: the same model, sharding, loss, optimizer and schedulers through
  ``ddpgraph.TrainStep`` (the whole step graphed), the LR scheduler stepped after each call.

Configs: ``debugmodel`` (torchtitan's: dim 256, 6 layers, vocab 2048; seq 2048, batch 8, as its
debug_model.toml) and ``12x1024`` (dim 1024, 12 layers, 16 heads; seq 2048, batch 4).
Each part writes ``PART_DIR/titan-CONFIG-MODE.json`` (rank 0); ``merge`` makes one JSON with the
ratios against torchtitan's default step and the issue's targets.

    torchrun --standalone --nproc-per-node=1 benchmarks/titan_bench.py --config debugmodel \\
        --mode trainstep --out out/titan-parts
    python3 benchmarks/titan_bench.py merge out/titan-parts --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "debugmodel": {"sizes": {}, "seq": 2048, "batch": 8},
    "12x1024": {"sizes": {"dim": 1024, "n_layers": 12, "n_heads": 16}, "seq": 2048, "batch": 4},
}
MODES = ("titan", "titan-compile", "titan-cudagraph", "trainstep")
WARM = 20  # steps before timing: TrainStep's warm-up (12) and capture; compiles
TIMED = 50
# issue 48's targets: TrainStep's step time over torchtitan's default step, and its peak memory
TARGETS = {"debugmodel": 0.8, "12x1024": 1.0, "peak": 1.0}


def refuse_without_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit(
            f"titan_bench.py: needs a CUDA GPU, and torch {torch.__version__} sees none on this "
            "machine (torch.cuda.is_available() is False). Run benchmarks/titan_gpu.sh on the "
            "GPU machine."
        )


def _job(config: str, mode: str) -> Any:
    from tests.titan_workers import job_config

    spec = CONFIGS[config]
    job = job_config()
    job.training.seq_len = spec["seq"]
    job.training.local_batch_size = spec["batch"]
    job.training.steps = WARM + TIMED
    if mode == "titan-compile":
        job.compile.enable = True
        job.compile.components = ["model", "loss"]
    if mode == "titan-cudagraph":
        job.model.name = "compiler_toolkit.llama3"
        job.compile.joint_passes = []
        job.compile.passes = ["cudagraph"]
    return job


class _Logged:
    """torchtitan's MetricsProcessor's cadence: the loss and grad norm read on the host on step
    1 and every ``log_freq`` steps (``MetricsProcessor.should_log``)."""

    def __init__(self, log_freq: int) -> None:
        self.log_freq = log_freq
        self.ntokens_since_last_log = 0
        self.data_loading_times: list[float] = []

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass


def run_part(config: str, mode: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torchtitan.distributed import utils as dist_utils

    from tests.titan_workers import batches, build

    job = _job(config, mode)
    torch.cuda.reset_peak_memory_stats()
    trainer = build(job, device="cuda", sizes=CONFIGS[config]["sizes"])
    trainer.metrics_processor = _Logged(job.metrics.log_freq)
    data = batches(WARM + TIMED, trainer.model_args.vocab_size)
    result: dict[str, Any] = {}
    if mode == "trainstep":
        from ddpgraph import TrainStep

        mesh = trainer.parallel_dims.get_optional_mesh("batch")
        tokens = torch.tensor(job.training.local_batch_size * job.training.seq_len)
        global_tokens = dist_utils.dist_sum(tokens.cuda(), mesh)
        (optimizer,) = trainer.optimizers.optimizers
        step = TrainStep(
            trainer.model_parts[0],
            optimizer,
            lambda pred, labels: trainer.loss_fn(pred, labels) / global_tokens,
            clip_grad_norm=job.training.max_norm,
        )

        def one(i: int) -> None:
            loss = step(data[i][0]["input"], data[i][1])
            trainer.lr_schedulers.step()
            if trainer.metrics_processor.should_log(i + 1):
                loss.item()  # the host read torchtitan's logging does

    else:
        iterator = trainer.batch_generator(data)

        def one(i: int) -> None:
            trainer.step += 1
            trainer.train_step(iterator)

    for i in range(WARM):
        one(i)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(WARM, WARM + TIMED):
        one(i)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / TIMED
    if mode == "trainstep":
        report = step.report()
        result.update(replays=report.replays, fallbacks=list(report.fallbacks))
    result.update(
        ms_per_step=seconds * 1e3,
        steps_per_s=1 / seconds,
        peak_allocated_mib=torch.cuda.max_memory_allocated() / 2**20,
        peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20,
        world_size=dist.get_world_size(),
    )
    return result


def part(args: argparse.Namespace) -> int:
    refuse_without_cuda()
    import torch
    import torch.distributed as dist
    import torchtitan

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    record: dict[str, Any] = {
        "config": args.config,
        "mode": args.mode,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "0.2.2"),
        "warm_steps": WARM,
        "timed_steps": TIMED,
        "seq": CONFIGS[args.config]["seq"],
        "local_batch": CONFIGS[args.config]["batch"],
    }
    try:
        record.update(run_part(args.config, args.mode))
    except Exception as exc:  # a mode this torchtitan cannot run: named in the results
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc(limit=8)
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"titan-{args.config}-{args.mode}.json").write_text(json.dumps(record, indent=1))
        print(json.dumps({k: v for k, v in record.items() if k != "traceback"}))
    dist.destroy_process_group()
    return 0


def merge(args: argparse.Namespace) -> int:
    parts = [json.loads(p.read_text()) for p in sorted(Path(args.parts).glob("titan-*.json"))]
    if not parts:
        sys.exit(f"titan_bench.py merge: no titan-*.json in {args.parts}")
    comparisons = {}
    for config in CONFIGS:
        by_mode = {p["mode"]: p for p in parts if p["config"] == config and "error" not in p}
        base, mine = by_mode.get("titan"), by_mode.get("trainstep")
        if base is None or mine is None:
            continue
        time_ratio = mine["ms_per_step"] / base["ms_per_step"]
        peak_ratio = mine["peak_allocated_mib"] / base["peak_allocated_mib"]
        comparisons[config] = {
            "trainstep_over_titan_time": time_ratio,
            "time_target": TARGETS[config],
            "time_target_met": time_ratio <= TARGETS[config],
            "trainstep_over_titan_peak": peak_ratio,
            "peak_target": TARGETS["peak"],
            "peak_target_met": peak_ratio <= TARGETS["peak"],
            **{
                f"{mode}_over_titan_time": by_mode[mode]["ms_per_step"] / base["ms_per_step"]
                for mode in ("titan-compile", "titan-cudagraph")
                if mode in by_mode
            },
        }
    merged = {"benchmark": "benchmarks/titan_gpu.sh", "parts": parts, "comparisons": comparisons}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
    print(json.dumps(comparisons, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    joined = sub.add_parser("merge", help="merge the parts into one JSON")
    joined.add_argument("parts")
    joined.add_argument("--out", required=True)
    parser.add_argument("--config", choices=sorted(CONFIGS))
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--out", default="out/titan-parts")
    args = parser.parse_args()
    if args.command == "merge":
        return merge(args)
    if args.config is None or args.mode is None:
        parser.error("a part needs --config and --mode (or: merge PARTS --out FILE)")
    return part(args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.titan_workers
    raise SystemExit(main())
