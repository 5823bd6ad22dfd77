"""The programs in examples/ run on 2 CPU ranks (gloo), under torchrun and under ddpgraph launch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .procs import run_python

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TORCHRUN = ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
LAUNCH = ["-m", "ddpgraph", "launch", "--nproc-per-node", "2"]


def run_example(launcher: list[str], name: str, *args: str, tmp_path: Path):
    proc = run_python([*launcher, str(EXAMPLES / name), *args], cwd=tmp_path, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(120)
def test_resnet_graphed_ddp(tmp_path):
    proc = run_example(
        TORCHRUN, "resnet_graphed_ddp.py", "--steps", "8", "--batch-size", "8", "--log-every",
        "4", tmp_path=tmp_path,
    )  # fmt: skip
    out = proc.stdout
    assert "on 2 rank(s) (gloo, rank 0 on cpu), batch 8 per rank, 8 steps" in out
    losses = [float(v) for v in re.findall(r"step +\d+  loss (\d+\.\d+)", out)]
    assert len(losses) == 2 and all(0 < v < 10 for v in losses)  # rank 0 only, steps 4 and 8
    assert f"final loss {losses[-1]:.4f}" in out
    # the CPU runs eagerly, and the report says so and why
    assert "mode=eager steps=8 eager=8 replays=0" in out
    assert "fallback: the model is on cpu, not CUDA" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", [TORCHRUN, LAUNCH], ids=["torchrun", "ddpgraph-launch"])
def test_gather_metrics(tmp_path, launcher):
    proc = run_example(launcher, "gather_metrics.py", "--samples", "100", tmp_path=tmp_path)
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    assert lines[header].split() == ["rank", "host", "device", "samples", "loss", "accuracy"]
    # exactly one row per rank, in rank order, each with its share of the samples, then the total
    rows = [line.split() for line in lines[header + 1 : header + 4]]
    assert [(r[0], r[2], r[3]) for r in rows[:2]] == [("0", "cpu", "50"), ("1", "cpu", "50")]
    assert rows[2][:2] == ["all", "100"]
    assert sum(line.startswith("rank ") for line in lines) == 1  # printed by rank 0 only
    # the per-sample results, gathered once each, give the table's accuracy
    assert f"per sample: 100 samples, accuracy {rows[2][3]}" in lines
