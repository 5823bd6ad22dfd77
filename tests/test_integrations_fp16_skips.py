"""fp16 updates skipped for inf/NaN gradients, counted as each framework's own loop counts them.

transformers' Trainer (5.0 to 5.25) steps its LR scheduler unless
``accelerator.optimizer_step_was_skipped``; Accelerate's prepared scheduler
(``AcceleratedScheduler``) asks the same of its optimizers. ``AcceleratedOptimizer`` (accelerate
0.22 to 1.16) reports a skip when ``torch.amp.GradScaler.step`` did not call the optimizer's
``step()``: never for a fused optimizer (``_step_supports_amp_scaling``: the kernel skips on the
device), so the Trainer's default ``adamw_torch_fused`` advances its schedule through overflows,
and a non-fused optimizer holds it back.

Accelerate creates no GradScaler on the CPU (``Accelerator.__init__`` scales fp16 only where
``device.type != "cpu"``; the Trainer trains fp16 as fp32 there). These tests hand the
Accelerator what it builds on CUDA, torch's CPU ``GradScaler`` and native AMP, before anything is
prepared, so the framework's real fp16 path runs here: the autocast forward, the scaled
backward, ``AcceleratedOptimizer.step`` through the GradScaler, its verdict and the loop's
scheduler step. The GPU runs of the same rule are in tests/gpu/test_integrations_gpu.py and
tests/gpu/test_framework_tails_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddpgraph.integrations._optim import scaler_reports_skips
from ddpgraph.testing import CpuGraphs

from . import fp16_workers, trainer_workers
from . import integration_workers as workers

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(600)


def _scale_fp16_on_the_cpu(accelerator) -> None:
    """What ``Accelerator(mixed_precision="fp16")`` sets up on CUDA, on the CPU (its
    ``GradScalerKwargs`` included, as ``Accelerator.__init__`` passes them)."""
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None
    handler = accelerator.scaler_handler
    accelerator.scaler = torch.amp.GradScaler("cpu", **(handler.to_kwargs() if handler else {}))
    accelerator.native_amp = True


# ---------------------------------------------------------------- Accelerate's own loop

STEPS = 40  # TrainStep warms up for 12 calls here, then captures: 28 replays
OVERFLOWS = (2, 3, 30)  # targets of inf: inf/NaN gradients, in the warm-up and in a replay


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    return {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
        "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
        "sgd-fused": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
    }[kind](model.parameters())


def _accelerate_loop(kind: str, graphed: bool) -> dict[str, list]:
    """Accelerate's own fp16 loop or from_accelerator's (:func:`fp16_workers.accelerate_fp16_loop`)
    on a small MLP, the targets of steps ``OVERFLOWS`` inf."""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    _scale_fp16_on_the_cpu(accelerator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 8, generator=gen), torch.randn(8, 2, generator=gen)) for _ in range(STEPS)
    ]
    for i in OVERFLOWS:
        batches[i] = (batches[i][0], torch.full((8, 2), float("inf")))
    run, step = fp16_workers.accelerate_fp16_loop(
        accelerator, model, _optimizer(kind, model), torch.nn.MSELoss(), batches,
        graphed=graphed, engine=CpuGraphs(),
    )  # fmt: skip
    if step is not None:
        report = step.report()
        assert report.eager_steps == report.warmup_steps == 12, report
        assert report.replays == STEPS - 12 and report.skipped_steps == len(OVERFLOWS), report
    return run


@pytest.mark.parametrize("kind", ["adamw", "adamw-fused", "sgd-fused"])
def test_from_accelerator_counts_skipped_updates_as_accelerates_own_loop(kind):
    theirs = _accelerate_loop(kind, graphed=False)
    ours = _accelerate_loop(kind, graphed=True)
    reported = scaler_reports_skips(_optimizer(kind, torch.nn.Linear(1, 1)))
    assert reported == (kind == "adamw")  # fused kernels skip inside, unseen by Accelerate
    expected = [reported and i in OVERFLOWS for i in range(STEPS)]
    assert theirs["skipped"] == expected  # Accelerate's own verdicts, step by step
    assert ours["skipped"] == theirs["skipped"]
    assert ours["lrs"] == theirs["lrs"]  # held back, or advancing through the overflows
    if kind == "adamw":
        # TrainStep steps AdamW through the fused kernel in fp16 (the only one that skips on
        # the device): last-bit rounding apart from the script's foreach AdamW
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-3)
    else:
        assert ours["losses"] == theirs["losses"]


def test_accelerator_state_starts_fresh_bf16():
    """With the next test: an Accelerator of one precision does not leak into the next test
    (tests/conftest.py resets Accelerate's state after each test)."""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    assert accelerator.mixed_precision == "bf16"


def test_accelerator_state_starts_fresh_fp16():
    from accelerate.state import is_initialized

    assert not is_initialized()
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    assert accelerator.mixed_precision == "fp16"


# ---------------------------------------------------------------- transformers' Trainer


def _trainer_logs(graphed: bool, out, optim: str, overflow: bool) -> tuple[list, object]:
    """A 24-step fp16 run (48 micro-batches: 24 of warm-up, then replays) of the plain Trainer
    (its optimizer stepping the graphed step's arithmetic: capturable, the LR a float32 tensor,
    as GraphTrainer's graph steps it on the CPU engine and on CUDA) or GraphTrainer on the CPU
    engine; every logged step's loss, grad norm and LR."""
    import transformers

    from ddpgraph.integrations.transformers import GraphTrainer

    args = workers.trainer_args(
        str(out / ("graphed" if graphed else "plain")), fp16=True, optim=optim, max_steps=24,
        save_strategy="no",
    )  # fmt: skip
    common = dict(model=workers.tiny_gpt2(), args=args, train_dataset=workers.gpt2_data(128))
    if overflow:  # a loss times 1000: fp16's first loss scales overflow
        common["compute_loss_func"] = trainer_workers._scaled_loss
    if graphed:
        trainer = GraphTrainer(**common, step_options={"engine": CpuGraphs()})
    else:
        trainer = workers.with_graph_safe_arithmetic(transformers.Trainer)(**common)
    _scale_fp16_on_the_cpu(trainer.accelerator)
    trainer.train()
    keys = ("step", "loss", "grad_norm", "learning_rate")
    logs = [
        tuple(repr(entry[k]) for k in keys)  # repr: nan grad norms compare equal
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    return logs, trainer


def _skipped(logs) -> int:
    """How many updates the run skipped, all at its start (the scale settles, then stays)."""
    skipped = [not math.isfinite(float(grad_norm)) for _, _, grad_norm, _ in logs]
    first_update = skipped.index(False) if False in skipped else len(skipped)
    assert not any(skipped[first_update:]), skipped
    return first_update


@pytest.mark.parametrize(("optim", "overflow"), fp16_workers.TRAINER_CASES)
def test_graph_trainer_fp16_logs_the_plain_trainers_lrs_and_losses(tmp_path, optim, overflow):
    plain, _ = _trainer_logs(False, tmp_path, optim, overflow)
    ours, trainer = _trainer_logs(True, tmp_path, optim, overflow)
    report = trainer.report().step
    assert report.steps == 48 and report.replays == 24 and report.fallbacks == [], str(report)
    assert report.skipped_steps == _skipped(plain), (str(report), plain)
    if overflow:
        assert _skipped(plain) >= 4, plain
    assert [e[3] for e in ours] == [e[3] for e in plain]  # the LR at every logged step
    # a host read per update only where the Trainer's run makes one (GradScaler, non-fused)
    assert ("found_inf .item() per update" in str(trainer.report())) == (optim == "adamw_torch")
    lrs = [float(e[3]) for e in plain[: _skipped(plain)]]
    if optim == "adamw_torch_fused":
        assert ours == plain  # losses and grad norms too, to the bit
        assert len(set(lrs)) == len(lrs)  # the schedule advanced through the overflows
    else:
        assert lrs == [0.0] * len(lrs)  # held at the warm-up's start while skipping
        # GraphTrainer's fp16 AdamW is fused (it skips on the device): close, not equal
        theirs, mine = [float(e[1]) for e in plain], [float(e[1]) for e in ours]
        assert mine == pytest.approx(theirs, rel=1e-3)


def test_from_accelerator_scales_as_the_accelerators_grad_scaler_kwargs():
    """GradScalerKwargs set on the Accelerator are the step's grad_scaler: the same scale after
    the same overflows and growth as Accelerate's own loop (a default scaler ends 2**12 away)."""
    from accelerate.utils import GradScalerKwargs

    kwargs = GradScalerKwargs(init_scale=2.0**6, growth_interval=4, backoff_factor=0.25)
    scales = []
    for graphed in (False, True):
        accelerator = accelerate.Accelerator(
            cpu=True, mixed_precision="fp16", kwargs_handlers=[kwargs]
        )
        _scale_fp16_on_the_cpu(accelerator)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        gen = torch.Generator().manual_seed(1)
        batches = [
            (torch.randn(8, 8, generator=gen), torch.randn(8, 2, generator=gen))
            for _ in range(STEPS)
        ]
        for i in OVERFLOWS:
            batches[i] = (batches[i][0], torch.full((8, 2), float("inf")))
        opt = _optimizer("adamw-fused", model)
        _, step = fp16_workers.accelerate_fp16_loop(
            accelerator, model, opt, torch.nn.MSELoss(), batches, graphed=graphed,
            engine=CpuGraphs(),
        )  # fmt: skip
        scales.append(float(step.loss_scale) if step else accelerator.scaler.get_scale())
    assert scales[0] != 2.0**16 and scales[1] == scales[0], scales


@pytest.mark.parametrize(
    ("options", "handler", "match"),
    [
        ({"grad_scaler": {"init_scale": 8.0}}, {}, "the Accelerator sets fp16's loss scaling"),
        ({}, {"enabled": False}, "enabled=False"),
    ],
)
def test_from_accelerator_refuses_a_second_scaler_setting(options, handler, match):
    from accelerate.utils import GradScalerKwargs

    from ddpgraph import ConfigError
    from ddpgraph.integrations.accelerate import from_accelerator

    accelerator = accelerate.Accelerator(
        cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(**handler)]
    )
    _scale_fp16_on_the_cpu(accelerator)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    with pytest.raises(ConfigError, match=match):
        from_accelerator(accelerator, model, opt, torch.nn.MSELoss(), **options)
