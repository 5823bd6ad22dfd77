"""FSDP2 feature matrix (issue 31, item 5): pytorch/examples' FSDP2 example (pinned, unchanged
model and Checkpointer) run as written and ported to TrainStep, each row bit for bit equal to the
plain FSDP2 loop (losses, grad norms, evaluations, whole parameters, optimizer state), eagerly
and graphed on the CPU stand-in engine, on 2 and 3 gloo ranks. The 3-rank rows that load start
from a checkpoint the 2-rank plain run saved (resume at another world size)."""

from __future__ import annotations

import pytest
import torch

from ddpgraph import ConfigError
from ddpgraph.testing import run_distributed

from . import fsdp2_matrix_workers as w
from .test_objects import assert_same_error_everywhere

pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.timeout(1800)  # the fixture runs the whole matrix: 2 x ~30 runs

# name -> the row's feature; "graphs": whether the CPU stand-in must replay (False: the row is
# one FSDP2 cannot capture, run eagerly with the reason in report().fallbacks)
TWO_RANKS = [
    {"name": "example"},
    {"name": "mixed-precision", "mp": True},
    {"name": "explicit-prefetch", "prefetch": True},
    {"name": "explicit-prefetch+mixed-precision", "prefetch": True, "mp": True},
    {"name": "reshard-after-forward-false", "reshard": False},
    {"name": "reshard-after-forward-int-1", "reshard": 1},
    {"name": "no-clip", "clip": None},
    {"name": "adamw-weight-decay", "optimizer": "adamw"},
    {"name": "set-requires-gradient-sync-2", "calls": 2},
    {"name": "set-requires-gradient-sync-3", "calls": 3, "graphs": False},
    {"name": "accumulate-2", "split": 2},
    {"name": "scheduler", "scheduler": True},
    {"name": "lr-set-by-hand", "lr_by_hand": True},
    {"name": "frozen-parameter", "frozen": True},
    {"name": "evaluation", "eval_every": 3},
    {"name": "dropout", "dropout": 0.1},
    {"name": "checkpoint-dtensor-api", "save": True, "api": "dtensor"},
    {"name": "checkpoint-dcp-api", "save": True, "api": "dcp", "mp": True},
]
THREE_RANKS = [
    {"name": "3-example"},
    {"name": "3-explicit-prefetch+mixed-precision", "prefetch": True, "mp": True},
    {"name": "3-resume-dtensor-api-from-2", "load": "checkpoint-dtensor-api", "api": "dtensor"},
    {"name": "3-resume-dcp-api-from-2", "load": "checkpoint-dcp-api", "api": "dcp", "mp": True},
]
ROWS = {row["name"]: row for row in TWO_RANKS + THREE_RANKS}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fsdp2-matrix"))
    two = run_distributed(w.run_rows, 2, args=(TWO_RANKS, directory), timeout=850)
    three = run_distributed(w.run_rows, 3, args=(THREE_RANKS, directory), timeout=850)
    return {name: [r[name] for r in two] for name in two[0]} | {
        name: [r[name] for r in three] for name in three[0]
    }


def _equal(name: str, ours: dict, theirs: dict) -> None:
    for key in ("losses", "norms", "evals", "params", "state"):
        assert len(ours[key]) == len(theirs[key]), (name, key)
        for i, (a, b) in enumerate(zip(ours[key], theirs[key])):
            a, b = torch.as_tensor(a), torch.as_tensor(b)
            assert torch.equal(a, b), (name, key, i, (a.float() - b.float()).abs().max())


# The 3-rank resumes gave a NaN first loss until the graph-safe Adam took the foreach path:
# loading into an optimizer with no state steps it once at LR 0 with zero gradients, where
# torch's for-loop capturable Adam makes zero-moment elements NaN (pytorch#126514)
@pytest.mark.parametrize("name", list(ROWS))
def test_each_fsdp2_feature_trains_bit_for_bit_like_the_plain_example(matrix, name):
    row = ROWS[name]
    for runs in matrix[name]:  # every rank
        _equal(name, runs["eager"], runs["plain"])
        _equal(name, runs["graphed"], runs["plain"])
        mode, replays, fallbacks = runs["graphed"]["report"]
        if row.get("graphs", True):
            assert mode == "graphed" and replays > 0, (mode, replays, fallbacks)
        else:
            assert mode == "eager" and any("accumulate_calls=3" in f for f in fallbacks)


def test_the_matrix_has_at_least_twenty_rows_on_two_and_three_ranks():
    assert len(ROWS) >= 20 and THREE_RANKS and TWO_RANKS


def test_sync_off_kept_around_step_without_accumulate_calls_is_refused_on_every_rank():
    results = run_distributed(
        w.refuse_sync_off_without_accumulate_calls, 2, timeout=200, return_exceptions=True
    )
    assert_same_error_everywhere(
        results, ConfigError, "set_requires_gradient_sync(False)", "accumulate_calls=k"
    )
