"""DG110: a graph-owned tensor kept across replays without a copy.

A CUDA graph writes its outputs into the same tensors on every replay. A loop that keeps one of
them across iterations (appends it to a list, stores it in a dict, binds it to a name it reads on
the next iteration) keeps a reference, not a value: after k replays its k entries all read the
last replay's numbers. Accelerate's ``gradient_accumulation_for_autoregressive_models.py``
appends ``loss.detach()`` to a list and averages it at the end of the window: right eagerly,
wrong when ``loss`` is a graph's static output (``.detach()`` shares the memory).

Graph-owned here: a name assigned inside ``with torch.cuda.graph(g):``, or a tensor written in
place there (``static_out.copy_(y)``), both overwritten by ``g.replay()``; and a ddpgraph TrainStep's ``step.output`` and ``step.grad_norm`` (overwritten
by the next ``step(...)``) and the result of ``step.evaluate(...)`` (by the next evaluation); the
loss a TrainStep returns is already a copy. Views of them stay graph-owned (``.detach()``,
``.view()``, ``[0]``, ``out.logits``); a copy does not (``.clone()``, ``.item()``,
``float()``, ``.tolist()``, ``.cpu()``, ``.to(...)``, arithmetic). Reported only inside a loop
that runs the overwriting call: an append/extend/insert, a store into a list or dict built by the
script, a list ``+=``, or a name bound to the tensor and read before that binding on the next
iteration (``prev = static_loss`` compared after the next replay; ``total = static_loss`` then
``total += ...`` adds into the graph's own tensor). A container the loop builds afresh on every
iteration before the store keeps nothing across replays and is not reported, nor is a tensor of
a capture the loop makes afresh on every pass (each pass keeps a new one).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from .astutil import (
    Capture,
    Module,
    exclusive,
    kwarg,
    position,
    text,
    walk_local,
)
from .core import Report
from .replay import replays_of

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)
# Tensor methods that return a view of (or the same) storage: the result is still the graph's.
_VIEWS = frozenset(
    {
        "detach",
        "detach_",
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "t",
        "transpose",
        "permute",
        "movedim",
        "expand",
        "expand_as",
        "narrow",
        "select",
        "as_strided",
        "contiguous",
        "requires_grad_",
    }
)
# Attributes of a tensor that are not tensors sharing its memory.
_METADATA = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_leaf", "grad_fn"}
)
# Values a capture's body binds that are host values, not graph outputs.
_HOST_CALLS = frozenset({"len", "int", "float", "bool", "str", "range", "enumerate", "zip"})
_HOST_METHODS = frozenset({"item", "tolist", "size", "dim", "numel", "shape", "dtype", "device"})
# In-place methods that change no values.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "pin_memory_", "record_stream_"})
_KEEPERS = frozenset({"append", "appendleft", "insert", "extend", "extendleft"})
_CONTAINER_CALLS = frozenset(
    {"list", "dict", "set", "defaultdict", "OrderedDict", "deque", "collections.defaultdict"}
)
_COPY_HINT = "or .item() for a number to log; .detach() alone still shares the graph's memory"


@dataclass(frozen=True)
class Owner:
    """What owns a tensor and what overwrites it."""

    source: str  # "static_loss", "step.grad_norm"
    what: str  # "an output of the graph g captured at line 37"
    writers: tuple[ast.Call, ...]  # the calls that overwrite it in place
    writer: str  # "g.replay()"
    # the capture that makes the tensor (a capture run on every pass of a loop makes a new one)
    made_by: ast.With | None = None


def check_kept_outputs(mod: Module, report: Report) -> None:
    """DG110: a graph-owned tensor kept across the loop's replays by reference."""
    steps = _train_steps(mod)
    if not mod.captures and not steps:
        return
    analysis = _Analysis(mod, steps)
    for node in ast.walk(mod.tree):
        if not isinstance(node, (ast.Call, ast.Assign, ast.AugAssign)):
            continue
        if mod.enclosing_capture(node) is not None:
            continue
        if isinstance(node, ast.Call):
            analysis.check_keeper_call(node, report)
        elif isinstance(node, ast.Assign):
            analysis.check_store(node, report)
            analysis.check_carried_name(node, report)
        else:
            analysis.check_list_add(node, report)


class _Analysis:
    def __init__(self, mod: Module, steps: dict[str, list[ast.Assign]]) -> None:
        self.mod = mod
        self.steps = steps
        self.capture_outputs = {
            id(binding): capture for capture in mod.captures for binding in _outputs(capture, mod)
        }
        self.written = {
            (id(mod.scope_of(capture.node)), name): capture
            for capture in mod.captures
            for name in _written_in_place(capture, mod)
        }
        self._resolving: set[tuple[str, int]] = set()
        self._scope_bindings: dict[int, dict[str, list[ast.AST]]] = {}

    # --- sinks ------------------------------------------------------------------------------

    def check_keeper_call(self, call: ast.Call, report: Report) -> None:
        """``kept.append(t)``, ``kept.insert(i, t)``, ``kept.extend([t])``."""
        func = call.func
        if not (isinstance(func, ast.Attribute) and func.attr in _KEEPERS) or not call.args:
            return
        value, owned = self._owned_element(call.args[-1], call)
        if owned is not None:
            self._report_kept(call, value, func.value, owned, report, f"{func.attr}()")

    def check_store(self, node: ast.Assign, report: Report) -> None:
        """``history[k] = t`` into a list or dict the script built; into a container lint
        cannot see built (``self.history[k]``, a parameter), a note. A store into a tensor
        (``buf[i] = t``) copies the values and is fine."""
        for target in node.targets:
            if not isinstance(target, ast.Subscript):
                continue
            known = self._is_container(target.value, node)
            if not known and self._bound_in_scope(target.value, node):
                continue  # a tensor, or something else the scope built
            value, owned = self._owned_element(node.value, node)
            if owned is not None:
                self._report_kept(node, value, target.value, owned, report, "a store", proven=known)

    def check_list_add(self, node: ast.AugAssign, report: Report) -> None:
        """``losses += [t]`` (a list extended by reference)."""
        if not isinstance(node.op, ast.Add):
            return
        value: ast.AST = node.value
        owned = None
        if isinstance(value, (ast.List, ast.Tuple)) or self._is_container(node.target, node):
            value, owned = self._owned_element(value, node)
        if owned is not None:
            self._report_kept(node, value, node.target, owned, report, "+=")

    def check_carried_name(self, node: ast.Assign, report: Report) -> None:
        """``prev = static_loss`` read on the next iteration, after the next replay."""
        if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
            return
        name = node.targets[0].id
        owned = self.owner(node.value, node)
        if owned is None:
            return
        loop = self._writing_loop(node, owned)
        if loop is None:
            return
        for read in self._carried_reads(name, node, loop, owned):
            writer = self._first_writer(loop, owned)
            report.finding(
                node,
                "DG110",
                f"{name!r} keeps {_described(node.value, owned)} into the next iteration, "
                f"where {owned.writer} (line {writer.lineno}) overwrites that tensor in place: "
                f"{name!r} read at line {read.lineno} holds the new values, not this "
                "iteration's",
                f"keep a copy: {name} = {_copied(node.value)} ({_COPY_HINT})",
            )
            return

    # --- ownership --------------------------------------------------------------------------

    def owner(self, expr: ast.AST, at: ast.AST) -> Owner | None:
        """The graph (or TrainStep) that owns the tensor ``expr`` evaluates to, if provable."""
        if isinstance(expr, ast.Name):
            return self._resolve(expr.id, at)
        if isinstance(expr, ast.Attribute):
            step = text(expr.value)
            if expr.attr in ("output", "grad_norm") and self._is_step(expr.value, at):
                return self._step_owner(step, f"{step}.{expr.attr}", evaluate=False)
            return None if expr.attr in _METADATA else self.owner(expr.value, at)
        if isinstance(expr, ast.Subscript):
            return self.owner(expr.value, at) if _view_index(expr.slice) else None
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            func = expr.func
            if func.attr == "evaluate" and self._is_step(func.value, at):
                step = text(func.value)
                return self._step_owner(step, f"{step}.evaluate(...)'s result", evaluate=True)
            return self.owner(func.value, at) if func.attr in _VIEWS else None
        if isinstance(expr, ast.IfExp):
            return self.owner(expr.body, at) or self.owner(expr.orelse, at)
        if isinstance(expr, ast.BoolOp):
            return next((o for v in expr.values if (o := self.owner(v, at))), None)
        if isinstance(expr, (ast.NamedExpr, ast.Starred)):
            return self.owner(expr.value, at)
        return None

    def _is_step(self, expr: ast.AST, at: ast.AST) -> bool:
        """``expr`` is a graphed TrainStep: for a name, the one this scope binds there."""
        built = self.steps.get(text(expr))
        if not built:
            return False
        if not isinstance(expr, ast.Name) or not self._bindings(expr.id, self.mod.scope_of(at)):
            return True  # ``self.step``, or a module's step read in a function
        ids = {id(b) for b in built}
        return any(id(b) in ids for b in self._reaching_bindings(expr.id, at))

    def _owned_element(self, value: ast.AST, at: ast.AST) -> tuple[ast.AST, Owner | None]:
        """``value`` if owned, else an owned element of the list, tuple, set or dict literal it
        is (``(step, static_loss)``, ``{"loss": static_loss}``), with its owner. (Extending by an
        owned tensor keeps its rows: views of it.)"""
        elements: list[ast.expr] = []
        if isinstance(value, (ast.List, ast.Tuple, ast.Set)):
            elements = value.elts
        elif isinstance(value, ast.Dict):
            elements = value.values
        for element in elements:
            found, owned = self._owned_element(element, at)
            if owned is not None:
                return found, owned
        return value, None if elements else self.owner(value, at)

    def _step_owner(self, step: str, what: str, *, evaluate: bool) -> Owner:
        writers = tuple(_step_calls(self.mod, step, evaluate))
        if evaluate:
            owned = "owned by the step's evaluation graph on CUDA"
            return Owner(what, owned, writers, f"{step}.evaluate(...)")
        return Owner(what, "owned by the TrainStep's graph", writers, f"{step}(...)")

    def _resolve(self, name: str, at: ast.AST) -> Owner | None:
        key = (name, id(at))
        if key in self._resolving:
            return None
        self._resolving.add(key)
        try:
            reaching = list(self._reaching_bindings(name, at))
            for binding in reaching:
                owned = self._binding_owner(binding, name)
                if owned is not None:
                    return owned
            return self._written_owner(name, at, reaching)
        finally:
            self._resolving.discard(key)

    def _written_owner(self, name: str, at: ast.AST, reaching: list[ast.AST]) -> Owner | None:
        """A tensor the capture writes in place (``static_out.copy_(y)`` in its body), still
        bound at ``at`` to what it was at capture."""
        capture = self.written.get((id(self.mod.scope_of(at)), name))
        if capture is None or any(_pos(b) > _pos(capture.node) for b in reaching):
            return None
        what = (
            f"written in place by the graph {capture.graph} captured at line {capture.node.lineno}"
        )
        return Owner(name, what, tuple(replays_of(self.mod, capture)), f"{capture.graph}.replay()")

    def _binding_owner(self, binding: ast.AST, name: str) -> Owner | None:
        capture = self.capture_outputs.get(id(binding))
        if capture is not None:
            writers = tuple(replays_of(self.mod, capture))
            what = f"an output of the graph {capture.graph} captured at line {capture.node.lineno}"
            return Owner(name, what, writers, f"{capture.graph}.replay()", capture.node)
        if isinstance(binding, ast.Assign):
            return self.owner(_assigned_part(binding, name), binding)
        if isinstance(binding, (ast.AnnAssign, ast.NamedExpr)) and binding.value is not None:
            return self.owner(binding.value, binding)
        if isinstance(binding, (ast.For, ast.AsyncFor)):
            return self.owner(binding.iter, binding)  # a row of an owned tensor is a view
        if isinstance(binding, ast.withitem):
            return self.owner(binding.context_expr, binding.context_expr)
        return None

    def _reaching_bindings(self, name: str, at: ast.AST) -> Iterator[ast.AST]:
        """Bindings of ``name`` that may give its value at ``at``: the nearest one that runs on
        every path, those in branches after it, and those later in a loop around both."""
        mod = self.mod
        dominating = self._dominating(name, at)
        here = _pos(at)
        for binding in self._bindings(name, mod.scope_of(at)):
            # ``x = x.detach()`` reads the old value (or the last iteration's), not its own
            before = not self._inside(at, binding) and _pos(binding) < here
            if dominating is None:
                reaches = before or self._loop_carries(binding, at, None)
            else:
                reaches = (
                    binding is dominating
                    or (before and _pos(binding) > _pos(dominating))
                    or self._loop_carries(binding, at, dominating)
                )
            if reaches:
                yield binding

    def _bindings(self, name: str, scope: ast.AST) -> list[ast.AST]:
        """Statements (and ``with ... as`` items, walrus) that bind ``name`` in ``scope``."""
        index = self._scope_bindings.get(id(scope))
        if index is None:
            index = self._scope_bindings[id(scope)] = {}
            for node in walk_local(scope):
                for bound in _names_bound_by(node):
                    index.setdefault(bound, []).append(node)
        return index.get(name, [])

    def _loop_carries(self, binding: ast.AST, at: ast.AST, dominating: ast.AST | None) -> bool:
        """``binding`` sits later in a loop around ``at`` that does not re-run ``dominating``."""
        if _pos(binding) < _pos(at) and not exclusive(self.mod, binding, at):
            return False
        for loop in self._loops(at):
            if self._inside(binding, loop) and (
                dominating is None or not self._inside(dominating, loop)
            ):
                return True
        return False

    def _dominating(self, name: str, at: ast.AST) -> ast.AST | None:
        """The nearest statement before ``at`` that binds ``name`` on every path to it (a
        ``with`` body runs whole, so its bindings count)."""
        node: ast.AST = at
        for ancestor in [*self.mod.ancestors(at)]:
            if (
                isinstance(ancestor, (ast.For, ast.AsyncFor))
                and node in ancestor.body
                and name in _stored(ancestor.target)
            ):
                return ancestor  # bound afresh before each pass through the body
            placed = position(self.mod, node)
            if placed is not None:
                _, body, index = placed
                for statement in reversed(body[:index]):
                    found = _direct_binding(statement, name)
                    if found is not None:
                        return found
            if isinstance(ancestor, _SCOPES):
                return None
            node = ancestor
        return None

    # --- loops ------------------------------------------------------------------------------

    def _loops(self, node: ast.AST) -> Iterator[ast.AST]:
        for ancestor in self.mod.ancestors(node):
            if isinstance(ancestor, _SCOPES):
                return
            if isinstance(ancestor, _LOOPS):
                yield ancestor

    def _inside(self, node: ast.AST, container: ast.AST) -> bool:
        return node is container or any(a is container for a in self.mod.ancestors(node))

    def _writing_loop(self, node: ast.AST, owned: Owner) -> ast.AST | None:
        """The innermost loop around ``node`` that runs a call overwriting ``owned``; None when
        that loop captures afresh on every pass (each pass keeps a new tensor)."""
        for loop in self._loops(node):
            if any(self._inside(w, loop) for w in owned.writers):
                made_by = owned.made_by
                if made_by is not None and self._every_pass(made_by, loop):
                    return None
                return loop
        return None

    def _every_pass(self, node: ast.AST, loop: ast.AST) -> bool:
        """``node`` runs on every pass of ``loop``'s body (no ``if``/``except`` on the way)."""
        if not self._inside(node, loop):
            return False
        for ancestor in self.mod.ancestors(node):
            if ancestor is loop:
                return True
            if isinstance(ancestor, (ast.If, ast.IfExp, ast.Match, ast.ExceptHandler, ast.Try)):
                return False
        return False

    def _first_writer(self, loop: ast.AST, owned: Owner) -> ast.Call:
        return min((w for w in owned.writers if self._inside(w, loop)), key=_pos)

    # --- what is kept -----------------------------------------------------------------------

    def _report_kept(
        self,
        node: ast.AST,
        value: ast.AST,
        container: ast.AST,
        owned: Owner,
        report: Report,
        how: str,
        *,
        proven: bool = True,
    ) -> None:
        loop = self._writing_loop(node, owned)
        if loop is None:
            return
        if isinstance(container, ast.Name):
            fresh = self._dominating(container.id, node)
            if fresh is not None and self._inside(fresh, loop):
                return  # a new container every iteration: nothing is kept across replays
        writer = self._first_writer(loop, owned)
        kept = text(container)
        unproven = "" if proven else f" if {kept} is a list or dict (lint cannot see it built)"
        (report.finding if proven else report.note)(
            node,
            "DG110",
            f"{how} keeps {_described(value, owned)} in {kept} across the loop's iterations, "
            f"and {owned.writer} (line {writer.lineno}) overwrites that tensor in place: every "
            f"entry of {kept} reads the values of the last {owned.writer}{unproven}",
            f"keep a copy: {_copied(value)} ({_COPY_HINT})",
        )

    def _bound_in_scope(self, node: ast.AST, at: ast.AST) -> bool:
        """A name this scope binds (not a parameter, not an attribute)."""
        return isinstance(node, ast.Name) and bool(self._bindings(node.id, self.mod.scope_of(at)))

    def _is_container(self, node: ast.AST, at: ast.AST) -> bool:
        """A name the script bound to a list, dict or set (literal, comprehension or
        constructor) in this scope."""
        if not isinstance(node, ast.Name):
            return False
        for binding in self._bindings(node.id, self.mod.scope_of(at)):
            value = getattr(binding, "value", None)
            if isinstance(binding, ast.Assign):
                value = _assigned_part(binding, node.id)
            if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp)):
                return True
            if isinstance(value, ast.Call):
                name = self.mod.call_name(value) or ""
                if name in _CONTAINER_CALLS or name.rpartition(".")[2] in _CONTAINER_CALLS:
                    return True
        return False

    def _carried_reads(
        self, name: str, binding: ast.Assign, loop: ast.AST, owned: Owner
    ) -> Iterator[ast.Name | ast.AugAssign]:
        """Reads of ``name`` in ``loop`` that see ``binding`` from the previous iteration after
        an overwriting call ran."""
        writers = [w for w in owned.writers if self._inside(w, loop)]
        for read in _reads(loop, name):
            in_value = self._inside(read, binding.value)
            if not (in_value or _pos(read) < _pos(binding) or exclusive(self.mod, read, binding)):
                continue
            if _is_none_test(self.mod, read):
                continue  # ``prev is None`` reads no values
            fresh = self._dominating(name, read)
            if fresh is not None and fresh is not binding and self._inside(fresh, loop):
                continue  # re-bound earlier in the same iteration
            if any(_pos(w) > _pos(binding) or _pos(w) < _pos(read) for w in writers):
                yield read


# --- helpers --------------------------------------------------------------------------------


# the integrations' functions that build a TrainStep as a framework is set up
_FRAMEWORK_BUILDERS = (
    "ddpgraph.integrations.accelerate.from_accelerator",
    "ddpgraph.integrations.fabric.from_fabric",
)


def _train_steps(mod: Module) -> dict[str, list[ast.Assign]]:
    """Names (``step``, ``self.step``) bound to a graphed ddpgraph TrainStep, with the
    assignments that build one."""
    steps: dict[str, list[ast.Assign]] = {}
    imported = mod.aliases.values()
    if not any(name.startswith("ddpgraph") or "TrainStep" in name for name in imported):
        return steps  # no TrainStep without importing ddpgraph (walking every file is slow)
    for node in ast.walk(mod.tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        name = mod.call_name(node.value) or ""
        mode = kwarg(node.value, "graph")
        if isinstance(mode, ast.Constant) and mode.value == "never":
            continue  # eager: its output is the model's own, not a graph's
        if name == "TrainStep" or name.endswith(".TrainStep") or name in _FRAMEWORK_BUILDERS:
            for target in node.targets:
                steps.setdefault(text(target), []).append(node)
    return steps


def _step_calls(mod: Module, step: str, evaluate: bool) -> Iterator[ast.Call]:
    """``step(...)`` calls (they overwrite output/grad_norm) or ``step.evaluate(...)``."""
    for node in ast.walk(mod.tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if evaluate and isinstance(func, ast.Attribute) and func.attr == "evaluate":
            if text(func.value) == step:
                yield node
        elif not evaluate and text(func) == step:
            yield node


def _outputs(capture: Capture, mod: Module) -> Iterator[ast.AST]:
    """Each binding in the capture's body of a tensor the graph writes (its replays do)."""
    if capture.graph is None or next(replays_of(mod, capture), None) is None:
        return
    for node in walk_local(capture.node):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if value is not None and not _host_value(mod, value):
            yield node


def _written_in_place(capture: Capture, mod: Module) -> Iterator[str]:
    """Names the capture's body writes into (``static_out.copy_(y)``, ``total.add_(x)``)."""
    if capture.graph is None or next(replays_of(mod, capture), None) is None:
        return
    for call in walk_local(capture.node):
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            continue
        method, target = call.func.attr, call.func.value
        in_place = method.endswith("_") and not method.startswith("_")
        if in_place and method not in _NOT_WRITES and isinstance(target, ast.Name):
            yield target.id


def _host_value(mod: Module, value: ast.expr) -> bool:
    """A value the capture's body computes on the host (a count, a shape): not graph memory."""
    if isinstance(value, ast.Constant):
        return True
    if isinstance(value, ast.Subscript):
        return _host_value(mod, value.value)  # ``x.shape[0]``
    if isinstance(value, ast.Attribute):
        return value.attr in _HOST_METHODS
    if isinstance(value, ast.Call):
        func = value.func
        if isinstance(func, ast.Attribute) and func.attr in _HOST_METHODS:
            return True
        return (mod.call_name(value) or "") in _HOST_CALLS
    return False


def _stored(target: ast.AST) -> set[str]:
    """The names an assignment target binds: ``a``, ``a, (b, *c)``; not ``a[i]`` or ``a.b``,
    which store into an object."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_stored(e) for e in target.elts))
    if isinstance(target, ast.Starred):
        return _stored(target.value)
    return set()


def _bound_names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Assign):
        return set().union(*(_stored(t) for t in node.targets))
    if isinstance(node, ast.AnnAssign):
        return _stored(node.target)
    return set()


def _assigned_part(node: ast.Assign, name: str) -> ast.AST:
    """The part of the value bound to ``name``: ``a, b = x, y`` gives ``y`` for ``b``."""
    for target in node.targets:
        if (
            isinstance(target, (ast.Tuple, ast.List))
            and isinstance(node.value, (ast.Tuple, ast.List))
            and len(target.elts) == len(node.value.elts)
        ):
            for element, part in zip(target.elts, node.value.elts, strict=True):
                if isinstance(element, ast.Name) and element.id == name:
                    return part
    return node.value


def _names_bound_by(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        return _bound_names(node)
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return _stored(node.target)
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return _stored(node.optional_vars)
    if isinstance(node, ast.NamedExpr):
        return {node.target.id}
    return set()


def _direct_binding(statement: ast.stmt, name: str) -> ast.AST | None:
    """The binding of ``name`` that ``statement`` makes whenever it runs and completes: its own,
    the last one of a ``with`` or ``try`` body, or an ``if`` whose every branch binds it (the
    ``if`` stands for them; the branches' own bindings are read as those after it)."""
    if isinstance(statement, (ast.Assign, ast.AnnAssign)) and name in _bound_names(statement):
        return statement
    if isinstance(statement, (ast.With, ast.AsyncWith, ast.Try)):
        found = _last_direct_binding(statement.body, name)
        if found is not None:
            return found
    if isinstance(statement, (ast.With, ast.AsyncWith)):
        for item in statement.items:
            if item.optional_vars is not None and name in _stored(item.optional_vars):
                return item
    if isinstance(statement, ast.If) and statement.orelse:
        branches = (statement.body, statement.orelse)
        if all(_last_direct_binding(branch, name) is not None for branch in branches):
            return statement
    return None


def _last_direct_binding(body: list[ast.stmt], name: str) -> ast.AST | None:
    for inner in reversed(body):
        found = _direct_binding(inner, name)
        if found is not None:
            return found
    return None


def _reads(loop: ast.AST, name: str) -> Iterator[ast.Name | ast.AugAssign]:
    for node in walk_local(loop):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load):
            yield node
        elif isinstance(node, ast.AugAssign) and text(node.target) == name:
            yield node  # ``total += x`` reads (and writes into) what ``total`` holds


def _is_none_test(mod: Module, read: ast.AST) -> bool:
    parent = mod.parents.get(read)
    return (
        isinstance(parent, ast.Compare)
        and all(isinstance(op, (ast.Is, ast.IsNot)) for op in parent.ops)
        and any(
            isinstance(c, ast.Constant) and c.value is None
            for c in [parent.left, *parent.comparators]
        )
    )


def _view_index(index: ast.AST) -> bool:
    """Basic indexing (constants, slices): a view. A tensor index copies."""
    if isinstance(index, ast.Tuple):
        return all(_view_index(e) for e in index.elts)
    if isinstance(index, ast.UnaryOp):
        return _view_index(index.operand)
    return isinstance(index, (ast.Constant, ast.Slice))


def _described(value: ast.AST, owned: Owner) -> str:
    source = text(value)
    if source == owned.source:
        return f"{source} ({owned.what})"
    return f"{source} (a view of {owned.source}, {owned.what})"


def _copied(value: ast.AST) -> str:
    source = text(value)
    return (
        f"{source.removesuffix('.detach()')}.detach().clone()"
        if source.endswith(".detach()")
        else f"{source}.clone()"
    )


def _pos(node: ast.AST) -> tuple[int, int]:
    if isinstance(node, ast.withitem):
        node = node.context_expr
    return getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
