"""transformers' ``Trainer`` against ``GraphTrainer`` on a small GPT-2, side by side.

Both train the same GPT-2 (4 layers, d=256, GPT-2's vocabulary) on the same padded,
attention-masked rows (random lengths, -100 labels on the padding) in bf16, with AdamW, a linear
warm-up and decay, ``max_grad_norm=1.0`` and ``logging_steps=10``; the modes take turns in one
process (``--repeats`` times). A rate is optimizer steps per second between step
``--measure-from`` (past warm-up and capture) and the end of the run, each end behind a device
sync. The JSON has each mode's rates and median, the ratio, the last logged loss and learning
rate of each (the same schedule, so the same learning rate), and the GraphTrainer's report
(replays; eager steps only in warm-up).

    torchrun --nproc-per-node=1 benchmarks/frameworks.py --out benchmarks/results/frameworks-h200.json
    python benchmarks/frameworks.py --quick --out /tmp/frameworks.json    # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch
import transformers

from ddpgraph.integrations.transformers import GraphTrainer


def rows(n: int, length: int, vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (n, length), generator=gen)
    lengths = torch.randint(length // 4, length + 1, (n,), generator=gen)
    mask = (torch.arange(length) < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return [
        {"input_ids": a, "attention_mask": m, "labels": y} for a, m, y in zip(ids, mask, labels)
    ]


class Clock(transformers.TrainerCallback):
    """Times the optimizer steps after ``start`` (each end behind a device sync)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.t0: float | None = None
        self.t1: float | None = None
        self.steps = 0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.start:
            self._sync()
            self.t0 = time.perf_counter()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        self.t1 = time.perf_counter()
        self.steps = state.global_step - self.start

    @property
    def rate(self) -> float:
        assert self.t0 is not None and self.t1 is not None
        return self.steps / (self.t1 - self.t0)


def run(mode: str, opts: argparse.Namespace, data: list[dict[str, torch.Tensor]]) -> dict:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=opts.vocab, n_positions=opts.seq, n_embd=opts.dim, n_layer=opts.layers,
        n_head=max(1, opts.dim // 64),
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=opts.batch, max_steps=opts.steps,
            gradient_accumulation_steps=opts.accumulate, learning_rate=3e-4,
            lr_scheduler_type="linear", warmup_steps=opts.steps // 10, max_grad_norm=1.0,
            bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
            logging_steps=10, save_strategy="no", report_to=[], disable_tqdm=True,
            dataloader_drop_last=True, seed=0,
        )  # fmt: skip
        clock = Clock(opts.measure_from)
        cls = GraphTrainer if mode == "graph_trainer" else transformers.Trainer
        trainer = cls(model=model, args=args, train_dataset=data, callbacks=[clock])
        trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    result = {
        "steps_per_s": clock.rate,
        "last_loss": logged[-1]["loss"],
        "last_learning_rate": logged[-1]["learning_rate"],
        "learning_rates": [e["learning_rate"] for e in logged],
    }
    if isinstance(trainer, GraphTrainer):
        report = trainer.report()
        result["report"] = str(report)
        assert report.step is not None
        result["replays"] = report.step.replays
        result["eager_steps"] = report.step.eager_steps
        result["warmup_steps"] = report.step.warmup_steps
        result["fallbacks"] = report.step.fallbacks
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--measure-from", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny CPU smoke run")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    if opts.quick:
        opts.steps, opts.measure_from, opts.batch, opts.seq = 20, 14, 4, 16
        opts.dim, opts.layers, opts.vocab, opts.repeats = 32, 2, 100, 1
    data = rows(opts.steps * opts.batch * opts.accumulate, opts.seq, opts.vocab)
    modes = ("trainer", "graph_trainer")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(opts.repeats):
        for mode in modes:
            runs[mode].append(run(mode, opts, data))
            print(mode, f"{runs[mode][-1]['steps_per_s']:.1f} steps/s", flush=True)
    median = {m: statistics.median(r["steps_per_s"] for r in runs[m]) for m in modes}
    result = {
        "config": vars(opts),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "median_steps_per_s": median,
        "speedup": median["graph_trainer"] / median["trainer"],
        "same_learning_rates": runs["trainer"][0]["learning_rates"]
        == runs["graph_trainer"][0]["learning_rates"],
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(json.dumps({k: result[k] for k in ("median_steps_per_s", "speedup")}, indent=2))
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
