"""``ddpgraph bench``: eager DDP, torch.compile and TrainStep's whole-step graph, in one run.

Every mode of a config runs in the same process, on the same rotating batches, one after the
other, so ratios between modes are meaningful even on a noisy machine. Step times come from CUDA
events recorded between consecutive steps with one sync at the end (the host runs ahead, as in
real training); on CPU, wall-clock. Each mode reports the median and p90 step time, the GPU-busy
time per step from the profiler, peak memory and the time to its first fast step (building the
model, compiling, warming up and capturing: everything before steady state).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._files import write_file
from .._typed_torch import cuda_event, nccl_version
from ..data.device_data import DeviceData
from ..distributed import runtime
from ..step import TrainStep

WARMUP_STEPS = 14  # TrainStep: 12 eager, the capture, one replay; the same count for every mode


@dataclass(frozen=True)
class BenchConfig:
    name: str
    build: Callable[[], nn.Module]
    sample_shape: tuple[int, ...]
    batch_size: int
    amp: str | None = None
    conv: bool = False  # channels_last applies


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
        logits: torch.Tensor = self.head(self.encoder(x).mean(dim=1))
        return logits


def _resnet50() -> nn.Module:
    import torchvision

    model: nn.Module = torchvision.models.resnet50(weights=None, num_classes=10)
    return model


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


CONFIGS = {
    "mlp": BenchConfig("MLP 8x1024 b64", _mlp8x1024, (1024,), 64),
    "transformer": BenchConfig("transformer 6x512 b16 bf16", _Encoder, (128, 512), 16, "bf16"),
    "resnet50": BenchConfig("ResNet-50 b32 fp32", _resnet50, (3, 224, 224), 32, conv=True),
    "resnet50-b256": BenchConfig(
        "ResNet-50 b256 bf16", _resnet50, (3, 224, 224), 256, "bf16", conv=True
    ),
}
QUICK = BenchConfig("MLP 2x64 b8 (quick)", _tiny, (64,), 8)
MODES = (
    "eager_ddp",
    "compile_reduce_overhead",
    "train_step",
    "train_step_channels_last",
    "train_step_compiled",
    "train_step_fp16",
    "train_step_device_data",
)
DEVICE_DATA_K = 8  # train_step_device_data: steps per replay (ddpgraph train's default)
QUICK_MODES = ("eager_ddp", "train_step")


# ------------------------------------------------------------------ measuring
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


def _step_times(fn: Callable[[], Any], steps: int, device: torch.device) -> list[float]:
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    events = [cuda_event(enable_timing=True) for _ in range(steps + 1)]
    torch.cuda.synchronize()
    events[0].record()
    for event in events[1:]:
        fn()
        event.record()
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in itertools.pairwise(events)]


def _gpu_busy_ms(fn: Callable[[], Any], steps: int, device: torch.device) -> float | None:
    """Kernel time per step from the profiler: what the GPU itself needs, without launch gaps."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(
        getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        for e in prof.key_averages()
    )
    return total_us / 1e3 / steps if total_us else None


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "steps": len(ordered),
    }


@contextmanager
def _fresh(device: torch.device) -> Iterator[None]:
    """Each mode starts with the allocator emptied and the peak-memory counter reset."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    yield
    torch._dynamo.reset()


def _measure(
    make_step: Callable[[], Callable[[], Any]],
    device: torch.device,
    steps: int,
    steps_per_call: int = 1,
) -> dict[str, Any]:
    """Times per training step; a call of ``steps_per_call`` steps is timed whole and divided."""
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    started = time.perf_counter()
    one = make_step()
    for _ in range(WARMUP_STEPS):
        one()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_fast = time.perf_counter() - started
    calls = max(1, steps // steps_per_call)
    times = [t / steps_per_call for t in _step_times(one, calls, device)]
    result: dict[str, Any] = _summary(times)
    result["first_fast_step_s"] = first_fast
    busy = _gpu_busy_ms(one, max(1, min(steps, 20) // steps_per_call), device)
    result["gpu_busy_ms"] = busy / steps_per_call if busy is not None else None
    result["steps_per_call"] = steps_per_call
    if device.type == "cuda":
        # this mode's own peak: memory still held by earlier modes is not its cost
        result["peak_memory_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return result


# ---------------------------------------------------------------------- modes
def _cycle(batches: list[tuple[torch.Tensor, ...]]) -> Callable[[], tuple[torch.Tensor, ...]]:
    it = itertools.cycle(batches)
    return lambda: next(it)


def _hand_written(
    cfg: BenchConfig, device: torch.device, batches: list[Any], *, compile_mode: str | None
) -> Callable[[], Any]:
    """The status quo: a hand-written DDP loop on the default stream, optionally compiled."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model: nn.Module = cfg.build().to(device)
    if compile_mode is not None:
        model = torch.compile(model, mode=compile_mode)  # type: ignore[assignment]
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    next_batch = _cycle(batches)

    def one() -> None:
        x, y = next_batch()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
            loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()

    return one


def _train_step(
    cfg: BenchConfig, device: torch.device, batches: list[Any], **options: Any
) -> tuple[TrainStep, Callable[[], Any]]:
    torch.manual_seed(0)
    model = cfg.build().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    amp = options.pop("amp", cfg.amp)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), amp=amp, **options)
    if step.options.steps_per_replay > 1:
        data = _device_data(cfg, device, step.options.steps_per_replay)
        return step, lambda: step(data)
    next_batch = _cycle(batches)
    return step, lambda: step(*next_batch())


def _device_data(cfg: BenchConfig, device: torch.device, k: int) -> DeviceData:
    """2k random batches on the device: an epoch holds two replays' worth."""
    gen = torch.Generator(device=device).manual_seed(0)
    n = 2 * k * cfg.batch_size
    x = torch.randn((n, *cfg.sample_shape), device=device, generator=gen)
    y = torch.randint(10, (n,), device=device, generator=gen)
    return DeviceData(x, y, batch_size=cfg.batch_size, device=device, channels_last=cfg.conv)


def not_applied(mode: str, cfg: BenchConfig) -> str | None:
    """Why ``mode`` is not measured on ``cfg``, or None when it is."""
    if mode == "train_step_channels_last" and not cfg.conv:
        return "channels_last applies to conv nets only"
    if mode == "train_step_fp16" and cfg.amp is None:
        return "fp16 is measured next to the bf16 configs only"
    return None


def run_mode(
    mode: str, cfg: BenchConfig, device: torch.device, batches: list[Any], steps: int
) -> dict[str, Any] | None:
    """One mode of one config; None where the mode does not apply (:func:`not_applied`)."""
    if not_applied(mode, cfg) is not None:
        return None
    with _fresh(device):
        if mode == "eager_ddp":
            return _measure(
                lambda: _hand_written(cfg, device, batches, compile_mode=None), device, steps
            )
        if mode == "compile_reduce_overhead":
            return _measure(
                lambda: _hand_written(cfg, device, batches, compile_mode="reduce-overhead"),
                device,
                steps,
            )
        choices: dict[str, dict[str, Any]] = {
            "train_step": {},
            "train_step_channels_last": {"channels_last": True},
            "train_step_compiled": {"compile": True, "channels_last": cfg.conv},
            "train_step_fp16": {"amp": "fp16"},
            "train_step_device_data": {
                "steps_per_replay": DEVICE_DATA_K,
                "channels_last": cfg.conv,
            },
        }
        options = dict(choices[mode])
        holder: dict[str, TrainStep] = {}

        def make() -> Callable[[], Any]:
            holder["step"], one = _train_step(cfg, device, batches, **options)
            return one

        k = int(options.get("steps_per_replay", 1))
        result = _measure(make, device, steps, steps_per_call=k)
        step = holder["step"]
        report = step.report()
        result |= {
            "mode": report.mode,
            "time_to_first_replay_s": report.time_to_first_replay,
            "fallbacks": report.fallbacks,
        }
        graph = step.bare_graph()
        if graph is not None:  # the floor: its own graph replayed with no wrapper at all
            bare = [t / k for t in _step_times(graph.replay, max(1, steps // k), device)]
            result["bare_replay"] = _summary(bare)
        return result


# ------------------------------------------------------------------- the run
def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["nccl"] = ".".join(map(str, nccl_version()))
    return info


def git_commit() -> str:
    """The checkout's commit (``-dirty`` with uncommitted changes to tracked files), for results.

    ``DDPGRAPH_COMMIT`` wins: a tree copied to a GPU machine travels without its ``.git``.
    """
    if os.environ.get("DDPGRAPH_COMMIT"):
        return os.environ["DDPGRAPH_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        status = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


CPU_NOTE = (
    "on CPU there are no CUDA graphs: TrainStep runs eager like the baseline, so the ratios "
    "between modes measure only noise; run on a CUDA machine for numbers that mean something"
)


def choose(
    names: list[str], modes: list[str] | None, *, quick: bool
) -> tuple[list[BenchConfig], list[str]]:
    """The configs and modes a run measures; ``eager_ddp`` always first, as the baseline.

    ``quick`` only changes the defaults (the tiny config, eager and TrainStep): configs and modes
    asked for by name are run as asked.
    """
    configs = [CONFIGS[n] for n in names] if names else [QUICK] if quick else list(CONFIGS.values())
    if not modes:
        return configs, list(QUICK_MODES if quick else MODES)
    return configs, ["eager_ddp", *(m for m in MODES if m in modes and m != "eager_ddp")]


def cpu_warnings(
    device: torch.device, configs: list[BenchConfig], *, steps: int = 60, repeats: int = 3
) -> list[str]:
    """What a run on ``device`` should be told before it starts: nothing on CUDA. The advice
    to shorten the run names only what this run (``steps``, ``repeats``) has not done yet."""
    if device.type == "cuda":
        return []
    found = [f"warning: {CPU_NOTE}."]
    slow = [c.name for c in configs if c is not QUICK and c.build is not _tiny]
    if slow:
        shorter = " ".join(
            flag for flag, left in (("--steps 5", steps > 5), ("--repeats 1", repeats > 1)) if left
        )
        also = f" (or {shorter})" if shorter else ""
        found.append(
            f"warning: {', '.join(slow)} on CPU take(s) many minutes per repeat; pass --quick "
            f"with no --config for a smoke run{also}."
        )
    return found


def needs_torchvision(config: BenchConfig) -> bool:
    return config.build is _resnet50


def torchvision_problem() -> str | None:
    """Why the ResNet-50 configs cannot run here (None: they can): torchvision missing, or one
    built for another torch (PyPI's x86 wheels link the CUDA torch: on a CPU torch their
    ``import`` fails with "operator torchvision::nms does not exist")."""
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # ImportError, or the RuntimeError/OSError of a mismatched build
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        return f"the ResNet-50 configs need torchvision, which does not import here ({why}); {torchvision_install()}"
    return None


def torchvision_install() -> str:
    """The install command of the torchvision that matches this torch (its minor + 15: torch
    2.13 goes with torchvision 0.28), from PyTorch's CPU index for a CPU-only torch."""
    major_minor = torch.__version__.split("+")[0].split(".")[:2]
    wanted = f"torchvision=={int(major_minor[0]) - 2}.{int(major_minor[1]) + 15}.*"
    if torch.version.cuda is None and torch.version.hip is None:
        return (
            f"install the CPU build: pip install '{wanted}' --index-url "
            "https://download.pytorch.org/whl/cpu"
        )
    return f"install it: pip install '{wanted}' (or the clone's extra: pip install -e '.[vision]')"


class Interruptible:
    """Ctrl-C during a bench run, remembered: Python only prints a KeyboardInterrupt raised in a
    finalizer or a callback ("Exception ignored in ..."), and the run would go on to exit 0. The
    run checks between modes (:meth:`check`) and stops there; what it finished stays written.

    Used as ``with Interruptible(out) as stop:``; leaving it by Ctrl-C raises KeyboardInterrupt
    whose text says what ``out`` holds, which the command line adds to its one line.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen = False
        self.kept = 0  # repeats written to ``out``

    def __enter__(self) -> Interruptible:
        self._previous = signal.getsignal(signal.SIGINT)
        if self._previous is signal.default_int_handler:  # not one the caller installed
            signal.signal(signal.SIGINT, self._handle)
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._ignored
        return self

    def _ignored(self, report: Any) -> None:
        """Python's "Exception ignored in ..." report: not for the Ctrl-C it ignored, which
        :meth:`check` raises again."""
        if not (self.seen and isinstance(report.exc_value, KeyboardInterrupt)):
            self._unraisable(report)

    def _handle(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt

    def written(self, repeats: int) -> None:
        self.kept = repeats

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> None:
        if signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, self._previous)
        sys.unraisablehook = self._unraisable
        # a Ctrl-C that Python ignored after the last check still stops the run
        if self.seen or (kind is not None and issubclass(kind, KeyboardInterrupt)):
            kept = (
                f"the {self.kept} finished repeat(s) are in {self.out}"
                if self.kept
                else f"no repeat had finished: nothing written to {self.out}"
            )
            raise KeyboardInterrupt(kept) from None


def run_bench(
    names: list[str],
    *,
    modes: list[str] | None,
    steps: int,
    repeats: int,
    quick: bool,
    out: Path,
) -> dict[str, Any]:
    """Run each config's modes ``repeats`` times, interleaved; write JSON, markdown and PNG.

    ``names`` empty: every config (the tiny one with ``quick``); ``modes`` None: every mode (eager
    and TrainStep with ``quick``).
    """
    from rich.progress import Progress

    rt = runtime.init()
    device = rt.device
    configs, modes = choose(names, modes, quick=quick)
    results: dict[str, Any] = {
        "environment": environment(),
        "world_size": rt.world_size,
        "timing": "CUDA events between consecutive steps, one sync at the end (CPU: wall-clock)",
        "configs": {},
    }
    if device.type != "cuda":
        results["note"] = CPU_NOTE
    if rt.is_main:
        for line in cpu_warnings(device, configs, steps=steps, repeats=repeats):
            print(f"ddpgraph bench: {line}", file=sys.stderr, flush=True)
    total = len(configs) * repeats  # repeats of all configs: what the JSON holds when done
    with Progress(disable=not rt.is_main) as progress, Interruptible(out) as stop:
        task = progress.add_task("bench", total=len(configs) * len(modes) * repeats)
        for cfg in configs:
            batches = _batches(cfg, device)
            runs: list[dict[str, Any]] = []
            results["configs"][cfg.name] = {"runs": runs}
            for r in range(repeats):
                run: dict[str, Any] = {}
                for mode in modes:
                    progress.update(task, description=f"{cfg.name}: {mode} ({r + 1}/{repeats})")
                    measured = run_mode(mode, cfg, device, batches, steps)
                    stop.check()
                    if measured is not None:
                        run[mode] = measured
                    progress.advance(task)
                runs.append(run)
                # said first: a disk that refuses the JSON loses no result
                # one line however narrow the terminal: a number cut in two reads as two
                progress.console.print(
                    _run_line(cfg.name, r, repeats, run), markup=False, soft_wrap=True
                )
                if rt.is_main:  # a run cut short by a time limit keeps its finished repeats
                    _write_json(results, out, fix=_repeat_fix(out, stop.kept, total=total))
                    stop.written(sum(len(c["runs"]) for c in results["configs"].values()))
    runtime.shutdown()
    if rt.is_main:
        write_outputs(results, out)
    return results


def _run_line(name: str, r: int, repeats: int, run: dict[str, Any]) -> str:
    eager = run["eager_ddp"]["median_ms"]
    parts = [
        f"{mode} {m['median_ms']:.3f} ms ({m['median_ms'] / eager:.2f}x)" for mode, m in run.items()
    ]
    return f"[bench] {name} {r + 1}/{repeats}: " + ", ".join(parts)


def write_outputs(results: dict[str, Any], out: Path) -> None:
    """``out`` (JSON), and beside it the markdown table (.md) and the chart (.png, if matplotlib)."""
    from .report import chart, table_rows, to_markdown

    rows = table_rows(out.name, results)
    markdown = to_markdown(rows)
    if results.get("note"):
        markdown += f"\n\nNote: {results['note']}."
    print(markdown)  # first: a file the disk refuses loses no result
    written: list[Path] = []
    try:
        _write_json(results, out)
        written.append(out)
        written.append(write_file(out.with_suffix(".md"), markdown + "\n", fix=WRITE_FIX))
        chart(rows, out.with_suffix(".png"), fix=WRITE_FIX)
    except KeyboardInterrupt:
        # Ctrl-C while the chart is drawn (a second or more): what is already whole stays
        kept = " and ".join(str(path) for path in written) or f"nothing new in {out}"
        raise KeyboardInterrupt(f"kept {kept}; the results are printed above") from None


# What a bench run whose file could not be written can do besides freeing space.
WRITE_FIX = "pass another --out (the results are printed above)"


def _repeat_fix(out: Path, kept: int, *, total: int) -> str:
    """The fix of a JSON write that failed after a repeat: only the repeats' lines are printed
    (the table comes at the end), and ``out`` still holds the repeats written before."""
    holds = (
        f"{out} holds {kept} of the {total} repeat(s)" if kept else f"nothing was written to {out}"
    )
    return f"pass another --out ({holds}; each finished repeat's times are printed above)"


def _write_json(results: dict[str, Any], out: Path, *, fix: str = WRITE_FIX) -> None:
    write_file(out, json.dumps(results, indent=2) + "\n", fix=fix)
