"""Regenerate the README's performance section (table + chart) from benchmarks/results/*.json.

Usage: python benchmarks/render.py  (needs matplotlib for the chart: pip install matplotlib)

Only numbers recorded by `ddpgraph bench` are shown; nothing here is typed by hand. Each row is
the median over the file's repeated runs, and every ratio compares modes measured in one run.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
CHART = ROOT / "benchmarks" / "results" / "step-times.png"
START, END = "<!-- perf:start -->", "<!-- perf:end -->"


def load() -> list[tuple[str, dict]]:
    files = sorted(RESULTS.glob("*.json"))
    return [(f.name, json.loads(f.read_text())) for f in files if _is_step_bench(f)]


def _is_step_bench(path: Path) -> bool:
    data = json.loads(path.read_text())
    return "configs" in data and "environment" in data


def rows(name: str, data: dict) -> list[dict]:
    out = []
    for config, result in data["configs"].items():
        runs = result["runs"]
        modes = [m for m in runs[0] if isinstance(runs[0][m], dict) and "median_ms" in runs[0][m]]
        row = {"file": name, "config": config, "runs": len(runs)}
        for mode in modes:
            row[mode] = statistics.median(r[mode]["median_ms"] for r in runs)
            row[f"{mode}/eager"] = statistics.median(
                r[mode]["median_ms"] / r["eager_ddp"]["median_ms"] for r in runs
            )
        bare = [r["train_step"]["bare_replay"]["median_ms"] for r in runs if "bare_replay" in r["train_step"]]
        if bare:
            row["bare_replay"] = statistics.median(bare)
        first = [r["train_step"].get("time_to_first_replay_s") for r in runs]
        row["first_replay_s"] = statistics.median(f for f in first if f is not None) if any(first) else None
        out.append(row)
    return out


MODE_TITLES = {
    "eager_ddp": "eager DDP",
    "compile_reduce_overhead": "torch.compile reduce-overhead",
    "train_step": "TrainStep",
    "train_step_channels_last": "TrainStep channels_last",
    "train_step_compiled": "TrainStep compile=True",
}


def table(all_rows: list[dict]) -> str:
    modes = [m for m in MODE_TITLES if any(m in r for r in all_rows)]
    header = ["config", *(f"{MODE_TITLES[m]} ms" for m in modes), "TrainStep / eager", "bare replay ms", "first replay s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in all_rows:
        cells = [r["config"]]
        cells += [f"{r[m]:.3f}" if m in r else "–" for m in modes]
        cells.append(f"{r['train_step/eager']:.3f}")
        cells.append(f"{r['bare_replay']:.3f}" if "bare_replay" in r else "–")
        cells.append(f"{r['first_replay_s']:.2f}" if r["first_replay_s"] is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(all_rows: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: table only", file=sys.stderr)
        return False
    modes = [m for m in MODE_TITLES if any(m in r for r in all_rows)]
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.8 * len(all_rows)))
    height = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ys = [j + i * height for j in range(len(all_rows))]
        ax.barh(ys, [r.get(mode, 0) / r["eager_ddp"] for r in all_rows], height, label=MODE_TITLES[mode])
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(all_rows))], [r["config"] for r in all_rows])
    ax.set_xlabel("step time relative to eager DDP (lower is faster)")
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(CHART, dpi=120)
    return True


def section(results: list[tuple[str, dict]]) -> str:
    all_rows = [row for name, data in results for row in rows(name, data)]
    if not all_rows:
        return "No benchmark results recorded yet."
    envs = {
        name: data["environment"] for name, data in results
    }
    sources = "; ".join(
        f"`{name}`: {e.get('gpu', 'CPU')}, torch {e['torch']}, CUDA {e.get('cuda')}, "
        f"NCCL {e.get('nccl', '–')}, commit {e['commit'][:10]}, world size {data['world_size']}"
        for (name, data), e in zip(results, envs.values())
    )
    parts = [
        f"Medians of per-step times over repeated runs; ratios are within one run. Sources: {sources}.",
        "",
        table(all_rows),
    ]
    if chart(all_rows):
        parts += ["", f"![step time relative to eager DDP]({CHART.relative_to(ROOT).as_posix()})"]
    return "\n".join(parts)


def main() -> None:
    text = README.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"README.md lacks the {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n{section(load())}\n{END}{tail}")
    print(f"updated {README}")


if __name__ == "__main__":
    main()
