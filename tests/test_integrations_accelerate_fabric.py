"""``from_accelerator`` and ``from_fabric`` (:mod:`ddpgraph.integrations`): each loop trains bit for bit as
the framework's own DDP loop (2 gloo ranks, the real capture policy on the CPU): a tiny GPT-2 on
padded, attention-masked batches, 2 micro-batches per update, clipping, a warm-up schedule; the
same losses, grad norms and learning rates. A model or optimizer the framework already wrapped
is refused, naming the fix."""

from __future__ import annotations

import pytest
import torch

from ddpgraph import ConfigError, TrainStep
from ddpgraph.integrations.accelerate import from_accelerator
from ddpgraph.integrations.fabric import from_fabric
from ddpgraph.testing import run_distributed

from . import integration_workers as workers

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

RUN_S = 540  # one loop of 48 micro-batches on 2 ranks, on a loaded 2-core machine


def _same(ours, theirs):
    for key in ("losses", "norms", "lrs"):
        assert ours[key] == theirs[key], key  # exact floats
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name
    assert "mode=graphed" in ours["report"] and "replays=24" in ours["report"], ours["report"]


@pytest.mark.parametrize(
    "loop",
    [
        pytest.param("run_accelerate", id="accelerate"),
        pytest.param("run_fabric", id="fabric"),
    ],
)
def test_the_loop_trains_bit_for_bit_as_the_frameworks_own(loop):
    pytest.importorskip("accelerate" if loop == "run_accelerate" else "lightning")
    fn = getattr(workers, loop)
    theirs = run_distributed(fn, 2, args=(False,), timeout=RUN_S)
    ours = run_distributed(fn, 2, args=(True,), timeout=RUN_S)
    for rank in range(2):
        _same(ours[rank], theirs[rank])


def _model_and_optimizer():
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters())


def test_from_accelerator_refuses_what_prepare_wrapped():
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer = _model_and_optimizer()
    prepared_model, prepared_optimizer = accelerator.prepare(model, optimizer)
    with pytest.raises(ConfigError, match=r"already set up.*prepare only the data loader"):
        from_accelerator(accelerator, prepared_model, optimizer)
    with pytest.raises(ConfigError, match=r"optimizer accelerator.prepare\(\) wrapped"):
        from_accelerator(accelerator, torch.nn.Linear(4, 2), prepared_optimizer)
    with pytest.raises(ConfigError, match=r"amp=.*set it there"):
        fresh, opt = _model_and_optimizer()
        from_accelerator(accelerator, fresh, opt, amp="bf16")


def test_from_fabric_refuses_what_setup_wrapped():
    fabric_module = pytest.importorskip("lightning.fabric")
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1)
    model, optimizer = _model_and_optimizer()
    wrapped_model, wrapped_optimizer = fabric.setup(model, optimizer)
    with pytest.raises(
        ConfigError, match=r"model fabric.setup\(\) already wrapped.*setup_dataloaders"
    ):
        from_fabric(fabric, wrapped_model, optimizer)
    with pytest.raises(ConfigError, match=r"optimizer fabric.setup\(\) already wrapped"):
        from_fabric(fabric, torch.nn.Linear(4, 2), wrapped_optimizer)


@pytest.mark.parametrize(
    ("precision", "amp"), [("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("32-true", None)]
)
def test_fabric_precision_maps_to_amp(precision, amp):
    pytest.importorskip("lightning")
    from ddpgraph.integrations.fabric import amp_of

    assert amp_of(precision) == amp
    with pytest.raises(ConfigError, match="bf16-true"):
        amp_of("bf16-true")


def test_accelerate_mixed_precision_maps_to_amp():
    pytest.importorskip("accelerate")
    from ddpgraph.integrations.accelerate import amp_of

    assert [amp_of(p) for p in ("no", "bf16", "fp16")] == [None, "bf16", "fp16"]
    with pytest.raises(ConfigError, match="fp8"):
        amp_of("fp8")


def _accelerated_step(accelerate, k=1, **options):
    from ddpgraph.integrations.accelerate import attach, window_ends

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=k)
    torch.manual_seed(0)
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    scheduler = accelerator.prepare(scheduler)  # before the step, as the guide's port does
    ends = window_ends(accelerator, window_said=True)
    step = TrainStep(
        model, optimizer, torch.nn.MSELoss(), graph="never", window_ends=ends, **options
    )
    attach(accelerator, step, model, ends)
    return accelerator, step, scheduler


def test_fp16_overflow_holds_back_a_prepared_scheduler_and_save_state_keeps_the_loss_scale(
    tmp_path,
):
    """The mechanism from_accelerator attaches (on the CPU, with the step's own fp16): a
    skipped update of a non-fused AdamW holds the prepared scheduler back, as Accelerate's
    AcceleratedScheduler does for its own (GradScaler skipped the optimizer's step; a fused
    one's schedule advances: tests/test_integrations_fp16_skips.py); save_state / load_state
    carry model, optimizer and loss scale."""
    accelerate = pytest.importorskip("accelerate")
    accelerator, step, scheduler = _accelerated_step(accelerate, amp="fp16")
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    step(x, y)
    scheduler.step()
    assert not step.update_skipped and scheduler.get_last_lr() == [0.5e-3]
    step(x, torch.full((8, 2), float("inf")))  # inf/NaN gradients: the update is skipped
    scheduler.step()
    assert step.update_skipped and accelerator.optimizer_step_was_skipped
    assert scheduler.get_last_lr() == [0.5e-3]  # held back
    accelerator.save_state(str(tmp_path))
    saved = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl"} <= saved, saved
    params = [p.detach().clone() for p in step.model.parameters()]
    scale = float(step.loss_scale)
    step(x, y)  # moves everything on
    accelerator.load_state(str(tmp_path))
    for before, now in zip(params, step.model.parameters(), strict=True):
        assert torch.equal(before, now)
    assert float(step.loss_scale) == scale


def test_two_step_calls_in_one_accumulate_block_are_refused_where_they_overfill_the_window():
    accelerate = pytest.importorskip("accelerate")
    accelerator, step, _ = _accelerated_step(accelerate, k=2, accumulate_calls=2)
    model = step.model
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with accelerator.accumulate(model):
        step(x, y)  # Accelerate: sync_gradients False, the step's first micro-batch
        with pytest.raises(ConfigError, match=r"sync_gradients=False.*call 2 of"):
            step(x, y)


def test_non_ddp_set_ups_are_refused_naming_what_was_seen():
    """Accelerate's FSDP / DeepSpeed and Fabric's FSDP strategies (each guide's list)."""
    from types import SimpleNamespace

    pytest.importorskip("lightning")
    for kind in ("FSDP", "DEEPSPEED"):
        accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name=kind), _models=[])
        model, optimizer = _model_and_optimizer()
        with pytest.raises(ConfigError, match=rf"set up for {kind}; use accelerate's DDP"):
            from_accelerator(accelerator, model, optimizer)
    FSDPStrategy = type("FSDPStrategy", (), {})
    fabric = SimpleNamespace(strategy=FSDPStrategy())
    model, optimizer = _model_and_optimizer()
    with pytest.raises(
        ConfigError, match=r"strategy is FSDPStrategy; use Fabric\(strategy='ddp'\)"
    ):
        from_fabric(fabric, model, optimizer)


def test_from_accelerator_builds_the_step_over_accelerates_autocast_forward_without_a_warning():
    """The forward Accelerate's bf16 wraps (as ``prepare`` would) is wrapped before the step is
    built: the step captures it from its first call, and no call reports a model changed
    outside the step (the wrap once came after the build and was followed with a warning)."""
    import warnings

    accelerate = pytest.importorskip("accelerate")
    from ddpgraph.testing import CpuGraphs

    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model, optimizer = _model_and_optimizer()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = from_accelerator(
            accelerator, model, optimizer, torch.nn.MSELoss(), engine=CpuGraphs(), warmup=1
        )
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        for _ in range(4):
            step(x, y)
    outside = [str(w.message) for w in seen if "changed outside" in str(w.message)]
    assert not outside, outside
    assert step.report().replays >= 1, step.report()
    assert model(x).dtype == torch.float32  # Accelerate's convert_to_fp32 on the wrapped forward


def test_a_model_passed_where_the_framework_goes_is_named():
    """``from_accelerator(model, optimizer)``-style slips: the first argument is the framework's
    object, named with what was seen (it was an AttributeError deep in the option mapping)."""
    model, optimizer = _model_and_optimizer()
    with pytest.raises(
        TypeError, match=r"first argument is the script's accelerate.Accelerator, got Linear"
    ):
        from_accelerator(model, model, optimizer)
    with pytest.raises(
        TypeError, match=r"first argument is the script's lightning.Fabric, got Linear"
    ):
        from_fabric(model, model, optimizer)


def test_window_ends_that_is_not_callable_is_refused_at_construction():
    model, optimizer = _model_and_optimizer()
    with pytest.raises(ConfigError, match=r"window_ends=True must be a callable"):
        TrainStep(model, optimizer, torch.nn.MSELoss(), window_ends=True)  # type: ignore[arg-type]
