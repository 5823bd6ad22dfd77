"""Regenerate the README's performance section (table + chart) from benchmarks/results/*.json.

Usage: python benchmarks/render.py   (the chart needs matplotlib: pip install 'ddpgraph[plot]')

Only numbers recorded by `ddpgraph bench` appear; nothing is typed by hand. Each cell is the
median over the file's repeated runs, and each ratio compares modes measured in one run.
It never deletes README content it cannot regenerate: without matplotlib the chart already
committed stays linked (and is not redrawn); without results a section keeps its old text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ddpgraph.bench_report import chart, table_rows, to_markdown

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
CHART = RESULTS / "readme-chart.png"
START, END = "<!-- perf:start -->", "<!-- perf:end -->"
LOOPS_START, LOOPS_END = "<!-- loops:start -->", "<!-- loops:end -->"


def load() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if "configs" in data and "environment" in data and data["environment"].get("gpu"):
            found.append((path.name, data))
    return found


def section(results: list[tuple[str, dict]]) -> str | None:
    """The performance section, or None when there is nothing to render it from."""
    rows = [row for name, data in results for row in table_rows(name, data)]
    if not rows:
        return None
    sources = "\n".join(
        f"- `{name}`: {d['environment']['gpu']}, torch {d['environment']['torch']}, "
        f"CUDA {d['environment']['cuda']}, NCCL {d['environment'].get('nccl')}, "
        f"commit {d['environment']['commit'][:10]}, world size {d['world_size']}, "
        f"{rows_in(name, rows)} config(s), {d['timing']}"
        for name, d in results
    )
    parts = [
        "Step time in ms, median over repeated runs (× eager DDP: the median of per-run ratios).",
        "First fast step: seconds from building the model to steady state (compiling, warming up,",
        "capturing), per mode in column order, from each file's first run (cold compile caches).",
        "",
        to_markdown(rows),
        "",
        "Sources:",
        sources,
    ]
    drawn = chart(rows, CHART)
    if not drawn and CHART.exists():
        print(
            f"kept the existing {CHART.relative_to(ROOT).as_posix()} (not redrawn); install "
            "matplotlib (pip install 'ddpgraph[plot]') to redraw it",
            file=sys.stderr,
        )
    if drawn or CHART.exists():
        parts += ["", f"![step time relative to eager DDP]({CHART.relative_to(ROOT).as_posix()})"]
    return "\n".join(parts)


def rows_in(name: str, rows: list[dict]) -> int:
    return sum(1 for r in rows if r["source"] == name)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _source(name: str, env: dict) -> str:
    return (
        f"`{name}`: {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, NCCL {env.get('nccl')}, "
        f"commit {env['commit'][:10]}"
    )


def varlen_section(data: dict, name: str) -> list[str]:
    runs = data["runs"]
    lines = [
        f"Variable lengths ({data['config']['min_len']}..{data['config']['max_len']} tokens per "
        f"step, {data['config']['steps']} steps, {len(runs)} runs; median of runs, ratios per run):",
        "",
        "| mode | steady ms/step (× eager) | whole run ms/step | peak MiB (× eager padded) |",
        "|---|---|---|---|",
    ]
    for mode in runs[0]:
        rows = [run[mode] for run in runs]
        lines.append(
            f"| {mode} | {_median([r['median_ms'] for r in rows]):.2f} "
            f"({_median([r['vs_eager'] for r in rows]):.2f}×) | "
            f"{_median([r['whole_run_ms'] for r in rows]):.1f} | "
            f"{_median([r['peak_memory_mib'] for r in rows]):.0f} "
            f"({_median([r['memory_vs_eager_padded'] for r in rows]):.2f}×) |"
        )
    return [*lines, "", f"Source: {_source(name, data['environment'])}."]


def loader_section(data: dict, name: str) -> list[str]:
    models = data["models"]
    feeds = [f for f in next(iter(models.values()))["ratio_to_staged"]]
    lines = [
        "The main job's loop against the same TrainStep fed pre-staged device batches (rate ratio, "
        f"median of {data['config']['repeats']} repeats; `ddpgraph train` uses batched_prefetch):",
        "",
        "| model | staged steps/s | " + " | ".join(feeds) + " |",
        "|---|---|" + "---|" * len(feeds),
    ]
    for model, result in models.items():
        ratios = " | ".join(f"{result['ratio_to_staged'][f]:.2f}" for f in feeds)
        lines.append(f"| {model} | {result['steps_per_s']['staged']:.0f} | {ratios} |")
    return [*lines, "", f"Source: {_source(name, data['environment'])}."]


def watchdog_section(data: dict, name: str) -> list[str]:
    return [
        f"Watchdog cost on the graphed {data['config']} step: {data['step_ms_on']['median']:.4f} "
        f"vs {data['step_ms_off']['median']:.4f} ms with it off ({data['overhead_pct']:+.2f} %, "
        f"{data['rounds']} alternating on/off blocks of {data['steps_per_block']} steps). "
        f"Source: {_source(name, data['environment'])}."
    ]


def loops_section() -> str | None:
    """The real-loops section, or None when none of its result files exist."""
    parts: list[str] = []
    renderers = {
        "varlen-h200.json": varlen_section,
        "loader-h200.json": loader_section,
        "watchdog-overhead-h200.json": watchdog_section,
    }
    for name, render in renderers.items():
        path = RESULTS / name
        if path.exists():
            parts += [*render(json.loads(path.read_text()), name), ""]
    return "\n".join(parts).rstrip() or None


def _replace(text: str, start: str, end: str, body: str | None) -> str:
    if start not in text or end not in text:
        raise SystemExit(f"README.md lacks the {start} ... {end} markers")
    if body is None:
        print(f"no results for {start} ... {end}: kept that section as it was", file=sys.stderr)
        return text
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def main() -> None:
    text = _replace(README.read_text(), START, END, section(load()))
    README.write_text(_replace(text, LOOPS_START, LOOPS_END, loops_section()))
    print(f"updated {README}")


if __name__ == "__main__":
    main()
