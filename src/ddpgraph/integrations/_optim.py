"""The optimizer a framework holds while a TrainStep updates the real one."""

from __future__ import annotations

import sys
from typing import Any

import torch

from .._frames import PACKAGE_DIR, in_directories, line_outside
from ..errors import ConfigError
from ..step.capture_errors import TORCH_DIR
from ..step.optim import unscales_in_kernel

__all__ = ["OptimizerView", "refuse_script_steps", "scaler_reports_skips"]


def scaler_reports_skips(optimizer: torch.optim.Optimizer) -> bool:
    """Whether Accelerate reports an fp16 update of ``optimizer`` that overflowed as skipped,
    so that its loop (``Trainer``, ``AcceleratedScheduler``) holds the LR scheduler back.

    ``AcceleratedOptimizer.step`` (accelerate 0.22 to 1.16) reports a skip when
    ``torch.amp.GradScaler.step`` did not call ``optimizer.step()``. GradScaler calls it on every
    update for an optimizer with ``_step_supports_amp_scaling`` (fused Adam, AdamW, SGD,
    Adagrad: the kernel skips on the device) and only for finite gradients otherwise. So with a
    fused optimizer (the Trainer's default ``adamw_torch_fused`` on torch >= 2.8) no update is
    ever reported skipped and the schedule advances through overflows. Ask this of the
    optimizer as the script built it (TrainStep switches fp16 optimizers to fused kernels)."""
    return not unscales_in_kernel(optimizer)


class OptimizerView(torch.optim.Optimizer):
    """A framework's optimizer while the TrainStep updates the real one (inside its graph).

    ``zero_grad()`` does nothing (the graph reads and writes the same ``.grad`` tensors on every
    replay); ``step(closure)`` runs the closure only (a framework's closure runs the TrainStep),
    the update happened inside the graph. State and ``state_dict`` are the real optimizer's.

    ``own_lr=False``: the param groups are the real ones (a scheduler writes the LR there; the
    TrainStep copies it into the LR tensor its graph reads). ``own_lr=True``: the param groups are
    copies whose LR stays a float (a framework logs it without a host sync) and :meth:`push_lr`
    hands it to the real optimizer before each step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, own_lr: bool) -> None:  # a view
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.own_lr = own_lr
        groups = optimizer.param_groups
        self.param_groups = [dict(group) for group in groups] if own_lr else groups
        self._take_lr()

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def step(self, closure: Any = None) -> Any:
        return None if closure is None else closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def push_lr(self) -> None:
        if self.own_lr:
            for view, group in zip(self.param_groups, self.optimizer.param_groups):
                group["lr"] = view["lr"]

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        if self.own_lr:
            for saved, view in zip(state["param_groups"], self.param_groups):
                saved["lr"] = view["lr"]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        if self.own_lr:
            for view, group in zip(self.param_groups, self.optimizer.param_groups):
                view.update({k: v for k, v in group.items() if k != "params"})
            self._take_lr()
        else:
            self.param_groups = self.optimizer.param_groups  # load_state_dict replaced them

    def _take_lr(self) -> None:
        if self.own_lr:
            for view in self.param_groups:
                if isinstance(view["lr"], torch.Tensor):
                    view["lr"] = float(view["lr"])  # once, at construction or a load

    def __repr__(self) -> str:
        return f"OptimizerView({self.optimizer!r})"


def refuse_script_steps(optimizer: torch.optim.Optimizer, owner: str) -> None:
    """Make the script's own ``optimizer.step()`` on ``optimizer`` raise, naming its line: the
    TrainStep updates inside its step, so a call left in the loop would update twice (and one
    kept on some calls only would not be the window the step keeps). A step pre-hook: it runs
    where Python calls ``step()`` (eager and capturing steps, the script), never on a replay."""

    def pre_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not _called_by_ddpgraph():
            raise ConfigError(
                f"the script calls optimizer.step() itself, at {line_outside(TORCH_DIR, PACKAGE_DIR)}"
                f", but {owner} updates this optimizer inside each step call (the window's last "
                "with accumulate_calls): remove that line and its optimizer.zero_grad(); where it "
                "was conditional (`if step % k == 0 or last:`), pass accumulate_calls=k and "
                "step(..., last=<that condition>)."
            )

    optimizer.register_step_pre_hook(pre_hook)


def _called_by_ddpgraph() -> bool:
    """Whether the first caller outside torch (the optimizer's step wrapper) is ddpgraph's."""
    frame = sys._getframe(2)  # above the pre-hook: torch's step wrapper
    in_torch = in_directories(TORCH_DIR)
    while frame.f_back is not None and in_torch(frame):
        frame = frame.f_back
    return in_directories(PACKAGE_DIR)(frame)
