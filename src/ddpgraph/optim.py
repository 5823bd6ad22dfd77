"""Making an optimizer safe to step inside a CUDA graph.

Inside a graph every kernel argument is frozen at capture. Two things therefore have to live on
the device: the optimizer's step counters (``capturable=True`` where the optimizer has it) and
the learning rate (a 0-dim device tensor), so that an LR scheduler's change between replays is
seen by the replayed kernels without a re-capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import CaptureError

__all__ = ["GraphSafeOptimizer", "make_graph_safe"]


@dataclass
class GraphSafeOptimizer:
    """What :func:`make_graph_safe` changed, and the LR tensors it installed (one per group)."""

    optimizer: torch.optim.Optimizer
    changes: list[str]
    lr_tensors: list[torch.Tensor]

    def sync_lr(self) -> None:
        """Pick up an LR a scheduler or the user assigned as a float: copy it into the tensor.

        ``fill_`` with a Python number is a kernel launch with the value as an argument, not a
        host sync, so this is cheap enough for every step.
        """
        for group, lr in zip(self.optimizer.param_groups, self.lr_tensors):
            value = group["lr"]
            if value is not lr:
                lr.fill_(float(value))
                group["lr"] = lr


def make_graph_safe(optimizer: torch.optim.Optimizer, device: torch.device) -> GraphSafeOptimizer:
    """Turn on ``capturable`` (Adam, AdamW, …) or ``fused`` (SGD) and put the LR on ``device``.

    Raises :class:`CaptureError` naming the optimizer when it cannot be captured. Call before the
    optimizer's first step so its state is created on the device.
    """
    name = type(optimizer).__name__
    changes: list[str] = []
    for group in optimizer.param_groups:
        if "capturable" in group:
            if not group["capturable"]:
                group["capturable"] = True
                changes.append("capturable=True")
        elif isinstance(optimizer, torch.optim.SGD):
            _make_sgd_graph_safe(group, name)
            if "fused=True" not in changes:
                changes.append("fused=True")
        else:
            raise CaptureError(
                f"{name} cannot be stepped inside a CUDA graph (it has no `capturable` option); "
                "use SGD, Adam or AdamW, or pass graph='never' to TrainStep."
            )
        if group.get("differentiable"):
            raise CaptureError(f"{name}(differentiable=True) cannot be captured; turn it off.")
    _move_step_counters(optimizer, device)
    lr_tensors = [_lr_tensor(group, device) for group in optimizer.param_groups]
    changes.append("lr on device")
    return GraphSafeOptimizer(optimizer, changes, lr_tensors)


def _make_sgd_graph_safe(group: dict, name: str) -> None:
    # foreach SGD turns a tensor LR into `alpha=-lr`, an implicit .item() that breaks capture;
    # the fused kernel takes the LR tensor itself.
    if any(p.is_sparse or not p.is_floating_point() for p in group["params"]):
        raise CaptureError(f"{name} with sparse or non-float parameters cannot be captured.")
    group["fused"] = True
    group["foreach"] = False


def _move_step_counters(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    # State created before capturable was turned on keeps its step counter on the CPU.
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != device:
            state["step"] = step.to(device=device, dtype=torch.float32)


def _lr_tensor(group: dict, device: torch.device) -> torch.Tensor:
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.device == device and lr.dim() == 0:
        return lr
    tensor = torch.tensor(float(lr), dtype=torch.float32, device=device)
    group["lr"] = tensor
    return tensor
