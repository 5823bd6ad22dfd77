"""Public training scripts ported to ddpgraph (examples/ports/) train exactly like the originals.

Each port is run twice under torchrun on 2 CPU ranks (gloo) with a tiny config and the same seed:
``baseline.py`` (the original plus the lines that let it run on the CPU and record its losses) and
``ported.py`` (the baseline moved to ``ddpgraph.init()`` + ``TrainStep``). Their per-iteration
losses must be equal to the bit: on the CPU TrainStep runs the step eagerly, the same kernels in
the same order as the hand-written step (zero_grad, forward, loss, backward, clip, step), and
the random numbers are drawn in the same order (dropout in the forward, then the next batch).
"""

from __future__ import annotations

import hashlib
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PORTS = Path(__file__).resolve().parent.parent / "examples" / "ports"
sys.path.insert(0, str(PORTS))

import port_diffs as diffs  # noqa: E402
import port_runner as runner  # noqa: E402
import run_gpu  # noqa: E402

# iterations rank 0 records with port_runner.py's CPU arguments
ITERATIONS = {"nanogpt": 16, "ddp_tutorial": 16, "imagenet": 10, "llmc": 12}
MAX_PORT_LINES = 15  # lines added by a port (baseline.py -> ported.py); removed lines are free


def _run_both(name: str, tmp_path: Path) -> tuple[runner.Result, runner.Result]:
    port = runner.PORTS_BY_NAME[name]
    # both at once: most of a torchrun's time is start-up and shutdown, not training
    with ThreadPoolExecutor(len(runner.VARIANTS)) as pool:
        results = tuple(
            pool.map(
                lambda v: runner.run(port, v, tmp_path / v, nproc=2, mode="cpu", timeout=200),
                runner.VARIANTS,
            )
        )
    for result in results:
        assert result.error is None, f"{name}/{result.variant}: {result.error}"
        assert len(result.losses) == ITERATIONS[name], result.losses
    return results  # type: ignore[return-value]


@pytest.mark.timeout(240)  # two torchruns of 2 ranks each on a loaded 2-core machine
@pytest.mark.parametrize("name", ["nanogpt", "imagenet", "llmc"])
def test_port_trains_bit_for_bit_like_the_original_on_two_cpu_ranks(name, tmp_path):
    baseline, ported = _run_both(name, tmp_path)
    assert ported.losses == baseline.losses
    assert len(set(baseline.losses)) > 1  # it trains: the losses move


@pytest.mark.timeout(240)
def test_ddp_tutorial_port_runs_like_the_original_whose_loss_is_always_zero(tmp_path):
    # multigpu_torchrun.py trains Linear(20, 1) with F.cross_entropy on (batch, 1) float targets:
    # a softmax over one class, so its loss and gradients are 0 and the model never changes.
    # The comparison checks the plumbing (sampler, epochs, snapshot, launch), not numerics.
    baseline, ported = _run_both("ddp_tutorial", tmp_path)
    assert ported.losses == baseline.losses == [0.0] * ITERATIONS["ddp_tutorial"]
    assert (tmp_path / "ported" / "snapshot.pt").exists()  # saved from the bare module


@pytest.mark.timeout(240)
def test_imagenet_port_matches_under_the_scripts_own_spawn_launch_used_on_the_gpu(tmp_path):
    # run_gpu.py's imagenet command (--multiprocessing-distributed, world size 1), on the CPU:
    # the GPU-only flags overridden at the end. Without baseline.py's seed in main_worker the two
    # runs started from different weights (spawned workers do not inherit main()'s seed).
    port = runner.PORTS_BY_NAME["imagenet"]
    cpu = ("--dist-backend=gloo", "--dummy-samples=16", "--image-size=32", "-b", "4", "-j", "0")
    with ThreadPoolExecutor(len(runner.VARIANTS)) as pool:
        baseline, ported = pool.map(
            lambda v: runner.run(
                port, v, tmp_path / v, nproc=1, mode="gpu", timeout=200, extra=cpu
            ),
            runner.VARIANTS,
        )
    assert baseline.error is None and ported.error is None, (baseline.error, ported.error)
    assert len(baseline.losses) == 4
    assert ported.losses == baseline.losses


@pytest.mark.parametrize("name", sorted(runner.PORTS_BY_NAME))
def test_port_diffs_are_current_and_small(name):
    for kind, diff in diffs.port_diffs(name).items():
        committed = (PORTS / name / f"{kind}.diff").read_text()
        assert committed == diff.text, (
            f"run python examples/ports/port_diffs.py ({name}/{kind}.diff)"
        )
    assert diffs.port_diffs(name)["ported"].added <= MAX_PORT_LINES


@pytest.mark.parametrize("name", sorted(runner.PORTS_BY_NAME))
def test_originals_are_verbatim_with_licence_and_source(name):
    original = PORTS / name / "original"
    source = (original / "SOURCE.md").read_text()
    assert re.search(r"Commit: [0-9a-f]{40}", source) and "https://github.com/" in source
    recorded = dict(
        (file, digest) for digest, file in re.findall(r"^ {4}([0-9a-f]{64})  (\S+)$", source, re.M)
    )
    files = {p.name for p in original.iterdir() if p.name != "SOURCE.md"}
    assert set(recorded) == files and "LICENSE" in files
    for file, digest in recorded.items():
        assert hashlib.sha256((original / file).read_bytes()).hexdigest() == digest, file


def test_every_port_has_its_three_scripts():
    for name, port in runner.PORTS_BY_NAME.items():
        assert (PORTS / name / "original" / port.original).exists()
        for variant in runner.VARIANTS:
            assert port.script(variant).exists(), (name, variant)


def test_gpu_report_compares_loss_curves_and_survives_missing_runs():
    same = run_gpu.compare([3.0, 2.0, 1.0], [3.0, 2.0, 1.0])
    assert same["bitwise_equal"] and same["max_abs_diff"] == 0.0 and same["iterations"] == 3
    close = run_gpu.compare([3.0, 2.0, float("nan")], [3.0, 2.002])
    assert not close["bitwise_equal"] and not close["same_length"] and close["iterations"] == 2
    assert close["max_rel_diff"] == pytest.approx(0.001)
    assert run_gpu.compare([], [1.0]) == {"iterations": 0}  # a failed run: no comparison


def test_only_torchs_abort_at_exit_is_run_again_and_the_result_says_so(monkeypatch, tmp_path):
    """A worker aborting as its interpreter exits (torch's own teardown race; seen in 1 of 12
    runs of the unmodified nanoGPT baseline, and twice in a row in one CI run) is run again, up
    to twice; every other failure stands."""

    def fake_runs(*outcomes):
        calls = iter(outcomes)

        def once(port, variant, *args):
            error, tail = next(calls)
            return runner.Result(
                port.name, variant, 1 if error else 0, 1.0, [1.0], None, error, tail
            )

        return once

    port = runner.PORTS_BY_NAME["nanogpt"]
    aborted = ("exit 1: Signal 6 (SIGABRT)", f"... {runner.TEARDOWN_ABORT}\n...")
    monkeypatch.setattr(runner, "_run_once", fake_runs(aborted, (None, None)))
    result = runner.run(port, "baseline", tmp_path, nproc=2, mode="cpu", timeout=5)
    assert result.error is None and "SIGABRT" in result.retried
    monkeypatch.setattr(runner, "_run_once", fake_runs(aborted, aborted, (None, None)))
    result = runner.run(port, "baseline", tmp_path, nproc=2, mode="cpu", timeout=5)
    assert result.error is None and result.retried.startswith("2 run(s) died at exit")
    monkeypatch.setattr(runner, "_run_once", fake_runs(aborted, aborted, aborted))
    result = runner.run(port, "baseline", tmp_path, nproc=2, mode="cpu", timeout=5)
    assert "SIGABRT" in result.error  # an abort on the last run is the result
    other = ("exit 1: RuntimeError: boom", "Traceback ... RuntimeError: boom")
    monkeypatch.setattr(runner, "_run_once", fake_runs(other, (None, None)))
    result = runner.run(port, "baseline", tmp_path, nproc=2, mode="cpu", timeout=5)
    assert result.error == other[0] and result.retried is None
