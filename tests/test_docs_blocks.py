"""A Python block of the docs that uses a name an earlier block defines says so on its first line
(``# continues the block under "Section" (names)``): pasted alone it would fail with a
NameError, and the reader needs to know which block to paste first. tests/test_docs.py runs the
blocks of a page together; this reads each block alone, without running it."""

from __future__ import annotations

import ast
import builtins

import pytest

from .test_docs import PAGES, ROOT, Block, blocks

MARK = "# continues "


def _defined(tree: ast.AST) -> set[str]:
    """Every name the block binds: imports, definitions, assignments, arguments, handlers."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def _free_names(block: Block) -> list[str]:
    """The names ``block`` reads but neither binds nor gets from Python's builtins."""
    tree = ast.parse("\n".join(block.code))
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(read - _defined(tree) - set(dir(builtins)))


def _continued_blocks() -> list[tuple[str, Block]]:
    found = []
    for page in PAGES:
        runnable = [b for b in blocks(page) if b.language == "python" and b.skip is None]
        found += [(page.relative_to(ROOT).as_posix(), b) for b in runnable[1:]]
    return found


@pytest.mark.parametrize(
    ("page", "block"), _continued_blocks(), ids=lambda v: v if isinstance(v, str) else str(v.line)
)
def test_a_block_that_needs_an_earlier_one_names_it_on_its_first_line(page, block):
    free = _free_names(block)
    first = block.code[0].strip() if block.code else ""
    if free:
        assert first.startswith(MARK), f"{page}:{block.line} uses {free} from an earlier block"
        said = " ".join(line.strip().lstrip("#") for line in block.code if line.startswith("#"))
        assert all(name in said for name in free), f"{page}:{block.line}: name {free}"
    else:
        assert not first.startswith(MARK), f"{page}:{block.line} runs alone: drop the mark"
