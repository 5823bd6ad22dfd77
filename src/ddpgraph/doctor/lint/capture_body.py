"""What a capture body must not do: DG105 (host synchronisation or data loading inside a
capture) and DG106 (an Adam-family optimizer without ``capturable=True`` stepped inside it)."""

from __future__ import annotations

import ast

from .astutil import Module, calls_reaching, kwarg, made_for, optimizer_class, text
from .core import Report

_SYNC_METHODS = frozenset({"item", "cpu", "numpy", "tolist"})


def check_sync_in_capture(mod: Module, report: Report) -> None:
    """DG105: .item() / .cpu() / print(tensor) / next(loader) / synchronize inside a capture."""
    for capture in mod.captures:
        for call in calls_reaching(mod, capture.node):
            what = _sync_kind(mod, call)
            if what is None:
                continue
            report.finding(
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


def _sync_kind(mod: Module, call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in _SYNC_METHODS and not call.args:
        return f"{text(func)}()"
    name = mod.call_name(call)
    if name == "torch.cuda.synchronize":
        return "torch.cuda.synchronize()"
    if name == "next":
        return text(call)
    if name == "print" and any(_may_be_tensor(a) for a in call.args):
        return text(call)
    return None


def _may_be_tensor(value: ast.expr) -> bool:
    if isinstance(value, ast.Constant):
        return False
    if isinstance(value, ast.JoinedStr):
        return any(
            isinstance(v, ast.FormattedValue) and not isinstance(v.value, ast.Constant)
            for v in value.values
        )
    return True


def check_optimizer_capturable(mod: Module, report: Report) -> None:
    """DG106: an Adam-family optimizer without capturable=True is stepped inside a capture."""
    for capture in mod.captures:
        for call in calls_reaching(mod, capture.node):
            stepped = stepped_optimizer(call)
            if stepped is None:
                continue
            made = made_for(mod.optimizers, stepped, mod, capture.node)
            if made is None or not _not_capturable(made.call):
                continue
            cls = optimizer_class(mod.call_name(made.call))
            report.finding(
                call,
                "DG106",
                f"{stepped}.step() inside the capture at line {capture.node.lineno}, but "
                f"{stepped} = {cls}(...) (line {made.call.lineno}) is not capturable=True; "
                'capture fails with "... capturable is False"',
                f"construct it with {cls}(..., capturable=True) before the warm-up",
            )


def stepped_optimizer(call: ast.Call) -> str | None:
    """``opt`` for ``opt.step()`` and for ``scaler.step(opt)``."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "step"):
        return None
    if not call.args:
        return text(func.value)
    return text(call.args[0])


def _not_capturable(call: ast.Call) -> bool:
    if any(k.arg is None for k in call.keywords):
        return False  # **kwargs may carry capturable=True
    value = kwarg(call, "capturable")
    return value is None or (isinstance(value, ast.Constant) and value.value is False)
