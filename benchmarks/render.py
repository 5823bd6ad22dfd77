"""Regenerate the performance numbers of README.md and docs/benchmarks.md from benchmarks/results.

Usage: python benchmarks/render.py   (the chart needs matplotlib: pip install -e '.[plot]' in the clone)
       python benchmarks/render.py --objects   (only docs/benchmarks.md's object collectives)

Only numbers recorded in benchmarks/results/*.json appear; nothing is typed by hand. Each cell is
the median over the file's repeated runs, and each ratio compares modes measured in one run.
Only the text between each pair of markers is replaced; a file without its markers is an error,
so no other text is ever rewritten.
It never deletes content it cannot regenerate: without matplotlib the chart already committed
stays linked (and is not redrawn); without results a section keeps its old text.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from ddpgraph.bench.report import MODE_TITLES, chart, table_rows

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "benchmarks.md"
CHART = ROOT / "docs" / "img" / "step-time.png"
START, END = "<!-- perf:start -->", "<!-- perf:end -->"
LOOPS_START, LOOPS_END = "<!-- loops:start -->", "<!-- loops:end -->"
OBJECTS_START, OBJECTS_END = "<!-- objects:start -->", "<!-- objects:end -->"
HF_START, HF_END = "<!-- hf:start -->", "<!-- hf:end -->"
PORTS_START, PORTS_END = "<!-- ports:start -->", "<!-- ports:end -->"
HEADLINE_MODES = ("eager_ddp", "compile_reduce_overhead", "train_step", "train_step_compiled")


def load() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("parallel") == "fsdp2":
            continue  # FSDP2's modes have no eager DDP to compare with: docs/guides/fsdp2.md
        if "configs" in data and "environment" in data and data["environment"].get("gpu"):
            found.append((path.name, data))
    return found


def section(results: list[tuple[str, dict]]) -> str | None:
    """The performance section, or None when there is nothing to render it from."""
    rows = latest_rows(results)
    if not rows:
        return None
    modes = [m for m in MODE_TITLES if any(m in r["modes"] for r in rows)]
    marks = source_marks(rows)
    parts = [
        *scope(results),
        "",
        "Step time in ms, median over repeated runs (× eager DDP: that median over eager DDP's",
        "median in the same result file). One column per config; each cell is the newest",
        "measurement of that mode, its letter the result file it comes from.",
        "",
        *by_mode_table(rows, modes, marks, _step_cell),
        "",
        "First fast step: seconds from building the model to steady state (compiling, warming",
        "up, capturing), from each file's first run (cold compile caches):",
        "",
        *by_mode_table(rows, modes, marks, _first_fast_cell),
        "",
        "Sources:",
        "",
        *(f"- {letter}: {_file_line(name, results)}" for name, letter in marks.items()),
    ]
    CHART.parent.mkdir(parents=True, exist_ok=True)
    drawn = chart(rows, CHART)
    if not drawn and CHART.exists():
        print(
            f"kept the existing {_shown(CHART)} (not redrawn); install "
            "matplotlib (pip install 'ddpgraph[plot]') to redraw it",
            file=sys.stderr,
        )
    if drawn or CHART.exists():
        link = CHART.relative_to(PAGE.parent).as_posix()
        parts += ["", f"![step time relative to eager DDP]({link})"]
    return "\n".join(parts)


def latest_rows(results: list[tuple[str, dict]]) -> list[dict]:
    """One row per config: each mode's newest measurement (by the file's run date) with its own
    run's ratio; ``sources`` names the file of each mode. Configs from the shortest eager step
    to the longest."""
    merged: dict[str, dict] = {}
    for name, data in sorted(results, key=lambda item: item[1]["environment"]["date"]):
        for row in table_rows(name, data):
            into = merged.setdefault(row["config"], {"config": row["config"], "modes": {}})
            into.setdefault("sources", {})
            for mode, measured in row["modes"].items():
                into["modes"][mode] = measured
                into["sources"][mode] = name
    return sorted(merged.values(), key=lambda row: row["modes"]["eager_ddp"]["median_ms"])


def source_marks(rows: list[dict]) -> dict[str, str]:
    """A letter per result file the rows use, in file-name order."""
    names = sorted({name for row in rows for name in row["sources"].values()})
    return {name: chr(ord("a") + i) for i, name in enumerate(names)}


def by_mode_table(
    rows: list[dict], modes: list[str], marks: dict[str, str], cell: Callable[[dict], str]
) -> list[str]:
    """A mode per line and a config per column: three configs fit the page, seven modes do not."""
    lines = [
        "| mode | " + " | ".join(row["config"] for row in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for mode in modes:
        cells = [
            f"{cell(row['modes'][mode])} {marks[row['sources'][mode]]}"
            if mode in row["modes"]
            else "–"
            for row in rows
        ]
        lines.append(f"| {MODE_TITLES[mode]} | " + " | ".join(cells) + " |")
    return lines


def _step_cell(measured: dict) -> str:
    return f"{measured['median_ms']:.3f} ({measured['vs_eager']:.2f}×)"


def _first_fast_cell(measured: dict) -> str:
    return f"{measured['first_fast_step_s']:.1f}"


def _file_line(name: str, results: list[tuple[str, dict]]) -> str:
    data = dict(results)[name]
    env = data["environment"]
    return (
        f"`{name}`: {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, NCCL "
        f"{env.get('nccl')}, commit {env['commit'][:10]}, {env['date'][:10]}, world size "
        f"{data['world_size']}"
    )


def scope(results: list[tuple[str, dict]]) -> list[str]:
    """What the step times contain and what they leave out, from the files' own data."""
    sizes = sorted({d["world_size"] for _, d in results})
    gpus = sorted({d["environment"]["gpu"] for _, d in results})
    items = [
        "**What a time is:** one whole training step (zero_grad, forward, loss, backward, SGD "
        "with momentum) on synthetic batches already on the GPU; no data loading.",
        f"**Where:** world size {', '.join(map(str, sizes))} on one {' / '.join(gpus)}, torch "
        f"{_versions(results)}.",
    ]
    if sizes == [1]:
        items.append(
            "**No communication:** at world size 1, DDP's in-place NCCL all-reduce over one rank "
            "launches no kernel. The numbers show the CPU launch overhead a graph removes, not "
            "how training scales across GPUs."
        )
    return [_bullet(item) for item in items]


def _bullet(text: str) -> str:
    return textwrap.fill(text, 100, initial_indent="- ", subsequent_indent="  ")


def headline(results: list[tuple[str, dict]]) -> str | None:
    """The README's short table: the main modes, with what the numbers include."""
    rows = latest_rows(results)
    if not rows:
        return None
    modes = [m for m in HEADLINE_MODES if any(m in r["modes"] for r in rows)]
    lines = [
        "Median step time in ms (× eager DDP's median of the same run; lower is faster):",
        "",
        "| config | " + " | ".join(MODE_TITLES[m] for m in modes) + " |",
        "|---|" + "---:|" * len(modes),
    ]
    for row in rows:
        cells = [row["config"]]
        for mode in modes:
            m = row["modes"].get(mode)
            if m is None:
                cells.append("–")
            elif mode == "eager_ddp":
                cells.append(f"{m['median_ms']:.2f}")
            else:
                cells.append(f"{m['median_ms']:.2f} ({m['vs_eager']:.2f}×)")
        lines.append("| " + " | ".join(cells) + " |")
    shown = sorted({row["sources"][m] for row in rows for m in modes if m in row["modes"]})
    sources = ", ".join(f"`{name}`" for name in shown)
    more = _bullet(
        f"**Sources:** {sources} in `benchmarks/results/` (each config's newest measurement of "
        "each mode). The full tables, the time to the first fast step, and the loader and "
        "variable-length measurements: [docs/benchmarks.md](docs/benchmarks.md)."
    )
    return "\n".join([*lines, "", *scope(results), more])


def _versions(results: list[tuple[str, dict]]) -> str:
    envs = [d["environment"] for _, d in results]
    return " / ".join(
        sorted({f"{e['torch']} (CUDA {e['cuda']}, NCCL {e.get('nccl')})" for e in envs})
    )


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
    feeds = list(next(iter(models.values()))["ratio_to_staged"])
    k = data["config"].get("k")
    uses = (
        f"device_data with {k} steps per replay" if "device_data" in feeds else "batched_prefetch"
    )
    lines = [
        "The main job's loop against the same TrainStep fed pre-staged device batches (rate ratio, "
        f"median of {data['config']['repeats']} repeats; `ddpgraph train` uses {uses}):",
        "",
        "| feed | " + " | ".join(models) + " |",
        "|---|" + "---:|" * len(models),
        "| staged (steps/s) | "
        + " | ".join(f"{r['steps_per_s']['staged']:.0f}" for r in models.values())
        + " |",
    ]
    for feed in feeds:
        ratios = " | ".join(f"{r['ratio_to_staged'][feed]:.2f}" for r in models.values())
        lines.append(f"| {feed} | {ratios} |")
    memory = [
        f"{model} {r['device_data']['data_mib']:.0f} MiB of data, peak "
        f"{r['device_data']['peak_memory_mib']:.0f} MiB"
        for model, r in models.items()
        if (r.get("device_data") or {}).get("peak_memory_mib") is not None
    ]
    if memory:
        lines += ["", "device_data's memory (the process's peak, both steps): " + "; ".join(memory)]
    return [*lines, "", f"Source: {_source(name, data['environment'])}."]


def loader_k_section(data: dict, name: str) -> list[str]:
    """The same loop with more steps per replay: device_data's ratio only."""
    cells = ", ".join(
        f"{model} {r['ratio_to_staged']['device_data']:.2f}" for model, r in data["models"].items()
    )
    return [
        f"With {data['config']['k']} steps per replay, device_data against staged: {cells} "
        f"(median of {data['config']['repeats']} repeats). Source: "
        f"{_source(name, data['environment'])}."
    ]


def steps_per_replay_section(data: dict, name: str) -> list[str]:
    """Per-step wall time as a multiple of GPU-busy time, staged and for each K."""
    models = data["models"]
    keys = list(next(iter(models.values())))
    lines = [
        "Per-step wall time ÷ GPU-busy time (profiler kernel time) for pre-staged batches and "
        "for a DeviceData at K steps per replay; kernel time is the same for every K, so what "
        "grows with K is time between kernels inside the graph (benchmarks/probes/"
        "steps_per_replay_probe.py):",
        "",
        "| model | " + " | ".join(keys) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    for model, row in models.items():
        cells = " | ".join(
            f"{v['ms_per_step']:.3f} ms ({v['ms_per_step'] / v['gpu_busy_ms_per_step']:.2f}×)"
            for v in row.values()
        )
        lines.append(f"| {model} | {cells} |")
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
        "loader-k8-h200.json": loader_k_section,
        "steps-per-replay-probe-h200.json": steps_per_replay_section,
        "watchdog-overhead-h200.json": watchdog_section,
    }
    for name, render in renderers.items():
        path = RESULTS / name
        if path.exists():
            parts += [*render(json.loads(path.read_text()), name), ""]
    return "\n".join(parts).rstrip() or None


def hf_section() -> str | None:
    """Hugging Face models with attention masks: eager DDP against TrainStep, per model."""
    parts: list[str] = []
    for path in sorted(RESULTS.glob("hf-*.json")):
        data = json.loads(path.read_text())
        runs = data["runs"]
        parts += [
            f"{data['batches']}; {data['steps']} steps, {len(runs)} runs, median of runs "
            f"(`{path.name}`: {data['environment']['gpu']}, torch {data['environment']['torch']}, "
            f"commit {data['environment']['commit'][:10]}, world size {data['world_size']}):",
            "",
            "| model | kind | eager DDP ms/step | TrainStep ms/step (× eager) | graphs "
            "| max param diff vs graph='never' (that vs itself) |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for model in runs[0]:
            rows = [run[model] for run in runs]
            eager = _median([r["eager_ddp"]["median_ms"] for r in rows])
            graphed = _median([r["train_step"]["median_ms"] for r in rows])
            ratio = _median([r["ratio_to_eager"]["train_step"] for r in rows])
            graphs = max(r["train_step"].get("graphs", 0) for r in rows)
            diff = max(r.get("max_param_diff", float("nan")) for r in rows)
            noise = max(r.get("eager_noise", float("nan")) for r in rows)
            parts.append(
                f"| {model} | {rows[0]['kind']} | {eager:.2f} | {graphed:.2f} ({ratio:.2f}×) "
                f"| {graphs} | {diff:.1e} ({noise:.1e}) |"
            )
        for model in runs[0]:
            fallbacks = runs[0][model]["train_step"].get("fallbacks") or []
            if fallbacks:
                parts += ["", f"{model} ran eagerly: {fallbacks[0].split(' at ')[0].rstrip('.')}."]
        parts.append("")
    return "\n".join(parts).rstrip() or None


OBJECT_COLUMNS = {
    "ddpgraph": ("all_gather_object", "torch", "ddpgraph_vs_torch"),
    "ddpgraph_gather": ("gather_object", "torch_gather", "gather_vs_torch"),
    "ddpgraph_broadcast": ("broadcast_object", "torch_broadcast", "broadcast_vs_torch"),
}


def ports_section() -> str | None:
    """The pinned public scripts as written against their ports on a GPU
    (``upstream-ports-*.json`` from benchmarks/upstream_ports.py), a row per script and
    precision; None without such a file."""
    parts: list[str] = []
    for path in sorted(RESULTS.glob("upstream-ports-*.json")):
        data = json.loads(path.read_text())
        if data.get("device") in (None, "cpu"):
            continue  # a CPU smoke run times nothing worth a table
        parts += [
            f"`{path.name}`: {data['device']}, torch {data['torch']}, src tree "
            f"{data.get('src_tree', '?')}, world size {data['world_size']} (no communication). "
            "ms per update: the median interval between an epoch's full-batch updates after "
            "the step's warm-up, each behind a device sync; replayed: the port's replays that "
            "were not captures, over its steps.",
            "",
            "| script | precision | model, batch | as written ms | port ms (× faster) "
            "| replayed | captures |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for name, script in data["scripts"].items():
            parts += [_ports_row(name, script, precision) for precision in ("fp32", "amp")]
        parts.append("")
    rows = [line for line in parts if line is not None]
    return "\n".join(rows).rstrip() or None


def _ports_row(name: str, script: dict, precision: str) -> str | None:
    run = script.get(precision)
    if not isinstance(run, dict):
        return None  # not run (--precisions)
    sizes = script.get("sizes", {})
    shape = f"{sizes.get('model', '?')}, {sizes.get('batch', '?')}"
    theirs, ours, report = run.get("script", {}), run.get("port", {}), run.get("report", {})
    error = run.get("error") or theirs.get("error") or ours.get("error")
    if error or theirs.get("median_ms") is None or ours.get("median_ms") is None:
        last = str(error or "no full-batch interval").strip().splitlines()[-1].strip()
        last = last if len(last) <= 100 else last[:97] + "..."
        return f"| {name} | {precision} | {shape} | failed: {last} | | | |"
    faster = run.get("port_vs_script")
    port = f"{ours['median_ms']:.2f}" + (f" ({faster:.2f}×)" if faster else "")
    replayed = report.get("replayed_uncaptured", report.get("replayed"))
    shown = f"{replayed:.2f}" if isinstance(replayed, float) else "?"
    return (
        f"| {name} | {precision} | {shape} | {theirs['median_ms']:.2f} | {port} | {shown} "
        f"| {report.get('captures', '?')} |"
    )


def objects_section() -> str | None:
    """ddpgraph's object collectives against torch's, per recorded file (a chart per sweep)."""
    parts: list[str] = []
    for path in sorted(RESULTS.glob("objects-*.json")):
        data = json.loads(path.read_text())
        parts += _objects_sweep(path, data) if "cases" in data else _objects_legacy(path, data)
        parts.append("")
    return "\n".join(parts).rstrip() or None


def _objects_legacy(path: Path, data: dict) -> list[str]:
    """A file from before the sweep: one world size, one object per size."""
    first = data["results"][0]["median_s"]
    cols = [c for c in OBJECT_COLUMNS if c in first]
    parts = [
        f"{data['backend']}, world size {data['world_size']}, {data['device']}, torch "
        f"{data['torch']}, commit {data['git_commit'][:10]} (`{path.name}`): median ms per "
        "call, slowest rank (× torch's own call):",
        "",
        "| object | " + " | ".join(OBJECT_COLUMNS[c][0] for c in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for result in data["results"]:
        cells = [
            f"{result['median_s'][c] * 1e3:.3f} ({result[OBJECT_COLUMNS[c][2]]:.2f}×)" for c in cols
        ]
        parts.append(f"| {result['case']} | " + " | ".join(cells) + " |")
    return parts


def _objects_sweep(path: Path, data: dict) -> list[str]:
    """benchmarks/objects.py's sweep: a table per world size, kinds across, sizes down."""
    cases = data["cases"]
    kinds = list(dict.fromkeys(c["kind"] for c in cases))
    parts = [
        f"{data['backend']}, {data['device']}, {data['cpu_count']} CPUs, torch {data['torch']}, "
        f"commit {data['git_commit'][:10]} (`{path.name}`, `{data.get('command', '')}`). Each "
        "cell: ddpgraph's `all_gather_object` repeated in a loop, × torch's own call in the same "
        "processes (median of the runs' slowest-rank medians; in brackets the lowest and highest "
        "run), then the same call with no size history (`cold`: two collectives above 16 KiB), "
        "and ddpgraph's milliseconds. Left out: " + data.get("limits", "nothing") + ".",
    ]
    if data.get("sweep") == "eval":
        parts[0] += (
            " Sizes are items per rank (labels: ints < 1000; scores: floats; records: "
            '`{"id", "pred", "score"}`; scores_tensor: float32).'
        )
    if any("cpu_ratios" in c for c in cases):
        parts[0] += (
            " `CPU time`: the same ratio of the CPU seconds of all ranks together (the work "
            "done, which the machine's load delays but inflates less than wall time)."
        )
    if "load" in data:
        parts[0] += f" Machine at the end: {data['load']} (shared with other work: noisy)."
    for world in sorted({c["world_size"] for c in cases}):
        here = [c for c in cases if c["world_size"] == world]
        sizes = list(dict.fromkeys(c["size"] for c in here))
        parts += [
            "",
            f"World size {world}:",
            "",
            "| size | " + " | ".join(kinds) + " |",
            "|---|" + "---:|" * len(kinds),
        ]
        for size in sizes:
            cells = []
            for kind in kinds:
                case = next((c for c in here if c["kind"] == kind and c["size"] == size), None)
                cells.append("–" if case is None else _objects_cell(case))
            parts.append(f"| {size} | " + " | ".join(cells) + " |")
    chart_path = _objects_chart(data, PAGE.parent / "img" / f"{path.stem}.png")
    if chart_path is not None:
        link = chart_path.relative_to(PAGE.parent).as_posix()
        parts += ["", f"![ddpgraph all_gather_object × torch's, {data['backend']}]({link})"]
    return parts


def _objects_cell(case: dict) -> str:
    ratios, spread = case["ratios"], case.get("ratio_spread", {})
    texts = []
    if "ddpgraph_vs_torch" in ratios:
        lo, hi = spread.get("ddpgraph_vs_torch", [ratios["ddpgraph_vs_torch"]] * 2)
        text = f"**{ratios['ddpgraph_vs_torch']:.2f}×** [{lo:.2f}–{hi:.2f}]"
        if "cold_vs_torch" in ratios:
            text += f", cold {ratios['cold_vs_torch']:.2f}×"
        cpu = case.get("cpu_ratios", {}).get("ddpgraph_vs_torch")
        text += "" if cpu is None else f", CPU time {cpu:.2f}×"
        texts.append(text + f", {case['median_s']['ddpgraph'] * 1e3:.3g} ms")
    for key, name in (("gather_vs_torch", "gather"), ("broadcast_vs_torch", "broadcast")):
        if key in ratios:
            texts.append(f"{name} {ratios[key]:.2f}×")
    return "; ".join(texts) or "–"


def _objects_chart(data: dict, path: Path) -> Path | None:
    """One panel per world size: ddpgraph / torch against object size, a line per kind."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return path if path.exists() else None
    cases = data["cases"]
    worlds = sorted({c["world_size"] for c in cases})
    kinds = list(dict.fromkeys(c["kind"] for c in cases))
    fig, axes = plt.subplots(1, len(worlds), figsize=(4.2 * len(worlds), 3.6), sharey=True)
    axes = axes if len(worlds) > 1 else [axes]
    colors = dict(zip(kinds, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, world in zip(axes, worlds, strict=True):
        for kind in kinds:
            here = [c for c in cases if c["world_size"] == world and c["kind"] == kind]
            here = [c for c in here if "ddpgraph_vs_torch" in c["ratios"]]
            if not here:
                continue
            xs = [c["encoded_bytes"] for c in here]
            ax.plot(xs, [c["ratios"]["ddpgraph_vs_torch"] for c in here], "o-", label=kind,
                    color=colors[kind])  # fmt: skip
            cold = [(x, c["ratios"]["cold_vs_torch"]) for x, c in zip(xs, here, strict=True)
                    if "cold_vs_torch" in c["ratios"]]  # fmt: skip
            if cold:
                ax.plot(*zip(*cold, strict=True), "x--", color=colors[kind], alpha=0.45)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.9, color="gray", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_title(f"{data['backend']}, {world} ranks")
        ax.set_xlabel("encoded bytes per rank")
    axes[0].set_ylabel("ddpgraph / torch (time per call)")
    axes[0].legend(title="solid: loop, dashed: cold", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _replace(text: str, start: str, end: str, body: str | None) -> str:
    if start not in text or end not in text:
        raise SystemExit(f"the {start} ... {end} markers are missing; nothing was written")
    if body is None:
        print(f"no results for {start} ... {end}: kept that section as it was", file=sys.stderr)
        return text
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def main() -> None:
    if sys.argv[1:] == ["--objects"]:  # only the object-collective section and its charts
        page = _replace(PAGE.read_text(), OBJECTS_START, OBJECTS_END, objects_section())
        PAGE.write_text(page)
        print(f"updated the objects section of {_shown(PAGE)}")
        return
    results = load()
    readme = _replace(README.read_text(), START, END, headline(results))
    page = _replace(PAGE.read_text(), START, END, section(results))
    page = _replace(page, LOOPS_START, LOOPS_END, loops_section())
    page = _replace(page, HF_START, HF_END, hf_section())
    page = _replace(page, PORTS_START, PORTS_END, ports_section())
    page = _replace(page, OBJECTS_START, OBJECTS_END, objects_section())
    README.write_text(readme)
    PAGE.write_text(page)
    print(f"updated {_shown(README)} and {_shown(PAGE)}")


if __name__ == "__main__":
    main()
