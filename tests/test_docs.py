"""Every ```python block in README.md and docs/ runs, so no snippet has an undefined name.

A page's blocks run in order as one script (a later block may use what an earlier one defined),
in a fresh process with the page's own working directory, as ``python page.py``: what a reader
gets by pasting the page's code into a file. Lines that are not code are blanked, so a traceback's
line number is the line in the Markdown file. A block preceded by ``<!-- skip: reason -->`` is not
run (for code that needs a GPU, several hosts or a command line); the reason is required.

The pages run concurrently, two at a time (much of their time is process start-up), started
when the first page's test asks for them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import _LAUNCHER_VARS
from .procs import child_env

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^( *)```(\S*)\s*$")  # also inside a list item, indented
SKIP = re.compile(r"^<!--\s*skip:\s*(\S.*?)\s*-->$")
PAGE_TIMEOUT_S = 150


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the first code line
    language: str
    code: list[str]
    skip: str | None  # the reason, when marked


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` with their language and skip mark."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        before = next((s.strip() for s in reversed(lines[:i]) if s.strip()), "")
        mark = SKIP.match(before)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        indent = len(opening.group(1))
        code = [line[indent:] for line in lines[i + 1 : end]]
        found.append(Block(page, i + 2, opening.group(2), code, mark and mark[1]))
        i = end + 1
    return found


def script(page: Path) -> str | None:
    """The page's runnable Python blocks as one script, each code line at its Markdown line."""
    out = [""] * len(page.read_text().splitlines())
    runnable = [b for b in blocks(page) if b.language == "python" and b.skip is None]
    for block in runnable:
        out[block.line - 1 : block.line - 1 + len(block.code)] = block.code
    return "\n".join(out) + "\n" if runnable else None


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


RUNNABLE = [page for page in PAGES if script(page) is not None]


def _run(page: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    path = workdir / (_name(page).replace("/", "_").removesuffix(".md") + ".py")
    path.write_text(script(page) or "")
    env = {k: v for k, v in child_env(OMP_NUM_THREADS="1").items() if k not in _LAUNCHER_VARS}
    return subprocess.run(
        [sys.executable, path.name],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory: pytest.TempPathFactory):
    """Start every page at once (three run at a time) and hand each test its own page's result."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs: dict[Path, Future[subprocess.CompletedProcess[str]]] = {
            page: pool.submit(_run, page, tmp_path_factory.mktemp(page.stem)) for page in RUNNABLE
        }
        yield runs


@pytest.mark.timeout(PAGE_TIMEOUT_S * len(RUNNABLE) + 30)
@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_page_code_runs(page: Path, page_runs) -> None:
    proc = page_runs[page].result()
    assert proc.returncode == 0, f"{_name(page)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"


def test_every_python_block_runs_or_says_why_not() -> None:
    all_blocks = [b for page in PAGES for b in blocks(page)]
    assert [b for b in all_blocks if b.language in ("py", "python3", "pycon")] == []
    marked = [b for b in all_blocks if b.skip is not None]
    assert all(b.language == "python" for b in marked), "a skip mark only makes sense on python"
    # skipping is the exception: GPU-, multi-host- or command-line-only code
    assert len(marked) <= 6, [f"{_name(b.page)}:{b.line} {b.skip}" for b in marked]


def test_code_on_the_site_fits_80_columns() -> None:
    """Wider code scrolls sideways next to the site's two sidebars on a laptop screen."""
    pages = [page for page in PAGES if page.parent != ROOT]
    wide = [
        f"{_name(b.page)}:{b.line + i}"
        for page in pages
        for b in blocks(page)
        for i, line in enumerate(b.code)
        if len(line) > 80
    ]
    assert wide == []


def test_readme_is_short_with_lines_of_at_most_100_characters() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 1500
    long = [i for i, line in enumerate(text.splitlines(), 1) if len(line) > 100]
    assert long == []


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert ".venv/bin/python -m pytest -q" in readme
    assert "\npython -m pytest -q\n" in ci


def test_graph_auto_on_a_machine_without_cuda_is_eager_without_a_warning_as_the_guides_say():
    # the framework guides and graphed-training.md: eager, the reason in report().fallbacks
    import warnings

    import torch
    from torch import nn

    from ddpgraph import TrainStep

    if torch.cuda.is_available():
        pytest.skip("the promise is about a machine without CUDA")
    model = nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
        step(torch.randn(3, 4), torch.randn(3, 2))
    assert step.mode == "eager" and "not CUDA" in step.report().fallbacks[0]


@pytest.mark.timeout(PAGE_TIMEOUT_S + 30)
def test_the_transformers_guide_runs_without_transformers_config_warnings(tmp_path) -> None:
    """A reader who runs the guide sees its output, not transformers' complaints about the
    snippet's own config (GPT-2's special tokens outside a tiny vocabulary, its unmapped loss
    type: issue 50)."""
    proc = _run(ROOT / "docs" / "guides" / "transformers.md", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Model config" not in proc.stderr and "loss_type" not in proc.stderr, proc.stderr
