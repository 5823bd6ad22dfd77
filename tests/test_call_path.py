"""The replayed call's path held to a budget (issue 51, stage 0): the ddpgraph calls, frames and
modules one replayed ``step(x, y)`` runs around the CPU engine's recorded program, counted by
``benchmarks/probes/callpath_probe.py`` at 2 and 50 layers (one gloo rank, DDP, SGD).

Counts, not time (deterministic for one Python version): each stage of the call-path plan
(``reviews/call-path-turn7.md`` §5) lowers the budget to what it reached; a change that lengthens
the replayed path, or makes it grow with the model, fails here."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

import ddpgraph.step
from ddpgraph.testing import run_distributed

pytestmark = pytest.mark.timeout(600)  # a 50-layer capture on a loaded 2-core machine

PROBE = Path(__file__).resolve().parent.parent / "benchmarks" / "probes" / "callpath_probe.py"

# the budget of the tree as it stands (issue 51's targets: frames 3, calls 12, modules 5, growth 0)
FRAMES = 3  # ddpgraph frames from TrainStep.__call__ to the engine's replay, that one included
CALLS = 8  # ddpgraph calls around the recorded program's replay at 2 layers (outside + inside);
# stage 1 (59 before): the front tests attributes, make_batch computes the signature once (46);
# stage 2: one Guard checked once before the replay, none inside the engine (35);
# stage 3: the runner replays from its own frame after the pure decide (11);
# the LR and the script's sync flags tested in C-level passes, the watchdog read, no call (8)
MODULES = 6  # the ddpgraph modules they live in (8 before optim's sync_lr and ddp's script_sync)
GROWTH = 0  # calls at 50 layers - calls at 2 layers: the guard reads the model in C-level passes
CLASS_LINES = 300  # the longest class in step/ (issue 51's target; Runner was 603, TrainStep 324)
# a replayed step(data) (one step per replay): TrainStep.__call__ -> _run_data -> DataFeed.run ->
# Runner.train -> the replay (feed.py and data/device_data.py beside step(x, y)'s modules); 4
# frames, 25 calls and 9 modules while the feed checked and built the DeviceData's batch on every
# call and staged, checked and restored the LR through a context manager with no scheduler too
DATA_FRAMES, DATA_CALLS, DATA_MODULES = 5, 12, 7


def _probe(layers: list[int], feed: str = "batch") -> list[dict[str, Any]]:
    spec = importlib.util.spec_from_file_location("callpath_probe", PROBE)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return [probe.probe(n, feed=feed) for n in layers]


@pytest.fixture(scope="module")
def counts() -> dict[int, dict[str, Any]]:
    (rows,) = run_distributed(_probe, 1, args=([2, 50],), timeout=540)
    return {row["layers"]: row for row in rows}


@pytest.fixture(scope="module")
def data_counts() -> dict[int, dict[str, Any]]:
    (rows,) = run_distributed(_probe, 1, args=([2, 50], "data"), timeout=540)
    return {row["layers"]: row for row in rows}


def _shown(row: dict[str, Any]) -> str:
    return "\n".join(["outside the replay:", *row["path"], "inside:", *row["inside"]])


def test_the_replayed_call_keeps_to_its_frame_and_call_budget(counts):
    small = counts[2]
    assert small["frames"] is not None, "the probe never reached the engine's replay"
    assert small["frames"] <= FRAMES, _shown(small)
    assert small["calls"] <= CALLS, _shown(small)
    assert len(small["modules"]) <= MODULES, small["modules"]


def test_the_replayed_call_grows_no_more_than_its_budget_with_the_model(counts):
    small, large = counts[2], counts[50]
    assert large["frames"] == small["frames"]
    assert large["calls"] - small["calls"] <= GROWTH, _shown(large)
    assert len(large["modules"]) <= MODULES, large["modules"]


def test_a_replayed_step_data_keeps_to_its_budget_at_every_model_size(data_counts):
    """``step(data)``, the path the guides give a host-bound small model, held like
    ``step(x, y)``: its frames, calls and modules, the same at 2 and 50 layers."""
    small, large = data_counts[2], data_counts[50]
    assert small["frames"] is not None, "the probe never reached the engine's replay"
    assert small["frames"] <= DATA_FRAMES, _shown(small)
    assert small["calls"] <= DATA_CALLS, _shown(small)
    assert len(small["modules"]) <= DATA_MODULES, small["modules"]
    assert (large["frames"], large["calls"]) == (small["frames"], small["calls"]), _shown(large)


def test_no_class_in_step_is_longer_than_its_budget():
    """Each class of ``ddpgraph/step/`` (its sub-packages included) spans at most ``CLASS_LINES``
    lines, docstrings and comments counted: a responsibility that outgrows it gets a module."""
    package = Path(ddpgraph.step.__file__).parent
    long = [
        f"{path.relative_to(package)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(package.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > CLASS_LINES
    ]
    assert not long, f"classes over {CLASS_LINES} lines: {long}"


def _step_imports(module: str) -> set[str]:
    """The ``ddpgraph.step`` modules ``step/<module>.py`` imports when it runs (relative
    imports; those under ``if TYPE_CHECKING:`` are for the type checker only)."""
    tree = ast.parse((Path(ddpgraph.step.__file__).parent / f"{module}.py").read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    return {
        node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1 and id(node) not in typing_only
    }


def test_the_engines_meet_only_in_the_protocol_and_the_shared_key_table():
    """Issue 51 stage 4: the CPU engine does not build on the CUDA one (it imports nothing of
    ``graphs.py``), and the protocol module imports no other part of the step but ``batch``."""
    assert "graphs" not in _step_imports("cpu_graphs"), _step_imports("cpu_graphs")
    assert {"engine", "graph_table"} <= _step_imports("cpu_graphs")
    assert {"engine", "graph_table"} <= _step_imports("graphs")
    assert _step_imports("engine") == {"batch"}, _step_imports("engine")


def test_the_host_time_probe_runs_on_this_tree(tmp_path):
    """``benchmarks/probes/cpu_host_time.py`` reaches into the CPU engine to make its recorded
    program a no-op: a rename there must fail here, not in the next session that measures (it
    once read an attribute stage 4 renamed). A few calls only; the figures are not judged."""
    from .procs import run_python

    out = tmp_path / "host.json"
    probe = str(PROBE.with_name("cpu_host_time.py"))
    done = run_python([probe, "2", "--out", str(out)], timeout=400, env={"N": "5", "REPS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["layers"] == 2 and row["added_us"] > 0 and row["bare_us"] > 0, row


def test_the_host_time_parts_probe_runs_on_this_tree(tmp_path):
    """``benchmarks/probes/host_time_parts.py`` times a replayed call's parts on the step's own
    objects (the runner, its guard, engine and hooks): run on the CPU engine, as the GPU run will
    reach them, so that a rename fails here. A few calls only; the figures are not judged."""
    from .procs import run_python

    out = tmp_path / "parts.json"
    probe = str(PROBE.with_name("host_time_parts.py"))
    args = [probe, "--calls", "5", "--width", "32", "--out", str(out)]
    done = run_python(args, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text())["median_host_us"]
    assert set(found) >= {"step_call", "make_batch", "guard", "key_decide", "clone"}, found
    assert all(value > 0 for value in found.values()), found


def test_a_keys_plain_leaves_equal_and_hash_as_the_reports_named_ones():
    """A replayed call builds its signature's leaves as plain tuples (a C-level zip: a named
    tuple's constructor is a Python frame per tensor); ``report().captures`` shows them named
    (``signature.leaves[0].shape``). Both forms must find the same graph."""
    import torch

    from ddpgraph.step.batch import Leaf, make_batch, named

    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    plain = make_batch((x, y), min_positional=2).signature
    shown = named(plain)
    assert shown == plain and hash(shown) == hash(plain)
    assert {plain: "graph"}[shown] == "graph"
    assert all(type(leaf) is Leaf for leaf in shown.leaves)
    assert shown.leaves[0].shape == (4, 8) and shown.leaves[1].dtype == torch.int64


def _members(cls: type) -> set[str]:
    """The public names a class body states: its annotated attributes and its functions."""
    own = set(inspect.get_annotations(cls)) | {
        name for name, value in vars(cls).items() if callable(value)
    }
    return {name for name in own if not name.startswith("_")}


def test_every_wrapper_member_belongs_to_a_protocol_and_the_step_holds_only_protocols():
    """Issue 51 stage 5: what the step uses of a data-parallel wrapper is stated by three
    protocols (``GradSync``, ``CaptureGate``, ``Recovery``), the base implements exactly their
    members, and outside ``parallel/`` only the run context (which hands the one wrapper out as
    each protocol) names the class itself."""
    from ddpgraph.step.parallel import CaptureGate, DataParallel, GradSync, Recovery
    from ddpgraph.step.parallel.ddp import DDP
    from ddpgraph.step.parallel.fsdp2 import FSDP2
    from ddpgraph.step.parallel.local import Local

    stated = _members(GradSync) | _members(CaptureGate) | _members(Recovery)
    assert _members(DataParallel) == stated, _members(DataParallel) ^ stated
    for wrapper in (DDP, FSDP2, Local):
        extra = {n for n in _members(wrapper) if n not in stated}
        assert extra <= {"ddp", "root"}, f"{wrapper.__name__}: {extra}"  # their own handles
    package = Path(ddpgraph.step.__file__).parent
    naming = sorted(
        path.stem
        for path in package.glob("*.py")
        if "DataParallel"
        in {
            a.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom)
            for a in node.names
        }
    )
    assert naming == ["run_context"], naming
