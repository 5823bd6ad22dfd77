"""DG109: the LR set after a window's calls of a ``TrainStep(accumulate_calls=k)``.

With ``accumulate_calls`` the window's last call steps the optimizer inside the step. A loop in
llm.c's order (the micro-step loop, then ``param_group["lr"] = lr``, then ``optimizer.step()``)
so trains each window with the LR set for the one before: one step late, with no error.
``defer_update=True`` leaves the update to ``step.update()``, called where the loop stepped the
optimizer, and the LR set in between applies (docs/guides/real-loops.md). Found: a TrainStep
built with ``accumulate_calls`` other than 1 and without ``defer_update=True``, called in an
inner loop, and a param group's ``"lr"`` assigned after that inner loop in the same iteration
of the loop around it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .astutil import Module, int_value, kwarg, position, text, walk_local
from .core import Report

_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def check_lr_after_window(mod: Module, report: Report) -> None:
    for name, built in _steps_without_deferred_update(mod):
        for call in _calls_of(mod, name, mod.scope_of(built)):
            for assignment in _lr_set_after_the_window(mod, call):
                report.finding(
                    assignment,
                    "DG109",
                    f"the LR is set here, after the window's calls of {name} (line "
                    f"{call.lineno}), but {name} was built with accumulate_calls and without "
                    "defer_update (line "
                    f"{built.lineno}): the window's last call already stepped the optimizer, so "
                    "this LR reaches only the next window, one step late",
                    f"build it with defer_update=True and call {name}.update() where the loop "
                    "stepped the optimizer (after this line), as llm.c's loop does; or set the "
                    "LR before the window's first call",
                )


def _steps_without_deferred_update(mod: Module) -> Iterator[tuple[str, ast.Call]]:
    """(name, construction) of each TrainStep that accumulates over calls and updates in them."""
    for node in ast.walk(mod.tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        call = node.value
        qualname = mod.call_name(call) or ""
        if qualname != "TrainStep" and not qualname.endswith(".TrainStep"):
            continue
        calls = kwarg(call, "accumulate_calls")
        if calls is None or int_value(mod, calls) == 1:
            continue
        deferred = kwarg(call, "defer_update")
        if deferred is not None and not (
            isinstance(deferred, ast.Constant) and deferred.value is False
        ):
            continue  # True, or a value lint cannot tell: not proven
        for target in node.targets:
            yield text(target), call


def _calls_of(mod: Module, name: str, scope: ast.AST) -> Iterator[ast.Call]:
    for node in walk_local(scope):
        if isinstance(node, ast.Call) and text(node.func) == name:
            yield node


def _lr_set_after_the_window(mod: Module, call: ast.Call) -> Iterator[ast.AST]:
    """Param-group LR assignments after the inner loop holding ``call``, within the same
    iteration of the loop around it."""
    window = _enclosing(mod, call, _LOOPS)
    if window is None:
        return
    outer = _enclosing(mod, window, _LOOPS)
    if outer is None:
        return
    statement: ast.AST = window
    while mod.parents.get(statement) is not outer:
        statement = mod.parents[statement]
    found = position(mod, statement)
    if found is None:
        return
    _, body, index = found
    for later in body[index + 1 :]:
        for node in walk_local(later):
            if _sets_a_param_group_lr(mod, node):
                yield node


def _enclosing(mod: Module, node: ast.AST, kinds: tuple[type[ast.AST], ...]) -> ast.AST | None:
    current = mod.parents.get(node)
    while current is not None and not isinstance(current, (ast.FunctionDef, ast.Module)):
        if isinstance(current, kinds):
            return current
        current = mod.parents.get(current)
    return None


def _sets_a_param_group_lr(mod: Module, node: ast.AST) -> bool:
    """``group["lr"] = ...`` for a group of ``X.param_groups`` (by name or by index)."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)):
        return False
    key = node.slice
    if not (isinstance(key, ast.Constant) and key.value == "lr"):
        return False
    group = node.value
    if "param_groups" in text(group):
        return True
    loop = _enclosing(mod, node, (ast.For, ast.AsyncFor))
    while loop is not None:
        assert isinstance(loop, (ast.For, ast.AsyncFor))
        if text(loop.target) == text(group) and text(loop.iter).endswith("param_groups"):
            return True
        loop = _enclosing(mod, loop, (ast.For, ast.AsyncFor))
    return False
