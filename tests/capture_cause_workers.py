"""Workers for test_capture_cause.py: FSDP2 captures that fail, or would, and what the step says.

A host read inside the backward (``_RaiseInBackward``) is refused by the CPU graph engine in the
middle of FSDP2's backward, as CUDA's capture refuses it: FSDP2 is left mid-iteration, as the
device's failed capture left it (issue 48).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ddpgraph import TrainStep
from ddpgraph.step.optim import make_graph_safe
from ddpgraph.testing import CpuGraphs

from .fsdp2_workers import batches, full_params, make_model, shard


class _RaiseInBackward(torch.autograd.Function):
    """Identity forward; its backward reads a value on the host (harmless eagerly; a capture
    refuses it, on CUDA and on the CPU engine)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad.sum().item()  # the host read a capture refuses
        return grad


class FailingHead(nn.Module):
    """The model of fsdp2_workers with the failure point after the embedding: the backward
    has run the head's (the root's unsharded gradients hold values) and every block's
    (reduce-scatters done, on both ranks alike), and stops before the root's own."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.embed, self.blocks, self.head = self.net.embed, self.net.blocks, self.net.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _RaiseInBackward.apply(self.embed(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _hide_reset_iter_state() -> None:
    """torch 2.11 (the device image) has no FSDPModule.reset_iter_state."""
    from torch.distributed.fsdp import FSDPModule

    del FSDPModule.reset_iter_state


def _plain_sharded_model(failing: bool) -> nn.Module:
    if not failing:
        return shard(make_model())
    model = FailingHead()
    for block in model.blocks:
        torch.distributed.fsdp.fully_shard(block)
    torch.distributed.fsdp.fully_shard(model)
    return model


def capture_fails_in_backward(steps: int, hide_reset: bool) -> dict:
    """The capture fails inside FSDP2's backward on every rank; the step goes on eagerly."""
    if hide_reset:
        _hide_reset_iter_state()
    model = _plain_sharded_model(failing=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), warmup=3, engine=CpuGraphs())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses = [float(step(x, y)) for x, y in batches(steps)]
    return {
        "losses": losses,
        "params": full_params(model),
        "phase": step.phase.value,
        "fallbacks": list(step.report().fallbacks),
        "warnings": [str(w.message) for w in seen],
    }


def capture_fails_and_fsdp2_cannot_be_reset() -> str:
    """FSDP2's internals moved (the reset of torch 2.12 fails here): the CaptureError names
    that and the capture's own failure."""
    import ddpgraph.step.parallel.fsdp2 as fsdp2

    def moved(root: nn.Module) -> None:
        raise AttributeError("'FSDPParamGroup' object has no attribute '_post_reduce_event'")

    fsdp2.reset_iter_state = moved
    return capture_fails_in_backward_always(graph="auto")


def capture_fails_in_backward_always(graph: str = "always") -> str:
    """graph='always': the CaptureError itself names the failure."""
    _hide_reset_iter_state()
    model = _plain_sharded_model(failing=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainStep(
        model,
        opt,
        nn.CrossEntropyLoss(),
        warmup=3,
        graph=graph,
        engine=CpuGraphs(),
    )
    try:
        for x, y in batches(6):
            step(x, y)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _unsharded(model: nn.Module) -> list[torch.Tensor]:
    """FSDP2's unsharded parameters (what its backward accumulates into), read from FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return [
        fsdp_param._unsharded_param
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
    ]


def earlier_loss_kept(eager: int, steps: int, keep: bool) -> dict:
    """The script runs ``eager`` plain FSDP2 steps, keeps their last ``loss`` (``keep``), then
    trains through TrainStep: the step names the live graph, with the fix, and captures."""
    model = shard(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = nn.CrossEntropyLoss()
    data = batches(eager + steps)
    losses = []
    for x, y in data[:eager]:
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(float(loss))
        opt.step()
        opt.zero_grad(set_to_none=False)
    held = [get_gradient_edge(leaf).node for leaf in _unsharded(model)] if keep else []
    if not keep:
        del loss
    step = TrainStep(model, opt, loss_fn, warmup=3, engine=CpuGraphs())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses += [float(step(x, y)) for x, y in data[eager:]]
    fresh = [get_gradient_edge(leaf).node for leaf in _unsharded(model)] if keep else []
    return {
        "losses": losses,
        "params": full_params(model),
        "phase": step.phase.value,
        "replays": step.report().replays,
        "warnings": [str(w.message) for w in seen],
        # the old graph's nodes are no longer the parameters' accumulators (the step's fix)
        "nodes_replaced": sum(a is not b for a, b in zip(held, fresh)),
        "leaves": len(held),
        "rank": dist.get_rank(),
    }


def plain_loop(steps: int, failing_head: bool = False, graph_safe_from: int = 0) -> dict:
    """The plain FSDP2 loop over the same batches (no TrainStep); ``failing_head``: the model
    of the failing captures (its backward's host read is harmless here). From step
    ``graph_safe_from`` on the optimizer is the one TrainStep steps (capturable, the LR in a
    tensor: made so when the TrainStep is built, and kept after a fallback)."""
    model = _plain_sharded_model(failing=failing_head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for i, (x, y) in enumerate(batches(steps)):
        if i == graph_safe_from:
            make_graph_safe(opt, torch.device("cpu"))
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(float(loss))
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {"losses": losses, "params": full_params(model)}
