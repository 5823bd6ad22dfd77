"""ddpgraph lint on real code: a corpus of public, permissively licensed files with every finding
labelled after reading the code (tests/fixtures/lint/real/labels.json)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

from ddpgraph.doctor.lint import Finding, lint_paths

CORPUS = Path(__file__).parent / "fixtures" / "lint" / "real"
LICENSES = {"MIT", "BSD-3-Clause", "Apache-2.0"}
MAX_FALSE_POSITIVE_RATE = 0.05
MAX_BYTES = 3_000_000

Key = tuple[str, int, str]


def manifest() -> list[dict[str, str]]:
    return json.loads((CORPUS / "corpus.json").read_text())["files"]


def labels() -> dict[str, list[dict[str, object]]]:
    return json.loads((CORPUS / "labels.json").read_text())


@cache
def corpus_findings() -> tuple[Finding, ...]:
    files = [CORPUS / entry["file"] for entry in manifest()]
    findings, errors = lint_paths(files)
    assert errors == [], [str(e) for e in errors]
    return tuple(findings)


def key(finding: Finding) -> Key:
    return (Path(finding.file).relative_to(CORPUS).as_posix(), finding.line, finding.code)


def label_key(entry: dict[str, object]) -> Key:
    return (str(entry["file"]), int(str(entry["line"])), str(entry["code"]))


def test_the_corpus_is_real_permissive_attributed_and_small():
    entries = manifest()
    on_disk = {
        p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*.py") if p.name != "conftest.py"
    }
    assert on_disk == {e["file"] for e in entries}
    assert len(entries) >= 100
    assert len({e["repo"] for e in entries}) >= 10
    for entry in entries:
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]), entry
        assert entry["license"] in LICENSES, entry
        stored = f"{entry['repo'].replace('/', '__')}/{entry['path']}"
        assert entry["file"] == stored or "renamed" in entry.get("note", ""), entry
    sources = (CORPUS / "SOURCES.md").read_text()
    assert all(
        f"| {e['repo']} | `{e['commit'][:12]}` | {e['license']} |" in sources for e in entries
    )
    assert all(f"`{e['path']}`" in sources for e in entries)
    assert sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file()) < MAX_BYTES


def test_every_known_bug_in_the_corpus_is_found():
    found = {key(f) for f in corpus_findings()}
    missing = [label_key(e) for e in labels()["must_find"] if label_key(e) not in found]
    assert missing == []


def test_every_finding_is_labelled_and_every_label_is_still_found():
    found = {key(f) for f in corpus_findings()}
    labelled = {label_key(e) for e in labels()["findings"]}
    assert sorted(found - labelled) == [], "unlabelled findings: read the code and label them"
    assert sorted(labelled - found) == [], "labels of findings lint no longer makes"


def test_false_positive_rate_is_at_most_five_percent():
    verdicts = {label_key(e): e["label"] for e in labels()["findings"]}
    assert set(verdicts.values()) <= {"true", "defensible", "false"}
    found = [key(f) for f in corpus_findings()]
    false = [k for k in found if verdicts.get(k) == "false"]
    assert len(false) <= MAX_FALSE_POSITIVE_RATE * len(found), false


@pytest.mark.parametrize("section", ["findings", "before"])
def test_every_label_gives_a_reason(section: str):
    for entry in labels()[section]:
        assert entry["label"] in ("true", "defensible", "false") and len(str(entry["reason"])) > 20


# ---- DG109 on the llm.c port (examples/ports/llmc, karpathy/llm.c's train_gpt2.py, MIT) ----

LLMC = Path(__file__).parent.parent / "examples" / "ports" / "llmc"


def _llmc_ported_without_defer_update() -> str:
    """examples/ports/llmc/ported.py as a first port would be: accumulate_calls without
    defer_update=True, the loop's optimizer.step() line dropped (the step updates itself)."""
    ported = (LLMC / "ported.py").read_text()
    naive = ported.replace("\n                           defer_update=True, amp=", "\n"
                           "                           amp=")  # fmt: skip
    naive = naive.replace("        train_step.update()\n", "")
    assert naive.count("\n") == ported.count("\n") - 1, "ported.py changed: update this edit"
    return naive


def test_lint_finds_the_llmc_loops_lr_set_after_the_window_and_names_defer_update():
    from ddpgraph.doctor.lint import lint_source

    source = _llmc_ported_without_defer_update()
    findings = [f for f in lint_source(source, "train_gpt2.py") if f.code == "DG109"]
    assert [source.splitlines()[f.line - 1].strip() for f in findings] == ["param_group['lr'] = lr"]
    (finding,) = findings
    assert "one step late" in finding.message and "defer_update=True" in finding.fix
    assert "train_step.update()" in finding.fix


def test_the_llmc_port_as_written_and_its_originals_have_no_dg109():
    files = [LLMC / "ported.py", LLMC / "baseline.py", LLMC / "original" / "train_gpt2.py"]
    findings, errors = lint_paths(files)
    assert errors == [] and [f for f in findings if f.code == "DG109"] == []
    assert not [f for f in corpus_findings() if f.code == "DG109"]  # none in the real corpus
