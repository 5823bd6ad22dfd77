"""A pinned public script on the GPU, as written and as its guide ports it: the time of each
optimizer step of both, and the port's report (issue 52's GPU figures).

Runs Accelerate's ``complete_cv_example.py`` (``../shared/upstream/``, or ``$DDPGRAPH_UPSTREAM``
where the checkout travels without ``../shared``) through the worker of
``tests/gpu/test_upstream_scripts_gpu.py`` (``tests/upstream_cv.py``): the script unchanged (its
Adam made graph-safe where the port's TrainStep makes it, as the bit-for-bit test runs it) and
the Accelerate guide's port, in float32 and bf16, on one GPU (world size 1: no communication in
these figures). What is recorded: at each optimizer update (the prepared scheduler's ``step()``)
a host timestamp behind a device sync, and nothing of the parameters (the test records them
all; here that would be timed too). A step's time is the median interval between consecutive
updates of one epoch after the step's warm-up (updates 13 on), full batches only: the script
fixes 3 epochs of 7 batches of 64 (the last of 16) in its ``main()``, so that is few intervals;
the JSON keeps every timestamp.

The script's ``OneCycleLR`` rewrites Adam's betas before every step (``cycle_momentum=True``),
which the port re-captures at each step after the warm-up (torch's Adam takes betas only as
numbers); the report in the JSON says so, and the figures show what it costs.

Written, not yet run on a GPU (no device time was left in the session that wrote it)::

    DDPGRAPH_UPSTREAM=$PWD/.upstream python benchmarks/upstream_ports.py \\
        --out benchmarks/results/upstream-ports-h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the workers import tests.upstream_cv, as the GPU test does

BATCHES_PER_EPOCH = 7  # 400 training images in batches of 64 (the script's split and config)
WARMUP_UPDATES = 12  # the step's default warm-up: the 13th update is the first captured


def timed_run(folder: str, script: str, variant: str, flags: list[str]) -> dict[str, Any]:
    """One run of the script (``variant`` "graph_safe") or its port ("port") on this process's
    GPU, with a timestamp after each update in place of the test's parameter records."""
    import torch
    from accelerate.scheduler import AcceleratedScheduler

    from tests import upstream_cv

    def timestamps_only(record: dict[str, Any]) -> None:
        step = AcceleratedScheduler.step

        def stamped(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = step(self, *args, **kwargs)
            torch.cuda.synchronize()
            record.setdefault("times", []).append(time.perf_counter())
            return result

        AcceleratedScheduler.step = stamped  # type: ignore[method-assign]

    upstream_cv.record_updates = timestamps_only  # type: ignore[assignment]
    record = upstream_cv.run(folder, script, variant, flags)
    return {key: record.get(key) for key in ("times", "printed", "report")}


def step_ms(times: list[float]) -> dict[str, Any]:
    """The median and every interval between consecutive full-batch updates of one epoch, after
    the warm-up (an epoch's last, short batch and the evaluation between epochs left out)."""
    intervals = [
        (times[i + 1] - times[i]) * 1e3
        for i in range(WARMUP_UPDATES, len(times) - 1)
        if (i + 1) % BATCHES_PER_EPOCH != BATCHES_PER_EPOCH - 1  # the next is the short batch
        and (i + 1) % BATCHES_PER_EPOCH != 0  # the next is an epoch's first
    ]
    return {"median": statistics.median(intervals) if intervals else None, "all": intervals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default="no,bf16", help="the script's --mixed_precision")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    import tempfile

    import torch

    from ddpgraph.testing import run_distributed
    from tests import upstream, upstream_cv

    if not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark times the scripts on a GPU")
    script = upstream.script(upstream_cv.FOLDER, upstream_cv.NAME)
    runs: dict[str, Any] = {}
    for precision in [p for p in opts.precisions.split(",") if p]:
        flags = ["--mixed_precision", precision]
        runs[precision] = {}
        for variant in ("graph_safe", "port"):
            with tempfile.TemporaryDirectory() as tmp:
                upstream_cv.make_images(Path(tmp) / "images")
                args = (tmp, str(script), variant, flags)
                (found,) = run_distributed(timed_run, 1, backend="nccl", args=args, timeout=600)
            found["step_ms"] = step_ms(found["times"] or [])
            runs[precision][variant] = found
        ours, theirs = runs[precision]["port"], runs[precision]["graph_safe"]
        if ours["step_ms"]["median"] and theirs["step_ms"]["median"]:
            runs[precision]["port_vs_script"] = (
                theirs["step_ms"]["median"] / ours["step_ms"]["median"]
            )
        print(precision, {v: r["step_ms"]["median"] for v, r in runs[precision].items()
                          if isinstance(r, dict)}, flush=True)  # fmt: skip
    result = {
        "what": "complete_cv_example.py as written against its Accelerate-guide port, one GPU: "
        "median ms between consecutive full-batch updates after the warm-up (behind a device "
        "sync each); port_vs_script > 1 means the port is faster",
        "command": "python benchmarks/upstream_ports.py --out ...",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "world_size": 1,
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if opts.out:
        Path(opts.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
