"""The five pinned public scripts on one GPU, each as written and as its guide ports it: the time
of an optimizer update of both, steps/s, and the port's report (issue 52's GPU figures).

One command on the GPU machine (which gets the checkout without ``../shared``: copy
``../shared/upstream`` into a folder ``.git/info/exclude`` ignores, e.g. ``.upstream/``, carry it
and name it in ``$DDPGRAPH_UPSTREAM``; the wheels ``benchmarks/gpu_wheels.sh`` fetched into
``.whl/`` give what the GPU image lacks: ``datasets`` and ``evaluate`` for the glue script)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/ddpgraph-site .whl/*.whl
    PYTHONPATH=/tmp/ddpgraph-site:$PWD/src DDPGRAPH_UPSTREAM=$PWD/.upstream \\
        python3 benchmarks/upstream_ports.py --out benchmarks/results/upstream-ports-h100.json

About 20 runs of 10 to 30 s each, sized for the device's 10 minutes on an H100 (not measured);
the JSON is written after each script's precision, so a command cut short keeps what it
measured, and a run that fails keeps its error in the JSON while the others go on.

Run on an H100 with ``--precisions amp`` (benchmarks/results/upstream-ports-amp-h100.json;
glue failed there on the machine's transformers, since fixed in its data, not re-run), not yet
with fp32. On the CPU (``--device cpu --size tiny``: gloo, the ports on ``CpuGraphs``;
tests/test_upstream_ports.py) every part but the GPU runs.

The scripts (``../shared/upstream/``, or ``$DDPGRAPH_UPSTREAM``) run through the workers of their
bit-for-bit tests (``tests/upstream_*.py``), each run in its own ``run_distributed(..., 1,
backend="nccl")`` process (world size 1: no communication in these figures):

- ``cv``: Accelerate's ``complete_cv_example.py`` (ResNet-50d, 224 px, batches of 64: its
  ``main()`` fixes them; 1000 images, 800 to train), ``--mixed_precision no|bf16`` (its
  ``OneCycleLR`` rewrites Adam's betas before every step, which the port re-captures each step
  after the warm-up: the report says so);
- ``glue``: transformers' ``run_glue_no_trainer.py`` (a BERT-base-sized BERT, random weights, made
  locally), Accelerate's mixed precision ``no|bf16`` (as ``accelerate launch`` exports it);
- ``autoregressive``: Accelerate's ``gradient_accumulation_for_autoregressive_models.py`` (a Llama
  of SmolLM-360M's sizes, random weights, under the script's hub name in a local cache),
  ``--mixed_precision no|bf16``, ``--gradient_accumulation_steps 2``;
- ``timm``: timm's ``train.py`` (``--model resnet50``, 224 px, ``-b 128``: its default), fp32 or
  ``--amp --amp-dtype bfloat16``;
- ``torchvision``: torchvision's ``references/classification/train.py`` (``--model resnet50``,
  its default crops 224/256/224 and ``-b 32``), fp32 or ``--amp`` (fp16 autocast and
  ``GradScaler``).

What is timed is the script as written (``"script"``: its own optimizer untouched; the JSON names
the worker's variant) against its port (``"port"``: exactly what the tests run, on real CUDA
graphs). Precision ``fp32`` is each script's default; ``amp`` its own mixed-precision flag. The
data are random JPEGs (ImageFolders) and sentences made here; the sizes are in the JSON
(``--size tiny``: the CPU tests' sizes, for a quick check). What is recorded: a host timestamp
behind ``torch.cuda.synchronize()`` after each optimizer update (at the script's own update
point: the scheduler step it calls after each update, or torchvision's ``metric_logger.update``)
and nothing of the parameters (the tests record them all; here that would be timed too); the
port's ``step.report()`` once the run is over. A step's time is the median interval between
consecutive updates of one epoch after the step's warm-up (updates 13 on), full batches only
(an epoch's first update, which follows the evaluation and the loader's start, and a short last
batch left out); steps/s is 1000 over it; ``port_vs_script`` > 1 means the port is faster. The
report is kept as its text and parsed into numbers (``replayed`` = replays / steps; a step that
captures replays its new graph at once and counts as a replay: ``replayed_uncaptured`` leaves
those out).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the workers are tests/upstream_*.py, as the tests run them

SCRIPTS = ("cv", "glue", "autoregressive", "timm", "torchvision")
PRECISIONS = ("fp32", "amp")
WARMUP_UPDATES = 12  # the step's default warm-up: the 13th update is the first captured
RUN_S = 300  # one run's limit (the whole command is sized for 10 minutes on an H100)

# transformers' BertConfig defaults (bert-base-uncased's sizes); SmolLM-360M's config.json
BERT_BASE = dict(
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
    intermediate_size=3072, max_position_embeddings=512,
)  # fmt: skip
SMOLLM_360M = dict(
    vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
    num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=2048,
)  # fmt: skip


@dataclass
class Plan:
    """One script's runs: its worker (``tests/<module>.py``) and pinned files, the worker's
    variant that is the script as written and the port's, each precision's flags,
    ``args(base, script, variant, flags, device)`` (the worker's ``run`` arguments), how its
    updates fall in epochs, and the sizes (for the JSON)."""

    module: str
    folder: str
    files: tuple[str, ...]  # the script first, then what it imports from its folder
    script_variant: str
    port_variant: str
    flags: dict[str, list[str]]  # by precision: the script's flags (glue: the launcher's first)
    per_epoch: int  # optimizer updates an epoch
    last_short: bool  # an epoch's last update is of a short batch (or window)
    sizes: dict[str, Any]
    args: Callable[[str, str, str, list[str], str], tuple[Any, ...]]
    make: Callable[[str], None]  # the inputs, made once for every run of the script
    init: bool = True  # run_distributed makes the group (False: the script makes its own)


def plan_of(name: str, size: str, cv_model: str = "") -> Plan:
    """What ``name``'s runs are at ``size`` ("script": what its users feed, built offline;
    "tiny": the CPU tests' sizes); ``cv_model``: a smoke run's model for complete_cv_example in
    place of its ResNet-50d."""
    big = size == "script"
    if name == "cv":
        from tests import upstream_cv as cv

        images = 1000 if big else cv.IMAGES
        train = int(0.8 * images)  # the script's split
        return Plan(
            "upstream_cv", cv.FOLDER, (cv.NAME,), "original", "port",
            {"fp32": ["--mixed_precision", "no"], "amp": ["--mixed_precision", "bf16"]},
            per_epoch=math.ceil(train / 64), last_short=train % 64 != 0,
            sizes={"model": cv_model or "resnet50d (the script's)", "image": 224, "batch": 64,
                   "train_images": train, "epochs": 3},
            args=lambda base, script, variant, flags, device: (
                base, script, variant, [*flags, "--cpu"] if device == "cpu" else flags, device,
                cv_model,
            ),
            make=lambda base: cv.make_images(Path(base) / "images", images),
        )  # fmt: skip
    if name == "glue":
        from tests import upstream_glue as glue

        batch, length, rows = (32, 128, 768) if big else (4, 12, glue.ROWS)
        flags = ["--per_device_train_batch_size", str(batch), "--max_length", str(length)]
        flags += ["--num_train_epochs", "2"]
        return Plan(
            "upstream_glue", glue.FOLDER, (glue.NAME,), "original", "hand",
            # the script has no precision flag: accelerate launch's ACCELERATE_MIXED_PRECISION
            {"fp32": ["no", *flags], "amp": ["bf16", *flags]},
            per_epoch=math.ceil(rows / batch), last_short=rows % batch != 0,
            sizes={"model": "BERT-base sizes, random weights" if big else "tiny BERT (tests)",
                   "config": BERT_BASE if big else "tests/upstream_glue.py", "batch": batch,
                   "max_length": length, "pad_to_max_length": True, "train_rows": rows,
                   "epochs": 2},
            args=lambda base, script, variant, flags, device: (
                base, script, variant, flags[1:], flags[0], variant, True, device
            ),
            make=lambda base: glue.make_inputs(
                Path(base), config=BERT_BASE if big else None, rows=(rows, 64 if big else 16)
            ),
        )  # fmt: skip
    if name == "autoregressive":
        from tests import upstream_autoregressive as ar

        k, words = 2, 128 if big else 9
        batches = ar.KEPT // 2  # the script's default --per_device_batch_size 2
        return Plan(
            "upstream_autoregressive", ar.FOLDER, (ar.NAME,), "original", "port",
            {"fp32": ["--mixed_precision", "no"], "amp": ["--mixed_precision", "bf16"]},
            per_epoch=math.ceil(batches / k), last_short=batches % k != 0,
            sizes={"model": "SmolLM-360M sizes, random weights" if big else "tiny Llama (tests)",
                   "config": SMOLLM_360M if big else "tests/upstream_autoregressive.py",
                   "batch": 2, "gradient_accumulation_steps": k, "tokens": words + 1,
                   "train_rows": ar.KEPT, "epochs": 3},
            args=lambda base, script, variant, flags, device: (
                base, script, variant, k, tuple(flags), device
            ),
            make=lambda base: ar.make_inputs(
                Path(base), config=SMOLLM_360M if big else None, length=words
            ),
        )  # fmt: skip
    if name == "timm":
        from tests import upstream_timm as timm

        batch, train, side = (128, 2048, 224) if big else (4, timm.TRAIN, 32)
        flags = ["--epochs", "2", "-b", str(batch), "--input-size", "3", str(side), str(side)]
        if big:
            flags += ["--model", "resnet50", "-j", "8", "--log-interval", "50"]
        return Plan(
            "upstream_timm", timm.FOLDER, (timm.NAME,), "original", "port",
            {"fp32": flags, "amp": [*flags, "--amp", "--amp-dtype", "bfloat16"]},
            per_epoch=train // batch, last_short=False,  # timm's train loader drops the last
            sizes={"model": "resnet50" if big else "test_resnet (tests)", "image": side,
                   "batch": batch, "train_images": train, "workers": 8 if big else 0,
                   "epochs": 2},
            args=lambda base, script, variant, flags, device: (
                base, script, variant, [*flags, "--device", device] if device == "cuda" else flags,
                variant + ("_amp" if "--amp" in flags else ""), device,
            ),
            make=lambda base: (
                image_folders(Path(base) / "data", {"train": train, "validation": 256}, 8)
                if big else timm.make_images(Path(base) / "data")
            ),
            init=False,  # the script makes its group (none at world size 1)
        )  # fmt: skip
    if name == "torchvision":
        from tests import upstream_torchvision as tv

        batch, train = (32, 1280) if big else (4, tv.TRAIN)
        flags = ["--epochs", "2", "-b", str(batch)]
        if big:
            flags += ["--model", "resnet50", "--workers", "16", "--train-crop-size", "224",
                      "--val-resize-size", "256", "--val-crop-size", "224"]  # fmt: skip
        return Plan(
            "upstream_torchvision", tv.FOLDER, (tv.NAME, *tv.MODULES), "untouched", "port",
            {"fp32": flags, "amp": [*flags, "--amp"]},
            per_epoch=math.ceil(train / batch), last_short=train % batch != 0,
            sizes={"model": "resnet50" if big else "shufflenet_v2_x0_5 (tests)",
                   "image": 224 if big else 32, "batch": batch, "train_images": train,
                   "workers": 16 if big else 0, "epochs": 2},
            args=lambda base, script, variant, flags, device: (
                base, script, variant, flags, variant + ("_amp" if "--amp" in flags else ""),
                device,
            ),
            make=lambda base: (
                image_folders(Path(base) / "images", {"train": train, "val": 128}, 5)
                if big else tv.make_images(Path(base) / "images")
            ),
            init=False,  # the script makes its own group (utils.init_distributed_mode)
        )  # fmt: skip
    raise ValueError(f"unknown script {name!r}: choose from {', '.join(SCRIPTS)}")


def image_folders(root: Path, splits: dict[str, int], classes: int, side: int = 96) -> None:
    """ImageFolders (``root/<split>/c<label>/<n>.jpg``) of random ``side`` px JPEGs, each class
    lifted in its own band of rows (the scripts resize them to their crops)."""
    import torch
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    band = side // classes
    for split, count in splits.items():
        for n in range(count):
            label = n % classes
            pixels = torch.randint(0, 128, (side, side, 3), generator=gen, dtype=torch.uint8)
            pixels[label * band : (label + 1) * band] += 100
            folder = root / split / f"c{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels.numpy()).save(folder / f"{n}.jpg")


def step_ms(
    times: list[float], per_epoch: int, last_short: bool, warmup: int = WARMUP_UPDATES
) -> dict[str, Any]:
    """The median and every interval (ms) between consecutive updates of one epoch after the
    warm-up: the interval into an epoch's first update (the evaluation and the loader's start
    between) and into a short last one left out. ``times[i]`` is update ``i + 1``'s."""
    intervals = []
    for i in range(warmup, len(times) - 1):
        upcoming = (i + 1) % per_epoch  # the next update's place in its epoch (0: the first)
        if upcoming == 0 or (last_short and upcoming == per_epoch - 1):
            continue
        intervals.append((times[i + 1] - times[i]) * 1e3)
    median = statistics.median(intervals) if intervals else None
    return {
        "median_ms": median,
        "steps_per_s": 1e3 / median if median else None,
        "intervals": len(intervals),
        "updates": len(times),
        "all_ms": intervals,
    }


def parse_report(text: str) -> dict[str, Any]:
    """``str(step.report())`` as numbers: its first line's ``key=value`` pairs (steps, eager,
    replays, warm-up...), the captures, re-captures and fallbacks counted, the replayed fraction
    of the step's calls (``replayed``), and the fraction replayed from an earlier capture
    (``replayed_uncaptured``: a step that captures replays its new graph at once, which the
    report counts as a replay too)."""
    if not text:
        return {}
    head, *rest = text.splitlines()
    found: dict[str, Any] = {}
    for key, value in re.findall(r"([\w/ ()-]+?)=(\S+)", head):
        key = key.strip()
        found[key] = int(value) if value.isdigit() else value
    found["captures"] = sum(line.startswith("captured ") for line in rest)
    trained = sum(line.startswith("captured train ") for line in rest)
    found["recaptures"] = sum(line.startswith("re-captured: ") for line in rest)
    found["fallbacks"] = sum(line.startswith("fallback: ") for line in rest)
    steps, replays = found.get("steps"), found.get("replays")
    counted = isinstance(steps, int) and steps and isinstance(replays, int)
    found["replayed"] = replays / steps if counted else None
    found["replayed_uncaptured"] = (replays - trained) / steps if counted else None
    return found


def time_one(
    plan: Plan, base: str, script: str, variant: str, flags: list[str], device: str
) -> dict[str, Any]:
    """One run of ``plan``'s script (or port) in its own process: its timestamps, the lines it
    printed, the port's report, the seconds the run took (with the process's start)."""
    from ddpgraph.testing import run_distributed
    from tests.upstream import timed_run

    args = (plan.module, plan.args(base, script, variant, flags, device), {})
    backend = "nccl" if device == "cuda" else "gloo"
    began = time.perf_counter()
    (found,) = run_distributed(
        timed_run, 1, backend=backend, args=args, timeout=RUN_S, init=plan.init
    )
    found["run_s"] = time.perf_counter() - began
    found["printed"] = (found["printed"] or [])[-6:]  # its last lines (the evaluation's)
    return found


def run_script(
    name: str,
    precisions: list[str],
    size: str,
    device: str,
    cv_model: str = "",
    result: dict[str, Any] | None = None,
    save: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Every precision of ``name``: the script as written and its port, timed, into ``result``
    (``save()`` after each precision)."""
    from tests import upstream

    plan = plan_of(name, size, cv_model)
    script = str(upstream.script(plan.folder, plan.files[0]))
    for file in plan.files[1:]:
        upstream.script(plan.folder, file)  # its SHA-256 checked too
    result = {} if result is None else result
    result |= {
        "script": f"{plan.folder}/{plan.files[0]}",
        "timed": {"script": plan.script_variant, "port": plan.port_variant},
        "sizes": plan.sizes,
        "updates_per_epoch": plan.per_epoch,
        "updates_expected": plan.per_epoch * plan.sizes["epochs"],
        "short_last_update": plan.last_short,
    }
    with tempfile.TemporaryDirectory() as base:
        began = time.perf_counter()
        plan.make(base)
        result["inputs_s"] = time.perf_counter() - began
        for precision in precisions:
            flags = plan.flags[precision]
            runs: dict[str, Any] = {"flags": flags}
            for role, variant in (("script", plan.script_variant), ("port", plan.port_variant)):
                try:
                    found = time_one(plan, base, script, variant, flags, device)
                except Exception as error:  # kept in the JSON; the other runs still run
                    found = {"error": f"{type(error).__name__}: {error}"[-4000:], "report": ""}
                found.update(step_ms(found.pop("times", None) or [], plan.per_epoch,
                                     plan.last_short))  # fmt: skip
                runs[role] = found
            runs["report"] = parse_report(runs["port"]["report"])
            ours, theirs = runs["port"]["median_ms"], runs["script"]["median_ms"]
            runs["port_vs_script"] = theirs / ours if ours and theirs else None
            result[precision] = runs
            save()
            print(name, precision, {r: runs[r]["median_ms"] for r in ("script", "port")},
                  "replayed", runs["report"].get("replayed"), flush=True)  # fmt: skip
    return result


def _src_tree() -> str:
    """The git tree id of ``src/`` as it is on disk (the GPU machine's copy of the working tree
    has no current ``.git``: its HEAD named a commit older than the files that ran)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_receipt import git_tree_hash

    return git_tree_hash(ROOT / "src")[:10]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--scripts", default=",".join(SCRIPTS), help="of " + ",".join(SCRIPTS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help="fp32 (each script's default), amp (its mixed-precision flag)")  # fmt: skip
    parser.add_argument("--size", choices=("script", "tiny"), default=None,
                        help="script: what its users feed (the default on cuda); tiny: the "
                        "CPU tests' sizes (the default on cpu)")  # fmt: skip
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of every part but the GPU (gloo, CpuGraphs)")  # fmt: skip
    parser.add_argument("--out", default=None, help="the JSON to write")
    parser.add_argument("--cv-model", default="", help=argparse.SUPPRESS)  # a CPU smoke run's
    opts = parser.parse_args(argv)
    import torch

    names = [s for s in opts.scripts.split(",") if s]
    precisions = [p for p in opts.precisions.split(",") if p]
    for value, known, what in ((names, SCRIPTS, "--scripts"), (precisions, PRECISIONS, "--precisions")):  # fmt: skip
        if not value or set(value) - set(known):
            parser.error(f"{what} {','.join(value)!r}: choose among {','.join(known)}")
    size = opts.size or ("script" if opts.device == "cuda" else "tiny")
    from tests import upstream

    if not upstream.UPSTREAM.is_dir():
        parser.error(f"no pinned scripts at {upstream.UPSTREAM}: ../shared/upstream beside the "
                     "checkout, or a copy named in $DDPGRAPH_UPSTREAM")  # fmt: skip
    if opts.cv_model and opts.device != "cpu":
        parser.error("--cv-model is for a smoke run on the CPU: the GPU times the script's model")
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark times the scripts on a GPU (--device cpu "
                     "smoke-tests it)")  # fmt: skip
    if opts.device == "cpu" and size == "script":
        parser.error("--size script on the CPU would take hours: --size tiny")
    results: dict[str, Any] = {}
    result = {
        "what": "each pinned script as written (its own optimizer) against its port, one "
        "process: median ms between consecutive full-batch updates of an epoch after the "
        "warm-up, each behind a device sync; port_vs_script > 1 means the port is faster; "
        "report: the port's step.report() parsed (replayed = replays / steps)",
        "command": "python benchmarks/upstream_ports.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name() if opts.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "size": size,
        "versions": _versions(),
        "src_tree": _src_tree(),
        "world_size": 1,
        "scripts": results,
    }  # fmt: skip

    def save() -> None:  # after each precision: a command cut short keeps what it measured
        if opts.out:
            Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")

    for name in names:
        if name == "cv" and opts.device == "cpu" and not opts.cv_model:
            results[name] = {"skipped": "its main() fixes ResNet-50d at 224 px, batches of 64: "
                             "too heavy for the CPU (--cv-model NAME builds another)"}  # fmt: skip
        else:
            results[name] = {}
            run_script(name, precisions, size, opts.device, opts.cv_model, results[name], save)
    save()
    return result


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    found: dict[str, str | None] = {}
    for package in ("torch", "accelerate", "transformers", "timm", "torchvision"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


if __name__ == "__main__":
    main()
