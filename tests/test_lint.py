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


def test_cli_clean_file_exits_zero():
    result = CliRunner().invoke(cli, ["lint", str(FIXTURES / "gather_rank_fixed.py")])
    assert result.exit_code == 0, result.output
    assert result.output == ""


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
