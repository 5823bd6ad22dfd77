"""Module-level workers for tests/test_habits.py: each runs TrainStep (graphed on the CPU stand-in
engine) and the plain DDP loop a script would write, on the same data, and returns both."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpgraph import TrainStep
from ddpgraph.testing import CpuGraphs

from .step_workers import as_the_step_steps, batches, float_lr_step_as_the_step


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _sgd_step(model: nn.Module, **options: object) -> TrainStep:
    """TrainStep with SGD (momentum 0.9, as :func:`_sgd_ddp`) and cross-entropy."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return TrainStep(model, opt, nn.CrossEntropyLoss(), **options)  # type: ignore[arg-type]


def _sgd_ddp(model: nn.Module, graph_safe: bool = True) -> tuple[DDP, torch.optim.Optimizer]:
    """The reference DDP loop's model and SGD; ``graph_safe``: the SGD the graphed step steps
    (fused, the LR in a tensor), for a comparison with a CpuGraphs run."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return DDP(model), as_the_step_steps(opt) if graph_safe else opt


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def buffers_like_ddp(steps: int, calls: int, graphed: bool) -> dict:
    """A BatchNorm model on different data per rank, ``accumulate_calls=calls``: TrainStep's
    state on this rank after the first step and at the end, and ``evaluate()``, against the
    plain DDP loop (``no_sync`` for every micro-batch but a window's last) and DDP's eval
    forward."""
    rank = torch.distributed.get_rank()
    data = batches(steps * calls, 8, seed=40 + rank)  # different BatchNorm statistics per rank
    probe = batches(1, 5, seed=99)[0][0]
    model = _bn_model()
    step = _sgd_step(model, accumulate_calls=calls, engine=CpuGraphs() if graphed else None)
    ours: list[dict[str, torch.Tensor]] = []
    for i, (x, y) in enumerate(data):
        step(x, y)
        if i == calls - 1:
            ours.append(_state(model))
    ours.append(_state(model))
    our_eval = step.evaluate(probe).clone()
    our_eval_again = step.evaluate(probe).clone()  # rank-local: no second broadcast

    reference = _bn_model()
    ddp, opt = _sgd_ddp(reference, graph_safe=graphed)
    theirs: list[dict[str, torch.Tensor]] = []
    for i, (x, y) in enumerate(data):
        last = (i + 1) % calls == 0
        with contextlib.nullcontext() if last else ddp.no_sync():
            (nn.functional.cross_entropy(ddp(x), y) / calls).backward()
        if last:
            opt.step()
            opt.zero_grad()
        if i == calls - 1:
            theirs.append(_state(reference))
    theirs.append(_state(reference))
    ddp.eval()
    with torch.no_grad():
        their_eval = ddp(probe)
    return {
        "ours": ours,
        "theirs": theirs,
        "our_eval": our_eval,
        "our_eval_again": our_eval_again,
        "their_eval": their_eval,
        "replays": step.report().replays,
    }


def _three_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def _frozen_at(model: nn.Module, i: int, schedule: dict[int, tuple[int, bool]]) -> None:
    """``schedule[i] = (layer, requires_grad)``: what the script changes before step ``i``."""
    if i in schedule:
        layer, flag = schedule[i]
        for p in model[layer].parameters():
            p.requires_grad_(flag)


def freezing_like_the_eager_loop(steps: int, schedule: dict[int, tuple[int, bool]]) -> dict:
    """Freeze (and unfreeze) layers mid-run with ``find_unused_parameters=True``, as airbench94
    and gradual-unfreezing fine-tunes do: TrainStep (graphed, CPU stand-in) against the eager
    DDP loop, which for an unfreeze builds its DDP again (a DDP built over the frozen set would
    never sync the unfrozen parameters' gradients)."""
    rank = torch.distributed.get_rank()
    data = batches(steps, 8, seed=50 + rank)
    kwargs = {"find_unused_parameters": True}
    model = _three_layers()
    step = TrainStep(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        nn.CrossEntropyLoss(),
        ddp_kwargs=kwargs,
        engine=CpuGraphs(),
    )
    replays_at: dict[int, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data):
            _frozen_at(model, i, schedule)
            step(x, y)
            replays_at[i] = step.report().replays
    reference = _three_layers()
    opt = as_the_step_steps(torch.optim.AdamW(reference.parameters(), lr=0.01))  # as graphed
    ddp = DDP(reference, **kwargs)
    for i, (x, y) in enumerate(data):
        _frozen_at(reference, i, schedule)
        if i in schedule and schedule[i][1]:
            ddp = DDP(reference, **kwargs)  # an unfreeze: DDP over the new trainable set
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    report = step.report()
    return {
        "ours": [p.detach().clone() for p in model.parameters()],
        "theirs": [p.detach().clone() for p in reference.parameters()],
        "replays_at": replays_at,
        "fallbacks": report.fallbacks,
        "mode": report.mode,
        "warnings": [str(w.message) for w in caught],
    }


def last_window_like_accelerate(epochs: int, per_epoch: int, calls: int) -> dict:
    """``accumulate_calls=calls`` over epochs of ``per_epoch`` batches (not a multiple):
    ``step(x, y, last=True)`` on each epoch's last batch against accelerate's loop (the leftover
    micro-batches step the optimizer at the end of the data, each loss divided by ``calls``,
    the last one's backward synced)."""
    rank = torch.distributed.get_rank()
    data = batches(per_epoch, 8, seed=60 + rank)
    model = _bn_model()
    step = _sgd_step(model, accumulate_calls=calls, clip_grad_norm=1.0, engine=CpuGraphs())
    our_norms = []
    for _ in range(epochs):
        for i, (x, y) in enumerate(data):
            step(x, y, last=i == per_epoch - 1)
            if step.grad_norm is not None:
                our_norms.append(step.grad_norm.clone())
    reference = _bn_model()
    ddp, opt = _sgd_ddp(reference)
    their_norms = []
    for _ in range(epochs):
        taken = 0
        for i, (x, y) in enumerate(data):
            taken += 1
            sync = taken == calls or i == per_epoch - 1  # accelerate's sync_gradients
            with contextlib.nullcontext() if sync else ddp.no_sync():
                (nn.functional.cross_entropy(ddp(x), y) / calls).backward()
            if sync:
                their_norms.append(nn.utils.clip_grad_norm_(reference.parameters(), 1.0))
                opt.step()
                opt.zero_grad()
                taken = 0
    return {
        "ours": _state(model),
        "theirs": _state(reference),
        "our_norms": our_norms,
        "their_norms": their_norms,
        "replays": step.report().replays,
    }


def script_sync_flag(steps: int, calls: int, on: str) -> dict:
    """nanoGPT's ``model.require_backward_grad_sync = (micro == k - 1)`` kept in the port (set
    on the bare module, or as ``no_sync()`` on ``step.model``), with ``accumulate_calls=calls``:
    against the DDP loop that the flag drives."""
    rank = torch.distributed.get_rank()
    data = batches(steps * calls, 8, seed=70 + rank)
    model = _bn_model()
    step = _sgd_step(model, accumulate_calls=calls, engine=CpuGraphs())
    for i, (x, y) in enumerate(data):
        last = (i + 1) % calls == 0
        if on == "module":
            model.require_backward_grad_sync = last
            step(x, y)
        else:
            with contextlib.nullcontext() if last else step.model.no_sync():
                step(x, y)
    reference = _bn_model()
    ddp, opt = _sgd_ddp(reference)
    for i, (x, y) in enumerate(data):
        last = (i + 1) % calls == 0
        ddp.require_backward_grad_sync = last
        (nn.functional.cross_entropy(ddp(x), y) / calls).backward()
        if last:
            opt.step()
            opt.zero_grad()
    return {"ours": _state(model), "theirs": _state(reference), "replays": step.report().replays}


def script_sync_contradicts(case: str) -> None:
    """The script's sync control on a call that must step: raises (on every rank)."""
    model = _bn_model()
    calls = 1 if case in ("calls1-module", "calls1-no_sync") else 2
    step = _sgd_step(model, accumulate_calls=calls, engine=CpuGraphs())
    x, y = batches(1, 8)[0]
    if case == "calls1-module":
        model.require_backward_grad_sync = False
        step(x, y)
    elif case == "calls1-no_sync":
        with step.model.no_sync():
            step(x, y)
    else:  # the k-th call with the flag off
        model.require_backward_grad_sync = False
        step(x, y)
        step(x, y)


def _lr_at(it: int) -> float:
    return 0.05 * (1 + it % 7) / 7  # a new LR every step, as llm.c's get_lr


def llmc_loop(steps: int, calls: int, graphed: bool) -> dict:
    """llm.c's loop: micro-steps with ``require_backward_grad_sync = (micro == k - 1)``, then the
    grad norm, the LR set for this step, ``optimizer.step()``: the port keeps the loop with
    ``defer_update=True`` and ``step.update()``; against the eager DDP loop."""
    rank = torch.distributed.get_rank()
    data = batches(steps * calls, 8, seed=80 + rank)
    model = _bn_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.1)
    step = TrainStep(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        accumulate_calls=calls,
        clip_grad_norm=1.0,
        defer_update=True,
        engine=CpuGraphs() if graphed else None,
    )
    our_norms, our_losses = [], []
    for it in range(steps):
        for micro in range(calls):
            x, y = data[it * calls + micro]
            model.require_backward_grad_sync = micro == calls - 1
            our_losses.append(step(x, y).clone())
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(it)
        step.update()
        our_norms.append(step.grad_norm.clone())
    reference = _bn_model()
    ddp = DDP(reference)
    opt = torch.optim.AdamW(reference.parameters(), lr=1.0, weight_decay=0.1)
    # graphed: the AdamW the step steps, the loop's float LR filled into its LR tensor
    opt_step = float_lr_step_as_the_step(opt) if graphed else opt.step
    their_norms, their_losses = [], []
    for it in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(calls):
            x, y = data[it * calls + micro]
            ddp.require_backward_grad_sync = micro == calls - 1
            loss = nn.functional.cross_entropy(ddp(x), y)
            their_losses.append(loss.detach().clone())
            (loss / calls).backward()
        their_norms.append(nn.utils.clip_grad_norm_(ddp.parameters(), 1.0))
        for group in opt.param_groups:
            group["lr"] = _lr_at(it)
        opt_step()
    report = step.report()
    return {
        "ours": _state(model),
        "theirs": _state(reference),
        "norms": (our_norms, their_norms),
        "losses": (our_losses, their_losses),
        "replays": report.replays,
        "captures": [c.kind for c in report.captures],
    }


def update_misuse(case: str) -> None:
    """step.update() where it does not belong, or missing: raises on every rank."""
    model = _bn_model()
    step = _sgd_step(
        model, accumulate_calls=2, defer_update=case != "not-deferred", engine=CpuGraphs()
    )
    x, y = batches(1, 8)[0]
    if case == "not-deferred":
        step(x, y)
        step(x, y)
        step.update()
    elif case == "missing":
        step(x, y)
        step(x, y)
        step(x, y)
    else:  # "early": mid-window
        step(x, y)
        step.update()


UNPINNED = (
    "capture failed: RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph "
    "capture unless the CPU tensor is pinned"
)


def unused_parameter_failure_explained(find_unused: bool) -> str | None:
    """How the DDP wrapper explains the capture failure DDP's unused-parameter bookkeeping
    causes on CUDA (the text torch raises there)."""
    step = _sgd_step(_bn_model(), ddp_kwargs={"find_unused_parameters": find_unused})
    return step._body.parallel.explain_capture_failure(UNPINNED)
