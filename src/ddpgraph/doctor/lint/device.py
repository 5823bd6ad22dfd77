"""DG101: a collective that uses the current device runs before this rank's device is bound.

Why it matters: object collectives (``all_gather_object`` ...) put their payload on
``torch.cuda.current_device()``; tensor collectives and DDP use the tensors' device. Without a
binding every rank's current device is cuda:0, so object collectives hang or NCCL reports
"Duplicate GPU detected"; tensors made with a bare ``.cuda()`` land on cuda:0 as well.

The rule follows the file's entry points (module code, the ``__main__`` block, ``main()``, the
function handed to ``mp.spawn``) through this file's functions, in execution order, with the
binding state on every path: bound, unbound or maybe. It reports a trigger only where the device
is unbound on every path and an NCCL group was initialized on that path. Any binding torch offers
counts: ``set_device`` on any accelerator module (however it was reached),
``torch.accelerator.set_device_index``, ``init_process_group(device_id=...)``, an entered
``torch.cuda.device(...)``, ``CUDA_VISIBLE_DEVICES`` set per rank, ``ddpgraph.init()``.
A function of another module called first might bind the device: that makes it "maybe" (a note
in strict mode). Functions no entry point reaches are a library's: checked only in strict mode,
as notes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

from .astutil import Module, arg, dotted, kwarg, text
from .core import Report

_INIT_GROUP = "torch.distributed.init_process_group"
# These use the current device: object collectives put their payload there
# (_get_object_coll_device), and barrier() without device_ids / device_id= runs on it ("using the
# device under current context", distributed_c10d.barrier).
_CURRENT_DEVICE_CALLS = frozenset(
    {
        "all_gather_object",
        "gather_object",
        "broadcast_object_list",
        "scatter_object_list",
        "barrier",
        "monitored_barrier",
    }
)
# These use the device of the tensors they get: wrong only for tensors made on cuda:0 by default.
_TENSOR_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "gather",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
    }
)
_SPAWNERS = frozenset(
    {
        "torch.multiprocessing.spawn",
        "torch.multiprocessing.start_processes",
        "multiprocessing.Process",
        "torch.multiprocessing.Process",
    }
)
_SCOPED_BINDERS = frozenset({"torch.cuda.device", "torch.accelerator.device_index"})
# Calls into these never bind the device or initialize a group.
_INERT_ROOTS = frozenset(
    {
        "torch",
        "torchvision",
        "numpy",
        "os",
        "sys",
        "argparse",
        "time",
        "math",
        "random",
        "json",
        "logging",
        "functools",
        "itertools",
        "collections",
        "pathlib",
        "datetime",
        "typing",
        "dataclasses",
        "re",
        "shutil",
        "tempfile",
        "warnings",
        "contextlib",
        "copy",
        "pickle",
        "socket",
        "subprocess",
        "tqdm",
        "yaml",
        "pandas",
        "PIL",
        "matplotlib",
    }
)
# Words in the name of another module's function that may bind the device or make the group.
_SETUP_WORDS = (
    "dist",
    "setup",
    "set_up",
    "initialize",
    "device",
    "launch",
    "rank",
    "gpu",
    "cuda",
    "parallel",
    "accelerat",
    "process_group",
)
_FIX = (
    "call ddpgraph.init(), or torch.cuda.set_device(local_rank) (any accelerator: "
    "torch.accelerator.set_device_index(local_rank)) with init_process_group('nccl', "
    "device_id=torch.device('cuda', local_rank)), before any CUDA work or collective"
)


class Bound(IntEnum):
    NO = 0
    MAYBE = 1
    YES = 2


class Group(IntEnum):
    NONE = 0  # no process group initialized on this path (as far as the file shows)
    MAYBE = 1  # another module's function may have made one
    NCCL = 2  # an NCCL (or unknown-backend) group of several ranks


@dataclass(frozen=True)
class _State:
    """The (binding, group) pair of every path that reaches a point: a branch that binds and
    makes the group keeps them together, so ``if distributed: set_device(); init()`` is safe."""

    paths: frozenset[tuple[Bound, Group]] = frozenset({(Bound.NO, Group.NONE)})

    @classmethod
    def of(cls, bound: Bound, group: Group) -> _State:
        return cls(frozenset({(bound, group)}))

    def merge(self, other: _State) -> _State:
        return _State(self.paths | other.paths)

    def bind(self) -> _State:
        return _State(frozenset((Bound.YES, group) for _, group in self.paths))

    def make_group(self) -> _State:
        return _State(frozenset((bound, Group.NCCL) for bound, _ in self.paths))

    def maybe(self) -> _State:
        """After another module's function: it may have bound the device or made the group."""
        return _State(
            frozenset(
                (
                    Bound.MAYBE if bound == Bound.NO else bound,
                    Group.MAYBE if group == Group.NONE else group,
                )
                for bound, group in self.paths
            )
        )

    def bound_as(self, before: _State) -> _State:
        """Leaving a ``with torch.cuda.device(i):`` block: the binding of before, the groups of now."""
        bounds = {bound for bound, _ in before.paths}
        return _State(frozenset((b, g) for b in bounds for _, g in self.paths))


def check_unbound_device(mod: Module, report: Report) -> None:
    _report_noop_bindings(mod, report)
    if not _uses_accelerator(mod):
        return  # a CPU job has nothing to bind
    flow = _Flow(mod, bare_cuda=_bare_cuda_use(mod))
    for root in _entry_roots(mod):
        flow.run_root(root)
    strict_roots: list[Sequence[ast.stmt]] = []
    if report.strict:
        unreached = [*mod.functions.values(), *(m for m in mod.methods.values() if m)]
        strict_roots = [f.body for f in unreached if id(f) not in flow.visited]
    for body in strict_roots:
        flow.run_root(body, library=True)
    proven = sorted(flow.proven, key=lambda t: (t[0].lineno, t[0].col_offset))
    if proven:
        call, what = proven[0]  # the first one: the rest follow from the same missing binding
        report.finding(
            call,
            "DG101",
            f"{what} runs before this rank's device is bound (no torch.cuda.set_device(), "
            "init_process_group(device_id=...) or ddpgraph.init() on any path to it); every "
            "rank then uses cuda:0, and object collectives hang or NCCL reports 'Duplicate GPU "
            "detected'",
            _FIX,
        )
    for call, what, why in flow.unproven:
        report.note(
            call, "DG101", f"{what} may run before this rank's device is bound: {why}", _FIX
        )


def _report_noop_bindings(mod: Module, report: Report) -> None:
    for node in ast.walk(mod.tree):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            continue
        call = node.value
        name = mod.call_name(call)
        if name not in _SCOPED_BINDERS:
            continue
        index = text(call.args[0]) if call.args else "local_rank"
        setter = (
            f"torch.accelerator.set_device_index({index})"
            if name == "torch.accelerator.device_index"
            else f"torch.cuda.set_device({index})"
        )
        report.finding(
            call,
            "DG101",
            f"{text(call)} makes a context manager and drops it: the device is not bound "
            f"({name} switches devices only inside a `with` block)",
            f"call {setter} instead, or put the work under `with {text(call)}:`",
        )


def _entry_roots(mod: Module) -> Iterator[Sequence[ast.stmt]]:
    """Module code (it runs on import and as a script) and, when nothing in the file calls it,
    a function named ``main`` (console scripts, hydra, fire call it)."""
    yield mod.tree.body
    main = mod.functions.get("main")
    if main is not None and not any(
        isinstance(n, ast.Call) and dotted(n.func) == "main" for n in ast.walk(mod.tree)
    ):
        yield main.body


class _Flow:
    """Walks statements in execution order with the binding state of the path."""

    def __init__(self, mod: Module, *, bare_cuda: bool) -> None:
        self.mod = mod
        self.bare_cuda = bare_cuda
        self.visited: set[int] = set()
        self.active: list[int] = []
        self.library = False
        self.proven: list[tuple[ast.Call, str]] = []
        self.unproven: list[tuple[ast.Call, str, str]] = []
        self.seen_triggers: set[int] = set()
        self.entered: dict[tuple[int, _State, bool], _State] = {}

    def run_root(self, body: Sequence[ast.stmt], *, library: bool = False) -> None:
        self.library = library
        # a library function's caller made the group (or not): only strict notes come from it
        self.block(body, _State.of(Bound.NO, Group.MAYBE) if library else _State())

    # --- statements ----------------------------------------------------------------------------

    def block(self, body: Sequence[ast.stmt], state: _State) -> _State | None:
        """The state after ``body``, None when every path through it leaves (return, raise)."""
        current: _State | None = state
        for stmt in body:
            if current is None:
                return None
            current = self.statement(stmt, current)
        return current

    def statement(self, stmt: ast.stmt, state: _State) -> _State | None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return state
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            return state
        if isinstance(stmt, ast.If):
            state = self.expressions(stmt.test, state)
            if _is_main_guard(stmt):
                return self.block(stmt.body, state)
            return _merge(self.block(stmt.body, state), self.block(stmt.orelse, state))
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            head = stmt.iter if isinstance(stmt, (ast.For, ast.AsyncFor)) else stmt.test
            state = self.expressions(head, state)
            after = self.block(stmt.body, state)
            # a loop body that always leaves by `continue`/`break` still falls through the loop
            after = after or state
            return self.block(stmt.orelse, after) or after
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            return self.with_block(stmt, state)
        if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            return self.try_block(stmt, state)
        if isinstance(stmt, ast.Assign) and _sets_visible_devices(stmt):
            return state.bind()
        state = self.expressions(stmt, state)
        if isinstance(stmt, (ast.Return, ast.Raise)):
            return None
        return state

    def with_block(self, stmt: ast.With | ast.AsyncWith, state: _State) -> _State | None:
        inner, scoped = state, False
        for item in stmt.items:
            inner = self.expressions(item.context_expr, inner)
            expr = item.context_expr
            if isinstance(expr, ast.Call) and self.mod.call_name(expr) in _SCOPED_BINDERS:
                inner = inner.bind()
                scoped = True
        after = self.block(stmt.body, inner)
        if after is None:
            return None
        return after.bound_as(state) if scoped else after

    def try_block(self, stmt: ast.stmt, state: _State) -> _State | None:
        body: list[ast.stmt] = getattr(stmt, "body", [])
        handlers: list[ast.ExceptHandler] = getattr(stmt, "handlers", [])
        result = self.block(body, state)
        result = self.block(getattr(stmt, "orelse", []), result) if result else None
        for handler in handlers:
            result = _merge(result, self.block(handler.body, state))
        final = getattr(stmt, "finalbody", [])
        return self.block(final, result) if result is not None and final else result

    # --- expressions ---------------------------------------------------------------------------

    def expressions(self, node: ast.AST, state: _State) -> _State:
        for call in _calls_in_order(node):
            state = self.call(call, state)
        return state

    def call(self, call: ast.Call, state: _State) -> _State:
        name = self.mod.call_name(call) or ""
        if _binds(self.mod, call, name):
            state = state.bind()
        if name == _INIT_GROUP:
            return self.init_group(call, state)
        self.check_trigger(call, name, state)
        if name in _SPAWNERS:
            self.spawn(call)
            return state
        body = self.mod.local_function(call)
        if body is not None:
            return self.enter(body, state)
        return state.maybe() if self.may_bind(call) else state

    def init_group(self, call: ast.Call, state: _State) -> _State:
        if _single_process(call) or not _maybe_nccl(call):
            return state
        return state.make_group()

    def enter(self, func: ast.FunctionDef | ast.AsyncFunctionDef, state: _State) -> _State:
        key = id(func)
        if key in self.active or len(self.active) > 12:
            return state  # recursion: its effect is already on the path
        known = self.entered.get((key, state, self.library))
        if known is not None:
            return known  # same body, same paths in: same paths out (and triggers already seen)
        self.visited.add(key)
        self.active.append(key)
        try:
            after = self.block(func.body, state)
        finally:
            self.active.pop()
        result = after if after is not None else state
        self.entered[(key, state, self.library)] = result
        return result

    def spawn(self, call: ast.Call) -> None:
        target = arg(call, 0, "fn") if "Process" not in (self.mod.call_name(call) or "") else None
        target = target or kwarg(call, "target")
        if isinstance(target, ast.Name) and target.id in self.mod.functions:
            func = self.mod.functions[target.id]
            if id(func) not in self.active:
                saved = self.active
                self.active = [id(func)]
                self.visited.add(id(func))
                self.block(func.body, _State())  # a new process: nothing bound, no group
                self.active = saved

    def may_bind(self, call: ast.Call) -> bool:
        """A set-up function imported from another module of this project (or a library not
        known to be inert): it may bind the device or make the process group. Told apart from
        loggers and data helpers by its name (``init_distributed``, ``setup``, ``set_gpu``)."""
        chain = dotted(call.func)
        origin = self.mod.aliases.get(chain.partition(".")[0]) if chain else None
        if chain is None or origin is None:
            return False  # a builtin, a method of some object (set_device is seen by name)
        if origin.partition(".")[0] in _INERT_ROOTS:  # "" for a relative import: not inert
            return False
        full = f"{origin}.{chain.partition('.')[2]}".lower()
        return any(word in full for word in _SETUP_WORDS)

    def check_trigger(self, call: ast.Call, name: str, state: _State) -> None:
        what = _trigger(self.mod, call, name, bare_cuda=self.bare_cuda)
        if what is None or id(call) in self.seen_triggers:
            return
        if all(bound == Bound.YES or group == Group.NONE for bound, group in state.paths):
            return  # bound wherever a group exists
        self.seen_triggers.add(id(call))
        proven = all(path == (Bound.NO, Group.NCCL) for path in state.paths)
        if proven and not self.library:
            self.proven.append((call, what))
            return
        why = (
            "nothing in this file's entry points reaches this function; its caller must bind "
            "the device first"
            if self.library
            else "a binding happens on some paths only, or in a function of another module"
        )
        self.unproven.append((call, what, why))


def _merge(a: _State | None, b: _State | None) -> _State | None:
    if a is None:
        return b
    if b is None:
        return a
    return a.merge(b)


def _calls_in_order(node: ast.AST) -> list[ast.Call]:
    """Calls in evaluation order, roughly: arguments (which end first) before their call."""
    found = [n for n in _walk_expr(node) if isinstance(n, ast.Call)]
    return sorted(found, key=lambda c: (c.end_lineno or 0, c.end_col_offset or 0))


def _walk_expr(node: ast.AST) -> Iterator[ast.AST]:
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.stmt)
            ):
                stack.append(child)


def _is_main_guard(stmt: ast.If) -> bool:
    test = stmt.test
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _binds(mod: Module, call: ast.Call, name: str) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in (
        "set_device",
        "set_device_index",
        "set_device_idx",
    ):
        return True  # torch.cuda / torch.xpu / device_module / getattr(torch, kind) / accelerator
    if name == _INIT_GROUP:
        return kwarg(call, "device_id") is not None
    return (
        name in ("ddpgraph.init",)
        or name.endswith(".ddpgraph.init")
        or (name.endswith(".init") and mod.aliases.get(name.partition(".")[0]) == "ddpgraph")
    )


def _sets_visible_devices(stmt: ast.Assign) -> bool:
    """``os.environ["CUDA_VISIBLE_DEVICES"] = str(local_rank)``: each process sees its own GPU."""
    for target in stmt.targets:
        if isinstance(target, ast.Subscript) and dotted(target.value) == "os.environ":
            key = target.slice
            if isinstance(key, ast.Constant) and key.value == "CUDA_VISIBLE_DEVICES":
                return True
    return False


def _trigger(mod: Module, call: ast.Call, name: str, *, bare_cuda: bool) -> str | None:
    module, _, func = name.rpartition(".")
    if module == "torch.distributed" and func in _CURRENT_DEVICE_CALLS:
        if func.endswith("barrier") and kwarg(call, "device_ids") is not None:
            return None
        return f"dist.{func}()"
    if bare_cuda and module == "torch.distributed" and func in _TENSOR_COLLECTIVES:
        return f"dist.{func}() on a tensor made on the default device"
    if bare_cuda and (
        name in ("DDP", "DistributedDataParallel") or name.endswith(".DistributedDataParallel")
    ):
        return "DistributedDataParallel(...) in a file that puts models on the default device"
    return None


def _single_process(call: ast.Call) -> bool:
    size = kwarg(call, "world_size")
    return isinstance(size, ast.Constant) and size.value == 1


def _maybe_nccl(call: ast.Call) -> bool:
    """NCCL unless the backend is a literal without it (no backend: NCCL on a CUDA machine)."""
    backend = arg(call, 0, "backend")
    if isinstance(backend, ast.Constant) and isinstance(backend.value, str):
        return "nccl" in backend.value.lower()
    return True


def _uses_accelerator(mod: Module) -> bool:
    """The rule is about GPUs: a CPU/gloo-only script has nothing to bind."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value == "nccl" or node.value.startswith("cuda"):
                return True
        elif isinstance(node, ast.Attribute):
            name = mod.qualname(node) or ""
            if node.attr == "cuda" or name.startswith(("torch.cuda", "torch.accelerator")):
                return True
        elif isinstance(node, ast.keyword) and node.arg in ("device_ids", "output_device"):
            return True
    return False


def _bare_cuda_use(mod: Module) -> bool:
    """Tensors or models put on "the" GPU without an index: cuda:0 on every unbound rank."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "cuda"
                and not node.args
                and not node.keywords
            ):
                return True
            name = mod.call_name(node) or ""
            if name == "torch.accelerator.current_accelerator":
                return True
            if name == "torch.device" and len(node.args) == 1 and _is_bare_cuda(node.args[0]):
                return True
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "to"
                and node.args
                and _is_bare_cuda(node.args[0])
            ):
                return True
            if any(k.arg == "device" and _is_bare_cuda(k.value) for k in node.keywords):
                return True
    return False


def _is_bare_cuda(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == "cuda"
