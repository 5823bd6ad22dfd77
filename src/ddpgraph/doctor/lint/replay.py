"""What runs around a replay: DG107 (the optimizer captured in the graph stepped again around
its replay) and DG108 (a static input re-bound by assignment instead of ``copy_()``).

A statement in the other branch of an ``if`` than the replay (``if graphed: g.replay() else:
opt.step()``) never runs with it and is not reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .astutil import (
    Capture,
    Module,
    calls,
    calls_reaching,
    exclusive,
    last_assignment,
    position,
    target_names,
    text,
    walk_local,
)
from .capture_body import stepped_optimizer
from .core import Report


def _schedulers(mod: Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(mod.tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if "lr_scheduler" in (mod.call_name(node.value) or ""):
            names.update(text(t) for t in node.targets)
    return names


def replays_of(mod: Module, capture: Capture) -> Iterator[ast.Call]:
    """``g.replay()`` calls of the captured graph, in the scope that captured it."""
    scope = mod.scope_of(capture.node)
    for call in calls(scope):
        func = call.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "replay"
            and text(func.value) == capture.graph
        ):
            yield call


def _replay_region(mod: Module, replay: ast.Call) -> tuple[ast.AST, int]:
    """What runs around a replay: its innermost loop (any order), or the rest of its block."""
    statement: ast.AST = replay
    for ancestor in mod.ancestors(replay):
        if isinstance(ancestor, (ast.For, ast.AsyncFor, ast.While)):
            return ancestor, 0
        if isinstance(ancestor, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            break
        statement = ancestor
    placed = position(mod, statement)
    if placed is None:
        return statement, replay.lineno
    parent, _, _ = placed
    return parent, replay.lineno


def check_double_step(mod: Module, report: Report) -> None:
    """DG107: the optimizer stepped inside the graph is stepped again around its replay."""
    for capture in mod.captures:
        if capture.graph is None:
            continue
        inside = {s for c in calls_reaching(mod, capture.node) if (s := stepped_optimizer(c))}
        inside -= _schedulers(mod)  # scheduler.step() is host-side; only optimizers matter here
        if not inside:
            continue
        for replay in replays_of(mod, capture):
            region, after = _replay_region(mod, replay)
            for call in calls(region):
                stepped = stepped_optimizer(call)
                if (
                    stepped in inside
                    and call.lineno > after
                    and mod.enclosing_capture(call) is None
                    and not exclusive(mod, call, replay)
                ):
                    report.finding(
                        call,
                        "DG107",
                        f"{stepped}.step() is already captured in {capture.graph} (line "
                        f"{capture.node.lineno}); calling it again around "
                        f"{capture.graph}.replay() (line {replay.lineno}) updates the "
                        "parameters twice per batch",
                        f"remove this {stepped}.step(): {capture.graph}.replay() already runs it",
                    )


def check_static_rebound(mod: Module, report: Report) -> None:
    """DG108: a name the graph reads is re-bound between replays instead of copy_()."""
    for capture in mod.captures:
        if capture.graph is None:
            continue
        inputs = _static_inputs(mod, capture)
        if not inputs:
            continue
        reported: set[int] = set()
        for replay in replays_of(mod, capture):
            region, after = _replay_region(mod, replay)
            for name, node in _rebindings(mod, region, inputs):
                if (
                    id(node) in reported
                    or _sets_up(mod, node, capture.node)
                    or exclusive(mod, node, replay)
                    or (after and not _between(node, capture.node, replay))
                ):
                    continue
                reported.add(id(node))
                report.finding(
                    node,
                    "DG108",
                    f"{name!r} is read by the graph captured at line {capture.node.lineno} but "
                    f"is re-bound here before {capture.graph}.replay(); the replay still reads "
                    "the tensor (or value) it saw at capture, so every replay trains on the same data",
                    f"keep the static tensor and copy into it: {name}.copy_(new_value)",
                )


def _between(node: ast.AST, capture: ast.With, replay: ast.Call) -> bool:
    """Straight-line code (no loop around the replay): only a re-binding after the capture and
    before the replay changes what the replay should have read."""
    line = getattr(node, "lineno", 0)
    return (capture.end_lineno or capture.lineno) < line < replay.lineno


def _sets_up(mod: Module, assignment: ast.AST, capture: ast.With) -> bool:
    """An assignment in the same block as the capture, just before it, creates the static input."""
    mine, theirs = position(mod, assignment), position(mod, capture)
    return mine is not None and theirs is not None and mine[1] is theirs[1] and mine[2] < theirs[2]


def _static_inputs(mod: Module, capture: Capture) -> set[str]:
    """Names read inside the capture, before any write there, that were bound earlier."""
    written: set[str] = set()
    read: set[str] = set()
    names = sorted(
        (n for n in walk_local(capture.node) if isinstance(n, ast.Name)),
        key=lambda n: (n.lineno, n.col_offset),
    )
    as_data: set[str] = set()
    for name in names:
        if isinstance(name.ctx, ast.Store):
            written.add(name.id)
        elif name.id not in written:
            read.add(name.id)
            if not _used_as_key(mod, name):
                as_data.add(name.id)
    # Modules, losses and functions are called, not fed: only data can be a static input; a
    # dict key (``graphs[mode]``) or a str/number constant is read on the host while capturing.
    called = {text(c.func) for c in calls(capture.node)}
    skip = called | {m.target for m in mod.ddp + mod.optimizers} | set(mod.aliases)
    skip |= set(mod.functions) | {capture.graph or ""}
    inputs: set[str] = set()
    for candidate in (read & as_data) - skip:
        value = last_assignment(mod, candidate, capture.node)
        if value is not None and _host_constant(value):
            continue
        if (
            value is not None
            or _loop_binds(mod, capture.node, candidate)
            or candidate in _parameters(mod.scope_of(capture.node))
        ):
            inputs.add(candidate)
    return inputs


def _used_as_key(mod: Module, name: ast.Name) -> bool:
    parent = mod.parents.get(name)
    return isinstance(parent, ast.Subscript) and parent.slice is name


def _host_constant(value: ast.expr) -> bool:
    if isinstance(value, ast.IfExp):
        return _host_constant(value.body) and _host_constant(value.orelse)
    return isinstance(value, ast.Constant) and isinstance(value.value, (str, int, float, bool))


def _parameters(scope: ast.AST) -> set[str]:
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    args = scope.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}


def _loop_binds(mod: Module, node: ast.AST, name: str) -> bool:
    return any(
        isinstance(a, ast.For) and name in target_names(a.target) for a in mod.ancestors(node)
    )


def _rebindings(mod: Module, region: ast.AST, inputs: set[str]) -> Iterator[tuple[str, ast.AST]]:
    if isinstance(region, (ast.For, ast.AsyncFor)):
        for name in sorted(target_names(region.target) & inputs):
            yield name, region.target
    for node in walk_local(region):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or mod.enclosing_capture(node):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for name in sorted(target_names(target) & inputs):
                if not isinstance(target, (ast.Subscript, ast.Attribute)):
                    yield name, node
