"""The optimizer the step runs vs the script's own (issue 31, item 6), measured on the CPU.

On CUDA the step makes Adam/AdamW ``capturable=True`` and SGD fused, with a tensor LR. What was
found, with torch 2.13's ``torch/optim/adam.py``: the capturable path computes the bias
corrections on the device in float32 (``_foreach_pow(beta, step)``) and folds them in another
order (``exp_avg / ((sqrt(v)/bc2_sqrt + eps) / step_size)``) than the default path (double on the
host, ``addcdiv(exp_avg, sqrt(v)/bc2_sqrt + eps, value=step_size)``), so the two differ from the
first step. A device-side replica of the default path's scalars and op order (:func:`replica_adam`)
is bitwise equal to the default path on the CPU; CUDA's kernels order ``addcdiv`` differently
(``a + v*(b/c)``, contracted), so the step does not switch to it without a GPU measurement, and
records each change with its measured size in ``report().optimizer_changes`` instead.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpgraph.step.optim import allow_capturable_on_cpu, make_graph_safe, plan_graph_safety
from ddpgraph.step.optim_diff import (
    PROBE_STEPS,
    measured_difference,
    measured_differences,
    step_options,
)

STEPS = 20


@pytest.fixture
def capturable_on_cpu():
    """torch refuses capturable=True on CPU tensors; the arithmetic is the same code. The CPU
    engine's own gate (once per process, as the step does; a monkeypatch undone after one test
    left the step's cached gate pointing at a function no longer installed)."""
    allow_capturable_on_cpu()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))


def _train(make, tensor_lr=False, replica=False) -> list[torch.Tensor]:
    model = _model()
    opt = make(model.parameters())
    if tensor_lr:  # float64 for the replica: the default path's LR is a Python float (a double)
        dtype = torch.float64 if replica else torch.float32
        for group in opt.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]), dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(10, (16,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        replica_adam(opt) if replica else opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@torch.no_grad()
def replica_adam(opt: torch.optim.Optimizer) -> None:
    """Adam/AdamW's default foreach path with every per-step scalar computed on the device
    (float64 from the step tensor and a float64 LR tensor, rounded to float32 where the default
    path's kernel casts its scalar): graph-safe arithmetic, no host read. A float32 LR tensor
    (what the step installs) is already off by 1.5e-8 here: 1e-3 is not a float32."""
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        states = [opt.state[p] for p in params]
        for p, s in zip(params, states):
            if not s:
                s["step"] = torch.tensor(0.0)
                s["exp_avg"] = torch.zeros_like(p)
                s["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        lr = torch.as_tensor(group["lr"], dtype=torch.float64)
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        if group["weight_decay"]:
            if isinstance(opt, torch.optim.AdamW):
                torch._foreach_mul_(params, (1 - lr * group["weight_decay"]).float())
            else:
                raise NotImplementedError("Adam's L2 weight decay: not measured")
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        grads = [p.grad for p in params]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        for p, m, v, step in zip(params, exp_avgs, exp_avg_sqs, steps):
            t = step.double()
            bias1, bias2 = 1 - torch.pow(beta1, t), 1 - torch.pow(beta2, t)
            step_size = ((lr / bias1) * -1).float()
            denom = v.sqrt().div_(bias2.sqrt().float()).add_(group["eps"])
            p.addcdiv_(m * step_size, denom)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_capturable_differs_from_the_default_path_and_a_device_scalar_replica_does_not(
    kind, foreach, capturable_on_cpu
):
    cls = getattr(torch.optim, kind)
    kwargs = {"lr": 1e-3, "weight_decay": 0.01 if kind == "AdamW" else 0.0}
    default = _train(lambda p: cls(p, foreach=foreach, **kwargs))
    capturable = _train(lambda p: cls(p, foreach=foreach, capturable=True, **kwargs), True)
    replica = _train(lambda p: cls(p, foreach=foreach, **kwargs), True, replica=True)
    assert _difference(capturable, default) > 0  # last bits from the first step on
    assert _difference(replica, default) == 0  # the default path's scalars, on the device


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgds_tensor_lr_is_bitwise_and_its_fused_switch_is_measured(nesterov):
    """The fused switch's difference depends on the data and the device (0 on this model and
    on the report's probe on the CPU, 3e-8 on a deeper model after 20 steps): measured per
    run, on the device, for the report."""
    kwargs = {"lr": 0.05, "momentum": 0.9, "nesterov": nesterov, "weight_decay": 1e-4}
    default = _train(lambda p: torch.optim.SGD(p, **kwargs))
    assert _difference(_train(lambda p: torch.optim.SGD(p, **kwargs), True), default) == 0
    sgd = torch.optim.SGD(_model().parameters(), **kwargs)
    before = step_options(sgd)[0]
    sgd.param_groups[0].update(fused=True, foreach=False)
    assert measured_difference(sgd, 0, before, torch.device("cpu")) == 0


def test_the_report_lists_each_change_that_makes_a_difference_with_its_own_size(
    capturable_on_cpu,
):
    cpu = torch.device("cpu")
    model = _model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = step_options(adamw)
    plan = plan_graph_safety(adamw, cpu, fp16=False)
    assert not isinstance(plan, str)
    assert plan.changes == ["capturable=True", "foreach=True", "lr on device"]
    # the settings together against the script's (the for-loop path on the CPU); the LR tensor
    # alone makes no difference on the foreach path, so it is made and not listed
    assert [line.split(" (")[0] for line in plan.described] == plan.changes[:2]
    assert all(f"after {PROBE_STEPS} steps" in line for line in plan.described)
    settings, lr = measured_differences(adamw, 0, before[0], cpu)
    assert settings > 0 and lr == 0  # each measured alone, each with its own size
    assert f"max |Δparam| {settings:.3g} vs the script's settings" in plan.described[0]

    # already capturable, on the for-loop path the CPU defaults to: moved to foreach (the
    # for-loop path gives NaN at LR 0, pytorch#126514); the LR tensor alone measures 0 there
    already = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    plan = plan_graph_safety(already, cpu, fp16=False)
    assert not isinstance(plan, str) and plan.changes == ["foreach=True", "lr on device"]
    assert [line.split(" (")[0] for line in plan.described] == ["foreach=True"]
    on_foreach = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, foreach=True)
    plan = plan_graph_safety(on_foreach, cpu, fp16=False)
    assert not isinstance(plan, str) and plan.changes == ["lr on device"]
    assert plan.described == []


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_a_graph_safe_adam_at_lr_0_leaves_zero_gradient_elements_alone(kind, foreach):
    """pytorch#126514: torch's for-loop capturable Adam divides by ``-lr / bias_correction1``
    before adding eps, so LR 0 (a linear warm-up's first step) makes every element whose second
    moment is 0 NaN. Found by the CPU engine in the Accelerate matrix and run_glue; the graph-safe
    optimizer steps on the foreach path (CUDA's default), which adds eps first."""
    param = nn.Parameter(torch.tensor([1.0, 2.0, 0.0]))
    opt = kind([param], lr=1e-3, foreach=foreach)
    safe = make_graph_safe(opt, torch.device("cpu"))
    safe.lr_tensors[0].fill_(0.0)
    for _ in range(3):
        param.grad = torch.tensor([0.5, 0.0, 0.0])
        opt.step()
    assert param.detach().tolist() == [1.0, 2.0, 0.0]
    # the path it replaced is the one that fails: torch's own capturable for-loop step
    loop = nn.Parameter(torch.tensor([1.0, 2.0, 0.0]))
    theirs = kind([loop], lr=torch.tensor(0.0), capturable=True, foreach=False)
    loop.grad = torch.tensor([0.5, 0.0, 0.0])
    theirs.step()
    assert loop.detach()[1:].isnan().all(), "torch fixed pytorch#126514: revisit foreach=True"


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    ],
    ids=["sgd", "adamw-fused"],
)
def test_a_change_that_changes_nothing_is_made_but_not_reported(make, capturable_on_cpu):
    """Issue 42 item 5: the H200 listed capturable=True and lr on device for a fused AdamW whose
    graphed run was bitwise the script's own. Both measure 0 on the probe (as SGD's changes do on
    the CPU), so the report lists neither; the settings are still changed."""
    opt = make(_model().parameters())
    plan = plan_graph_safety(opt, torch.device("cpu"), fp16=False)
    assert not isinstance(plan, str) and "lr on device" in plan.changes
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert plan.described == []


def test_a_device_tensor_lr_given_by_the_script_is_no_change(capturable_on_cpu):
    opt = torch.optim.AdamW(
        _model().parameters(), lr=torch.tensor(1e-3), capturable=True, foreach=True
    )
    plan = plan_graph_safety(opt, torch.device("cpu"), fp16=False)
    assert not isinstance(plan, str) and plan.changes == [] and plan.described == []
