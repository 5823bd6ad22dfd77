"""Tables and charts from ``ddpgraph bench`` JSON: medians over the repeats, and each mode's
median over eager DDP's as its ratio (the modes of one repeat run back to back, on the same
batches, so drift falls on all of them)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from .._files import write_file

MODE_TITLES = {
    "eager_ddp": "eager DDP",
    "compile_reduce_overhead": "compile reduce-overhead",
    "train_step": "TrainStep",
    "train_step_channels_last": "TrainStep channels_last",
    "train_step_compiled": "TrainStep compile=True",
    "train_step_fp16": "TrainStep fp16 (loss scaling in the graph)",
    "train_step_device_data": "TrainStep DeviceData, 8 steps/replay",
}


# What proves that a file beside a bench JSON is a bench table or chart (``ddpgraph bench``
# replaces only those): the first line of a table, the PNG "Software" text of a chart.
TABLE_STARTS = (
    "| config | eager DDP ms (× eager) |",
    "| config | mode | median ms | vs eager FSDP2 |",
)
CHART_SOFTWARE = "ddpgraph bench"


def written_by_bench(path: Path) -> bool:
    """Whether ``path`` (a .md or .png) holds a table or chart that ``ddpgraph bench`` wrote."""
    try:
        with open(path, "rb") as file:
            head = file.read(64 * 1024)
    except OSError:
        return False
    if path.suffix == ".md":
        first = head.split(b"\n", 1)[0].decode("utf-8", errors="replace")
        return first.startswith(TABLE_STARTS)
    return _png_software(head) == CHART_SOFTWARE


def _png_software(data: bytes) -> str | None:
    """The "Software" tEXt of a PNG (its chunks before the image data), or None."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    at = 8
    while at + 8 <= len(data):
        length = int.from_bytes(data[at : at + 4], "big")
        kind = data[at + 4 : at + 8]
        body = data[at + 8 : at + 8 + length]
        if kind == b"IDAT":
            return None
        if kind == b"tEXt" and b"\0" in body:
            key, value = body.split(b"\0", 1)
            if key == b"Software":
                return value.decode("latin-1")
        at += 12 + length
    return None


def table_rows(source: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per config: each mode's median step time, its ratio to eager DDP and extras."""
    rows = []
    for config, result in results["configs"].items():
        runs = result["runs"]
        row: dict[str, Any] = {"source": source, "config": config, "runs": len(runs), "modes": {}}
        eager_ms = statistics.median(r["eager_ddp"]["median_ms"] for r in runs)
        for mode in MODE_TITLES:
            measured = [r[mode] for r in runs if mode in r]
            if not measured:
                continue
            median_ms = statistics.median(m["median_ms"] for m in measured)
            row["modes"][mode] = {
                "median_ms": median_ms,
                # the ratio of the two medians the table shows, so that its columns agree
                "vs_eager": median_ms / eager_ms,
                # the first run's: later runs in the process hit warm compile caches
                "first_fast_step_s": measured[0]["first_fast_step_s"],
                "gpu_busy_ms": _median_or_none(m.get("gpu_busy_ms") for m in measured),
                "bare_replay_ms": _median_or_none(
                    m.get("bare_replay", {}).get("median_ms") for m in measured
                ),
            }
        rows.append(row)
    return rows


def _median_or_none(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def to_markdown(rows: list[dict[str, Any]]) -> str:
    modes = [m for m in MODE_TITLES if any(m in r["modes"] for r in rows)]
    header = [
        "config",
        *(f"{MODE_TITLES[m]} ms (× eager)" for m in modes),
        "first fast step s (1st run)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["config"]]
        for mode in modes:
            m = row["modes"].get(mode)
            cells.append("–" if m is None else f"{m['median_ms']:.3f} ({m['vs_eager']:.2f}×)")
        cells.append(
            " / ".join(
                f"{row['modes'][m]['first_fast_step_s']:.1f}" for m in modes if m in row["modes"]
            )
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: Path, *, fix: str = "write it elsewhere") -> bool:
    """A bar chart of step time relative to eager DDP; False (and a note) without matplotlib.

    Written whole or not at all (``fix``: what the error says to do besides freeing space)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: no chart (install the plot extra from the clone: "
            "pip install -e '.[plot]')",
            file=sys.stderr,
        )
        return False
    modes = [m for m in MODE_TITLES if any(m in r["modes"] for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.9 * len(rows)))
    height = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ys = [j + i * height for j in range(len(rows))]
        values = [r["modes"].get(mode, {}).get("vs_eager", 0.0) for r in rows]
        ax.barh(ys, values, height, label=MODE_TITLES[mode])
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(rows))], [r["config"] for r in rows])
    ax.set_xlabel("step time relative to eager DDP (lower is faster)")
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    try:
        # a PNG named by its suffix: the partial file write_file hands over has another one
        # its tEXt chunk says who wrote it: a later run removes only a chart it can prove is one
        write_file(
            path,
            lambda partial: fig.savefig(
                partial, dpi=120, format="png", metadata={"Software": CHART_SOFTWARE}
            ),
            fix=fix,
        )
    finally:
        plt.close(fig)
    return True
