"""DG104: the number of eager DDP forwards before a capture breaks DDP's warm-up rule.

The rule itself lives in :mod:`ddpgraph.facts` (TrainStep and explain use it too). Counted are
all forwards of the model that DDP's reducer sees, in execution order from its construction to
the capture: warm-up loops, single calls, earlier captures (their forward runs on the host while
capturing). Forwards under ``model.no_sync()`` or ``torch.no_grad()`` skip the reducer
(``DistributedDataParallel._pre_forward``) and do not count; a captured forward under them is
never timed, so it is not checked. A count the rule cannot prove (a loop over a loader, a
helper of another module given the model) is a note in strict mode.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...facts import WARMUP_RULE, ddp_count_allows_capture
from .astutil import (
    Capture,
    Module,
    calls,
    dotted,
    int_value,
    made_for,
    range_count,
    text,
    walk_local,
)
from .astutil import ddp_called as _ddp_called
from .core import Report

_UNTIMED_CONTEXTS = frozenset(
    {"torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad", "torch.set_grad_enabled"}
)
# Handing the model to these never runs its forward.
_INERT = frozenset(
    {"print", "len", "isinstance", "hasattr", "getattr", "setattr", "id", "type", "repr", "str"}
)


def check_warmup_count(mod: Module, report: Report) -> None:
    for capture in mod.captures:
        for model in _ddp_called(mod, capture.node):
            names = frozenset({model.target})
            captured = _Forwards(mod, names).count(capture.node.body)
            if captured == 0 or _untimed_context(mod, capture.node, names):
                continue  # no_sync / no_grad: DDP does not time this forward
            _check(mod, report, capture, model.target)


def _check(mod: Module, report: Report, capture: Capture, target: str) -> None:
    made = made_for(mod.ddp, target, mod, capture.node)
    counted = None
    if made is not None and made.scope is mod.scope_of(capture.node):
        counted = _CountBefore(mod, target, made.call, capture.node).run()
    if counted is None:
        report.note(
            capture.node,
            "DG104",
            f"could not count the eager forwards of DDP model {target!r} before this capture "
            "(a loop of unknown length, a helper given the model, or a model built elsewhere); "
            f"DDP needs: {WARMUP_RULE}",
            WARMUP_RULE,
        )
        return
    count, where = counted
    if ddp_count_allows_capture(count):
        return
    report.finding(
        where or capture.node,
        "DG104",
        f"{count} eager DDP iteration(s) before the capture at line {capture.node.lineno}: DDP "
        "times iterations 1..10 and every 100th with CUDA events that the next forward reads "
        "on the host, so the captured forward fails with 'operation not permitted when stream "
        "is capturing' (or a later eager one with 'invalid argument')",
        WARMUP_RULE,
    )


def _untimed_context(mod: Module, node: ast.AST, names: frozenset[str]) -> bool:
    return any(
        isinstance(a, (ast.With, ast.AsyncWith)) and _untimed_with(mod, a, names)
        for a in (node, *mod.ancestors(node))
    )


def _untimed_with(mod: Module, stmt: ast.With | ast.AsyncWith, names: frozenset[str]) -> bool:
    for item in stmt.items:
        expr = item.context_expr
        if not isinstance(expr, ast.Call):
            continue
        name = mod.call_name(expr) or ""
        if name in _UNTIMED_CONTEXTS:
            enabled = expr.args[0] if expr.args else None
            if name != "torch.set_grad_enabled" or (
                isinstance(enabled, ast.Constant) and enabled.value is False
            ):
                return True
        func = expr.func
        if isinstance(func, ast.Attribute) and func.attr == "no_sync" and text(func.value) in names:
            return True
    return False


@dataclass
class _Forwards:
    """Counts the forwards of a DDP model (known by ``names``) that a piece of code runs."""

    mod: Module
    names: frozenset[str]
    active: list[int] = field(default_factory=list)

    def count(self, body: Sequence[ast.stmt] | ast.AST) -> int | None:
        if not isinstance(body, ast.AST):
            total = 0
            for stmt in body:
                n = self.count(stmt)
                if n is None:
                    return None
                total += n
            return total
        node = body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return 0
        if isinstance(node, (ast.For, ast.AsyncFor)):
            return self._loop(node)
        if isinstance(node, ast.While):
            inner = _add(self.expression(node.test), self.count(node.body))
            return 0 if inner == 0 else None
        if isinstance(node, ast.If):
            test, yes, no = (
                self.expression(node.test),
                self.count(node.body),
                self.count(node.orelse),
            )
            return _add(test, yes) if yes == no else None
        if isinstance(node, (ast.With, ast.AsyncWith)):
            head = sum(self.expression(i.context_expr) or 0 for i in node.items)
            if _untimed_with(self.mod, node, self.names):
                return head
            return _add(head, self.count(node.body))
        if isinstance(node, ast.Try):
            return _add(self.count(node.body), self.count(node.finalbody))
        return self.expression(node)

    def _loop(self, loop: ast.For | ast.AsyncFor) -> int | None:
        inner = _add(self.count(loop.body), 0)
        head = self.expression(loop.iter)
        if inner == 0:
            return _add(head, self.count(loop.orelse))
        times = range_count(self.mod, loop.iter)
        if inner is None or times is None or head is None:
            return None
        return _add(head + times * inner, self.count(loop.orelse))

    def expression(self, node: ast.AST) -> int | None:
        if self._aliased(node):
            return None  # `m = model`, `[model]`: forwards through another name are not seen
        total = 0
        for call in calls(node):
            if text(call.func) in self.names:
                total += 1
                continue
            passed = [a for a in (*call.args, *(k.value for k in call.keywords))]
            given = [i for i, a in enumerate(passed) if text(a) in self.names]
            func = self.mod.local_function(call)
            if func is not None:
                n = self._local(func, call, given)
                if n is None:
                    return None
                total += n
            elif given and (self.mod.call_name(call) or "") not in _INERT:
                return None  # handed to code this file does not show: it may run the model
        return total

    def _aliased(self, node: ast.AST) -> bool:
        """The model is stored under another name or in a container (not called, not a method
        or attribute read, not an argument: those are handled)."""
        for name in walk_local(node):
            if not (isinstance(name, ast.Name) and name.id in self.names):
                continue
            parent = self.mod.parents.get(name)
            if isinstance(parent, ast.Call) or (
                isinstance(parent, ast.Attribute) and parent.value is name
            ):
                continue
            if isinstance(parent, ast.keyword) or isinstance(name.ctx, ast.Store):
                continue
            return True
        return False

    def _local(
        self, func: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call, given: list[int]
    ) -> int | None:
        if id(func) in self.active:
            return 0
        if len(self.active) > 8:
            return None  # too deep to follow: the count stays unknown
        params = [a.arg for a in (*func.args.posonlyargs, *func.args.args)]
        if params and params[0] in ("self", "cls") and isinstance(call.func, ast.Attribute):
            params = params[1:]
        names = set(self.names)
        for index in given:
            if index < len(call.args) and index < len(params):
                names.add(params[index])
            elif index < len(call.args):
                return None  # *args: cannot follow it
        for keyword in call.keywords:
            if keyword.arg and text(keyword.value) in self.names:
                names.add(keyword.arg)
        inner = _Forwards(self.mod, frozenset(names), [*self.active, id(func)])
        return inner.count(func.body)


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


class _CountBefore:
    """Eager forwards from the DDP construction to the capture, in execution order."""

    def __init__(self, mod: Module, target: str, construction: ast.Call, capture: ast.With) -> None:
        self.mod = mod
        self.forwards = _Forwards(mod, frozenset({target}))
        self.construction = construction
        self.capture = capture
        self.started = False
        self.total: int | None = 0
        self.where: ast.AST | None = None

    def run(self) -> tuple[int, ast.AST | None] | None:
        scope = self.mod.scope_of(self.capture)
        body = (
            scope.body
            if isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef))
            else []
        )
        reached = self.block(body)
        if not reached or not self.started or self.total is None:
            return None
        return self.total, self.where

    def contains(self, stmt: ast.AST, node: ast.AST) -> bool:
        return stmt is node or any(a is stmt for a in self.mod.ancestors(node))

    def block(self, body: Sequence[ast.stmt]) -> bool:
        """Count ``body`` up to the capture; True when the capture was reached."""
        for stmt in body:
            if self.total is None:
                return True
            if self.contains(stmt, self.capture):
                return self.enclosing(stmt)
            if not self.started and self.contains(stmt, self.construction):
                self.start_in(stmt)
                continue
            if self.started:
                self.add(stmt)
        return False

    def add(self, stmt: ast.stmt) -> None:
        n = self.forwards.count(stmt)
        self.total = _add(self.total, n)
        loops = [
            node
            for node in walk_local(stmt)
            if isinstance(node, (ast.For, ast.AsyncFor)) and self.forwards.count(node)
        ]
        if n and loops:  # point at the warm-up loop that set the count
            self.where = max(loops, key=lambda loop: loop.lineno).iter

    def start_in(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, (ast.With, ast.AsyncWith, ast.Try)):
            self.block(stmt.body)
        elif isinstance(stmt, ast.If):
            branch = (
                stmt.body
                if any(self.contains(s, self.construction) for s in stmt.body)
                else stmt.orelse
            )
            self.block(branch)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Expr)):
            self.started = True
        else:
            self.total = None  # built inside a loop: each pass builds a new model

    def enclosing(self, stmt: ast.stmt) -> bool:
        if stmt is self.capture:
            return True
        if isinstance(stmt, (ast.With, ast.AsyncWith, ast.Try)):
            return self.block(stmt.body) or self._unreached()
        if isinstance(stmt, ast.If):
            branch = (
                stmt.body if any(self.contains(s, self.capture) for s in stmt.body) else stmt.orelse
            )
            self.total = _add(self.total, self.forwards.expression(stmt.test))
            return self.block(branch) or self._unreached()
        if isinstance(stmt, ast.For) and self.started:
            return self.loop_until(stmt)
        self.total = None  # inside a while loop or another structure: earlier passes unknown
        return True

    def _unreached(self) -> bool:
        self.total = None
        return True

    def loop_until(self, loop: ast.For) -> bool:
        """``for i, x in enumerate(...)`` with the capture under ``if i == N``: N earlier passes
        ran the loop's other branch."""
        equality = _equality_around(self.mod, self.capture, loop)
        if equality is None:
            self.total = None
            return True
        test, count, chain = equality
        per_pass = 0
        for stmt in loop.body:
            if stmt is chain:
                branches = [self.forwards.count(b) for b in _other_branches(chain)]
                if any(b is None for b in branches):
                    self.total = None
                    return True
                per_pass += max([b for b in branches if b is not None], default=0)
            elif self.contains(stmt, self.capture):
                self.total = None
                return True
            else:
                n = self.forwards.count(stmt)
                if n is None:
                    self.total = None
                    return True
                per_pass += n
        self.total = _add(self.total, count * per_pass)
        self.where = test
        return True


def _equality_around(
    mod: Module, capture: ast.With, loop: ast.For
) -> tuple[ast.expr, int, ast.If] | None:
    """The ``if i == N:`` directly in ``loop``'s body whose branch holds the capture, where i
    counts the loop's passes from zero."""
    for stmt in loop.body:
        if not isinstance(stmt, ast.If) or not any(a is stmt for a in mod.ancestors(capture)):
            continue
        if not any(s is capture or any(a is s for a in mod.ancestors(capture)) for s in stmt.body):
            return None
        test = stmt.test
        if (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.left, ast.Name)
            and _counts_from_zero(loop, test.left.id)
        ):
            value = int_value(mod, test.comparators[0])
            if value is not None:
                return test, value, stmt
    return None


def _other_branches(chain: ast.If) -> list[list[ast.stmt]]:
    """The ``elif`` / ``else`` bodies of an if-chain (the branches an earlier pass may take)."""
    branches: list[list[ast.stmt]] = []
    orelse = chain.orelse
    while len(orelse) == 1 and isinstance(orelse[0], ast.If):
        branches.append(orelse[0].body)
        orelse = orelse[0].orelse
    branches.append(orelse)
    return branches


def _counts_from_zero(loop: ast.For, variable: str) -> bool:
    """``for i in range(...)`` / ``for i, x in enumerate(...)``: i is the number of earlier passes."""
    it = loop.iter
    if not isinstance(it, ast.Call) or it.keywords:
        return False
    func = dotted(it.func)
    if func == "range" and len(it.args) == 1:
        return isinstance(loop.target, ast.Name) and loop.target.id == variable
    if func == "enumerate" and len(it.args) == 1 and isinstance(loop.target, ast.Tuple):
        first = loop.target.elts[0]
        return isinstance(first, ast.Name) and first.id == variable
    return False
