"""Static checks for the classic DDP / CUDA-graph / object-collective bugs (``ddpgraph lint``).

The script is parsed, never imported or run. Each rule has a code (``DG1xx``), a message that
names what was seen and a fix. The rules err on the side of silence: a value the linter cannot
prove wrong (a count read from the command line, a list built elsewhere) is not reported.

A finding is silenced by ``# noqa`` or ``# noqa: DG104`` on its line.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["RULES", "Finding", "LintError", "Rule", "lint_file", "lint_paths", "lint_source"]


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    summary: str


RULES: dict[str, Rule] = {
    rule.code: rule
    for rule in (
        Rule(
            "DG101",
            "unbound-device",
            "collective, NCCL process group or DDP before any device binding",
        ),
        Rule(
            "DG102",
            "object-list-size",
            "all_gather_object / gather_object output list not sized by the world size",
        ),
        Rule(
            "DG103",
            "ddp-capture-stream",
            "DDP model captured on another stream than the one it was constructed on",
        ),
        Rule(
            "DG104",
            "ddp-warmup-count",
            "fewer than 11 eager DDP iterations before capture, or a multiple of 100",
        ),
        Rule("DG105", "sync-in-capture", "host synchronisation or data loading inside a capture"),
        Rule(
            "DG106",
            "optimizer-not-capturable",
            "Adam-family optimizer without capturable=True stepped inside a capture",
        ),
        Rule(
            "DG107",
            "double-optimizer-step",
            "optimizer stepped inside the graph and again after its replay",
        ),
        Rule(
            "DG108",
            "static-input-rebound",
            "static graph input re-bound by assignment instead of copy_() between replays",
        ),
    )
}


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    col: int
    code: str
    message: str
    fix: str

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "rule": RULES[self.code].name}

    def format_text(self) -> str:
        return (
            f"{self.file}:{self.line}:{self.col}: {self.code} {self.message}\n    fix: {self.fix}"
        )


class LintError(Exception):
    """A file could not be read or parsed; ``path`` names it, the message says why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"{path}: {reason}")


# --- what the rules look for ----------------------------------------------------------------

_DDP = "torch.nn.parallel.DistributedDataParallel"
_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "monitored_barrier",
    }
)
_BINDERS = frozenset(
    {"torch.cuda.set_device", "torch.accelerator.set_device_index", "torch.cuda.device"}
)
# Optimizers whose step keeps host-side state unless capturable=True (torch/optim).
_CAPTURABLE_OPTIMIZERS = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "ASGD"})
_SYNC_METHODS = frozenset({"item", "cpu", "numpy", "tolist"})
_DEFAULT_STREAM = "<the default stream>"
_GRAPH_STREAM = "<torch.cuda.graph's own capture stream>"
_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z0-9, ]+))?", re.IGNORECASE)


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, None for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _text(node: ast.AST) -> str:
    return ast.unparse(node)


def _kwarg(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _arg(call: ast.Call, index: int, name: str) -> ast.expr | None:
    """The argument passed as keyword ``name`` or at position ``index``."""
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args):
        return call.args[index]
    return _kwarg(call, name)


def _walk_local(node: ast.AST) -> Iterator[ast.AST]:
    """Like ast.walk, but does not enter nested function or class definitions (other scopes)."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stack.append(child)


def _calls(node: ast.AST) -> Iterator[ast.Call]:
    return (n for n in _walk_local(node) if isinstance(n, ast.Call))


@dataclass
class _Capture:
    node: ast.With
    graph: str | None  # text of the CUDAGraph expression
    stream: str  # text of the capture stream, or _GRAPH_STREAM


@dataclass
class _Made:
    """An object built by an assignment ``target = Ctor(...)``: a DDP model or an optimizer."""

    target: str
    call: ast.Call
    stream: str  # the stream current at construction (DDP)
    scope: ast.AST


@dataclass
class _Module:
    """Facts gathered in one pass over a file; the rules read them."""

    tree: ast.Module
    aliases: dict[str, str] = field(default_factory=dict)
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    captures: list[_Capture] = field(default_factory=list)
    ddp: list[_Made] = field(default_factory=list)
    optimizers: list[_Made] = field(default_factory=list)
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)

    def qualname(self, node: ast.expr) -> str | None:
        """The imported name a Name/Attribute chain refers to (``dist.barrier`` -> torch.distributed.barrier)."""
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        full = self.aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    def call_name(self, call: ast.Call) -> str | None:
        return self.qualname(call.func)

    def scope_of(self, node: ast.AST) -> ast.AST:
        current = self.parents.get(node)
        while current is not None and not isinstance(
            current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)
        ):
            current = self.parents.get(current)
        return current if current is not None else self.tree

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        current = self.parents.get(node)
        while current is not None:
            yield current
            current = self.parents.get(current)

    def enclosing_capture(self, node: ast.AST) -> _Capture | None:
        for ancestor in self.ancestors(node):
            for capture in self.captures:
                if capture.node is ancestor:
                    return capture
        return None


def _is_ddp(name: str | None) -> bool:
    if name is None:
        return False
    return name in ("DDP", "DistributedDataParallel") or (
        name.startswith("torch.") and name.endswith(".DistributedDataParallel")
    )


def _is_collective(name: str | None) -> bool:
    if name is None:
        return False
    module, _, func = name.rpartition(".")
    return module == "torch.distributed" and func in _COLLECTIVES


def _optimizer_class(name: str | None) -> str | None:
    if name is None:
        return None
    module, _, cls = name.rpartition(".")
    if cls in _CAPTURABLE_OPTIMIZERS and (module in ("", "optim") or module.startswith("torch.")):
        return cls
    return None


def _collect(tree: ast.Module) -> _Module:
    mod = _Module(tree)
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
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mod.functions.setdefault(node.name, node)
    _collect_streams(mod, tree, _DEFAULT_STREAM)
    return mod


def _collect_streams(mod: _Module, node: ast.AST, stream: str) -> None:
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
                    inner = _text(expr.args[0])
                elif name in ("torch.cuda.graph", "torch.cuda.graphs.graph") and isinstance(
                    child, ast.With
                ):
                    graph = _arg(expr, 0, "cuda_graph")
                    capture_stream = _arg(expr, 2, "stream")
                    mod.captures.append(
                        _Capture(
                            child,
                            _text(graph) if graph is not None else None,
                            _text(capture_stream) if capture_stream is not None else _GRAPH_STREAM,
                        )
                    )
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = _DEFAULT_STREAM  # a function body runs on whatever stream its caller has
        if isinstance(child, (ast.Assign, ast.AnnAssign)) and isinstance(child.value, ast.Call):
            _note_construction(mod, child, child.value, inner)
        _collect_streams(mod, child, inner)


def _note_construction(
    mod: _Module, stmt: ast.Assign | ast.AnnAssign, call: ast.Call, stream: str
) -> None:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    if len(targets) != 1:
        return
    target = _text(targets[0])
    name = mod.call_name(call)
    if _is_ddp(name):
        mod.ddp.append(_Made(target, call, stream, mod.scope_of(stmt)))
    elif _optimizer_class(name):
        mod.optimizers.append(_Made(target, call, stream, mod.scope_of(stmt)))


# --- helpers shared by the graph rules --------------------------------------------------------


def _calls_reaching(mod: _Module, root: ast.AST) -> Iterator[ast.Call]:
    """Calls in ``root`` and, transitively, in the bodies of this file's functions it calls."""
    seen: set[str] = set()
    pending: list[ast.AST] = [root]
    while pending:
        for call in _calls(pending.pop()):
            yield call
            func = call.func
            if isinstance(func, ast.Name) and func.id in mod.functions and func.id not in seen:
                seen.add(func.id)
                pending.append(mod.functions[func.id])


def _ddp_called(mod: _Module, root: ast.AST) -> list[_Made]:
    """The DDP models whose forward runs (directly or through a local function) in ``root``."""
    called = {_text(c.func) for c in _calls_reaching(mod, root)}
    found: dict[str, _Made] = {}
    for made in mod.ddp:
        if made.target in called:
            found[made.target] = made  # the last construction of a name wins
    return list(found.values())


def _made_for(made: Sequence[_Made], target: str, mod: _Module, use: ast.AST) -> _Made | None:
    """The construction ``use`` most likely refers to: same scope and earlier, else any earlier."""
    candidates = [m for m in made if m.target == target]
    line, scope = getattr(use, "lineno", 0), mod.scope_of(use)
    earlier = [m for m in candidates if m.call.lineno <= line]
    local = [m for m in earlier if m.scope is scope]
    best = local or earlier or candidates
    return best[-1] if best else None


def _int_value(mod: _Module, node: ast.expr) -> int | None:
    """An int the expression provably has: a literal, or a name assigned one literal once."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        values = [
            n.value
            for n in ast.walk(mod.tree)
            if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets)
        ]
        annotated = [
            n.value
            for n in ast.walk(mod.tree)
            if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)
            and n.target.id == node.id
            and n.value is not None
        ]
        values += annotated
        if len(values) == 1:
            value = values[0]
            if isinstance(value, ast.Constant) and type(value.value) is int:
                return value.value
    if isinstance(node, ast.BinOp):
        left, right = _int_value(mod, node.left), _int_value(mod, node.right)
        if left is not None and right is not None:
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
    return None


def _range_count(mod: _Module, node: ast.expr) -> int | None:
    """The number of iterations of ``range(...)`` when provable."""
    if not (isinstance(node, ast.Call) and _dotted(node.func) == "range" and not node.keywords):
        return None
    bounds = [_int_value(mod, a) for a in node.args]
    if not bounds or any(b is None for b in bounds) or len(bounds) > 3:
        return None
    values = [b for b in bounds if b is not None]
    start, stop, step = (0, values[0], 1) if len(values) == 1 else (*values[:2], 1)
    if len(values) == 3:
        step = values[2]
    if step <= 0:
        return None
    return max(0, -(-(stop - start) // step))


def _statement_lists(node: ast.AST) -> Iterator[list[ast.stmt]]:
    for name in ("body", "orelse", "finalbody", "handlers"):
        value = getattr(node, name, None)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            yield value


def _position(mod: _Module, node: ast.AST) -> tuple[ast.AST, list[ast.stmt], int] | None:
    """The parent, the statement list holding ``node`` and its index there."""
    parent = mod.parents.get(node)
    if parent is None:
        return None
    for body in _statement_lists(parent):
        for index, stmt in enumerate(body):
            if stmt is node:
                return parent, body, index
    return None


# --- the rules --------------------------------------------------------------------------------

_Emit = Callable[[ast.AST, str, str, str], None]


def _rule_unbound_device(mod: _Module, emit: _Emit) -> None:
    """DG101: the first collective / DDP / NCCL group that provably runs before any binding."""
    groups = [c for c in _all_calls(mod) if mod.call_name(c) == _INIT_GROUP]
    bindings = [c for c in _all_calls(mod) if _binds_device(mod, c)]
    if not _uses_cuda(mod) or not (groups or bindings):
        return  # a CPU job, or a library module whose caller may have bound the device
    nccl = any(_maybe_nccl(g) for g in groups)
    triggers: list[tuple[ast.Call, str]] = []
    for call in _all_calls(mod):
        name = mod.call_name(call)
        if nccl and _is_collective(name):
            triggers.append((call, f"dist.{(name or '').rpartition('.')[2]}()"))
        elif _is_ddp(name) and (nccl or _kwarg(call, "device_ids") is not None):
            triggers.append((call, "DistributedDataParallel(...)"))
    if not bindings:
        triggers += [(g, f"{_text(g.func)}({_backend_text(g)})") for g in groups if _maybe_nccl(g)]
    unbound = [(c, what) for c, what in triggers if not _bound_before(mod, c, bindings)]
    if not unbound:
        return
    call, what = min(unbound, key=lambda t: (t[0].lineno, t[0].col_offset))
    where = (
        "no torch.cuda.set_device(), init_process_group(device_id=...) or ddpgraph.init() "
        "in this file"
        if not bindings
        else "the device is bound only later in the same function"
    )
    emit(
        call,
        "DG101",
        f"{what} runs before this rank's CUDA device is bound ({where}); every rank then "
        "uses cuda:0, and object collectives hang or NCCL reports 'Duplicate GPU detected'",
        "call ddpgraph.init(), or torch.cuda.set_device(local_rank) with "
        "init_process_group('nccl', device_id=torch.device('cuda', local_rank)), before any "
        "CUDA work or collective",
    )


_INIT_GROUP = "torch.distributed.init_process_group"


def _all_calls(mod: _Module) -> list[ast.Call]:
    return [n for n in ast.walk(mod.tree) if isinstance(n, ast.Call)]


def _binds_device(mod: _Module, call: ast.Call) -> bool:
    name = mod.call_name(call) or ""
    if name == _INIT_GROUP:
        return _kwarg(call, "device_id") is not None
    return name in _BINDERS or name == "ddpgraph.init" or name.endswith(".ddpgraph.init")


def _maybe_nccl(call: ast.Call) -> bool:
    """NCCL unless the backend is a literal without it (no backend: NCCL on a CUDA machine)."""
    backend = _arg(call, 0, "backend")
    if isinstance(backend, ast.Constant) and isinstance(backend.value, str):
        return "nccl" in backend.value.lower()
    return True


def _backend_text(call: ast.Call) -> str:
    backend = _arg(call, 0, "backend")
    return _text(backend) if backend is not None else ""


def _uses_cuda(mod: _Module) -> bool:
    """The rule is about GPUs: a CPU/gloo-only script has nothing to bind."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value == "nccl" or node.value.startswith("cuda"):
                return True
        elif isinstance(node, ast.Attribute):
            if node.attr == "cuda" or (mod.qualname(node) or "").startswith("torch.cuda"):
                return True
        elif isinstance(node, ast.keyword) and node.arg in ("device_ids", "output_device"):
            return True
    return False


def _bound_before(mod: _Module, trigger: ast.Call, bindings: Sequence[ast.Call]) -> bool:
    """Proof of the bug only: a binding elsewhere may run first, one later in the same scope cannot."""
    scope = mod.scope_of(trigger)
    for binding in bindings:
        if mod.scope_of(binding) is not scope or binding.lineno <= trigger.lineno:
            return True
    return False


def _rule_object_list_size(mod: _Module, emit: _Emit) -> None:
    """DG102: the output list of all_gather_object / gather_object has a fixed size."""
    for call in (n for n in ast.walk(mod.tree) if isinstance(n, ast.Call)):
        name = mod.call_name(call)
        if name == "torch.distributed.all_gather_object":
            output, func = _arg(call, 0, "object_list"), "all_gather_object"
        elif name == "torch.distributed.gather_object":
            output, func = _arg(call, 1, "object_gather_list"), "gather_object"
        else:
            continue
        if output is None:
            continue
        subgroup = _kwarg(call, "group") is not None  # its size may well be world size - k
        for problem in _fixed_sizes(mod, output, call, offsets=not subgroup):
            emit(
                call,
                "DG102",
                f"{func}() gets an output list {problem}, not one entry per rank; at any other "
                "length than the world size torch raises or leaves silent None entries",
                "pass [None] * dist.get_world_size() (or use ddpgraph.all_gather_object, which "
                "returns the list)",
            )
            break


def _fixed_sizes(
    mod: _Module, expr: ast.expr, call: ast.Call, depth: int = 0, *, offsets: bool = True
) -> Iterator[str]:
    """Describe each way ``expr`` is provably a list whose size ignores the world size
    (``offsets``: also world size +/- k, wrong unless the call is on a subgroup)."""
    if depth > 3:
        return
    if isinstance(expr, ast.IfExp):
        yield from _fixed_sizes(mod, expr.body, call, depth + 1, offsets=offsets)
        yield from _fixed_sizes(mod, expr.orelse, call, depth + 1, offsets=offsets)
    elif isinstance(expr, ast.List) and not any(isinstance(e, ast.Starred) for e in expr.elts):
        yield f"{_text(expr)} of {len(expr.elts)} entries" if expr.elts else "[] (empty)"
    elif isinstance(expr, ast.Call) and _dotted(expr.func) == "list" and not expr.args:
        yield "list() (empty)"
    elif isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult):
        for lst, size in ((expr.left, expr.right), (expr.right, expr.left)):
            if not isinstance(lst, ast.List):
                continue
            if _int_value(mod, size) is not None and not _mentions_world_size(size):
                yield f"{_text(expr)} of {_int_value(mod, size)} entries"
            elif offsets and (offset := _world_size_offset(mod, size)) is not None:
                yield f"{_text(expr)} of world size {offset:+d} entries"
    elif isinstance(expr, ast.ListComp) and len(expr.generators) == 1:
        count = _range_count(mod, expr.generators[0].iter)
        if count is not None and not _mentions_world_size(expr.generators[0].iter):
            yield f"{_text(expr)} of {count} entries"
    elif isinstance(expr, ast.Name):
        value = _last_assignment(mod, expr.id, call)
        if value is not None:
            yield from _fixed_sizes(mod, value, call, depth + 1, offsets=offsets)


def _world_size_offset(mod: _Module, expr: ast.expr) -> int | None:
    """k where ``expr`` is ``<world size> + k`` or ``- k`` with k a non-zero literal, else None."""
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add | ast.Sub)):
        return None
    sign = 1 if isinstance(expr.op, ast.Add) else -1
    left_k, right_k = _int_value(mod, expr.left), _int_value(mod, expr.right)
    if right_k and _mentions_world_size(expr.left) and not _mentions_world_size(expr.right):
        return sign * right_k  # world + k, world - k
    if left_k and sign == 1 and _mentions_world_size(expr.right):
        return left_k  # k + world ("k - world" is no size anyone means)
    return None


def _mentions_world_size(expr: ast.expr) -> bool:
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and "world" in node.id.lower():
            return True
        if isinstance(node, ast.Attribute) and "world" in node.attr.lower():
            return True
    return False


def _last_assignment(mod: _Module, name: str, before: ast.AST) -> ast.expr | None:
    """The value of the last ``name = ...`` in ``before``'s scope at an earlier line."""
    scope = mod.scope_of(before)
    line = getattr(before, "lineno", 0)
    best: ast.Assign | None = None
    for node in _walk_local(scope):
        if (
            isinstance(node, ast.Assign)
            and node.lineno < line
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == name
            and (best is None or node.lineno > best.lineno)
        ):
            best = node
    return best.value if best is not None else None


def _rule_capture_stream(mod: _Module, emit: _Emit) -> None:
    """DG103: a captured DDP model was constructed on another stream than the capture's."""
    for capture in mod.captures:
        for made in _ddp_called(mod, capture.node):
            made = _made_for(mod.ddp, made.target, mod, capture.node) or made
            if made.stream == capture.stream:
                continue
            on = "the default stream" if made.stream == _DEFAULT_STREAM else f"stream {made.stream}"
            into = (
                "torch.cuda.graph's own side stream (no stream= given)"
                if capture.stream == _GRAPH_STREAM
                else f"stream {capture.stream}"
            )
            emit(
                capture.node,
                "DG103",
                f"DDP model {made.target!r} was constructed on {on} (line {made.call.lineno}) but "
                f"is captured on {into}; capture fails with 'operation would make the legacy "
                "stream depend on a capturing blocking stream'",
                "create s = torch.cuda.Stream(); construct DDP, the optimizer and the warm-up "
                "under `with torch.cuda.stream(s):` and capture with "
                "`torch.cuda.graph(g, stream=s)` (ddpgraph.TrainStep does this)",
            )


def _rule_warmup_count(mod: _Module, emit: _Emit) -> None:
    """DG104: the eager DDP iterations before a capture are < 11 or a multiple of 100."""
    for capture in mod.captures:
        models = _ddp_called(mod, capture.node)
        if not models:
            continue
        targets = {m.target for m in models}
        found = _warmup_before(mod, capture.node, targets)
        if found == "none" and _never_warmed(mod, capture.node, models):
            found = (0, capture.node)
        if not isinstance(found, tuple):
            continue
        count, where = found
        if count >= 11 and count % 100 != 0:
            continue
        reason = "fewer than 11" if count < 11 else "a multiple of 100"
        emit(
            where,
            "DG104",
            f"{count} eager DDP iteration(s) before the capture at line {capture.node.lineno} "
            f"({reason}): DDP records CUDA-event timers at iterations 0..10 and every 100th, "
            "so the captured forward fails with 'operation not permitted when stream is "
            "capturing'",
            "run at least 11 eager iterations before capture, and not a multiple of 100 "
            "(e.g. 11 or 20)",
        )


def _warmup_before(
    mod: _Module, capture: ast.With, targets: set[str]
) -> tuple[int, ast.AST] | Literal["none"] | None:
    """The provable warm-up count before ``capture`` and the node that sets it; "none" when the
    scope holds no eager call of the model before it; None when the count is unknowable."""
    node: ast.AST = capture
    equal_to: tuple[str, int, ast.AST] | None = None  # from `if i == N:` around the capture
    while True:
        placed = _position(mod, node)
        if placed is None:
            return None
        parent, body, index = placed
        for stmt in reversed(body[:index]):
            loop = _loop_calling(mod, stmt, targets)
            if loop is not None:
                count = _range_count(mod, loop.iter)
                return (count, loop.iter) if count is not None else None
            if _reaches_ddp(mod, stmt, targets):
                return None  # eager calls the linter cannot count
        if isinstance(parent, ast.If) and body is parent.body:
            equal_to = _equality(mod, parent.test) or equal_to
        if isinstance(parent, ast.For) and equal_to is not None:
            variable, count, where = equal_to
            if _counts_from_zero(parent, variable):
                return count, where
        if isinstance(parent, (ast.For, ast.AsyncFor, ast.While)):
            return None  # earlier passes of this loop may have been the warm-up
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            return "none"
        node = parent


def _never_warmed(mod: _Module, capture: ast.With, models: Sequence[_Made]) -> bool:
    """The model is built in the capture's own scope and nothing between could have run it."""
    scope = mod.scope_of(capture)
    for model in models:
        made = _made_for(mod.ddp, model.target, mod, capture)
        if made is None or made.scope is not scope or made.call.lineno >= capture.lineno:
            return False
        between = [c for c in _calls(scope) if made.call.lineno < c.lineno < capture.lineno]
        for call in between:
            passed = [*call.args, *(k.value for k in call.keywords)]
            if any(_text(a) == model.target for a in passed):
                return False  # handed to a helper that may warm it up
            if isinstance(call.func, ast.Name) and call.func.id in mod.functions:
                return False  # a local function may use the model through a global
    return True


def _loop_calling(mod: _Module, stmt: ast.stmt, targets: set[str]) -> ast.For | None:
    loops = [n for n in _walk_local(stmt) if isinstance(n, ast.For)]
    for loop in sorted(loops, key=lambda n: n.lineno, reverse=True):
        if mod.enclosing_capture(loop) is None and _reaches_ddp(mod, loop, targets):
            return loop
    return None


def _reaches_ddp(mod: _Module, node: ast.AST, targets: set[str]) -> bool:
    return any(_text(c.func) in targets for c in _calls_reaching(mod, node))


def _equality(mod: _Module, test: ast.expr) -> tuple[str, int, ast.AST] | None:
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.left, ast.Name)
    ):
        value = _int_value(mod, test.comparators[0])
        if value is not None:
            return test.left.id, value, test
    return None


def _counts_from_zero(loop: ast.For, variable: str) -> bool:
    """``for i in range(...)`` / ``for i, x in enumerate(...)``: i is the number of earlier passes."""
    it = loop.iter
    if not isinstance(it, ast.Call) or it.keywords:
        return False
    func = _dotted(it.func)
    if func == "range" and len(it.args) == 1:
        return isinstance(loop.target, ast.Name) and loop.target.id == variable
    if func == "enumerate" and len(it.args) == 1 and isinstance(loop.target, ast.Tuple):
        first = loop.target.elts[0]
        return isinstance(first, ast.Name) and first.id == variable
    return False


def _rule_sync_in_capture(mod: _Module, emit: _Emit) -> None:
    """DG105: .item() / .cpu() / print(tensor) / next(loader) / synchronize inside a capture."""
    for capture in mod.captures:
        for call in _calls_reaching(mod, capture.node):
            what = _sync_kind(mod, call)
            if what is None:
                continue
            emit(
                call,
                "DG105",
                f"{what} inside the CUDA-graph capture at line {capture.node.lineno}: "
                + (
                    "it runs once, while capturing, so every replay reuses the first batch"
                    if what.startswith("next(")
                    else "it waits for the GPU, which a capturing stream forbids ('operation "
                    "not permitted when stream is capturing'), and would run only once anyway"
                ),
                "move it out of the captured region: copy each batch into the static inputs "
                "before g.replay(), and read static outputs (loss.item()) after the replay",
            )


def _sync_kind(mod: _Module, call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in _SYNC_METHODS and not call.args:
        return f"{_text(func)}()"
    name = mod.call_name(call)
    if name == "torch.cuda.synchronize":
        return "torch.cuda.synchronize()"
    if name == "next":
        return f"{_text(call)}"
    if name == "print" and any(_may_be_tensor(a) for a in call.args):
        return f"{_text(call)}"
    return None


def _may_be_tensor(arg: ast.expr) -> bool:
    if isinstance(arg, ast.Constant):
        return False
    if isinstance(arg, ast.JoinedStr):
        return any(
            isinstance(v, ast.FormattedValue) and not isinstance(v.value, ast.Constant)
            for v in arg.values
        )
    return True


def _rule_optimizer_capturable(mod: _Module, emit: _Emit) -> None:
    """DG106: an Adam-family optimizer without capturable=True is stepped inside a capture."""
    for capture in mod.captures:
        for call in _calls_reaching(mod, capture.node):
            stepped = _stepped_optimizer(call)
            if stepped is None:
                continue
            made = _made_for(mod.optimizers, stepped, mod, capture.node)
            if made is None or not _not_capturable(made.call):
                continue
            cls = _optimizer_class(mod.call_name(made.call))
            emit(
                call,
                "DG106",
                f"{stepped}.step() inside the capture at line {capture.node.lineno}, but "
                f"{stepped} = {cls}(...) (line {made.call.lineno}) is not capturable=True; "
                'capture fails with "... capturable is False"',
                f"construct it with {cls}(..., capturable=True) before the warm-up",
            )


def _stepped_optimizer(call: ast.Call) -> str | None:
    """``opt`` for ``opt.step()`` and for ``scaler.step(opt)``."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "step"):
        return None
    if not call.args:
        return _text(func.value)
    return _text(call.args[0])


def _not_capturable(call: ast.Call) -> bool:
    if any(k.arg is None for k in call.keywords):
        return False  # **kwargs may carry capturable=True
    value = _kwarg(call, "capturable")
    return value is None or (isinstance(value, ast.Constant) and value.value is False)


def _schedulers(mod: _Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(mod.tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if "lr_scheduler" in (mod.call_name(node.value) or ""):
            names.update(_text(t) for t in node.targets)
    return names


def _replays(mod: _Module, capture: _Capture) -> Iterator[ast.Call]:
    """``g.replay()`` calls of the captured graph, in the scope that captured it."""
    scope = mod.scope_of(capture.node)
    for call in _calls(scope):
        func = call.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "replay"
            and _text(func.value) == capture.graph
        ):
            yield call


def _replay_region(mod: _Module, replay: ast.Call) -> tuple[ast.AST, int]:
    """What runs around a replay: its innermost loop (any order), or the rest of its block."""
    statement: ast.AST = replay
    for ancestor in mod.ancestors(replay):
        if isinstance(ancestor, (ast.For, ast.AsyncFor, ast.While)):
            return ancestor, 0
        if isinstance(ancestor, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            break
        statement = ancestor
    placed = _position(mod, statement)
    if placed is None:
        return statement, replay.lineno
    parent, _, _ = placed
    return parent, replay.lineno


def _rule_double_step(mod: _Module, emit: _Emit) -> None:
    """DG107: the optimizer stepped inside the graph is stepped again around its replay."""
    for capture in mod.captures:
        if capture.graph is None:
            continue
        inside = {s for c in _calls_reaching(mod, capture.node) if (s := _stepped_optimizer(c))}
        inside -= _schedulers(mod)  # scheduler.step() is host-side; only optimizers matter here
        if not inside:
            continue
        for replay in _replays(mod, capture):
            region, after = _replay_region(mod, replay)
            for call in _calls(region):
                stepped = _stepped_optimizer(call)
                if (
                    stepped in inside
                    and call.lineno > after
                    and mod.enclosing_capture(call) is None
                ):
                    emit(
                        call,
                        "DG107",
                        f"{stepped}.step() is already captured in {capture.graph} (line "
                        f"{capture.node.lineno}); calling it again around "
                        f"{capture.graph}.replay() (line {replay.lineno}) updates the "
                        "parameters twice per batch",
                        f"remove this {stepped}.step(): {capture.graph}.replay() already runs it",
                    )


def _rule_static_rebound(mod: _Module, emit: _Emit) -> None:
    """DG108: a name the graph reads is re-bound between replays instead of copy_()."""
    for capture in mod.captures:
        if capture.graph is None:
            continue
        inputs = _static_inputs(mod, capture)
        if not inputs:
            continue
        reported: set[int] = set()
        for replay in _replays(mod, capture):
            region, _ = _replay_region(mod, replay)
            for name, node in _rebindings(mod, region, inputs):
                if id(node) in reported or _sets_up(mod, node, capture.node):
                    continue
                reported.add(id(node))
                emit(
                    node,
                    "DG108",
                    f"{name!r} is read by the graph captured at line {capture.node.lineno} but "
                    f"is re-bound here before {capture.graph}.replay(); the replay still reads "
                    "the tensor (or value) it saw at capture, so every replay trains on the same data",
                    f"keep the static tensor and copy into it: {name}.copy_(new_value)",
                )


def _sets_up(mod: _Module, assignment: ast.AST, capture: ast.With) -> bool:
    """An assignment in the same block as the capture, just before it, creates the static input."""
    mine, theirs = _position(mod, assignment), _position(mod, capture)
    return mine is not None and theirs is not None and mine[1] is theirs[1] and mine[2] < theirs[2]


def _static_inputs(mod: _Module, capture: _Capture) -> set[str]:
    """Names read inside the capture, before any write there, that were bound earlier."""
    written: set[str] = set()
    read: set[str] = set()
    names = sorted(
        (n for n in _walk_local(capture.node) if isinstance(n, ast.Name)),
        key=lambda n: (n.lineno, n.col_offset),
    )
    for name in names:
        if isinstance(name.ctx, ast.Store):
            written.add(name.id)
        elif name.id not in written:
            read.add(name.id)
    # Modules, losses and functions are called, not fed: only data can be a static input.
    called = {_text(c.func) for c in _calls(capture.node)}
    skip = called | {m.target for m in mod.ddp + mod.optimizers} | set(mod.aliases)
    skip |= set(mod.functions) | {capture.graph or ""}
    return {
        name
        for name in read - skip
        if _last_assignment(mod, name, capture.node) is not None
        or _loop_binds(mod, capture.node, name)
        or name in _parameters(mod.scope_of(capture.node))
    }


def _parameters(scope: ast.AST) -> set[str]:
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    args = scope.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}


def _loop_binds(mod: _Module, node: ast.AST, name: str) -> bool:
    return any(
        isinstance(a, ast.For) and name in _target_names(a.target) for a in mod.ancestors(node)
    )


def _target_names(target: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _rebindings(mod: _Module, region: ast.AST, inputs: set[str]) -> Iterator[tuple[str, ast.AST]]:
    if isinstance(region, (ast.For, ast.AsyncFor)):
        for name in sorted(_target_names(region.target) & inputs):
            yield name, region.target
    for node in _walk_local(region):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or mod.enclosing_capture(node):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for name in sorted(_target_names(target) & inputs):
                if not isinstance(target, (ast.Subscript, ast.Attribute)):
                    yield name, node


_RULE_FUNCTIONS: tuple[Callable[[_Module, _Emit], None], ...] = (
    _rule_unbound_device,
    _rule_object_list_size,
    _rule_capture_stream,
    _rule_warmup_count,
    _rule_sync_in_capture,
    _rule_optimizer_capturable,
    _rule_double_step,
    _rule_static_rebound,
)


# --- entry points -----------------------------------------------------------------------------


def lint_source(source: str, filename: str = "<string>") -> list[Finding]:
    """Every finding in ``source``, sorted by position. Raises :class:`LintError` on a syntax error."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise LintError(
            filename, f"cannot parse: {exc.msg} at line {exc.lineno}, column {exc.offset}"
        ) from None
    except ValueError as exc:  # e.g. null bytes
        raise LintError(filename, f"cannot parse: {exc}") from None
    mod = _collect(tree)
    lines = source.splitlines()
    findings: dict[tuple[int, int, str], Finding] = {}

    def emit(node: ast.AST, code: str, message: str, fix: str) -> None:
        line, col = getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1
        if _suppressed(lines, line, code):
            return
        findings.setdefault((line, col, code), Finding(filename, line, col, code, message, fix))

    for rule in _RULE_FUNCTIONS:
        rule(mod, emit)
    return sorted(findings.values(), key=lambda f: (f.line, f.col, f.code))


def _suppressed(lines: Sequence[str], line: int, code: str) -> bool:
    if not 1 <= line <= len(lines):
        return False
    match = _NOQA.search(lines[line - 1])
    if match is None:
        return False
    codes = match.group("codes")
    return codes is None or code in {c.strip().upper() for c in codes.split(",")}


def lint_file(path: str | Path) -> list[Finding]:
    """Findings of one file; :class:`LintError` if it cannot be read or parsed."""
    name = str(path)
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise LintError(name, f"cannot read: {reason}") from None
    return lint_source(source, name)


def lint_paths(paths: Iterable[str | Path]) -> tuple[list[Finding], list[LintError]]:
    """Lint every file (directories: their ``*.py``); return the findings and the files that failed."""
    findings: list[Finding] = []
    errors: list[LintError] = []
    for path in map(Path, paths):
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        if not files:  # a wrong directory must not pass as "no findings"
            errors.append(LintError(str(path), "is a directory without any *.py file"))
        for file in files:
            try:
                findings.extend(lint_file(file))
            except LintError as exc:
                errors.append(exc)
    return findings, errors
