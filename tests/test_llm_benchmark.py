"""benchmarks/llm_gpu.sh (issue 49, item 4): its CPU trial runs the same trainers end to end and
writes the JSON the GPU run writes, marked as no GPU figures; without CUDA the GPU run refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "llm_gpu.sh"


def _run(tmp_path: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), **env}
    return subprocess.run(
        ["bash", str(SCRIPT)], env=environ, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(420)
def test_the_cpu_trial_writes_the_fields_the_gpu_run_writes(tmp_path):
    for module in ("trl", "peft", "datasets", "tokenizers"):
        pytest.importorskip(module)
    # the tiny Llama, LoRA and SFT: 15 steps, the capture at step 13, steps 14-15 replayed
    proc = _run(tmp_path, 400, DEVICE="cpu", MODELS="tiny", STEPS="15", WORKLOADS="sft,lora")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "llm-tiny-cpu.json").read_text())
    assert result["figures"] == "cpu-trial" and result["device"] == "cpu"
    assert result["precision"] == "fp32" and result["config"]["steps"] == 15
    assert result["versions"]["torch"] == torch.__version__
    assert result["versions"]["trl"] != "not installed" and result["commit"]
    assert set(result["runs"]) == {"sft", "lora"}
    for workload, runs in result["runs"].items():
        plain, graphed = runs["plain"], runs["graphed"]
        assert "error" not in plain and "error" not in graphed, (workload, runs)
        for run in (plain, graphed):
            assert run["steps_per_s"] > 0 and run["tokens_per_s"] > 0
        assert graphed["replays"] >= 2 and graphed["step_calls"] == 15
        assert graphed["replayed_fraction"] == graphed["replays"] / 15
        assert runs["losses_equal"] is True, (plain["losses"], graphed["losses"])
        assert runs["speedup"] == graphed["steps_per_s"] / plain["steps_per_s"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_without_cuda_the_gpu_run_refuses_naming_the_cpu_trial(tmp_path):
    proc = _run(tmp_path, 120, MODELS="small")
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stderr
    assert "DEVICE=cpu MODELS=small bash benchmarks/llm_gpu.sh" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_an_unknown_device_is_refused(tmp_path):
    proc = _run(tmp_path, 60, DEVICE="gpu")
    assert proc.returncode == 2 and "DEVICE=gpu is not cuda or cpu" in proc.stderr
