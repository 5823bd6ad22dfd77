from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from ddpgraph import TrainStep
from ddpgraph.bench import CONFIGS, MODES, QUICK, choose, cpu_warnings
from ddpgraph.bench.report import table_rows, to_markdown
from ddpgraph.cli import cli


@pytest.mark.timeout(240)
def test_bench_quick_writes_json_table_and_chart(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpgraph",
            "bench",
            "--quick",
            "--steps",
            "8",
            "--repeats",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a CPU run says that its ratios mean nothing, before it starts and in what it writes
    assert "ddpgraph bench: warning: on CPU there are no CUDA graphs" in proc.stderr
    assert "take(s) many minutes" not in proc.stderr  # the tiny config is quick
    data = json.loads(out.read_text())
    assert "no CUDA graphs" in data["note"]
    assert "Note: on CPU there are no CUDA graphs" in out.with_suffix(".md").read_text()
    assert data["environment"]["torch"] == torch.__version__
    assert data["environment"]["commit"]
    (config,) = data["configs"].values()
    assert len(config["runs"]) == 2
    for run in config["runs"]:
        assert set(run) == {"eager_ddp", "train_step"}
        for mode in run.values():
            assert mode["steps"] == 8 and 0 < mode["median_ms"] <= mode["p90_ms"]
            assert mode["first_fast_step_s"] > 0
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("| config | eager DDP ms") and "(1.00×)" in markdown


def test_quick_changes_only_the_defaults_config_and_mode_still_choose():
    configs, modes = choose([], None, quick=True)
    assert configs == [QUICK] and modes == ["eager_ddp", "train_step"]
    configs, modes = choose(["mlp"], ["train_step_compiled"], quick=True)
    assert configs == [CONFIGS["mlp"]] and modes == ["eager_ddp", "train_step_compiled"]
    configs, modes = choose([], ["train_step"], quick=True)
    assert configs == [QUICK] and modes == ["eager_ddp", "train_step"]
    configs, modes = choose([], None, quick=False)
    assert configs == list(CONFIGS.values()) and modes == list(MODES)


def test_a_cpu_bench_is_warned_that_ratios_measure_nothing_and_a_full_one_is_slow():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert cpu_warnings(cuda, list(CONFIGS.values())) == []
    (only,) = cpu_warnings(cpu, [QUICK])
    assert "no CUDA graphs" in only and "measure only noise" in only
    full = cpu_warnings(cpu, [CONFIGS["mlp"], CONFIGS["resnet50"]])
    assert len(full) == 2
    assert "MLP 8x1024 b64, ResNet-50 b32 fp32 on CPU take(s) many minutes" in full[1]
    assert "pass --quick" in full[1] and "(or --steps 5 --repeats 1)" in full[1]
    # a run that is already that short is not told to be (issue 50, item 15)
    (_, short) = cpu_warnings(cpu, [CONFIGS["resnet50"]], steps=5, repeats=1)
    assert "--steps 5" not in short and "--repeats 1" not in short
    (_, fewer) = cpu_warnings(cpu, [CONFIGS["resnet50"]], steps=5, repeats=3)
    assert fewer.endswith("for a smoke run (or --repeats 1).")


def test_bench_out_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(blocker / "b.json")])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--out'" in result.output
    assert f"{blocker} is not a writable directory" in result.output
    assert not isinstance(result.exception, AssertionError) and "Traceback" not in result.output


def test_report_rows_take_medians_and_the_ratio_of_the_medians_shown():
    def mode(ms):
        return {"median_ms": ms, "first_fast_step_s": 1.0}

    results = {
        "configs": {
            "c": {
                "runs": [
                    {"eager_ddp": mode(10.0), "train_step": mode(2.0)},
                    {"eager_ddp": mode(20.0), "train_step": mode(2.0)},
                    {"eager_ddp": mode(12.0), "train_step": mode(3.0)},
                ]
            }
        }
    }
    (row,) = table_rows("x.json", results)
    assert row["modes"]["eager_ddp"]["median_ms"] == 12.0
    # the ratio of the medians the table shows (2 / 12), not the median of the per-run ratios
    # (0.2, of 0.2, 0.1, 0.25), which would disagree with the ms columns beside it
    assert row["modes"]["train_step"]["vs_eager"] == 2.0 / 12.0
    assert "| c | 12.000 (1.00×) | 2.000 (0.17×) |" in to_markdown([row])


@pytest.mark.timeout(300)
def test_compile_true_with_inductor_on_cpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    step = TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), compile=True
    )
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=gen), torch.randint(4, (32,), generator=gen)
    losses = [float(step(x, y)) for _ in range(5)]
    assert step.report().fallbacks == ["the model is on cpu, not CUDA"]
    assert losses[-1] < losses[0]


@pytest.mark.timeout(240)
def test_bench_varlen_quick_runs_every_mode_on_padded_buckets(tmp_path):
    out = tmp_path / "varlen.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpgraph",
            "bench",
            "--varlen",
            "--quick",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert set(run) == {"eager_ddp", "eager_ddp_padded", "train_step_buckets"}
    assert run["eager_ddp"]["vs_eager"] == 1.0
    assert all(m["median_ms"] > 0 and m["whole_run_ms"] > 0 for m in run.values())
    # on the CPU the ratios are noise, and it says so; every time printed has its unit
    assert "ddpgraph bench: warning: on CPU there are no CUDA graphs" in proc.stderr
    assert data["note"].startswith("on CPU there are no CUDA graphs")
    (line,) = [text for text in proc.stdout.splitlines() if text.startswith("[bench varlen]")]
    assert line.count(" ms (") == 3 and line.count(" ms per step)") == 3, line


def test_causal_lm_ignores_padding_labels():
    from ddpgraph.bench.varlen import QUICK_LM, CausalLM

    torch.manual_seed(0)
    model = CausalLM(QUICK_LM).eval()
    ids = torch.randint(QUICK_LM.vocab, (2, 5))
    padded = torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    labels = torch.cat([ids, torch.full((2, 3), -100)], dim=1)
    with torch.no_grad():
        assert torch.allclose(model(ids, ids), model(padded, labels), atol=1e-6)


def _bench_on_tiny_disk(tmp_path, *, leave_free_kib: int):
    from .procs import on_tiny_disk

    mount = tmp_path / "tiny"
    bench = f"{sys.executable} -m ddpgraph bench --quick --steps 5 --repeats 1 --out {mount}/b.json"
    job = on_tiny_disk(mount, "256k", f"{bench}; code=$?; echo left: $(ls -A {mount}); exit $code",
                       leave_free_kib=leave_free_kib, timeout=200)  # fmt: skip
    (left,) = [text.split()[1:] for text in job.stdout.splitlines() if text.startswith("left:")]
    return mount, job, left


def _the_one_error_line(job) -> str:
    assert job.returncode == 1, job.stderr[-3000:]
    assert "Traceback" not in job.stderr + job.stdout and "[rank0]" not in job.stderr
    (line,) = [text for text in job.stderr.splitlines() if text.startswith("ddpgraph: error: ")]
    assert job.stderr.rstrip().endswith(
        "(rerun with --debug or DDPGRAPH_DEBUG=1 for the traceback)"
    )
    return line


@pytest.mark.timeout(240)
def test_bench_on_a_full_disk_is_one_line_exit_1_and_nothing_half_written(tmp_path):
    mount, job, left = _bench_on_tiny_disk(tmp_path, leave_free_kib=0)
    assert _the_one_error_line(job) == (
        f"ddpgraph: error: could not write {mount}/b.json: no space left on the device (0.0 MiB "
        "free; [Errno 28] No space left on device). Free space there or pass another --out "
        f"(nothing was written to {mount}/b.json; each finished repeat's times are printed "
        "above); nothing half-written was left."
    )  # the table comes at the end: what is printed is the repeats' lines (issue 50, item 13)
    assert "[bench] MLP 2x64 b8 (quick) 1/1: eager_ddp" in job.stdout  # the results, kept
    assert left == [".fill"]  # no JSON, no partial file


@pytest.mark.timeout(240)
def test_bench_with_no_room_for_the_chart_keeps_the_json_and_the_table(tmp_path):
    mount, job, left = _bench_on_tiny_disk(tmp_path, leave_free_kib=16)
    line = _the_one_error_line(job)
    assert line.startswith(f"ddpgraph: error: could not write {mount}/b.png: no space left on the ")
    assert "| MLP 2x64 b8 (quick) |" in job.stdout  # the table was printed before any write
    assert left == [".fill", "b.json", "b.md"]  # written whole; no partial chart
