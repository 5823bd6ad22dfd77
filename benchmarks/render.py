"""Regenerate the README's performance section (table + chart) from benchmarks/results/*.json.

Usage: python benchmarks/render.py   (the chart needs matplotlib)

Only numbers recorded by `ddpgraph bench` appear; nothing is typed by hand. Each cell is the
median over the file's repeated runs, and each ratio compares modes measured in one run.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddpgraph.bench_report import chart, table_rows, to_markdown

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
CHART = RESULTS / "readme-chart.png"
START, END = "<!-- perf:start -->", "<!-- perf:end -->"


def load() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if "configs" in data and "environment" in data and data["environment"].get("gpu"):
            found.append((path.name, data))
    return found


def section(results: list[tuple[str, dict]]) -> str:
    rows = [row for name, data in results for row in table_rows(name, data)]
    if not rows:
        return "No GPU benchmark results recorded yet."
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
    if chart(rows, CHART):
        parts += ["", f"![step time relative to eager DDP]({CHART.relative_to(ROOT).as_posix()})"]
    return "\n".join(parts)


def rows_in(name: str, rows: list[dict]) -> int:
    return sum(1 for r in rows if r["source"] == name)


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
