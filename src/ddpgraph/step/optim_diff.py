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

A change that changes nothing is not reported (issue 42, item 5). ``optimizer_changes`` answers
"does the graphed run step my optimizer as my script would?", so it lists a change only where the
probe measured a difference, each with its own size: the settings (``capturable``, ``fused``)
against the script's, with the script's float LR, and then the LR tensor against that float. A
fused AdamW, for one, gets ``capturable=True`` only to pass torch's capture check (its step
counters are on the device and its kernel reads a tensor LR as it reads a float): both measure 0
on the probe, and on an H200 the whole run was bit for bit the script's own, so the report lists
nothing. Listing it with "difference 0" would tell a reader to look for a difference that is not
there; every setting changed stays visible in the optimizer's ``param_groups`` (and in
``GraphSafeOptimizer.changes``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = [
    "LR_CHANGE",
    "PROBE_STEPS",
    "describe_changes",
    "measured_difference",
    "step_options",
]

PROBE_STEPS = 20  # as issue 31's measurement: the difference is visible and still small
_PROBE_SIZE = 4096
_STEP_OPTIONS = ("capturable", "foreach", "fused")
LR_CHANGE = "lr on device"  # the change that puts the LR in a tensor; the others are settings


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
    the group's hyperparameters, on ``device``: every change together. Runs 2 x 20 small
    optimizer steps; no sync but the final ``float()``."""
    probe = _Probe(optimizer, group, device)
    return _largest(probe.run(before, tensor_lr=False), probe.run(probe.now, tensor_lr=True))


def measured_differences(
    optimizer: torch.optim.Optimizer,
    group: int,
    before: dict[str, Any],
    device: torch.device,
) -> tuple[float, float]:
    """Each change's own share, as :func:`measured_difference` measures: (the settings now vs
    the script's ``before``, both with the script's float LR; the LR tensor vs that float, both
    with the settings now). Runs 3 x 20 small optimizer steps."""
    probe = _Probe(optimizer, group, device)
    theirs = probe.run(before, tensor_lr=False)
    settings = probe.run(probe.now, tensor_lr=False)
    ours = probe.run(probe.now, tensor_lr=True)
    return _largest(theirs, settings), _largest(settings, ours)


class _Probe:
    """One param group's optimizer on a 4096-value probe: the same start and gradients for every
    run, the group's hyperparameters with the step options each run asks for."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: int, device: torch.device) -> None:
        settings = optimizer.param_groups[group]
        # what the constructor takes (defaults also hold derived keys, e.g. AdamW's
        # decoupled_weight_decay)
        takes = inspect.signature(type(optimizer).__init__).parameters
        self.kind = type(optimizer)
        self.hyper = {
            k: _plain(settings[k])
            for k in optimizer.defaults
            if k in takes and k in settings and k not in (*_STEP_OPTIONS, "params")
        }
        self.now = {k: settings[k] for k in _STEP_OPTIONS if k in settings}
        gen = torch.Generator().manual_seed(0)
        self.start = torch.randn(_PROBE_SIZE, generator=gen).to(device)
        self.grads = [
            torch.randn(_PROBE_SIZE, generator=gen).to(device) for _ in range(PROBE_STEPS)
        ]

    def run(self, options: dict[str, Any], *, tensor_lr: bool) -> torch.Tensor:
        return _probe(self.kind, {**self.hyper, **options}, self.start, self.grads, tensor_lr)


def _largest(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


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
    """One line for each change made to the script's optimizer that changes its numbers, with
    the size of the difference it makes alone (:func:`measured_differences`; groups with the same
    settings are measured once, the largest group's size is given). A change measured at exactly
    0 is left out: see the module's docstring."""
    if not changes:
        return []
    measured: dict[str, tuple[float, float]] = {}
    for g, options in enumerate(before):
        key = repr(sorted(options.items()))
        if key not in measured:
            measured[key] = measured_differences(optimizer, g, options, device)
    settings = max(size for size, _ in measured.values())
    lr = max(size for _, size in measured.values())
    name = type(optimizer).__name__
    return [
        f"{change} ({name}: max |Δparam| {size:.3g} vs the script's "
        f"{'float LR' if change == LR_CHANGE else 'settings'} after {PROBE_STEPS} steps of a "
        f"{_PROBE_SIZE}-value probe on {device})"
        for change in changes
        if (size := lr if change == LR_CHANGE else settings) != 0
    ]
