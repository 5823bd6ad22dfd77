"""``ddpgraph bench --parallel fsdp2``: FSDP2 (``fully_shard``) eager, torchtitan-style, graphed.

Modes, each on the same model sharded the same way (every encoder layer, then the root) with
AdamW, clipping at 1.0 and bf16 autocast, in one process, one after the other:

``eager_fsdp2``         the plain FSDP2 loop a script writes (the baseline)
``fwd_bwd_graphed``     torchtitan's default: forward + backward captured with ``torch.cuda.graph``,
                        clipping and the optimizer eager (over DTensors)
``train_step``          TrainStep: the whole step (clip and optimizer too) as one graph;
                        ``bare_replay`` is that graph replayed with nothing around it

With one rank FSDP2 runs no collective (it skips them): the numbers measure the host and GPU work
of FSDP2's step, not communication. Peak memory is each mode's own (``max_memory_allocated``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._files import write_file
from .._typed_torch import cuda_stream
from ..distributed import runtime
from ..step import TrainStep
from ..step.parallel.fsdp2 import shard_blocks
from . import (
    CPU_NOTE,
    WRITE_FIX,
    BenchConfig,
    Interruptible,
    _batches,
    _cycle,
    _Encoder,
    _fresh,
    _measure,
    _step_times,
    _summary,
    environment,
)

__all__ = ["FSDP2_CONFIGS", "FSDP2_MODES", "run_fsdp2"]


class _LargeEncoder(_Encoder):
    """12 layers of d=1024 (about 150M parameters): optimizer state and gradients that FSDP2's
    sharding would divide across ranks."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        layer = nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
        self.head = nn.Linear(1024, 10)


def _tiny_encoder() -> nn.Module:
    enc = _Encoder.__new__(_Encoder)
    nn.Module.__init__(enc)
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    enc.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    enc.head = nn.Linear(32, 10)
    return enc


FSDP2_CONFIGS = {
    "transformer": BenchConfig(
        "FSDP2 transformer 6x512 b16 bf16", _Encoder, (128, 512), 16, "bf16"
    ),
    "transformer-large": BenchConfig(
        "FSDP2 transformer 12x1024 b8 s512 bf16", _LargeEncoder, (512, 1024), 8, "bf16"
    ),
}
FSDP2_QUICK = BenchConfig("FSDP2 transformer 2x32 b4 (quick)", _tiny_encoder, (16, 32), 4)
FSDP2_MODES = ("eager_fsdp2", "fwd_bwd_graphed", "train_step")
CLIP = 1.0


def _sharded(cfg: BenchConfig, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = cfg.build().to(device)
    shard_blocks(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _autocast(cfg: BenchConfig, device: torch.device) -> Any:
    # no weight-cast cache: a cache filled during capture would point at freed memory
    return torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16", cache_enabled=False
    )


def _eager(cfg: BenchConfig, device: torch.device, batches: list[Any]) -> Callable[[], Any]:
    model, opt = _sharded(cfg, device)
    loss_fn = nn.CrossEntropyLoss()
    next_batch = _cycle(batches)

    def one() -> None:
        x, y = next_batch()
        opt.zero_grad(set_to_none=True)
        with _autocast(cfg, device):
            loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()

    return one


def _fwd_bwd_graphed(
    cfg: BenchConfig, device: torch.device, batches: list[Any]
) -> Callable[[], Any]:
    """torchtitan's way: forward + backward in one graph, clip and optimizer eager."""
    model, opt = _sharded(cfg, device)
    loss_fn = nn.CrossEntropyLoss()
    next_batch = _cycle(batches)
    static_x, static_y = (t.clone() for t in batches[0])

    def fwd_bwd() -> None:
        with _autocast(cfg, device):
            loss = loss_fn(model(static_x), static_y)
        loss.backward()

    def eager_rest() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=False)  # the graph accumulates into these gradients

    if device.type != "cuda":

        def plain() -> None:
            x, y = next_batch()
            static_x.copy_(x)
            static_y.copy_(y)
            fwd_bwd()
            eager_rest()

        return plain
    stream = cuda_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up on the side stream, as torch.cuda.graph wants
        for _ in range(3):
            fwd_bwd()
            eager_rest()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fwd_bwd()

    def one() -> None:
        x, y = next_batch()
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        graph.replay()
        eager_rest()

    return one


def _train_step(
    cfg: BenchConfig, device: torch.device, batches: list[Any], holder: dict[str, Any]
) -> Any:
    model, opt = _sharded(cfg, device)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), amp=cfg.amp, clip_grad_norm=CLIP)
    holder["step"] = step
    next_batch = _cycle(batches)
    return lambda: step(*next_batch())


def run_fsdp2_mode(
    mode: str, cfg: BenchConfig, device: torch.device, batches: list[Any], steps: int
) -> dict[str, Any]:
    """One mode of one config; a mode that fails is recorded with its error, not fatal."""
    with _fresh(device):
        try:
            if mode == "eager_fsdp2":
                return _measure(lambda: _eager(cfg, device, batches), device, steps)
            if mode == "fwd_bwd_graphed":
                return _measure(lambda: _fwd_bwd_graphed(cfg, device, batches), device, steps)
            holder: dict[str, TrainStep] = {}
            result = _measure(lambda: _train_step(cfg, device, batches, holder), device, steps)
        except Exception as exc:  # the other modes still run and are written
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}
        report = holder["step"].report()
        result |= {
            "mode": report.mode,
            "time_to_first_replay_s": report.time_to_first_replay,
            "fallbacks": report.fallbacks,
        }
        graph = holder["step"].bare_graph()
        if graph is not None:  # the floor: the same graph replayed with no TrainStep around it
            result["bare_replay"] = _summary(_step_times(graph.replay, steps, device))
        return result


def run_fsdp2(
    names: list[str], *, steps: int, repeats: int, quick: bool, out: Path
) -> dict[str, Any]:
    """Each config's FSDP2 modes ``repeats`` times, interleaved; JSON, markdown and PNG."""
    rt = runtime.init()
    device = rt.device
    if names:
        unknown = sorted(set(names) - set(FSDP2_CONFIGS))
        if unknown:
            raise ValueError(f"--parallel fsdp2 has configs {sorted(FSDP2_CONFIGS)}, not {unknown}")
    configs = (
        [FSDP2_CONFIGS[n] for n in names]
        if names
        else [FSDP2_QUICK]
        if quick
        else list(FSDP2_CONFIGS.values())
    )
    results: dict[str, Any] = {
        "environment": environment(),
        "parallel": "fsdp2",
        "world_size": rt.world_size,
        "timing": "CUDA events between consecutive steps, one sync at the end (CPU: wall-clock)",
        "note": (
            "world size 1: FSDP2 runs no collective (it skips them)"
            if rt.world_size == 1
            else f"{rt.world_size} ranks: all-gathers and reduce-scatters inside the graphs"
        ),
        "configs": {},
    }
    if rt.is_main and device.type != "cuda":
        print(f"ddpgraph bench: warning: {CPU_NOTE}.", file=sys.stderr, flush=True)
    with Interruptible(out) as stop:  # the JSON is written at the end: Ctrl-C keeps nothing
        for cfg in configs:
            batches = _batches(cfg, device)
            runs: list[dict[str, Any]] = []
            results["configs"][cfg.name] = {"runs": runs}
            for r in range(repeats):
                run = {}
                for mode in FSDP2_MODES:
                    run[mode] = run_fsdp2_mode(mode, cfg, device, batches, steps)
                    stop.check()
                runs.append(run)
                if rt.is_main:
                    print(_line(cfg.name, r, repeats, run), file=sys.stderr, flush=True)
    runtime.shutdown()
    if rt.is_main:
        _ratios(results)
        markdown = _markdown(results) + f"\n\nNote: {results['note']}.\n"
        print(markdown)  # first: a file the disk refuses loses no result
        write_file(out, json.dumps(results, indent=2) + "\n", fix=WRITE_FIX)
        write_file(out.with_suffix(".md"), markdown, fix=WRITE_FIX)
    return results


def _line(name: str, r: int, repeats: int, run: dict[str, Any]) -> str:
    parts = [
        f"{mode} {m['median_ms']:.3f} ms" if "median_ms" in m else f"{mode} failed: {m['error']}"
        for mode, m in run.items()
    ]
    return f"[bench fsdp2] {name} {r + 1}/{repeats}: " + ", ".join(parts)


def _ratios(results: dict[str, Any]) -> None:
    """The issue's targets as numbers, per config and repeat: graphed / eager, graphed /
    torchtitan-style, TrainStep / bare graph, peak memory graphed / eager."""
    for entry in results["configs"].values():
        entry["ratios"] = []
        for run in entry["runs"]:
            eager, titan, mine = (run.get(m, {}) for m in FSDP2_MODES)
            ratios: dict[str, float] = {}
            if "median_ms" in mine and "median_ms" in eager:
                ratios["train_step_vs_eager"] = mine["median_ms"] / eager["median_ms"]
            if "median_ms" in mine and "median_ms" in titan:
                ratios["train_step_vs_fwd_bwd_graphed"] = mine["median_ms"] / titan["median_ms"]
            if "median_ms" in mine and "bare_replay" in mine:
                ratios["train_step_vs_bare_graph"] = (
                    mine["median_ms"] / mine["bare_replay"]["median_ms"]
                )
            if mine.get("peak_memory_mib") and eager.get("peak_memory_mib"):
                ratios["peak_memory_vs_eager"] = mine["peak_memory_mib"] / eager["peak_memory_mib"]
            entry["ratios"].append(ratios)


def _markdown(results: dict[str, Any]) -> str:
    """One row per config and mode: median step time, ratio to eager FSDP2, peak memory."""
    lines = [
        "| config | mode | median ms | vs eager FSDP2 | bare graph ms | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in results["configs"].items():
        run = entry["runs"][0]
        eager = run.get("eager_fsdp2", {}).get("median_ms")
        for mode, m in run.items():
            if "median_ms" not in m:
                lines.append(f"| {name} | {mode} | failed: {m.get('error', '')[:80]} | | | |")
                continue
            ratio = f"{m['median_ms'] / eager:.3f}x" if eager else ""
            bare = m.get("bare_replay", {}).get("median_ms")
            peak = m.get("peak_memory_mib")
            lines.append(
                f"| {name} | {mode} | {m['median_ms']:.3f} | {ratio} | "
                f"{'' if bare is None else f'{bare:.3f}'} | "
                f"{'' if peak is None else f'{peak:.0f}'} |"
            )
    return "\n".join(lines)
