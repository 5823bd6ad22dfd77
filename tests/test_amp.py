"""fp16 with dynamic loss scaling, and the ``amp`` spellings, on CPU: TrainStep against torch's
own autocast + torch.amp.GradScaler loop, overflows included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpgraph import TrainStep, load_checkpoint, save_checkpoint
from ddpgraph.testing import CpuGraphs

from .step_workers import batches, make_model

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("amp", "dtype"),
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        (torch.float16, torch.float16),
        (None, None),
    ],
)
def test_amp_takes_the_spellings_people_use(amp, dtype):
    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.Linear(1, 1), amp=amp)
    assert step._precision.dtype is dtype
    assert (step.loss_scale is not None) == (dtype is torch.float16)


def _data(n=30, overflow_at=(9, 19)):
    """Batches where some overflow fp16 (activations beyond 65504 make the loss inf)."""
    data = batches(n, 8)
    return [(x * 1e6, y) if i in overflow_at else (x, y) for i, (x, y) in enumerate(data)]


OPTIMIZERS = {
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2),
}


def _reference(opt_fn, data, clip, init_scale):
    """The eager loop torch's docs give: autocast fp16 + GradScaler."""
    model = make_model()
    opt = opt_fn(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=5)
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip, foreach=True)
        scaler.step(opt)
        scaler.update()
    return model, scaler


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_fp16_matches_autocast_and_gradscaler_bitwise_through_overflows(opt_name, clip):
    data = _data()
    opt_fn = OPTIMIZERS[opt_name]
    model = make_model()
    step = TrainStep(
        model,
        opt_fn(model.parameters()),
        nn.CrossEntropyLoss(),
        amp="fp16",
        clip_grad_norm=clip,
        grad_scaler={"init_scale": 2.0**10, "growth_interval": 5},
    )
    for x, y in data:
        step(x, y)
    reference, scaler = _reference(opt_fn, data, clip, 2.0**10)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert float(step.loss_scale) == scaler.get_scale()
    assert step.report().skipped_steps == 2
    assert "skipped (fp16 overflow)=2" in str(step.report())


def test_the_loss_scale_is_saved_and_restored_in_place(tmp_path):
    model = make_model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, fused=True),
        nn.CrossEntropyLoss(),
        amp="fp16",
    )
    for x, y in _data(12, overflow_at=(3, 7)):
        step(x, y)
    scale = step.loss_scale
    saved = step.state_dict()
    assert saved["scaler"]["scale"] == 2.0**14 and saved["scaler"]["skipped"] == 2
    save_checkpoint(tmp_path, step=12, train_step=step)
    scale.fill_(1.0)
    load_checkpoint(tmp_path, train_step=step)
    assert step.loss_scale is scale and float(scale) == 2.0**14


def test_fp16_on_a_real_hf_model_matches_gradscaler_bitwise():
    """GPT-2 (dropout 0.1, its own loss, mapping batches) through 5 overflows of a too-high
    initial scale; the GPU twin is tests/gpu/test_amp_gpu.py."""
    transformers = pytest.importorskip("transformers")

    def build():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=500)
        return transformers.GPT2LMHeadModel(config)

    gen = torch.Generator().manual_seed(3)
    data = [torch.randint(500, (4, 32), generator=gen) for _ in range(30)]
    options = {"init_scale": 2.0**24, "growth_interval": 25}
    reference = build()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", **options)
    torch.manual_seed(1)
    expected = []
    for ids in data:
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = reference(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        expected.append(loss.detach().float())
    model = build()
    step = TrainStep(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        amp="fp16",
        grad_scaler=options,
    )
    torch.manual_seed(1)
    losses = [step({"input_ids": ids, "labels": ids}).clone() for ids in data]
    assert torch.equal(torch.stack(losses), torch.stack(expected))
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert float(step.loss_scale) == scaler.get_scale()
    assert step.report().skipped_steps >= 3


SGD_KWARGS = {
    "momentum": {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4},
    "nesterov": {"lr": 0.1, "momentum": 0.9, "nesterov": True},
}


def _fused_sgd_skipped_on_the_host(params, **kwargs):
    """torch's fused SGD, but GradScaler skips an overflowed step on the host, as for an
    unfused optimizer: its buffers are made at the first real update (torch's semantics, the
    fused kernel's arithmetic)."""
    opt = torch.optim.SGD(params, fused=True, **kwargs)
    opt._step_supports_amp_scaling = False
    return opt


@pytest.mark.parametrize(
    ("sgd", "fused", "engine"),
    [
        ("momentum", False, "graphed"),
        ("nesterov", False, "graphed"),
        ("momentum", True, "graphed"),
        ("momentum", True, "eager"),
    ],
)
def test_fp16_sgd_whose_first_steps_overflow_makes_its_momentum_at_the_first_real_update(
    sgd, fused, engine
):
    """fp16's first steps overflow as a rule (torchvision's train.py --amp on shufflenet: its
    first 9). torch's fused SGD, which the graphed step uses (and a script may choose), makes its
    momentum buffers with ``empty_like`` on a step that finds none, and a step that found_inf
    skips leaves them so: the next real update added uninitialized memory (NaN on the H100, and
    on the CPU: tests/test_upstream_torchvision.py's ``--amp`` runs). The step makes them zeros
    before the first step, so the first real update's momentum is its gradient, as in torch's
    own first step: bit for bit the fused kernel's run with the skips taken on the host."""
    data = _data(overflow_at=(0, 1, 2, 11))
    model = make_model()
    kwargs = SGD_KWARGS[sgd]
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), fused=fused or None, **kwargs),
        nn.CrossEntropyLoss(),
        amp="fp16",
        grad_scaler={"init_scale": 2.0**10, "growth_interval": 5},
        engine=CpuGraphs() if engine == "graphed" else None,
    )
    for x, y in data:
        step(x, y)
    assert step.report().mode == engine
    reference, scaler = _reference(
        lambda p: _fused_sgd_skipped_on_the_host(p, **kwargs), data, None, 2.0**10
    )
    assert step.report().skipped_steps == 4
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert float(step.loss_scale) == scaler.get_scale()


def test_fp16_sgd_with_dampening_names_its_damped_first_update():
    """The zero buffers make the first real update's momentum ``(1 - dampening) * grad``, where
    torch's first step takes ``grad``: equal at dampening 0 (the test above), named otherwise."""
    model = make_model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1),
        nn.CrossEntropyLoss(),
        amp="fp16",
        engine=CpuGraphs(),
    )
    (line,) = [c for c in step.report().optimizer_changes if "momentum buffers" in c]
    assert "dampening=0.1" in line and "undamped" in line, line


def test_fp16_sgd_gives_no_momentum_buffer_to_a_frozen_parameter():
    """A script that passes every parameter, the frozen ones too (LoRA's base weights), gets
    buffers only for those that train, as torch's own SGD would after its first step."""
    model = make_model()
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    TrainStep(model, opt, nn.CrossEntropyLoss(), amp="fp16", engine=CpuGraphs())
    assert frozen not in opt.state
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters() if p.requires_grad)


class _ScalingSeen(torch.utils._python_dispatch.TorchDispatchMode):
    """Per update, in order: whether the gradients were unscaled before the step (the inf check
    given a scale other than 1) and which tensor keyword arguments the fused kernel was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.unscaled: list[bool] = []
        self.kernel: list[tuple[str, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if "_amp_foreach_non_finite_check_and_unscale_" in name:
            self.unscaled.append(float(args[2]) != 1.0)
        elif "_fused_" in name:
            given = (k for k in ("grad_scale", "found_inf") if kwargs.get(k) is not None)
            self.kernel.append(tuple(given))
        return func(*args, **kwargs)


UNSCALED_WHERE = {  # the script's optimizer as built -> is it handed the scale? (GradScaler's rule)
    "sgd-plain": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False),
    "sgd-fused": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True), True),
    "adamw-foreach": (lambda p: torch.optim.AdamW(p, lr=1e-2), False),
    "adamw-fused": (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True), True),
}


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("opt_name", sorted(UNSCALED_WHERE))
def test_fp16_unscales_before_the_step_exactly_where_gradscaler_does(opt_name, clip):
    """GradScaler passes the scale into the step only of an optimizer built fused
    (``_step_supports_amp_scaling``) and not after ``unscale_`` (clipping); for any other it
    unscales the gradients before the step. The step does the same, handing its fused kernel
    the overflow verdict always (it skips on the device): on CUDA the kernel's own unscaling
    rounds the update differently (torchvision's train.py --amp SGD parted from its port at the
    first real update; benchmarks/probes/fused_sgd_grad_scale.py). The step runs through the CPU
    engine's capture and replays; the script is torch's autocast + GradScaler loop."""
    opt_fn, scaled_in_kernel = UNSCALED_WHERE[opt_name]
    unscaled_first = clip is not None or not scaled_in_kernel
    data = _data(6, overflow_at=())
    model = make_model()
    step = TrainStep(
        model, opt_fn(model.parameters()), nn.CrossEntropyLoss(), amp="fp16",
        clip_grad_norm=clip, engine=CpuGraphs(), warmup=2,
    )  # fmt: skip
    with _ScalingSeen() as ours:
        for x, y in data:
            step(x, y)
    assert step.report().replays > 0, str(step.report())
    assert ours.unscaled and set(ours.unscaled) == {unscaled_first}, ours.unscaled
    given = ("found_inf",) if unscaled_first else ("grad_scale", "found_inf")
    assert ours.kernel and set(ours.kernel) == {given}, ours.kernel
    with _ScalingSeen() as theirs:
        _reference(opt_fn, data, clip, 2.0**16)
    # GradScaler checks a fused optimizer's gradients for infs with a scale of 1 (no unscale)
    assert theirs.unscaled == [unscaled_first] * len(data), theirs.unscaled
