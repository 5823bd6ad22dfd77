"""The ops one optimizer update runs, Accelerate's ``complete_cv_example.py`` as written against its
port, counted per update: where an eager port spends more than the script (issue 52: on an H100
at fb2ebbd the port, held eager while OneCycleLR rewrites Adam's betas, took 27.76 ms per update
against the script's 24.48).

    python benchmarks/probes/eager_ops_per_update.py [--device cpu] [--model test_resnet]
        [--update N] [--profile] [--out FILE.json]

Each side runs in its own process (``run_distributed(..., 1)``, the script's own group) through
the worker of the scripts' tests (tests/upstream_cv.py, ``keep="times"``), ``--mixed_precision
bf16``, with a ``TorchDispatchMode`` counting every aten op by name from one
``AcceleratedScheduler.step()`` (the script's update point) to the next. On the CPU the port runs
on ``CpuGraphs`` and a timm model named by ``--model`` stands in for the script's ResNet-50d (its
ops per layer are the same kinds); on a GPU (``--device cuda``) it is the script's own model.
What comes out, for update N (default: the third from last, where the port is held eager): each
side's op count, and every op whose count differs, with both counts; and the port's report.

``--profile``: instead of counting, ``torch.profiler`` over updates 16 to 18 of the 21 (held
eager in the port), each side's wall time per update (behind a device sync), its profiled host
and device time, and the ops that take the most device time (self), side by side: where an eager
port's extra time goes on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", default="test_resnet", help="CPU only: timm model to build")
    parser.add_argument("--update", type=int, default=-3, help="from 1; < 0: from the end")
    parser.add_argument("--profile", action="store_true", help="torch.profiler, not counts")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.profile:
        result = profile(args.device, args.model)
    else:
        result = compare(args.device, args.model, args.update)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def _both_sides(worker: Any, device: str, model: str) -> dict[str, Any]:
    """``worker``'s result for the script as written ("original") and its port, each in its
    own process on the same images (each writes its own copy of the script and out_ folder)."""
    from ddpgraph.testing import run_distributed
    from tests import upstream, upstream_cv

    script = upstream.script(upstream_cv.FOLDER, upstream_cv.NAME)
    base = Path(tempfile.mkdtemp(prefix="cv-eager-"))
    upstream_cv.make_images(base / "images")
    flags = ["--mixed_precision", "bf16", *(["--cpu"] if device == "cpu" else [])]
    built = model if device == "cpu" else ""
    sides = {}
    for variant in ("original", "port"):
        run_args = (str(base), str(script), variant, flags, device, built)
        (sides[variant],) = run_distributed(worker, 1, args=run_args, timeout=900, init=False)
    return sides


def compare(device: str, model: str, update: int) -> dict[str, Any]:
    sides = _both_sides(_worker, device, model)
    counts = {variant: found["per_update"] for variant, found in sides.items()}
    report = sides["port"]["report"]
    n = min(len(counts["original"]), len(counts["port"]))
    index = update - 1 if update > 0 else n + update
    ours, theirs = Counter(counts["port"][index]), Counter(counts["original"][index])
    differing = {
        op: {"script": theirs[op], "port": ours[op]}
        for op in sorted(set(ours) | set(theirs))
        if ours[op] != theirs[op]
    }
    return {
        "what": "aten ops in one optimizer update of complete_cv_example.py, as written and "
        "ported (--mixed_precision bf16), counted between the script's scheduler steps",
        "device": device,
        "model": model if device == "cpu" else "resnet50d (the script's)",
        "updates": n,
        "update": index + 1,
        "ops": {"script": sum(theirs.values()), "port": sum(ours.values())},
        "ops_each_update": {
            side: [sum(c.values()) for c in counts[side][:n]] for side in ("original", "port")
        },
        "differing": differing,
        "port_report": report,
    }  # fmt: skip


PROFILED = (16, 19)  # scheduler steps: the updates after the 16th up to the 19th


def profile(device: str, model: str) -> dict[str, Any]:
    sides = _both_sides(_profiled, device, model)
    return {
        "what": "complete_cv_example.py as written and ported (--mixed_precision bf16): "
        f"torch.profiler over the updates after scheduler step {PROFILED[0]} up to "
        f"{PROFILED[1]} (the port held eager there)",
        "device": device,
        "model": model if device == "cpu" else "resnet50d (the script's)",
        "sides": sides,
    }


def _profiled(
    folder: str, script: str, variant: str, flags: list[str], device: str, model: str
) -> dict[str, Any]:
    import time

    import torch
    from accelerate.scheduler import AcceleratedScheduler
    from torch.profiler import ProfilerActivity

    from tests import upstream_cv

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    steps, stamps = [0], []
    inner = AcceleratedScheduler.step

    def stepped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = inner(self, *args, **kwargs)
        steps[0] += 1
        if PROFILED[0] <= steps[0] <= PROFILED[1]:
            if device == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            if steps[0] == PROFILED[0]:
                prof.start()
            elif steps[0] == PROFILED[1]:
                prof.stop()
        return result

    AcceleratedScheduler.step = stepped  # type: ignore[method-assign]
    record = upstream_cv.run(folder, script, variant, flags, device, model, keep="times")
    updates = PROFILED[1] - PROFILED[0]
    averages = prof.key_averages()
    # the ops that take the most device time (on the CPU: host time, there being no device)
    if device == "cuda":
        rows = sorted(averages, key=lambda e: -e.self_device_time_total)[:20]
    else:
        rows = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:20]
    return {
        "wall_ms_per_update": (stamps[-1] - stamps[0]) * 1e3 / updates,
        "host_ms_per_update": sum(e.self_cpu_time_total for e in averages) / 1e3 / updates,
        "device_ms_per_update": sum(e.self_device_time_total for e in averages) / 1e3 / updates,
        "top_device_ops": [
            {
                "op": e.key,
                "calls": e.count // updates,
                "device_ms": e.self_device_time_total / 1e3 / updates,
                "host_ms": e.self_cpu_time_total / 1e3 / updates,
            }
            for e in rows
        ],
        "report": record["report"],
    }


def _worker(
    folder: str, script: str, variant: str, flags: list[str], device: str, model: str
) -> dict[str, Any]:
    from accelerate.scheduler import AcceleratedScheduler
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests import upstream_cv

    per_update: list[Counter[str]] = [Counter()]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            per_update[-1][str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    inner = AcceleratedScheduler.step

    def stepped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = inner(self, *args, **kwargs)
        per_update.append(Counter())
        return result

    AcceleratedScheduler.step = stepped  # type: ignore[method-assign]
    with Count():
        record = upstream_cv.run(folder, script, variant, flags, device, model, keep="times")
    # per_update[0] is everything before the first update (model set-up, the first batch)
    return {"per_update": [dict(c) for c in per_update[1:-1]], "report": record["report"]}


if __name__ == "__main__":
    main()
