"""errors.explain(): known error texts map to a cause and a fix; `ddpgraph explain` prints them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddpgraph._known_errors import squeezed_regex
from ddpgraph.cli import cli
from ddpgraph.errors import KNOWN as TABLE
from ddpgraph.errors import Explanation, explain, explain_exception, with_explanation
from ddpgraph.facts import WARMUP_RULE

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
        "a forbidden call inside CUDA-graph capture",
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
        "optimizer step counters on the GPU of a non-capturable optimizer",
    ),
]


@pytest.mark.parametrize(("text", "title"), KNOWN, ids=[t for _, t in KNOWN])
def test_known_texts_are_explained(text: str, title: str):
    found = explain(text)
    assert isinstance(found, Explanation)
    assert found.title == title
    assert found.cause and found.fix
    assert found.matched.lower() in " ".join(text.split()).lower()


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
    assert result.output.startswith("a collective timed out: 2 possible causes")


def test_cli_explain_unknown_exits_one():
    result = CliRunner().invoke(cli, ["explain", "something else entirely"])
    assert result.exit_code == 1
    assert "No known explanation" in result.output


# --- real error texts from public issues ---------------------------------------------------

CORPUS = json.loads(
    (Path(__file__).parent / "fixtures" / "explain" / "real_errors.json").read_text("utf-8")
)["texts"]


@pytest.mark.parametrize(
    "entry", CORPUS, ids=[e["source"].split("github.com/")[-1] for e in CORPUS]
)
def test_real_error_text_is_recognised_with_its_cause(entry: dict[str, str]):
    found = explain(entry["text"])
    assert found is not None, entry["source"]
    assert found.id == entry["expected"], (entry["source"], found.id)
    cause_ids = [c.id for c in found.causes]
    if "first" in entry:
        assert cause_ids[0] == entry["first"], (entry["source"], cause_ids)
    if "thread_cause" in entry:  # not visible in the text: it must at least be listed
        assert entry["thread_cause"] in cause_ids, (entry["source"], cause_ids)


def test_corpus_is_large_sourced_and_covers_every_known_error_it_names():
    assert len(CORPUS) >= 40
    assert all(e["source"].startswith("https://github.com/") and e["text"] for e in CORPUS)
    known = {k.id: {c.id for c in k.causes} for k in TABLE}
    for entry in CORPUS:
        assert entry["expected"] in known, entry
        for key in ("first", "thread_cause"):
            assert entry.get(key, entry["expected"]) in known[entry["expected"]] | {
                entry["expected"]
            }, entry


# --- matching across wraps, and which cause wins ----------------------------------------------


def test_a_message_wrapped_inside_a_word_is_recognised():
    text = "Exception occurred. If capturable=False, state_steps shou\nld not be CUDA tensors."
    found = explain(text)
    assert found is not None and found.id == "optimizer-step-on-cuda"
    assert found.matched == "If capturable=False, state_steps shou ld not be CUDA tensors"


def test_the_capturable_error_wrapped_over_two_lines_is_recognised():
    text = (
        "RuntimeError: Attempting CUDA graph capture of step() for an instance of AdamW\n"
        "but param_groups' capturable is False."
    )
    found = explain(text)
    assert found is not None and found.id == "optimizer-not-capturable"
    assert "capturable=True" in found.fix


def test_rich_traceback_frames_and_rank_prefixes_do_not_split_a_message():
    rich = (
        "│ AssertionError: If capturable=True, params and state_steps must │\n"
        "│ be CUDA tensors.                                               │"
    )
    assert getattr(explain(rich), "id", None) == "capturable-needs-cuda"
    prefixed = "[rank3]: ncclUnhandledCudaError: Call to CUDA function\n[rank3]: failed."
    assert getattr(explain(prefixed), "id", None) == "nccl-cuda-error"


def test_a_remote_exit_on_a_network_fault_wins_over_the_timeout_it_causes():
    log = (
        "[E ProcessGroupNCCL.cpp:455] Some NCCL operations have failed or timed out.\n"
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)\n"
        "NCCL error: remote process exited or there was a network error\n"
        "Last error: NET/IB : Got completion from peer 10.0.0.2<3913> with error 12, vendor err 129"
    )
    found = explain(log)
    assert found is not None and found.id == "peer-gone"
    assert [c.id for c in found.causes] == ["network-fault", "remote-exited"]
    assert "raise the timeout" not in found.render()


def test_an_out_of_memory_rank_wins_over_the_connections_it_closes():
    log = (
        "NCCL WARN socketProgress: Connection closed by remote peer node2<51159>\n"
        "NCCL WARN Cuda failure 'out of memory'"
    )
    assert getattr(explain(log), "id", None) == "oom"


def test_illegal_memory_access_from_the_nccl_watchdog_blames_kernels_and_p2p_before_graphs():
    watchdog = (
        "[PG ID 0 PG GUID 0(default_pg) Rank 2] Process group watchdog thread terminated with "
        "exception: CUDA error: an illegal memory access was encountered"
    )
    found = explain(watchdog)
    assert found is not None
    assert [c.id for c in found.causes] == ["kernel-before", "nccl-p2p", "graph-memory"]
    assert "CUDA_LAUNCH_BLOCKING=1" in found.fix
    replay = "g.replay()\nRuntimeError: CUDA error: an illegal memory access was encountered"
    assert explain(replay).causes[0].id == "graph-memory"  # type: ignore[union-attr]


CAPTURE = "RuntimeError: CUDA error: operation not permitted when stream is capturing"


@pytest.mark.parametrize(
    ("context", "first"),
    [
        ("  File distributed.py, in _pre_forward\n    set_runtime_stats_and_log()", "ddp-warmup"),
        ("    loss_value = loss.item()", "host-sync"),
        (  # a host sync inside a DDP model's forward is no DDP warm-up problem
            '  File "torch/nn/parallel/distributed.py", line 1643, in forward\n'
            "    return self._run_ddp_forward(*inputs, **kwargs)\n"
            '  File "model.py", line 12, in forward\n    if mask.sum().item() > 0:',
            "host-sync",
        ),
        (
            "    hidden_states[mask] if compact else hidden_states.reshape(-1, h)",
            "data-dependent-shape",
        ),
        ("    y = x[:, ~attention_mask.bool()]", "data-dependent-shape"),
        ("    kept = labels[labels != -100]", "data-dependent-shape"),
        ("    idx, = torch.where(torch.eq(expert, 3))", "data-dependent-shape"),
        ("    rows = scores.masked_select(keep)", "data-dependent-shape"),
        ("    if torch.is_nonzero(flag):", "host-sync"),  # a truth test, not a shape
        ("    y = torch.where(mask, x, 0)", "ddp-warmup"),  # three arguments: a fixed shape
        ("    y = x[:, :mask_len]", "ddp-warmup"),  # a slice
        ("model on cuda:1, capture stream on the current device", "device-mismatch"),
        ("Warp CUDA error 900 (in function cuda_load_module)", "uncaptured-setup"),
        ("", "ddp-warmup"),  # no evidence: the table's order, DDP's warm-up count first
    ],
)
def test_capture_errors_list_every_cause_with_the_evident_one_first(context: str, first: str):
    found = explain(f"{context}\n{CAPTURE}")
    assert found is not None and found.id == "capture-not-permitted"
    ids = [c.id for c in found.causes]
    assert ids[0] == first
    assert sorted(ids) == [
        "data-dependent-shape",
        "ddp-warmup",
        "device-mismatch",
        "host-sync",
        "uncaptured-setup",
    ]
    assert all(c.tell for c in found.causes)


class _Loss:
    def item(self) -> float:
        raise RuntimeError(f"CUDA error: {CAPTURE.split('CUDA error: ')[1]}")


def test_explain_exception_reads_the_traceback_to_order_the_causes():
    try:
        _Loss().item()  # the frame that shows the host sync
    except RuntimeError as exc:
        found = explain_exception(exc)
        explained = with_explanation(exc)
    assert found is not None and found.causes[0].id == "host-sync"
    assert explain(CAPTURE).causes[0].id == "ddp-warmup"  # type: ignore[union-attr]
    assert "ddpgraph explains: a forbidden call inside CUDA-graph capture" in explained
    assert explained.index("host synchronisation") < explained.index("DDP timing")


def test_explain_exception_finds_the_first_error_of_a_failed_capture_in_its_chain():
    # torch.cuda.graph's __exit__ raises "previous error during capture" over the first error
    try:
        try:
            _Loss().item()
        except RuntimeError:  # torch chains it implicitly (__context__), as here
            raise RuntimeError(  # noqa: B904
                "CUDA error: operation failed due to a previous error during capture"
            )
    except RuntimeError as exc:
        found = explain_exception(exc)
    assert found is not None and found.id == "capture-not-permitted"
    assert found.causes[0].id == "host-sync"


def test_torchs_cuda_error_boilerplate_is_no_evidence():
    boilerplate = (
        "CUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.\nFor debugging consider passing "
        "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side "
        "assertions."
    )
    replay = f"    g.replay()\nRuntimeError: CUDA error: an illegal memory access was encountered\n{boilerplate}"
    assert explain(replay).causes[0].id == "graph-memory"  # type: ignore[union-attr]
    capture = explain(f"{CAPTURE}\n{boilerplate}")
    assert capture is not None and capture.causes == explain(CAPTURE).causes  # type: ignore[union-attr]


def test_the_warmup_cause_quotes_the_shared_rule():
    found = explain(CAPTURE)
    assert found is not None and WARMUP_RULE in found.causes[0].fix


def test_store_barrier_timeout_reads_worker_count_against_world_size():
    text = (
        "Timed out initializing process group in store based barrier on rank: 0, for key: "
        "store_based_barrier_key:1 (world_size={}, worker_count={}, timeout=0:30:00)"
    )
    assert explain(text.format(8, 9)).causes[0].id == "too-many-workers"  # type: ignore[union-attr]
    assert explain(text.format(8, 7)).causes[0].id == "missing-workers"  # type: ignore[union-attr]


def test_render_lists_every_cause_with_how_to_tell_them_apart():
    found = explain(CAPTURE)
    assert found is not None
    text = found.render()
    assert text.startswith("a forbidden call inside CUDA-graph capture: 5 possible causes")
    for number, cause in enumerate(found.causes, start=1):
        assert f"{number}. {cause.title}\n   cause: {cause.cause}\n   fix: {cause.fix}" in text
        assert f"how to tell: {cause.tell}" in text


def test_patterns_cannot_use_escapes_that_lowering_would_invert():
    with pytest.raises(ValueError, match=r"upper-case escape"):
        squeezed_regex(r"Connection\Sreset")
    assert squeezed_regex(r"Remote Process \d").search("remoteprocess7")


def test_every_known_pattern_and_cause_is_complete():
    ids = [k.id for k in TABLE]
    assert len(ids) == len(set(ids))
    for known in TABLE:
        assert known.causes and known.title
        cause_ids = [c.id for c in known.causes]
        assert len(cause_ids) == len(set(cause_ids))
        for cause in known.causes:
            assert cause.title and cause.cause and cause.fix
            assert len(known.causes) == 1 or cause.tell, (known.id, cause.id)


# --- the CLI reads files as Python reads source, and stdin --------------------------------------


def test_cli_explain_prints_all_causes():
    result = CliRunner().invoke(cli, ["explain", CAPTURE])
    assert result.exit_code == 0
    found = explain(CAPTURE)
    assert found is not None and result.output == found.render() + "\n"
    assert result.output.count("how to tell: ") == 5


@pytest.mark.parametrize(
    ("data", "name"),
    [
        ("\ufeffncclInvalidUsage: Duplicate GPU detected\n".encode(), "bom"),
        (
            "# -*- coding: latin-1 -*-\n# caf\u00e9\nncclInvalidUsage: Duplicate GPU detected\n".encode(
                "latin-1"
            ),
            "pep263",
        ),
        (b"\xff\xfe garbage\nncclInvalidUsage: Duplicate GPU detected\n", "undecodable"),
    ],
)
def test_cli_explain_reads_a_file_as_tokenize_open_does(tmp_path: Path, data: bytes, name: str):
    log = tmp_path / f"{name}.log"
    log.write_bytes(data)
    result = CliRunner().invoke(cli, ["explain", str(log)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("two ranks on one GPU\ncause: ")


def test_cli_explain_reports_an_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    log = tmp_path / "secret.log"
    log.write_text("ncclInvalidUsage")

    def denied(self: Path) -> bytes:  # chmod 0 does not stop root, who runs these tests
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    result = CliRunner().invoke(cli, ["explain", str(log)])
    assert result.exit_code == 1
    assert "secret.log" in result.output and "Permission denied" in result.output


def test_cli_explain_refuses_a_missing_file_or_a_directory_instead_of_reading_its_name(tmp_path):
    missing = tmp_path / "nonexistent.log"
    for source in (str(missing), "nonexistent.log", "logs/rank0.txt"):
        result = CliRunner().invoke(cli, ["explain", source])
        assert result.exit_code == 2, (source, result.output)
        assert f"Invalid value for 'SOURCE': no file {source} (looked in " in result.output
        assert "No known explanation" not in result.output
    result = CliRunner().invoke(cli, ["explain", f"{tmp_path}/"])
    assert result.exit_code == 2
    assert f"{tmp_path}/ is a directory; pass a log file in it" in result.output
    # a message of one word is still a message
    result = CliRunner().invoke(cli, ["explain", "ncclInvalidUsage"])
    assert result.exit_code in (0, 1) and "Invalid value" not in result.output


def test_cli_explain_reads_stdin_bytes_with_a_bom():
    data = "\ufeffRuntimeError: Address already in use\n".encode()
    result = CliRunner().invoke(cli, ["explain", "-"], input=data)
    assert result.exit_code == 0
    assert result.output.startswith("rendezvous port already in use: 2 possible causes")


def test_cli_explain_treats_a_long_message_as_text_not_a_path():
    message = "x" * 5000 + " Default process group has not been initialized"
    result = CliRunner().invoke(cli, ["explain", message])
    assert result.exit_code == 0 and "torchrun" in result.output


def test_trls_fused_lm_head_mask_index_is_named_first_through_ddp(tmp_path: Path):
    """TRL's fused LM-head loss scores only the valid positions on CUDA (`hidden_states[mask]`):
    a capture through it fails in that line, inside DDP's forward. The line from the installed
    TRL, run as the frame that raises, must put the data-dependent shape first, not DDP."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    source = Path(trl_utils.__file__).read_text("utf-8").splitlines()
    line = next(i for i, text in enumerate(source) if "hidden_states[mask] if compact" in text)
    # code compiled as TRL's file, raising at that line what CUDA raises there: the traceback
    # shows TRL's own text for the frame, read from the installed file
    body = "\n" * line + "raise RuntimeError(f'CUDA error: {CAPTURE}')"
    code = compile(body, trl_utils.__file__, "exec")
    try:
        exec(code, {"CAPTURE": CAPTURE.split("CUDA error: ")[1]})
    except RuntimeError as exc:
        found = explain_exception(exc)
    assert found is not None and found.id == "capture-not-permitted"
    assert found.causes[0].id == "data-dependent-shape", [c.id for c in found.causes]
