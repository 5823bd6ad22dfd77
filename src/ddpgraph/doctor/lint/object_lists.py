"""DG102: the output list of ``all_gather_object`` / ``gather_object`` must have one entry per
rank of the group the call uses.

torch raises at a shorter length and leaves silent trailing ``None`` entries at a longer one, so
the length must be derived from that group's world size: ``dist.get_world_size(group)``. A list
of a fixed size (``[None] * 2``, ``[None for _ in gather_objects]`` over a 3-entry list), and
``[None] * dist.get_world_size()`` (the default group's size) passed with ``group=`` (PyTorch's
own checkpoint bug, pytorch/pytorch#135045) are findings. A length the rule cannot trace (a
parameter, a variable named ``world_size`` next to a subgroup) is a note in strict mode.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, replace

from .astutil import Module, arg, dotted, int_value, reaching_value, text
from .core import Report

_DEFAULT = "<default group>"
_AMBIGUOUS = "<a world size of some group>"
_FIX = (
    "size it by the group the call uses: [None] * dist.get_world_size(group) (or use "
    "ddpgraph.all_gather_object, which returns the list)"
)
_MAX_DEPTH = 4


@dataclass(frozen=True)
class _Size:
    """What a list length is: ``fixed`` entries, the world size of ``group`` (+ ``offset``), or
    ``None`` for both when it cannot be traced (``how`` says what was seen)."""

    how: str
    fixed: int | None = None
    group: str | None = None
    offset: int = 0


def check_object_list_size(mod: Module, report: Report) -> None:
    for call in (n for n in ast.walk(mod.tree) if isinstance(n, ast.Call)):
        name = mod.call_name(call)
        if name == "torch.distributed.all_gather_object":
            output, group, func = (
                arg(call, 0, "object_list"),
                arg(call, 2, "group"),
                "all_gather_object",
            )
        elif name == "torch.distributed.gather_object":
            output, group, func = (
                arg(call, 1, "object_gather_list"),
                arg(call, 3, "group"),
                "gather_object",
            )
        else:
            continue
        if output is None:
            continue
        used = _group_text(group)
        for size in _list_sizes(mod, output, call, 0):
            verdict = _judge(size, used)
            if verdict is None:
                continue
            proven, problem = verdict
            message = (
                f"{func}() gets an output list {problem}; torch needs exactly one entry per rank "
                f"of {'the default group' if used == _DEFAULT else 'group ' + used} and raises "
                "at a shorter length or leaves silent None entries at a longer one"
            )
            if proven:
                report.finding(call, "DG102", message, _FIX)
            else:
                report.note(call, "DG102", message, _FIX)
            break


def _group_text(group: ast.expr | None) -> str:
    if group is None or (isinstance(group, ast.Constant) and group.value is None):
        return _DEFAULT
    name = text(group)
    if name.endswith(("group.WORLD", "GroupMember.WORLD")):
        return _DEFAULT
    return name


def _judge(size: _Size, used: str) -> tuple[bool, str] | None:
    """(proven, what is wrong) or None when the size is right."""
    if size.fixed is not None:
        return True, f"{size.how} of {size.fixed} entries, not derived from the world size"
    if size.group is None:
        return False, f"{size.how}, whose length could not be traced to the world size"
    if size.group == _AMBIGUOUS:
        if used == _DEFAULT and size.offset:
            return True, f"{size.how} of world size {size.offset:+d} entries"
        if used != _DEFAULT:
            return False, f"{size.how}, not shown to be the size of group {used}"
        return None
    if size.group == used:
        if size.offset:
            return used == _DEFAULT, f"{size.how} of world size {size.offset:+d} entries"
        return None
    sized_by = "the default group" if size.group == _DEFAULT else f"group {size.group}"
    if size.group == _DEFAULT or used == _DEFAULT:
        return True, f"{size.how}, sized by the world size of {sized_by}"
    return False, f"{size.how}, sized by {sized_by}"  # two names may be one group


def _list_sizes(mod: Module, expr: ast.expr, at: ast.AST, depth: int) -> Iterator[_Size]:
    """Every size the list ``expr`` may have (an ``a if c else b`` has two)."""
    if depth > _MAX_DEPTH:
        return
    shown = text(expr)
    if isinstance(expr, ast.IfExp):
        yield from _list_sizes(mod, expr.body, at, depth + 1)
        yield from _list_sizes(mod, expr.orelse, at, depth + 1)
    elif isinstance(expr, ast.Constant) and expr.value is None:
        return  # gather_object on a rank that is not the destination
    elif isinstance(expr, (ast.List, ast.Tuple)) and not any(
        isinstance(e, ast.Starred) for e in expr.elts
    ):
        yield _Size(shown if expr.elts else f"{shown} (empty)", fixed=len(expr.elts))
    elif isinstance(expr, ast.Call) and dotted(expr.func) == "list" and not expr.args:
        yield _Size("list() (empty)", fixed=0)
    elif isinstance(expr, ast.Call) and dotted(expr.func) == "list" and len(expr.args) == 1:
        yield replace(_collection_size(mod, expr.args[0], at, depth + 1), how=shown)
    elif isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult):
        yield _repeated(mod, expr, at, depth)
    elif (
        isinstance(expr, ast.ListComp) and len(expr.generators) == 1 and not expr.generators[0].ifs
    ):
        yield replace(_collection_size(mod, expr.generators[0].iter, at, depth + 1), how=shown)
    elif isinstance(expr, ast.Name):
        value = reaching_value(mod, expr.id, at)
        if value is None:
            yield _Size(f"{shown} (made elsewhere, or in one branch only)")
        else:
            for size in _list_sizes(mod, value, at, depth + 1):
                yield _Size(f"{shown} = {size.how}", size.fixed, size.group, size.offset)
    else:
        yield _Size(shown)


def _repeated(mod: Module, expr: ast.BinOp, at: ast.AST, depth: int) -> _Size:
    for lst, count in ((expr.left, expr.right), (expr.right, expr.left)):
        if isinstance(lst, ast.List) and not any(isinstance(e, ast.Starred) for e in lst.elts):
            size = _count(mod, count, at, depth + 1)
            if size.fixed is not None:
                return _Size(text(expr), fixed=size.fixed * len(lst.elts))
            if len(lst.elts) == 1:
                return _Size(text(expr), None, size.group, size.offset)
    return _Size(text(expr))


def _collection_size(mod: Module, expr: ast.expr, at: ast.AST, depth: int) -> _Size:
    """The length of what a comprehension iterates over."""
    if isinstance(expr, ast.Call) and dotted(expr.func) == "range" and not expr.keywords:
        if len(expr.args) == 1:
            return _count(mod, expr.args[0], at, depth)
        if len(expr.args) == 2 and int_value(mod, expr.args[0]) == 0:
            return _count(mod, expr.args[1], at, depth)
        return _Size(text(expr))
    sizes = list(_list_sizes(mod, expr, at, depth))
    return sizes[0] if len(sizes) == 1 else _Size(text(expr))


def _count(mod: Module, expr: ast.expr, at: ast.AST, depth: int) -> _Size:
    """What a number of entries is: a literal, a world size (of which group), or unknown."""
    shown = text(expr)
    value = int_value(mod, expr)
    if value is not None:
        return _Size(shown, fixed=value)
    if depth > _MAX_DEPTH:
        return _Size(shown)
    if isinstance(expr, ast.Call):
        return _call_count(mod, expr, at, depth)
    if isinstance(expr, ast.IfExp):  # `group.size() if group is not None else world_size()`
        sizes = [_count(mod, branch, at, depth + 1) for branch in (expr.body, expr.orelse)]
        if all(size.group is not None and not size.offset for size in sizes):
            named = [size.group for size in sizes if size.group not in (_DEFAULT, _AMBIGUOUS)]
            return _Size(shown, group=named[0] if named else _AMBIGUOUS)
        return _Size(shown)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Add, ast.Sub)):
        sign = 1 if isinstance(expr.op, ast.Add) else -1
        left, right = int_value(mod, expr.left), int_value(mod, expr.right)
        if right is not None:
            base = _count(mod, expr.left, at, depth + 1)
            if base.group is not None:
                return _Size(shown, None, base.group, base.offset + sign * right)
        if left is not None and sign == 1:
            base = _count(mod, expr.right, at, depth + 1)
            if base.group is not None:
                return _Size(shown, None, base.group, base.offset + left)
        return _Size(shown)
    if any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and "WORLD_SIZE" in n.value
        for n in ast.walk(expr)
    ):
        return _Size(shown, group=_DEFAULT)  # the launcher's WORLD_SIZE: the default group
    if isinstance(expr, ast.Name):
        value_expr = reaching_value(mod, expr.id, at)
        if value_expr is not None:
            found = _count(mod, value_expr, at, depth + 1)
            if found.fixed is not None or found.group is not None:
                return found
        if "world" in expr.id.lower():
            return _Size(shown, group=_AMBIGUOUS)
    if isinstance(expr, ast.Attribute) and (
        "world" in expr.attr.lower() or expr.attr == "num_processes"
    ):
        return _Size(shown, group=_AMBIGUOUS)
    return _Size(shown)


def _call_count(mod: Module, call: ast.Call, at: ast.AST, depth: int) -> _Size:
    shown = text(call)
    name = mod.call_name(call) or dotted(call.func) or ""
    last = name.rpartition(".")[2]
    group = arg(call, 0, "group")
    if last == "get_world_size" and group is None:
        # no group given: torch's, or a project's wrapper (detectron2's comm, composer's dist)
        # that can only mean the default group's size
        return _Size(shown, group=_DEFAULT)
    if last.endswith(("world_size", "pg_size", "group_size")):
        return _Size(shown, group=_AMBIGUOUS if group is None else _group_text(group))
    if last in ("get_global_size", "num_processes"):
        return _Size(shown, group=_AMBIGUOUS)
    if isinstance(call.func, ast.Attribute) and last == "size" and not call.args:
        return _Size(shown, group=_group_text(call.func.value))  # ProcessGroup.size()
    if name == "len" and len(call.args) == 1:
        return _collection_size(mod, call.args[0], at, depth + 1)
    if name == "int" and len(call.args) == 1:
        return _count(mod, call.args[0], at, depth + 1)
    return _Size(shown)
