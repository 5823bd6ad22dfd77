"""benchmarks/upstream_ports.py (issue 52's GPU figures: the five pinned scripts as written
against their ports) on the CPU: every part but the GPU. The intervals it keeps and the report it
parses, on synthetic timestamps and a real TrainStep's report; and the one command itself with
``--device cpu --size tiny`` (gloo, the port on ``CpuGraphs``, one process a run) on three of
the scripts, its JSON read back. No test here asserts on a time."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from . import upstream

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _bench():
    spec = importlib.util.spec_from_file_location(
        "upstream_ports", ROOT / "benchmarks" / "upstream_ports.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_step_ms_keeps_full_batch_intervals_of_one_epoch_after_the_warmup():
    """Updates every 10 ms, but 500 ms into each epoch's first (its evaluation) and 3 ms into
    its short last one: only the intervals between full batches of one epoch, after the
    warm-up, are kept."""
    bench = _bench()
    per_epoch, epochs, times, now = 5, 4, [], 0.0
    for n in range(per_epoch * epochs):
        place = n % per_epoch
        now += 0.5 if place == 0 else 0.003 if place == per_epoch - 1 else 0.010
        times.append(now)
    found = bench.step_ms(times, per_epoch, last_short=True, warmup=6)
    # updates 7..20: kept are 7->8, 8->9 (epoch 2), 11->12, 12->13, 13->14, 16->17, 17->18, 18->19
    assert found["intervals"] == 8 and found["updates"] == 20
    assert found["all_ms"] == pytest.approx([10.0] * 8)
    assert found["median_ms"] == pytest.approx(10.0) and found["steps_per_s"] == pytest.approx(100)
    whole = bench.step_ms(times, per_epoch, last_short=False, warmup=6)
    assert whole["intervals"] == 11 and sorted(whole["all_ms"])[:3] == pytest.approx([3.0] * 3)
    assert bench.step_ms(times[:6], per_epoch, last_short=True, warmup=6)["median_ms"] is None


def test_parse_report_reads_a_real_steps_report():
    """A TrainStep on the CPU engine, 20 steps of two shapes: its own report's text parsed into
    the numbers the JSON keeps; and that report with a second capture, a re-capture, a fallback
    and fp16's skipped steps added (``StepReport``'s own text for each)."""
    from ddpgraph import TrainStep
    from ddpgraph.testing import CpuGraphs

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, opt, torch.nn.functional.cross_entropy, warmup=3, engine=CpuGraphs())
    for n in range(20):
        rows = 8 if n < 10 else 6  # a new shape: run eagerly at first
        step(torch.randn(rows, 4), torch.randint(3, (rows,)))
    report = step.report()
    found = _bench().parse_report(str(report))
    assert found["steps"] == 20 and found["warm-up"] == 3 and found["mode"] == step.mode
    assert found["replays"] + found["eager"] == 20 and found["replays"] > 0
    assert found["captures"] == len(report.captures) >= 1
    assert found["replayed"] == pytest.approx(found["replays"] / 20)
    assert found["engine"] == "cpu-recorded" and found["fallbacks"] == found["recaptures"] == 0
    more = dataclasses.replace(
        report, captures=report.captures * 2, recaptures=["the LR's tensor moved"],
        fallbacks=["a host read"], skipped_steps=3,
    )  # fmt: skip
    found = _bench().parse_report(str(more))
    assert (found["captures"], found["recaptures"], found["fallbacks"]) == (2, 1, 1)
    assert found["replayed_uncaptured"] == pytest.approx((found["replays"] - 2) / 20)
    assert found["skipped (fp16 overflow)"] == 3 and found["steps"] == 20
    assert _bench().parse_report("") == {}


def test_the_command_refuses_what_it_cannot_run(capsys, monkeypatch):
    bench = _bench()
    for argv, said in (
        (["--device", "cpu", "--scripts", "glue,bert"], "--scripts 'glue,bert'"),
        (["--device", "cpu", "--precisions", "fp16"], "--precisions 'fp16'"),
        (["--device", "cpu", "--size", "script"], "--size tiny"),
        (["--cv-model", "test_resnet"], "--cv-model is for a smoke run on the CPU"),
    ):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert said in capsys.readouterr().err
    monkeypatch.setattr(upstream, "UPSTREAM", Path("/nonexistent/upstream"))
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu"])
    assert "no pinned scripts at /nonexistent/upstream" in capsys.readouterr().err
    monkeypatch.undo()
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.main(["--scripts", "glue"])
        assert "no CUDA device" in capsys.readouterr().err


def test_the_command_times_the_scripts_and_their_ports_on_the_cpu(tmp_path):
    """The command as the GPU runs it, on the CPU at the tests' sizes, fp32: for each script a
    run as written (its optimizer untouched) and its port, only timestamps recorded, the port's
    report parsed; the numbers of updates and kept intervals are those of the runs' sizes."""
    for package in ("accelerate", "transformers", "timm", "torchvision"):
        pytest.importorskip(package)
    upstream.script("timm_train", "train.py")  # skips (with the reason) without ../shared
    out = tmp_path / "ports.json"
    argv = ["--device", "cpu", "--scripts", "cv,glue,timm,torchvision", "--precisions", "fp32"]
    _bench().main([*argv, "--out", str(out)])
    found = json.loads(out.read_text())
    assert found["size"] == "tiny" and found["device"] == "cpu"
    assert "skipped" in found["scripts"]["cv"]
    # one rank: glue 24 batches of 4 an epoch, timm 20 (-b 4), torchvision 14 (the last of 2)
    for name, updates, intervals in (("glue", 48, 34), ("timm", 40, 26), ("torchvision", 28, 12)):
        script = found["scripts"][name]
        runs = script["fp32"]
        assert script["timed"]["script"] in ("original", "untouched"), script["timed"]
        for role in ("script", "port"):
            assert runs[role]["updates"] == updates == script["updates_expected"], (name, role)
            assert runs[role]["intervals"] == intervals, (name, role, runs[role]["intervals"])
            assert runs[role]["median_ms"] > 0 and len(runs[role]["all_ms"]) == intervals
        assert runs["script"]["report"] == ""  # the script as written has no TrainStep
        report = runs["report"]
        assert report["replays"] > 0 and report["engine"] == "cpu-recorded", runs["port"]
        assert report["replays"] + report["eager"] == report["steps"]
        assert runs["port_vs_script"] == pytest.approx(
            runs["script"]["median_ms"] / runs["port"]["median_ms"]
        )


def test_a_failed_run_is_kept_and_the_others_still_run(tmp_path, monkeypatch):
    """A run that raises (as torchvision's --amp port may on the GPU) leaves its error in the
    JSON, written after each precision; the script's own run is still timed."""
    pytest.importorskip("torchvision")
    upstream.script("torchvision_classification", "train.py")  # skips without ../shared
    bench = _bench()
    saved = []

    def time_one(plan, base, script, variant, flags, device):
        if variant == "port":
            raise RuntimeError("the port failed")
        return {"times": [0.01 * n for n in range(28)], "printed": [], "report": ""}

    monkeypatch.setattr(bench, "time_one", time_one)
    result: dict = {}
    bench.run_script("torchvision", ["fp32", "amp"], "tiny", "cpu", "", result,
                     lambda: saved.append(json.dumps(result)))  # fmt: skip
    assert len(saved) == 2 and json.loads(saved[0]).keys() >= {"fp32", "timed"}
    for precision in ("fp32", "amp"):
        runs = result[precision]
        assert runs["port"]["error"] == "RuntimeError: the port failed"
        assert runs["port"]["median_ms"] is None and runs["port_vs_script"] is None
        assert runs["script"]["median_ms"] == pytest.approx(10.0)
        assert runs["script"]["intervals"] == 12 and runs["report"] == {}
