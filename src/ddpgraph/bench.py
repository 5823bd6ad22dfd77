"""``ddpgraph bench``: eager DDP against TrainStep's whole-step graph, in one run per config.

Every mode of a config runs in the same process, on the same batches, one after the other, so
ratios between modes are meaningful even on a noisy machine. Step times are CUDA-event times per
step (on CPU, wall-clock), reported as median and p90 over ``steps`` steps after warm-up.
"""

from __future__ import annotations

import itertools
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import runtime
from .step import TrainStep


@dataclass(frozen=True)
class BenchConfig:
    name: str
    build: Callable[[], nn.Module]
    sample_shape: tuple[int, ...]
    batch_size: int
    amp: str | None = None


def _mlp8x1024() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
        self.head = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


def _resnet50() -> nn.Module:
    import torchvision

    return torchvision.models.resnet50(weights=None, num_classes=10)


CONFIGS = {
    "mlp": BenchConfig("MLP 8x1024 b64", _mlp8x1024, (1024,), 64),
    "transformer": BenchConfig("transformer 6x512 b16 bf16", _Encoder, (128, 512), 16, "bf16"),
    "resnet50": BenchConfig("ResNet-50 b32 fp32", _resnet50, (3, 224, 224), 32),
}
QUICK = BenchConfig(
    "MLP 2x64 b8 (quick)",
    lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)),
    (64,),
    8,
)


def _batches(
    cfg: BenchConfig, device: torch.device, count: int = 4
) -> list[tuple[torch.Tensor, ...]]:
    # a few rotating batches, so that no mode measures a cache-resident single input
    gen = torch.Generator(device=device).manual_seed(0)
    return [
        (
            torch.randn((cfg.batch_size, *cfg.sample_shape), device=device, generator=gen),
            torch.randint(10, (cfg.batch_size,), device=device, generator=gen),
        )
        for _ in range(count)
    ]


class _Timer:
    """Per-step times as a training loop sees them: no sync between steps.

    On CUDA an event is recorded between consecutive steps and all are read after one final
    sync, so the host runs ahead as in real training and each delta is the step's share of the
    GPU timeline (launch gaps included when the host cannot keep up). On CPU, wall-clock.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def run(self, fn: Callable[[], Any], steps: int) -> list[float]:
        if not self.cuda:
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return times
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        torch.cuda.synchronize()
        events[0].record()
        for event in events[1:]:
            fn()
            event.record()
        events[-1].synchronize()
        return [a.elapsed_time(b) for a, b in itertools.pairwise(events)]


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "steps": len(ordered),
    }


def _fresh_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _eager_ddp(cfg: BenchConfig, device: torch.device, batches: list, steps: int) -> dict[str, Any]:
    """The status quo: a hand-written DDP loop on the default stream."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    _fresh_memory(device)
    torch.manual_seed(0)
    model = cfg.build().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16")
    i = 0

    def one() -> None:
        nonlocal i
        x, y = batches[i % len(batches)]
        i += 1
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()

    timer = _Timer(device)
    timer.run(one, 12)
    return _summary(timer.run(one, steps)) | _peak_memory(device)


def _train_step(
    cfg: BenchConfig, device: torch.device, batches: list, steps: int
) -> dict[str, Any]:
    _fresh_memory(device)
    torch.manual_seed(0)
    model = cfg.build().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), amp=cfg.amp)
    i = 0

    def one() -> None:
        nonlocal i
        step(*batches[i % len(batches)])
        i += 1

    timer = _Timer(device)
    timer.run(one, 14)  # warm-up, capture, first replays
    result: dict[str, Any] = {**_summary(timer.run(one, steps)), **_peak_memory(device)}
    report = step.report()
    result["mode"] = report.mode
    result["time_to_first_replay_s"] = report.time_to_first_replay
    result["fallbacks"] = report.fallbacks
    if step._graphs:
        graph = next(iter(step._graphs.values())).graph
        bare = _Timer(device).run(graph.replay, steps)
        result["bare_replay"] = _summary(bare)
    return result


def _peak_memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {"peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20}


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "commit": _git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def _git_commit() -> str:
    import os

    if os.environ.get("DDPGRAPH_COMMIT"):  # set where the tree travels without its .git
        return os.environ["DDPGRAPH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_bench(
    names: list[str], *, steps: int, repeats: int, quick: bool, out: Path
) -> dict[str, Any]:
    """Run every config's modes ``repeats`` times (interleaved), write JSON to ``out``, return it."""
    rt = runtime.init()
    device = rt.device
    configs = [QUICK] if quick else [CONFIGS[n] for n in names]
    results: dict[str, Any] = {
        "environment": environment(),
        "world_size": rt.world_size,
        "configs": {},
    }
    for cfg in configs:
        batches = _batches(cfg, device)
        runs = []
        for r in range(repeats):
            eager = _eager_ddp(cfg, device, batches, steps)
            graphed = _train_step(cfg, device, batches, steps)
            runs.append(
                {
                    "eager_ddp": eager,
                    "train_step": graphed,
                    "ratio": graphed["median_ms"] / eager["median_ms"],
                }
            )
            print(
                f"[bench] {cfg.name} run {r + 1}/{repeats}: eager {eager['median_ms']:.3f} ms, "
                f"TrainStep {graphed['median_ms']:.3f} ms ({graphed['mode']}), ratio {runs[-1]['ratio']:.3f}",
                flush=True,
            )
        results["configs"][cfg.name] = {
            "runs": runs,
            "median_ratio": statistics.median(r["ratio"] for r in runs),
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    runtime.shutdown()
    return results
