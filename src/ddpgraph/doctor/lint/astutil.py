"""The shared AST helper: names, scopes, branches and the facts every rule reads (captures, DDP
models, optimizers), gathered in one pass over a file."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

DEFAULT_STREAM = "<the default stream>"
GRAPH_STREAM = "<torch.cuda.graph's own capture stream>"
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
# Optimizers whose step keeps host-side state unless capturable=True (torch/optim).
CAPTURABLE_OPTIMIZERS = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "ASGD"})
_GRAPH_CONTEXTS = frozenset({"torch.cuda.graph", "torch.cuda.graphs.graph"})


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, None for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def text(node: ast.AST) -> str:
    return ast.unparse(node)


def kwarg(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def arg(call: ast.Call, index: int, name: str) -> ast.expr | None:
    """The argument passed as keyword ``name`` or at position ``index``."""
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args):
        return call.args[index]
    return kwarg(call, name)


def walk_local(node: ast.AST) -> Iterator[ast.AST]:
    """Like ast.walk, but does not enter nested function, lambda or class definitions."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(c for c in ast.iter_child_nodes(current) if not isinstance(c, _SCOPES))


def calls(node: ast.AST) -> Iterator[ast.Call]:
    return (n for n in walk_local(node) if isinstance(n, ast.Call))


def target_names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


@dataclass
class Capture:
    node: ast.With
    graph: str | None  # text of the CUDAGraph expression
    stream: str  # text of the capture stream, or GRAPH_STREAM


@dataclass
class Made:
    """An object built by an assignment ``target = Ctor(...)``: a DDP model or an optimizer."""

    target: str
    call: ast.Call
    stream: str  # the stream current at construction (DDP), as far as this scope shows
    scope: ast.AST


@dataclass
class Module:
    """Facts gathered in one pass over a file; the rules read them."""

    tree: ast.Module
    aliases: dict[str, str] = field(default_factory=dict)
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    captures: list[Capture] = field(default_factory=list)
    ddp: list[Made] = field(default_factory=list)
    optimizers: list[Made] = field(default_factory=list)
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    # methods of this file's classes by name (a name defined in two classes maps to None)
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef | None] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)

    def qualname(self, node: ast.AST) -> str | None:
        """The imported name a chain refers to (``dist.barrier`` -> torch.distributed.barrier)."""
        name = dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        full = self.aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    def call_name(self, call: ast.Call) -> str | None:
        return self.qualname(call.func)

    def scope_of(self, node: ast.AST) -> ast.AST:
        current = self.parents.get(node)
        while current is not None and not isinstance(current, (*_FUNCTIONS, ast.Module)):
            current = self.parents.get(current)
        return current if current is not None else self.tree

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        current = self.parents.get(node)
        while current is not None:
            yield current
            current = self.parents.get(current)

    def enclosing_capture(self, node: ast.AST) -> Capture | None:
        for ancestor in self.ancestors(node):
            for capture in self.captures:
                if capture.node is ancestor:
                    return capture
        return None

    def local_function(self, call: ast.Call) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The body a call runs when it is this file's: ``f()``, ``self.m()``/``obj.m()`` for a
        method name defined once in this file, ``Cls()`` for its ``__init__``."""
        func = call.func
        if isinstance(func, ast.Name):
            if func.id in self.functions:
                return self.functions[func.id]
            cls = self.classes.get(func.id)
            if cls is not None:
                return next(
                    (s for s in cls.body if isinstance(s, _FUNCTIONS) and s.name == "__init__"),
                    None,
                )
        if isinstance(func, ast.Attribute) and func.attr in self.methods:
            return self.methods[func.attr]
        return None


def is_ddp(name: str | None) -> bool:
    if name is None:
        return False
    return name in ("DDP", "DistributedDataParallel") or (
        name.startswith("torch.") and name.endswith(".DistributedDataParallel")
    )


def optimizer_class(name: str | None) -> str | None:
    if name is None:
        return None
    module, _, cls = name.rpartition(".")
    if cls in CAPTURABLE_OPTIMIZERS and (module in ("", "optim") or module.startswith("torch.")):
        return cls
    return None


def collect(tree: ast.Module) -> Module:
    mod = Module(tree)
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            mod.parents[child] = node
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    mod.aliases[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    mod.aliases[head] = head
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                mod.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.ImportFrom):  # relative: this project's own code
            for alias in node.names:
                mod.aliases[alias.asname or alias.name] = f".{node.module or ''}.{alias.name}"
        elif isinstance(node, ast.ClassDef):
            mod.classes.setdefault(node.name, node)
            for stmt in node.body:
                if isinstance(stmt, _FUNCTIONS):
                    seen = stmt.name in mod.methods
                    mod.methods[stmt.name] = None if seen else stmt
    for node in tree.body:
        if isinstance(node, _FUNCTIONS):
            mod.functions.setdefault(node.name, node)
    for node in ast.walk(tree):  # nested functions too, but a top-level one wins its name
        if isinstance(node, _FUNCTIONS) and not isinstance(mod.parents.get(node), ast.ClassDef):
            mod.functions.setdefault(node.name, node)
    _collect_streams(mod, tree, DEFAULT_STREAM)
    return mod


def _collect_streams(mod: Module, node: ast.AST, stream: str) -> None:
    """Record captures, DDP models and optimizers with the stream current where each was made."""
    for child in ast.iter_child_nodes(node):
        inner = stream
        if isinstance(child, (ast.With, ast.AsyncWith)):
            for item in child.items:
                expr = item.context_expr
                if not isinstance(expr, ast.Call):
                    continue
                name = mod.call_name(expr)
                if name == "torch.cuda.stream" and expr.args:
                    inner = text(expr.args[0])
                elif name in _GRAPH_CONTEXTS and isinstance(child, ast.With):
                    graph = arg(expr, 0, "cuda_graph")
                    capture_stream = arg(expr, 2, "stream")
                    mod.captures.append(
                        Capture(
                            child,
                            text(graph) if graph is not None else None,
                            text(capture_stream) if capture_stream is not None else GRAPH_STREAM,
                        )
                    )
        if isinstance(child, _FUNCTIONS):
            inner = DEFAULT_STREAM  # as far as this scope shows; DG103 knows it is unproven
        if isinstance(child, (ast.Assign, ast.AnnAssign)) and isinstance(child.value, ast.Call):
            _note_construction(mod, child, child.value, inner)
        _collect_streams(mod, child, inner)


def _note_construction(
    mod: Module, stmt: ast.Assign | ast.AnnAssign, call: ast.Call, stream: str
) -> None:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    if len(targets) != 1:
        return
    target = text(targets[0])
    name = mod.call_name(call)
    if is_ddp(name):
        mod.ddp.append(Made(target, call, stream, mod.scope_of(stmt)))
    elif optimizer_class(name):
        mod.optimizers.append(Made(target, call, stream, mod.scope_of(stmt)))


# --- reachability, values, positions -----------------------------------------------------------


def calls_reaching(mod: Module, root: ast.AST) -> Iterator[ast.Call]:
    """Calls in ``root`` and, transitively, in the bodies of this file's functions it calls."""
    seen: set[str] = set()
    pending: list[ast.AST] = [root]
    while pending:
        for call in calls(pending.pop()):
            yield call
            func = call.func
            if isinstance(func, ast.Name) and func.id in mod.functions and func.id not in seen:
                seen.add(func.id)
                pending.append(mod.functions[func.id])


def ddp_called(mod: Module, root: ast.AST) -> list[Made]:
    """The DDP models whose forward runs (directly or through a local function) in ``root``."""
    called = {text(c.func) for c in calls_reaching(mod, root)}
    found: dict[str, Made] = {}
    for made in mod.ddp:
        if made.target in called:
            found[made.target] = made  # the last construction of a name wins
    return list(found.values())


def made_for(made: Sequence[Made], target: str, mod: Module, use: ast.AST) -> Made | None:
    """The construction ``use`` most likely refers to: same scope and earlier, else any earlier."""
    candidates = [m for m in made if m.target == target]
    line, scope = getattr(use, "lineno", 0), mod.scope_of(use)
    earlier = [m for m in candidates if m.call.lineno <= line]
    local = [m for m in earlier if m.scope is scope]
    best = local or earlier or candidates
    return best[-1] if best else None


def assigned_values(mod: Module, name: str) -> list[ast.expr]:
    """Every value bound to ``name`` by ``name = v`` or ``name: T = v`` anywhere in the file."""
    values: list[ast.expr] = []
    for node in ast.walk(mod.tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            values.append(node.value)  # type: ignore[attr-defined]
    return values


def int_value(mod: Module, node: ast.expr) -> int | None:
    """An int the expression provably has: a literal, or a name assigned one literal once."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        values = assigned_values(mod, node.id)
        if len(values) == 1 and isinstance(values[0], ast.Constant):
            value = values[0].value
            return value if type(value) is int else None
    if isinstance(node, ast.BinOp):
        left, right = int_value(mod, node.left), int_value(mod, node.right)
        if left is not None and right is not None:
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
    return None


def range_count(mod: Module, node: ast.expr) -> int | None:
    """The number of iterations of ``range(...)`` when provable."""
    if not (isinstance(node, ast.Call) and dotted(node.func) == "range" and not node.keywords):
        return None
    bounds = [int_value(mod, a) for a in node.args]
    if not bounds or len(bounds) > 3 or any(b is None for b in bounds):
        return None
    values = [b for b in bounds if b is not None]
    start, stop, step = (0, values[0], 1) if len(values) == 1 else (values[0], values[1], 1)
    if len(values) == 3:
        step = values[2]
    if step <= 0:
        return None
    return max(0, -(-(stop - start) // step))


def statement_lists(node: ast.AST) -> Iterator[list[ast.stmt]]:
    for name in ("body", "orelse", "finalbody", "handlers"):
        value = getattr(node, name, None)
        if (
            isinstance(value, list)
            and value
            and isinstance(value[0], (ast.stmt, ast.excepthandler))
        ):
            yield value


def position(mod: Module, node: ast.AST) -> tuple[ast.AST, list[ast.stmt], int] | None:
    """The parent, the statement list holding ``node`` and its index there."""
    parent = mod.parents.get(node)
    if parent is None:
        return None
    for body in statement_lists(parent):
        for index, stmt in enumerate(body):
            if stmt is node:
                return parent, body, index
    return None


def last_assignment(mod: Module, name: str, before: ast.AST) -> ast.expr | None:
    """The value of the last ``name = ...`` (or ``name: T = ...``) at an earlier line in
    ``before``'s scope, else the module's own single binding of it."""
    found = _last_binding(mod, name, before)
    return found[1] if found is not None else None


def reaching_value(mod: Module, name: str, before: ast.AST) -> ast.expr | None:
    """Like :func:`last_assignment`, but only when that assignment reaches ``before`` on every
    path: it sits in a block that also holds ``before`` (not in one branch of an ``if`` whose
    other branch may have bound something else)."""
    found = _last_binding(mod, name, before)
    if found is None:
        return None
    statement, value = found
    if mod.scope_of(statement) is not mod.scope_of(before) and isinstance(
        mod.scope_of(before), (ast.FunctionDef, ast.AsyncFunctionDef)
    ):
        return value  # a module constant read in a function
    placed = position(mod, statement)
    if placed is None:
        return None
    _, body, index = placed
    enclosing = {id(before), *(id(a) for a in mod.ancestors(before))}
    return value if any(id(stmt) in enclosing for stmt in body[index + 1 :]) else None


def _last_binding(mod: Module, name: str, before: ast.AST) -> tuple[ast.stmt, ast.expr] | None:
    line = getattr(before, "lineno", 0)
    for scope in (mod.scope_of(before), mod.tree):
        best: tuple[int, ast.stmt, ast.expr] | None = None
        for node in walk_local(scope):
            value = _binding_value(node, name)
            if value is None or not isinstance(node, ast.stmt) or node.lineno >= line:
                continue
            if best is None or node.lineno > best[0]:
                best = (node.lineno, node, value)
        if best is not None:
            return best[1], best[2]
    return None


def _binding_value(node: ast.AST, name: str) -> ast.expr | None:
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == name:
            return node.value
    if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
        return None
    return node.value if node.target.id == name else None


def exclusive(mod: Module, first: ast.AST, second: ast.AST) -> bool:
    """The two nodes sit in different branches of one ``if``: a pass runs at most one of them."""
    chain = [second, *mod.ancestors(second)]
    index_of = {id(node): index for index, node in enumerate(chain)}
    previous = first
    for node in mod.ancestors(first):
        index = index_of.get(id(node))
        if index is None:
            previous = node
            continue
        if index == 0:
            return False  # ``second`` encloses ``first``
        other = chain[index - 1]
        if isinstance(node, ast.If):
            return (_holds(node.body, previous) and _holds(node.orelse, other)) or (
                _holds(node.orelse, previous) and _holds(node.body, other)
            )
        if isinstance(node, ast.IfExp):
            return {id(previous), id(other)} == {id(node.body), id(node.orelse)}
        return False
    return False


def _holds(body: Sequence[ast.stmt], node: ast.AST) -> bool:
    return any(stmt is node for stmt in body)
