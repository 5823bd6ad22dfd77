"""``TrainStep(parallel="none")``: the module unwrapped on a process group of one rank (what
``accelerator.prepare`` does on one process), bit for bit as DDP's step there; refused on every
rank where gradients would need a sync. ``from_accelerator`` wraps the model in DDP exactly where
Accelerate's own ``prepare`` does (2 gloo ranks: DDP; 1: none)."""

from __future__ import annotations

import pytest
import torch

from ddpgraph import ConfigError
from ddpgraph.testing import run_distributed

from . import parallel_none_workers as w
from .test_objects import assert_same_error_everywhere

pytestmark = pytest.mark.timeout(300)

RUN_S = 240


def test_one_rank_unwrapped_trains_bit_for_bit_as_ddp_of_one_rank():
    (ddp,) = run_distributed(w.train, 1, args=("auto",), timeout=RUN_S)
    (alone,) = run_distributed(w.train, 1, args=("none",), timeout=RUN_S)
    assert (ddp["ddp"], alone["ddp"]) == (True, False)
    assert alone["replays"] >= 5, alone["replays"]
    assert alone["losses"] == ddp["losses"]  # exact floats
    for ours, theirs in zip(alone["params"], ddp["params"], strict=True):
        assert torch.equal(ours, theirs)


def test_more_than_one_rank_is_refused_on_every_rank():
    results = run_distributed(w.refuse, 2, args=("ranks",), timeout=RUN_S, return_exceptions=True)
    assert_same_error_everywhere(
        results, ConfigError, "parallel='none'", "group has 2 ranks", "parallel='auto'"
    )


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("ddp_kwargs", "ddp_kwargs={'bucket_cap_mb': 1} are DistributedDataParallel's"),
        ("sharded", "got a model sharded with fully_shard"),
    ],
)
def test_what_an_unwrapped_step_cannot_take_is_refused(case, fragment):
    results = run_distributed(w.refuse, 1, args=(case,), timeout=RUN_S, return_exceptions=True)
    assert_same_error_everywhere(results, ConfigError, fragment)


@pytest.mark.parametrize("ranks", [1, 2])
def test_from_accelerator_wraps_in_ddp_where_prepare_does(ranks):
    """On the CPU Accelerate sets up MULTI_CPU on a gloo group of any size, and wraps; its one
    unwrapped case with a group, one GPU process (``torchrun --nproc-per-node 1``: MULTI_GPU,
    ``num_processes`` 1), is the rule's test below and tests/gpu/test_upstream_scripts_gpu.py."""
    pytest.importorskip("accelerate")
    seen = run_distributed(w.wrapped_as_prepare, ranks, timeout=RUN_S)
    assert seen == [{"kind": "MULTI_CPU", "prepare": True, "step": True}] * ranks, seen


@pytest.mark.parametrize("world", [None, 1, 2])
def test_prepares_ddp_follows_accelerates_rule(monkeypatch, world):
    """Accelerate's ``prepare``: DDP on several GPU processes (``multi_device``), always on
    MULTI_CPU, never with distributed_type NO; here with no process group, a group of one rank
    (``torchrun --nproc-per-node 1``: MULTI_GPU with one process, unwrapped) and a group of two
    that Accelerate did not count (DDP, as before: never unsynced replicas)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from ddpgraph.integrations.accelerate import _prepares_ddp

    monkeypatch.setattr(dist, "is_initialized", lambda: world is not None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)

    def told(n):
        return SimpleNamespace(num_processes=n)

    several = world == 2
    assert _prepares_ddp(told(1), "MULTI_GPU") is several
    assert _prepares_ddp(told(2), "MULTI_GPU")
    assert _prepares_ddp(told(1), "MULTI_CPU")
    assert _prepares_ddp(told(1), "NO") is several


@pytest.mark.parametrize(
    ("options", "said", "wrapping"),
    [
        ({}, False, {"parallel": "none"}),  # prepare leaves the model unwrapped: so does the step
        ({}, True, {"ddp_kwargs": {"bucket_cap_mb": 1}}),  # the script's own DDP arguments
        ({"parallel": "none"}, False, {}),  # the framework's DDP arguments dropped
        ({"parallel": "none"}, True, {"ddp_kwargs": {"bucket_cap_mb": 1}}),  # refused by the step
        ({"parallel": "ddp"}, False, {"ddp_kwargs": {"bucket_cap_mb": 1}}),
    ],
)
def test_wrapping_as_prepared_on_one_gpu_process_keeps_what_the_script_chose(
    options, said, wrapping
):
    from types import SimpleNamespace

    from ddpgraph.integrations.accelerate import wrapping_as_prepared

    one_gpu = SimpleNamespace(distributed_type=SimpleNamespace(name="MULTI_GPU"), num_processes=1)
    seen = wrapping_as_prepared(one_gpu, {"bucket_cap_mb": 1}, options, ddp_kwargs_said=said)
    assert seen == wrapping


def test_from_accelerator_keeps_the_scripts_ddp_kwargs_on_one_process():
    """``from_accelerator(..., ddp_kwargs=...)`` where Accelerate would leave the model
    unwrapped: the script asked for DDP's arguments, so the step builds DDP with them."""
    from types import SimpleNamespace

    from ddpgraph.integrations.accelerate import accelerator_options

    one_gpu = SimpleNamespace(
        distributed_type=SimpleNamespace(name="MULTI_GPU"), num_processes=1,
        gradient_accumulation_steps=1, mixed_precision="no", native_amp=False,
        device=torch.device("cpu"), ddp_handler=None, _models=[], _optimizers=[],
    )  # fmt: skip
    model, optimizer = w._model_and_optimizer()
    chosen = accelerator_options(one_gpu, model, optimizer, {"ddp_kwargs": {"bucket_cap_mb": 1}})
    assert chosen.get("ddp_kwargs") == {"bucket_cap_mb": 1} and "parallel" not in chosen, chosen
    chosen = accelerator_options(one_gpu, model, optimizer, {})
    assert chosen.get("parallel") == "none" and "ddp_kwargs" not in chosen, chosen


def test_without_a_group_none_is_the_module_and_an_unknown_choice_names_the_choices():
    from ddpgraph import TrainStep

    model, optimizer = w._model_and_optimizer()
    step = TrainStep(model, optimizer, torch.nn.MSELoss(), parallel="none", graph="never")
    assert step.model is model
    with pytest.raises(ConfigError, match=r"parallel='nope' must be one of .*'none'"):
        TrainStep(model, optimizer, torch.nn.MSELoss(), parallel="nope")
