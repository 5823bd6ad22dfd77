from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ddpgraph.demo.data import NUM_CLASSES, SAMPLE_SHAPES, synthetic_patterns
from ddpgraph.demo.models import build_model
from ddpgraph.demo.train import mode_text


@pytest.mark.timeout(180)
def test_train_end_to_end_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ddpgraph", "train", "--steps", "120", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "COLUMNS": "200"},  # the table on one line a row
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ddpgraph train: mlp" in proc.stdout and "wrote" in proc.stdout
    assert "mode: eager (cpu: no CUDA graphs), on every rank" in proc.stdout, proc.stdout
    run = json.loads((out / "run.json").read_text())
    assert run["world_size"] == 2 and [r["rank"] for r in run["ranks"]] == [0, 1]
    chance = 1 / NUM_CLASSES
    for rank in run["ranks"]:
        assert rank["device"] == "cpu" and rank["backend"] == "gloo"
        assert rank["samples_seen"] == 120 * 64
        curve = rank["loss_curve"]
        assert curve[-1] < 0.5 * curve[0], curve
        assert rank["accuracy"] > chance + 0.4, rank["accuracy"]
    assert not list(out.glob("*.tmp")), "run.json is written atomically"


def test_the_mode_cell_says_why_a_rank_runs_eager():
    def cell(device: str, mode: str = "eager", fallbacks: tuple[str, ...] = ()) -> str:
        return mode_text({"device": device, "mode": mode, "fallbacks": list(fallbacks)})

    assert (
        cell("cpu", fallbacks=("the model is on cpu, not CUDA",)) == "eager (cpu: no CUDA graphs)"
    )
    assert cell("cuda:0", fallbacks=("capture failed",)) == "eager (fallback: see run.json)"
    assert cell("cuda:0", "graphed") == "graphed"


def test_the_report_fits_80_columns_and_names_a_shared_mode_once():
    from rich.console import Console

    from ddpgraph.demo.train import TrainConfig, report_lines

    def rank(r: int, mode: str = "eager") -> dict:
        return {
            "rank": r, "device": "cpu", "mode": mode, "fallbacks": ["the model is on cpu"],
            "time_to_first_replay_s": None, "samples_seen": 19200, "final_loss": 0.1234,
            "accuracy": 0.531, "steps_per_s": 171.3,
        }  # fmt: skip

    def shown(everyone: list[dict]) -> str:
        console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
        for line in report_lines(TrainConfig(), everyone):
            console.print(line)
        return console.export_text()

    text = shown([rank(0), rank(1)])
    assert max(map(len, text.splitlines())) <= 80
    assert "accuracy" in text and "…" not in text
    assert text.count("eager (cpu: no CUDA graphs)") == 1 and text.rstrip().endswith("every rank")
    mixed = shown([rank(0), rank(1, mode="graphed")])  # ranks that differ: a column
    assert "mode: rank 0 eager (cpu: no CUDA graphs); rank 1 graphed" in mixed


def test_bad_cli_values_are_refused():
    proc = subprocess.run(
        [sys.executable, "-m", "ddpgraph", "train", "--steps", "0"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "--steps" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "ddpgraph", "train", "--model", "vgg"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "'vgg' is not one of" in proc.stderr


@pytest.mark.timeout(60)
def test_what_would_fail_late_is_refused_before_any_worker_starts(tmp_path):
    def train(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ddpgraph", "train", "--steps", "2", "--nproc", "2"]
        return subprocess.run([*command, *args], capture_output=True, text=True, timeout=50)

    # a batch larger than a rank's share of the data set: drop_last leaves no batch at all
    proc = train("--batch-size", "5000", "--out", str(tmp_path / "a"))
    assert proc.returncode == 2
    assert "--batch-size 5000 is more than the 4096 training samples each of the 2" in proc.stderr
    assert "use --batch-size 4096 or less" in proc.stderr
    # an --out that cannot be written, found before training instead of after it
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = train("--out", str(blocker / "sub"))
    assert proc.returncode == 2 and f"--out {blocker / 'sub'} is not a writable" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", sorted(SAMPLE_SHAPES))
def test_models_accept_their_data(name):
    data = synthetic_patterns(SAMPLE_SHAPES[name], num_samples=8, seed=0)
    x, y = data.tensors
    assert build_model(name)(x).shape == (8, NUM_CLASSES)
    assert y.dtype == torch.int64 and int(y.max()) < NUM_CLASSES


def test_data_is_deterministic_and_splits_differ():
    a = synthetic_patterns((4,), num_samples=16, seed=3).tensors[0]
    b = synthetic_patterns((4,), num_samples=16, seed=3).tensors[0]
    c = synthetic_patterns((4,), num_samples=16, seed=3, split="eval").tensors[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="num_samples=0"):
        synthetic_patterns((4,), num_samples=0, seed=0)
