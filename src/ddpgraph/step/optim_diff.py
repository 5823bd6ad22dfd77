"""How far the graph-safe optimizer's steps are from the script's own: measured, then reported.

A graph needs the optimizer's step counters and LR on the device (``capturable=True`` for Adam
and AdamW, the fused kernel for SGD, a tensor LR). torch computes the bias corrections of the
capturable path on the device in float32 and in another order than the default path (which
computes them in double on the host and folds them into kernel scalars), so the two differ in the
last bits from the first step on, and the difference grows with training. A bitwise graph-safe
equivalent of the default path would have to reproduce each backend's kernel order (CPU's
``addcdiv`` is ``a + v*b/c``, CUDA's ``a + v*(b/c)`` with contraction): see
``tests/test_optimizer_changes.py`` for what was measured. So the step keeps the script's
optimizer where it can (fused stays fused; an optimizer already capturable is untouched) and
otherwise measures the difference the change makes, on the device, with the script's own
hyperparameters, for :attr:`~ddpgraph.step.report.StepReport.optimizer_changes`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["PROBE_STEPS", "describe_changes", "measured_difference", "step_options"]

PROBE_STEPS = 20  # as issue 31's measurement: the difference is visible and still small
_PROBE_SIZE = 4096
_STEP_OPTIONS = ("capturable", "foreach", "fused")


def step_options(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings that choose its kernels (read before they are changed)."""
    return [{k: group[k] for k in _STEP_OPTIONS if k in group} for group in optimizer.param_groups]


def measured_difference(
    optimizer: torch.optim.Optimizer,
    group: int,
    before: dict[str, Any],
    device: torch.device,
) -> float:
    """The largest ``|Δparam|`` after :data:`PROBE_STEPS` steps of a 4096-value probe between the
    script's settings (``before``, a float LR) and the group's settings now (a tensor LR), with
    the group's hyperparameters, on ``device``. Runs 2 x 20 small optimizer steps; no sync but
    the final ``float()``."""
    settings = optimizer.param_groups[group]
    # what the constructor takes (defaults also hold derived keys, e.g. AdamW's
    # decoupled_weight_decay)
    takes = inspect.signature(type(optimizer).__init__).parameters
    hyper = {
        k: _plain(settings[k])
        for k in optimizer.defaults
        if k in takes and k in settings and k not in (*_STEP_OPTIONS, "params")
    }
    after = {k: settings[k] for k in _STEP_OPTIONS if k in settings}
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(_PROBE_SIZE, generator=gen)
    grads = [torch.randn(_PROBE_SIZE, generator=gen).to(device) for _ in range(PROBE_STEPS)]
    ends = [
        _probe(type(optimizer), {**hyper, **options}, start.to(device), grads, tensor_lr)
        for options, tensor_lr in ((before, False), (after, True))
    ]
    return float((ends[0] - ends[1]).abs().max())


def _probe(
    kind: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    start: torch.Tensor,
    grads: list[torch.Tensor],
    tensor_lr: bool,
) -> torch.Tensor:
    param = nn.Parameter(start.clone())
    opt = kind([param], **kwargs)
    if tensor_lr:
        opt.param_groups[0]["lr"] = torch.tensor(float(kwargs["lr"]), device=start.device)
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
    return param.detach()


def _plain(value: Any) -> Any:
    """A hyperparameter as a constructor takes it (an LR the step already made a tensor)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return float(value)
    return value


def describe_changes(
    optimizer: torch.optim.Optimizer,
    before: list[dict[str, Any]],
    changes: list[str],
    device: torch.device,
) -> list[str]:
    """One line per change made to the script's optimizer, each with the measured size of the
    difference it makes (groups with the same settings are measured once)."""
    if not changes:
        return []
    name = type(optimizer).__name__
    measured: dict[str, float] = {}
    for g, options in enumerate(before):
        key = repr(sorted(options.items()))
        if key not in measured:
            measured[key] = measured_difference(optimizer, g, options, device)
    size = max(measured.values())
    where = "bitwise the same" if size == 0 else f"max |Δparam| {size:.3g}"
    return [
        f"{change} ({name}: {where} vs the script's settings after {PROBE_STEPS} steps of a "
        f"{_PROBE_SIZE}-value probe on {device})"
        for change in changes
    ]
