"""``ddpgraph bench --varlen``: a causal LM fed batches of a new length (32..256) every step.

Modes, in one process on the same length sequence: eager DDP on the raw lengths, eager DDP on
padded batches (the memory reference), torch.compile reduce-overhead on the raw lengths, and
TrainStep with ``pad_batch(multiple=64)`` buckets and ``on_new_shape="capture"`` (one graph per
bucket, one pool). Each mode runs the sequence twice: the first pass includes compiling and
capturing (``whole_run_ms`` per step), the second is steady state (``median_ms`` from CUDA events).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data import pad_batch
from ..distributed import runtime
from ..step import TrainStep
from . import CPU_NOTE, Interruptible, _fresh, _step_times, _summary, _write_json, environment

VARLEN_MODES = ("eager_ddp", "eager_ddp_padded", "compile_reduce_overhead", "train_step_buckets")


@dataclass(frozen=True)
class LMConfig:
    name: str
    vocab: int = 8192
    width: int = 256
    layers: int = 4
    heads: int = 4
    batch_size: int = 16
    min_len: int = 32
    max_len: int = 256
    multiple: int = 64
    steps: int = 240


LM = LMConfig("causal LM 4x256 b16, lengths 32..256")
QUICK_LM = LMConfig(
    "causal LM 1x32 b2 (quick)",
    vocab=64,
    width=32,
    layers=1,
    heads=2,
    batch_size=2,
    min_len=4,
    max_len=24,
    multiple=8,
    steps=6,
)


class CausalLM(nn.Module):
    """GPT-like: token + position embeddings, causal encoder layers, tied head; returns its loss
    when given ``labels`` (padding labelled -100 is ignored), like HF's LM heads."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(cfg.max_len + cfg.multiple, cfg.width)
        layer = nn.TransformerEncoderLayer(
            cfg.width, cfg.heads, 4 * cfg.width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)
        x = self.tokens(input_ids) + self.positions(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=input_ids.device)
        logits = self.head(self.blocks(x, mask=mask, is_causal=True))
        if labels is None:
            return logits
        return nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )


def lm_batches(cfg: LMConfig, device: torch.device) -> list[dict[str, torch.Tensor]]:
    rng = random.Random(0)
    gen = torch.Generator(device=device).manual_seed(0)
    batches = []
    for _ in range(cfg.steps):
        length = rng.randint(cfg.min_len, cfg.max_len)
        ids = torch.randint(cfg.vocab, (cfg.batch_size, length), device=device, generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


def _hand_written(
    cfg: LMConfig, device: torch.device, compile_mode: str | None
) -> Callable[[Mapping[str, torch.Tensor]], Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model: nn.Module = CausalLM(cfg).to(device)
    if compile_mode is not None:
        model = torch.compile(model, mode=compile_mode)  # type: ignore[assignment]
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)

    def one(batch: Mapping[str, torch.Tensor]) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = ddp(**batch)
        loss.backward()
        opt.step()

    return one


def _train_step(cfg: LMConfig, device: torch.device) -> Callable[[Mapping[str, torch.Tensor]], Any]:
    torch.manual_seed(0)
    model = CausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    amp = "bf16" if device.type == "cuda" else None
    step = TrainStep(model, opt, amp=amp, on_new_shape="capture")
    return step


def _padded(cfg: LMConfig, batches: list[dict[str, torch.Tensor]]) -> list[Any]:
    return [pad_batch(b, multiple=cfg.multiple, dim=1) for b in batches]


def run_varlen_mode(
    mode: str, cfg: LMConfig, device: torch.device, batches: list[dict[str, torch.Tensor]]
) -> dict[str, Any]:
    with _fresh(device):
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        feed = (
            _padded(cfg, batches) if mode in ("eager_ddp_padded", "train_step_buckets") else batches
        )
        started = time.perf_counter()
        if mode == "train_step_buckets":
            one: Callable[[Any], Any] = _train_step(cfg, device)
        else:
            compile_mode = "reduce-overhead" if mode == "compile_reduce_overhead" else None
            one = _hand_written(cfg, device, compile_mode)
        for batch in feed:  # cold pass: compiles and captures included
            one(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        whole = (time.perf_counter() - started) / len(feed) * 1e3
        it = iter(feed)
        result: dict[str, Any] = _summary(_step_times(lambda: one(next(it)), len(feed), device))
        result["whole_run_ms"] = whole
        if isinstance(one, TrainStep):
            result["graphs"] = len(one.report().captures)
            result["mode"] = one.report().mode
        if device.type == "cuda":
            result["peak_memory_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return result


def run_varlen(*, repeats: int, quick: bool, out: Path) -> dict[str, Any]:
    """Every mode ``repeats`` times, interleaved; JSON with per-run ratios to eager DDP."""
    rt = runtime.init()
    cfg = QUICK_LM if quick else LM
    batches = lm_batches(cfg, rt.device)
    runs: list[dict[str, Any]] = []
    results: dict[str, Any] = {
        "environment": environment(),
        "world_size": rt.world_size,
        "config": cfg.__dict__,
        "timing": "median_ms: CUDA events over the second pass; whole_run_ms: first pass per step",
        "runs": runs,
    }
    # quick: no Inductor (a CPU compile takes minutes), the other modes' code paths all run
    modes = [m for m in VARLEN_MODES if not (quick and m == "compile_reduce_overhead")]
    if rt.device.type != "cuda":
        results["note"] = CPU_NOTE
        if rt.is_main:
            print(f"ddpgraph bench: warning: {CPU_NOTE}.", file=sys.stderr, flush=True)
    with Interruptible(out) as stop:
        for r in range(repeats):
            _repeat(results, modes, cfg, rt, batches, stop)
            if rt.is_main:  # said first: a disk that refuses the JSON loses no result
                _say(r, repeats, results["runs"][-1])
                _write_json(results, out)
                stop.written(r + 1)
    runtime.shutdown()
    return results


def _repeat(
    results: dict[str, Any],
    modes: list[str],
    cfg: Any,
    rt: runtime.Runtime,
    batches: Any,
    stop: Interruptible,
) -> None:
    """One run of every mode, with its ratios, appended to ``results["runs"]``."""
    run = {}
    for mode in modes:
        run[mode] = run_varlen_mode(mode, cfg, rt.device, batches)
        stop.check()
    eager = run["eager_ddp"]
    for measured in run.values():
        measured["vs_eager"] = measured["median_ms"] / eager["median_ms"]
        if "peak_memory_mib" in measured:
            measured["memory_vs_eager_padded"] = (
                measured["peak_memory_mib"] / run["eager_ddp_padded"]["peak_memory_mib"]
            )
    results["runs"].append(run)


def _say(r: int, repeats: int, run: dict[str, Any]) -> None:
    line = ", ".join(
        f"{m} {v['median_ms']:.2f} ms ({v['vs_eager']:.2f}x, whole run "
        f"{v['whole_run_ms']:.1f} ms per step)"
        for m, v in run.items()
    )
    print(f"[bench varlen] {r + 1}/{repeats}: {line}", flush=True)
