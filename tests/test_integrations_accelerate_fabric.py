"""``TrainStep.from_accelerator`` and ``TrainStep.from_fabric``: each loop trains bit for bit as
the framework's own DDP loop (2 gloo ranks, the real capture policy on the CPU): a tiny GPT-2 on
padded, attention-masked batches, 2 micro-batches per update, clipping, a warm-up schedule; the
same losses, grad norms and learning rates. A model or optimizer the framework already wrapped
is refused, naming the fix."""

from __future__ import annotations

import pytest
import torch

from ddpgraph import ConfigError, TrainStep
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
        TrainStep.from_accelerator(accelerator, prepared_model, optimizer)
    with pytest.raises(ConfigError, match=r"optimizer accelerator.prepare\(\) wrapped"):
        TrainStep.from_accelerator(accelerator, torch.nn.Linear(4, 2), prepared_optimizer)
    with pytest.raises(ConfigError, match=r"amp=.*set it there"):
        fresh, opt = _model_and_optimizer()
        TrainStep.from_accelerator(accelerator, fresh, opt, amp="bf16")


def test_from_fabric_refuses_what_setup_wrapped():
    fabric_module = pytest.importorskip("lightning.fabric")
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1)
    model, optimizer = _model_and_optimizer()
    wrapped_model, wrapped_optimizer = fabric.setup(model, optimizer)
    with pytest.raises(
        ConfigError, match=r"model fabric.setup\(\) already wrapped.*setup_dataloaders"
    ):
        TrainStep.from_fabric(fabric, wrapped_model, optimizer)
    with pytest.raises(ConfigError, match=r"optimizer fabric.setup\(\) already wrapped"):
        TrainStep.from_fabric(fabric, torch.nn.Linear(4, 2), wrapped_optimizer)


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
