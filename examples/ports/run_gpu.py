"""Run every port's original (baseline.py) and ddpgraph port (ported.py) on one CUDA device.

    python examples/ports/run_gpu.py --out ports_gpu.json [--ports nanogpt,imagenet] [--timeout 900]

Each script runs in its own fresh folder under ``--workdir`` (default: next to ``--out``), world
size 1 (torchrun with one process; imagenet through its own ``--multiprocessing-distributed``
launch), with ``CUDA_VISIBLE_DEVICES`` set to the first visible GPU. Per run it records rank 0's
losses, ms/iter (the median gap between iterations after the first ``--skip``, which covers
ddpgraph's eager warm-up and capture) and any error; a failed or timed-out script is recorded and
the next one runs. Per port it compares the two loss curves (a graphed step sums in another order
than eager, so they agree closely, not to the bit) and the speed-up. The JSON is rewritten after
every run, so an interrupted session keeps what finished. Exit status 0 when every run finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import port_runner as runner


def compare(baseline: list[float], ported: list[float]) -> dict:
    """How close two loss curves are: over the common prefix, and over the last 10 iterations."""
    n = min(len(baseline), len(ported))
    if n == 0:
        return {"iterations": 0}
    pairs = [(a, b) for a, b in zip(baseline[:n], ported[:n]) if math.isfinite(a + b)]
    abs_diffs = [abs(a - b) for a, b in pairs]
    rel_diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in pairs]
    tail = min(10, n)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "iterations": n,
        "same_length": len(baseline) == len(ported),
        "bitwise_equal": baseline[:n] == ported[:n],
        "first_loss": [baseline[0], ported[0]],
        "max_abs_diff": max(abs_diffs, default=None),
        "max_rel_diff": max(rel_diffs, default=None),
        "mean_last_10": [mean(baseline[n - tail : n]), mean(ported[n - tail : n])],
        "non_finite": len(pairs) < n,
    }


def environment() -> dict:
    probe = (
        "import json, torch; print(json.dumps({'torch': torch.__version__, "
        "'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name() "
        "if torch.cuda.is_available() else None}))"
    )
    info: dict = {"python": platform.python_version(), "host": platform.node()}
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
        )
        info.update(json.loads(out.stdout.strip().splitlines()[-1]))
    except Exception as exc:  # the report still runs the scripts, which will say more
        info["probe_error"] = repr(exc)
    try:
        import ddpgraph

        info["ddpgraph"] = ddpgraph.__version__
    except Exception as exc:
        info["ddpgraph_error"] = repr(exc)
    try:
        head = subprocess.run(
            ["git", "-C", str(runner.PORTS), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        info["commit"] = head.stdout.strip() or None
    except OSError:  # no git: the report is still useful
        info["commit"] = None
    info["torchvision"] = runner.has_torchvision()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path, help="JSON report to write")
    parser.add_argument("--ports", default=",".join(runner.PORTS_BY_NAME), help="comma-separated")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per script run")
    parser.add_argument("--skip", type=int, default=30, help="iterations left out of ms/iter")
    parser.add_argument("--workdir", type=Path, default=None, help="default: <out>.runs/")
    args = parser.parse_args(argv)

    names = [n for n in args.ports.split(",") if n]
    unknown = sorted(set(names) - set(runner.PORTS_BY_NAME))
    if unknown:
        parser.error(f"unknown port(s) {unknown}; choose from {sorted(runner.PORTS_BY_NAME)}")
    workdir = args.workdir or args.out.with_name(args.out.name + ".runs")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    report: dict = {"environment": environment(), "ports": {}}

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, allow_nan=True))

    ok = True
    for name in names:
        port = runner.PORTS_BY_NAME[name]
        entry: dict = {"command": {}, "runs": {}}
        report["ports"][name] = entry
        for variant in runner.VARIANTS:
            entry["command"][variant] = runner.command(port, variant, 1, "gpu")[1:]
            try:
                result = runner.run(
                    port,
                    variant,
                    workdir / name / variant,
                    nproc=1,
                    mode="gpu",
                    timeout=args.timeout,
                    skip=args.skip,
                    env={"CUDA_VISIBLE_DEVICES": visible},
                )
                entry["runs"][variant] = result.as_dict()
                ok &= result.error is None
            except Exception as exc:  # a broken runner for one script must not stop the rest
                entry["runs"][variant] = {"error": f"runner failed: {exc!r}"}
                ok = False
            print(f"{name}/{variant}: {_summary(entry['runs'][variant])}", flush=True)
            write()
        runs = entry["runs"]
        base, ported = runs.get("baseline", {}), runs.get("ported", {})
        entry["comparison"] = compare(base.get("losses", []), ported.get("losses", []))
        if base.get("ms_per_iter") and ported.get("ms_per_iter"):
            entry["speedup"] = base["ms_per_iter"] / ported["ms_per_iter"]
        write()
        print(
            f"{name}: {json.dumps(entry['comparison'])} speedup={entry.get('speedup')}", flush=True
        )
    print(f"wrote {args.out}")
    return 0 if ok else 1


def _summary(run: dict) -> str:
    if run.get("error"):
        return "ERROR " + run["error"].strip().splitlines()[-1][:300]
    losses = run.get("losses", [])
    last = f"{losses[-1]:.4f}" if losses else "-"
    return f"{len(losses)} iterations, last loss {last}, {run.get('ms_per_iter')} ms/iter"


if __name__ == "__main__":
    sys.exit(main())
