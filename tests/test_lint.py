"""ddpgraph lint: every rule against its positive and negative fixtures, the classic programs, the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddpgraph.cli import cli
from ddpgraph.doctor.lint import RULES, LintError, lint_file, lint_source

FIXTURES = Path(__file__).parent / "fixtures" / "lint"
_EXPECT = re.compile(r"#\s*expect:\s*(DG\d+(?:\s*,\s*DG\d+)*)")


def expected(path: Path) -> set[tuple[int, str]]:
    """The (line, code) pairs a fixture announces with ``# expect: DG1xx`` comments."""
    found = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _EXPECT.search(line)
        if match:
            found |= {(number, code.strip()) for code in match.group(1).split(",")}
    return found


def got(path: Path) -> set[tuple[int, str]]:
    return {(f.line, f.code) for f in lint_file(path)}


ALL_FIXTURES = sorted(FIXTURES.glob("*.py"))


@pytest.mark.parametrize("path", ALL_FIXTURES, ids=lambda p: p.name)
def test_fixture_findings_are_exactly_the_announced_ones(path: Path):
    assert got(path) == expected(path)


@pytest.mark.parametrize("code", sorted(RULES))
def test_every_rule_has_a_positive_and_a_clean_negative_fixture(code: str):
    stem = code.lower()
    positives = [p for p in ALL_FIXTURES if p.name.startswith(f"{stem}_positive")]
    negatives = [p for p in ALL_FIXTURES if p.name.startswith(f"{stem}_negative")]
    assert positives and negatives
    assert all(code in {c for _, c in expected(p)} for p in positives)
    assert all(lint_file(p) == [] for p in negatives)


def test_resnet_classic_broken_program():
    assert got(FIXTURES / "resnet_graph_broken.py") == {
        (37, "DG104"),  # for _ in range(3)
        (46, "DG103"),  # with torch.cuda.graph(g): DDP built on the default stream
        (49, "DG106"),  # opt.step() with Adam(lr=1e-3)
        (50, "DG105"),  # static_loss.item()
        (55, "DG108"),  # static_input = data.cuda(...)
        (56, "DG108"),  # static_target = target.cuda(...)
    }
    assert lint_file(FIXTURES / "resnet_graph_fixed.py") == []


def test_gather_classic_broken_programs():
    # DG101 points at the first call that uses the unbound device, not at init_process_group
    # (NCCL makes its communicators lazily, on the device current at the first collective).
    assert got(FIXTURES / "gather_rank_broken.py") == {(21, "DG101"), (21, "DG102")}
    assert got(FIXTURES / "gather_rank_broken_empty.py") == {(11, "DG101"), (13, "DG102")}
    assert lint_file(FIXTURES / "gather_rank_fixed.py") == []


def test_finding_names_what_was_seen_and_the_fix():
    (finding,) = [f for f in lint_file(FIXTURES / "resnet_graph_broken.py") if f.code == "DG104"]
    assert finding.col == 18 and finding.file.endswith("resnet_graph_broken.py")
    assert "3 eager DDP iteration(s)" in finding.message and "line 46" in finding.message
    assert "at least 11" in finding.fix
    (finding,) = [f for f in lint_file(FIXTURES / "resnet_graph_broken.py") if f.code == "DG106"]
    assert "Adam(..., capturable=True)" in finding.fix


WARMUP = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
def f(net, x, s):
    torch.cuda.set_device(0)
    with torch.cuda.stream(s):
        model = DDP(net)
        for _ in range({count}):
            model(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        model(x)
"""


@pytest.mark.parametrize(
    ("count", "flagged"),
    [
        ("0", True),
        ("3", True),
        ("10", True),
        ("11", False),
        ("12", False),
        ("99", True),  # the capture would record iteration 100's timers (facts.py)
        ("100", True),
        ("101", False),
        ("200", True),
        ("5, 16", False),
        ("5, 15", True),
        ("n", False),
    ],
)
def test_warmup_count_boundaries(count: str, flagged: bool):
    codes = [f.code for f in lint_source(WARMUP.format(count=count))]
    assert codes == (["DG104"] if flagged else [])


def test_noqa_silences_one_code_or_all():
    source = WARMUP.format(count="3").replace("range(3):", "range(3):  # noqa: DG104")
    assert lint_source(source) == []
    source = WARMUP.format(count="3").replace("range(3):", "range(3):  # noqa: DG105")
    assert [f.code for f in lint_source(source)] == ["DG104"]


def test_aliases_are_resolved():
    source = """
import torch as th
import torch.distributed as d
def main(rank):
    d.init_process_group("nccl")
    out = [None] * 3
    d.all_gather_object(out, rank)
    th.cuda.set_device(rank)
"""
    assert [(f.line, f.code) for f in lint_source(source)] == [(7, "DG101"), (7, "DG102")]


def test_syntax_error_raises_lint_error_naming_the_file():
    with pytest.raises(LintError, match=r"bad\.py: cannot parse: .* line 1"):
        lint_source("def f(:\n", "bad.py")


# --- the CLI ------------------------------------------------------------------------------------


def test_cli_text_output_and_exit_status():
    result = CliRunner().invoke(cli, ["lint", str(FIXTURES / "gather_rank_broken.py")])
    assert result.exit_code == 1
    assert "gather_rank_broken.py:21:5: DG101" in result.output
    assert "gather_rank_broken.py:21:5: DG102" in result.output
    assert "fix: size it by the group the call uses: [None] * dist.get_world_size(group)" in (
        result.output
    )


def test_cli_clean_file_exits_zero_and_says_so():
    result = CliRunner().invoke(cli, ["lint", str(FIXTURES / "gather_rank_fixed.py")])
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and result.stderr == "no findings in 1 file\n"
    two = CliRunner().invoke(cli, ["lint", *[str(FIXTURES / "gather_rank_fixed.py")] * 2])
    assert two.stderr == "no findings in 2 files\n"


def test_cli_json_output():
    files = [str(FIXTURES / "gather_rank_broken.py"), str(FIXTURES / "resnet_graph_fixed.py")]
    result = CliRunner().invoke(cli, ["lint", "--format", "json", *files])
    assert result.exit_code == 1
    payload = json.loads(result.output)
    assert [(f["line"], f["code"], f["rule"]) for f in payload["findings"]] == [
        (21, "DG101", "unbound-device"),
        (21, "DG102", "object-list-size"),
    ]
    assert set(payload["findings"][0]) == {
        "file",
        "line",
        "col",
        "code",
        "message",
        "fix",
        "rule",
        "severity",
    }
    assert {f["severity"] for f in payload["findings"]} == {"error"}
    assert payload["errors"] == [] and set(payload["rules"]) == set(RULES)


def test_cli_unreadable_and_unparsable_files_exit_two(tmp_path: Path):
    bad = tmp_path / "bad.py"
    bad.write_text("for x in :\n")
    missing = tmp_path / "missing.py"
    result = CliRunner().invoke(cli, ["lint", str(bad), str(missing)])
    assert result.exit_code == 2
    assert f"error: {bad}: cannot parse: invalid syntax at line 1" in result.output
    assert f"error: {missing}: cannot read: No such file or directory" in result.output


def test_cli_directory_is_linted_recursively(tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "job.py").write_text((FIXTURES / "gather_rank_broken.py").read_text())
    result = CliRunner().invoke(cli, ["lint", "--format", "json", str(tmp_path)])
    assert result.exit_code == 1
    assert len(json.loads(result.output)["findings"]) == 2


def test_cli_directory_without_python_files_is_an_error_not_a_pass(tmp_path):
    (tmp_path / "notes.txt").write_text("not python")
    result = CliRunner().invoke(cli, ["lint", str(tmp_path)])
    assert result.exit_code == 2
    assert f"{tmp_path}: is a directory without any *.py file" in result.output


# --- precision: what a rule cannot prove is a note, shown only in strict mode -------------------


def test_a_library_module_is_silent_and_strict_mode_shows_notes():
    library = FIXTURES / "dg101_negative_library.py"
    assert lint_file(library) == []
    notes = lint_file(library, strict=True)
    assert {(f.line, f.code, f.severity) for f in notes} == {
        (16, "DG101", "note"),
        (22, "DG101", "note"),
    }
    assert "its caller must bind the device first" in notes[0].message


def test_an_uncountable_warm_up_is_a_note_in_strict_mode():
    source = WARMUP.format(count="n")
    assert lint_source(source) == []
    (note,) = lint_source(source, strict=True)
    assert (note.code, note.severity, note.line) == ("DG104", "note", 11)
    assert "could not count" in note.message


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match="strict must be a bool, got 'yes'"):
        lint_source("x = 1\n", strict="yes")  # type: ignore[arg-type]


def test_cli_strict_prints_notes_but_exits_zero_without_findings():
    library = str(FIXTURES / "dg101_negative_library.py")
    assert CliRunner().invoke(cli, ["lint", library]).output == "no findings in 1 file\n"
    result = CliRunner().invoke(cli, ["lint", "--strict", library])
    assert result.exit_code == 0, result.output
    assert "dg101_negative_library.py:16:5: DG101 note: dist.all_gather_object()" in result.output
    assert "0 finding(s), 2 note(s)" in result.output


# --- reading files as Python does ---------------------------------------------------------------

BROKEN_GATHER = (
    "import torch.distributed as dist\nout = [None] * 2\ndist.all_gather_object(out, 1)\n"
)


def test_a_utf8_bom_file_parses(tmp_path: Path):
    path = tmp_path / "bom.py"
    path.write_bytes(b"\xef\xbb\xbf" + BROKEN_GATHER.encode())
    assert [(f.line, f.code) for f in lint_file(path)] == [(3, "DG102")]


def test_a_pep263_coding_line_decides_the_encoding(tmp_path: Path):
    path = tmp_path / "latin1.py"
    source = "# -*- coding: latin-1 -*-\n# caf\xe9\n" + BROKEN_GATHER
    path.write_bytes(source.encode("latin-1"))
    assert [(f.line, f.code) for f in lint_file(path)] == [(5, "DG102")]


def test_nul_bytes_name_their_line_and_column(tmp_path: Path):
    path = tmp_path / "nul.py"
    path.write_bytes(b"import os\nx = 1\ny = '\x00'\n")
    with pytest.raises(LintError, match=r"nul\.py: cannot parse: NUL byte at line 3, column 6"):
        lint_file(path)


def test_an_unknown_coding_is_a_read_error(tmp_path: Path):
    path = tmp_path / "odd.py"
    path.write_bytes(b"# -*- coding: no-such-codec -*-\nx = 1\n")
    with pytest.raises(LintError, match=r"odd\.py: cannot read: unknown encoding"):
        lint_file(path)


# ---- DG110: a graph-owned tensor kept across replays without a copy ----

KEPT = """
import torch
def train(model, loader, static_x):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = model(static_x)
        static_loss = static_out.sum()
    kept = []
    total = torch.zeros((), device="cuda")
    for x in loader:
        static_x.copy_(x)
        g.replay()
        {line}
    return kept, total
"""


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("kept.append(static_loss)", True),
        ("kept.append(static_loss.detach())", True),  # .detach() shares the memory
        ("kept.append(static_out.view(-1))", True),
        ("kept.append(static_out[0])", True),
        ("kept.append(static_out.logits)", True),
        ("kept.extend([static_loss])", True),
        ("kept += [static_loss.detach()]", True),
        ("kept.append((len(kept), static_loss))", True),
        ("kept.append({'loss': static_loss, 'n': 1})", True),
        ("kept.append({'loss': static_loss.item()})", False),
        ("kept.append(static_loss.clone())", False),
        ("kept.append(static_loss.detach().clone())", False),
        ("kept.append(static_loss.item())", False),
        ("kept.append(float(static_loss))", False),
        ("kept.append(static_out.tolist())", False),
        ("kept.append(static_out.cpu())", False),
        ("kept.append(static_out.to('cpu'))", False),
        ("kept.append(static_loss * 2)", False),
        ("kept.append(static_out[static_out > 0])", False),  # a mask index copies
        ("kept.append(static_out.shape)", False),
        ("total += static_loss.detach()", False),  # into a fresh tensor
        ("total = total + static_loss", False),
    ],
)
def test_dg110_copies_are_kept_safely_and_views_are_not(line: str, flagged: bool):
    findings = lint_source(KEPT.format(line=line))
    assert [(f.line, f.code) for f in findings] == ([(13, "DG110")] if flagged else [])


def test_dg110_names_the_kept_tensor_its_graph_the_replay_and_the_copy():
    path = FIXTURES / "dg110_positive_accelerate.py"
    (finding,) = lint_file(path)
    line = path.read_text().splitlines()[finding.line - 1].strip()
    assert line == "losses.append(loss.detach())  # expect: DG110"
    assert "loss.detach() (a view of loss, an output of the graph g captured at line 19)" in (
        finding.message
    )
    assert "keeps" in finding.message and "in losses" in finding.message
    assert "g.replay() (line 54) overwrites" in finding.message
    assert finding.fix.startswith("keep a copy: loss.detach().clone()")


def test_dg110_a_name_carried_into_the_next_iteration_names_the_read():
    path = FIXTURES / "dg110_positive.py"
    (finding,) = [f for f in lint_file(path) if f.line == 47]
    assert "'prev' keeps static_loss.detach()" in finding.message
    assert "'prev' read at line 45 holds the new values" in finding.message
    assert finding.fix.startswith("keep a copy: prev = static_loss.detach().clone()")


UPSTREAM = Path(__file__).parents[2] / "shared" / "upstream"
ACCELERATE_GA = (
    UPSTREAM
    / "accelerate_gradient_accumulation_autoregressive"
    / "gradient_accumulation_for_autoregressive_models.py"
)
ACCELERATE_GA_SHA256 = "61a8680c477a1f015ffb69c4d4169b50208449aea159eb97bddf1ea97ed08133"
# The micro-step of the script's loop (lines 244-251), and what a hand port to a CUDA graph makes
# of it: the forward and backward captured once before the loop, replayed on copied-in batches.
_MICRO_STEP = """\
                    outputs = model(**batch, use_cache=False, num_items_in_batch=num_items_in_batch)
                    loss = outputs.loss
"""
_REPLAY = """\
                    for key, value in batch.items():
                        static_batch[key].copy_(value)
                    graph.replay()
"""
_CAPTURE = """\
    total_batched_samples = 0
    static_batch = {k: v.clone() for k, v in next(iter(train_dataloader)).items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = model(**static_batch, use_cache=False)
        loss = outputs.loss * gradient_accumulation_steps * accelerator.num_processes
        accelerator.backward(loss)
"""


def _accelerate_ga_source() -> str:
    import hashlib

    assert ACCELERATE_GA.is_file(), f"{ACCELERATE_GA} is missing: ../shared/upstream holds it"
    data = ACCELERATE_GA.read_bytes()
    assert hashlib.sha256(data).hexdigest() == ACCELERATE_GA_SHA256, "the pinned script changed"
    return data.decode()


def test_dg110_accelerates_script_is_clean_eagerly_and_flagged_once_graphed_by_hand():
    """huggingface/accelerate's gradient_accumulation_for_autoregressive_models.py (pinned):
    appending loss.detach() is right eagerly; once loss is a graph's static output the list holds
    k references to it, and only that line is reported."""
    source = _accelerate_ga_source()
    assert [f for f in lint_source(source, "ga.py") if f.code == "DG110"] == []
    graphed = source.replace("    total_batched_samples = 0\n", _CAPTURE, 1)
    graphed = graphed.replace(_MICRO_STEP, _REPLAY, 1)
    for gone in ("loss = loss * gradient_accumulation_steps", "accelerator.backward(loss)"):
        graphed = graphed.replace(graphed[graphed.index(f"  {gone}") :].split("\n", 1)[0], "", 1)
    assert graphed.count("graph.replay()") == 1 and graphed.count("accelerator.backward") == 1
    lines = graphed.splitlines()
    found = [f for f in lint_source(graphed, "ga.py") if f.code == "DG110"]
    assert [lines[f.line - 1].strip() for f in found] == ["losses.append(loss.detach())"]


KEEPS_THE_GRAD_NORM = """
import torch
from torch import nn
from ddpgraph import TrainStep
from ddpgraph.testing import CpuGraphs

def train(model, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), engine=CpuGraphs(), clip_grad_norm=1.0)
    norms = []
    for x, y in data:
        step(x, y)
        norms.append(step.grad_norm{copy})
    return norms
"""


@pytest.mark.timeout(120)
def test_dg110_what_it_reports_is_real_on_the_cpu_engine_and_the_fix_mends_it():
    """Run the script it flags: on the CPU engine (CUDA's overwrite semantics) the kept
    step.grad_norm of every replayed step is one tensor; with the fix, each step's own norm."""
    from .step_workers import batches, make_model

    data = batches(16, 8)
    runs = {}
    for copy in ("", ".clone()"):
        source = KEEPS_THE_GRAD_NORM.format(copy=copy)
        findings = [(f.line, f.code) for f in lint_source(source)]
        assert findings == ([(13, "DG110")] if copy == "" else [])
        namespace: dict[str, object] = {}
        exec(compile(source, "script.py", "exec"), namespace)
        runs[copy] = namespace["train"](make_model(), data)  # type: ignore[operator]
    replayed = runs[""][12:]  # after the step's default warm-up of 12 eager steps
    assert len({n.data_ptr() for n in replayed}) == 1
    assert len({float(n) for n in replayed}) == 1  # k references, the last values
    assert len({float(n) for n in runs[".clone()"][12:]}) == len(replayed)


def test_dg110_pytorch_docs_whole_network_capture_logging_its_loss():
    """PyTorch's docs, "Whole-network capture" (pytorch_docs_whole_network.py, clean as
    written), with the replay loop logging its mean loss the way an eager loop does: the list
    holds ten references to the one static loss."""
    source = (FIXTURES / "pytorch_docs_whole_network.py").read_text()
    assert lint_source(source) == []
    logged = source.replace("for data, target in zip(", "losses = []\nfor data, target in zip(")
    logged += "    losses.append(static_loss.detach())\nprint(torch.stack(losses).mean().item())\n"
    lines = logged.splitlines()
    findings = lint_source(logged)
    assert [(lines[f.line - 1].strip(), f.code) for f in findings] == [
        ("losses.append(static_loss.detach())", "DG110")
    ]
    (finding,) = findings
    assert "static_loss.detach() (a view of static_loss, an output of the graph g" in (
        finding.message
    )
    assert finding.fix.startswith("keep a copy: static_loss.detach().clone()")


def test_dg110_a_store_into_a_container_lint_cannot_see_built_is_a_strict_note():
    stored = KEPT.replace(
        "def train(model, loader, static_x):", "def train(model, loader, static_x, log):"
    )
    assert lint_source(stored.format(line="log[x] = static_loss")) == []
    (note,) = lint_source(stored.format(line="log[x] = static_loss"), strict=True)
    assert (note.line, note.code, note.severity) == (13, "DG110", "note")
    assert "if log is a list or dict (lint cannot see it built)" in note.message
    # a store into a tensor copies the values: nothing, even in strict mode
    assert lint_source(KEPT.format(line="total[...] = static_loss"), strict=True) == []
