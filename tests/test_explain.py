"""errors.explain(): known error texts map to a cause and a fix; `ddpgraph explain` prints them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddpgraph.cli import cli
from ddpgraph.errors import Explanation, explain, with_explanation

# Texts as torch / NCCL print them (abridged), and the title each must map to.
KNOWN = [
    (
        "RuntimeError: CUDA error: operation would make the legacy stream depend on a capturing "
        "blocking stream",
        "DDP (or other work) on the default stream while capturing",
    ),
    (
        "RuntimeError: CUDA error: operation failed due to a previous error during capture",
        "capture aborted by an earlier error",
    ),
    (
        "RuntimeError: CUDA error: operation not permitted when stream is capturing\n"
        "  File ddp.py, in _pre_forward: set_runtime_stats_and_log",
        "a host synchronisation inside CUDA-graph capture",
    ),
    (
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, invalid "
        "usage, NCCL version 2.21.5\nncclInvalidUsage: This usually reflects invalid usage of "
        "NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA "
        "device 1000",
        "two ranks on one GPU",
    ),
    (
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
        "OpType=ALLGATHER, Timeout(ms)=600000) ran for 600027 milliseconds before timing out.",
        "a collective timed out",
    ),
    (
        "Process hangs forever in torch.distributed.all_gather_object(output, obj)",
        "object collective failure or hang",
    ),
    (
        "RuntimeError: [third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:22408: Connection reset by peer.",
        "a peer rank is gone",
    ),
    (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
        "waiting 1800000ms for recv operation to complete; Connection closed by peer "
        "[10.0.0.2]:4721",
        "a peer rank is gone",
    ),
    (
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "illegal memory access",
    ),
    (
        "RuntimeError: Attempting CUDA graph capture of step() for an instance of AdamW but "
        "param_groups' capturable is False.",
        "optimizer not capturable",
    ),
    (
        "AssertionError: If capturable=False, state_steps should not be CUDA tensors.",
        "optimizer not capturable",
    ),
]


@pytest.mark.parametrize(("text", "title"), KNOWN, ids=[t for _, t in KNOWN])
def test_known_texts_are_explained(text: str, title: str):
    found = explain(text)
    assert isinstance(found, Explanation)
    assert found.title == title
    assert found.cause and found.fix and found.matched.lower() in text.lower()


def test_capture_error_explains_the_ddp_warmup_rule():
    found = explain("operation not permitted when stream is capturing")
    assert found is not None
    assert "at least 11" in found.fix and "multiple of 100" in found.fix
    assert "every 100th" in found.cause


def test_root_cause_wins_over_its_consequence():
    log = (
        "CUDA error: operation failed due to a previous error during capture\n"
        "... earlier: CUDA error: operation would make the legacy stream depend on a capturing "
        "blocking stream"
    )
    found = explain(log)
    assert found is not None and "torch.cuda.graph(g, stream=s)" in found.fix


def test_unknown_text_is_not_explained():
    assert explain("ValueError: shapes (3,) and (4,) not aligned") is None
    assert explain("") is None


def test_with_explanation_appends_to_known_messages_only():
    exc = RuntimeError("CUDA error: an illegal memory access was encountered")
    text = with_explanation(exc)
    assert text.startswith("CUDA error: an illegal memory access was encountered\n\n")
    assert "ddpgraph explains: illegal memory access" in text and "fix: " in text
    assert with_explanation(ValueError("plain")) == "plain"


SRC = Path(__file__).resolve().parents[1] / "src"


def _modules_after(statement: str) -> str:
    """Run ``statement`` in a fresh interpreter on this checkout; print which heavy modules loaded."""
    code = f"import sys; {statement}; print(sorted({{'rich', 'click', 'ddpgraph.doctor', 'ddpgraph.cli'}} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return out.stdout.strip()


def test_errors_module_stays_light():
    assert _modules_after("import ddpgraph.errors") == "[]"


def test_import_ddpgraph_does_not_import_cli_side():
    assert _modules_after("import ddpgraph") == "[]"
    assert _modules_after("import ddpgraph.cli") != "[]"  # the probe itself can see them


def test_cli_explain_argument():
    result = CliRunner().invoke(cli, ["explain", "ncclInvalidUsage: Duplicate GPU detected"])
    assert result.exit_code == 0
    assert result.output.startswith("two ranks on one GPU\ncause: ")
    assert "torch.cuda.set_device(local_rank)" in result.output


def test_cli_explain_reads_stdin():
    log = "Traceback ...\nRuntimeError: Watchdog caught collective operation timeout: ...\n"
    result = CliRunner().invoke(cli, ["explain", "-"], input=log)
    assert result.exit_code == 0
    assert result.output.startswith("a collective timed out\n")


def test_cli_explain_unknown_exits_one():
    result = CliRunner().invoke(cli, ["explain", "something else entirely"])
    assert result.exit_code == 1
    assert "No known explanation" in result.output
