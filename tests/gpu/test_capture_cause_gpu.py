"""Issue 48 on CUDA (written, not run here: no GPU on the CI machine). One GPU, a world of 1
(the `rt` fixture), FSDP2 on each encoder layer and the root.

* The script runs eager FSDP2 steps on the default stream and keeps its last `loss`: on torch
  2.11 the capture then failed with a CaptureError that named no cause (an AccumulateGrad node
  of the default stream kept alive). TrainStep names it, gives the parameters new accumulators,
  and graphs: bitwise the eager FSDP2 loop over the same batches.
* A host read inside the backward fails the capture mid-backward; on a torch without
  FSDPModule.reset_iter_state (hidden here, as on 2.11) the step resets FSDP2 itself and runs
  eagerly, its fallback naming the original error and the line that did it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpgraph import TrainStep
from ddpgraph.step.optim import make_graph_safe

from . import fsdp2_gpu_workers as w

pytestmark = pytest.mark.timeout(600)


class _HostReadInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad.abs().sum().item() < 0:  # a host read: eager runs it, a capture cannot
            raise AssertionError("unreachable")
        return grad


HOST_READ_LINE = next(
    n
    for n, line in enumerate(Path(__file__).read_text(encoding="utf-8").splitlines(), 1)
    if "grad.abs().sum().item()" in line
)


def test_an_earlier_loss_kept_alive_is_named_and_the_step_still_graphs(rt):
    eager, steps = 3, 20
    data = w.batches(eager + steps)
    model = w.sharded()
    opt = w.adamw(model, "foreach", graph_safe=False)
    loss_fn = nn.CrossEntropyLoss()
    first = []
    for x, y in data[:eager]:  # the script's own steps, default stream, `loss` kept
        loss = loss_fn(model(x), y)
        loss.backward()
        first.append(float(loss))
        opt.step()
        opt.zero_grad(set_to_none=False)
    step = TrainStep(model, opt, loss_fn, graph="always")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        graphed = first + [float(step(x, y)) for x, y in data[eager:]]
    assert loss.grad_fn is not None  # still held, all along
    named = [str(m.message) for m in seen if "autograd graph of an earlier loss" in str(m.message)]
    assert named and "del loss" in named[0]
    assert step.phase.value == "graphed" and step.report().replays > 0
    # the reference steps the script's AdamW for its eager steps, then the graph-safe one the
    # TrainStep made of it (capturable, the LR a device tensor), as the graphed run does
    ref = w.sharded()
    ref_opt = w.adamw(ref, "foreach", graph_safe=False)
    reference = w.eager_loop(ref, ref_opt, data[:eager])
    make_graph_safe(ref_opt, torch.device("cuda"))
    reference += w.eager_loop(ref, ref_opt, data[eager:])
    assert graphed == reference
    for a, b in zip(w.full_params(model), w.full_params(ref), strict=True):
        assert torch.equal(a, b)


def test_a_capture_failing_mid_backward_without_reset_iter_state_runs_eagerly_named(
    rt, monkeypatch
):
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "reset_iter_state", raising=False)
    model = w.sharded()
    model.head.register_forward_hook(lambda m, a, out: _HostReadInBackward.apply(out))
    opt = w.adamw(model, "foreach", graph_safe=False)
    step = TrainStep(model, opt, nn.CrossEntropyLoss())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = [float(step(x, y)) for x, y in w.batches(20)]
    assert step.phase.value == "eager"
    (fallback,) = step.report().fallbacks
    assert "capture failed:" in fallback
    assert f"test_capture_cause_gpu.py:{HOST_READ_LINE}" in fallback
    assert all(torch.isfinite(torch.tensor(losses)))
