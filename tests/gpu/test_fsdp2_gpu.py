"""FSDP2 (fully_shard) under TrainStep on CUDA: one GPU bitwise against the eager FSDP2 loop (world
size 1: FSDP2 runs no collective), a fake process group of 4 and 8 ranks (the sharded paths
captured and replayed, no numerics), and real NCCL ranks (skipped under 2 GPUs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpgraph import CaptureError, TrainStep
from ddpgraph.facts import DEFAULT_WARMUP
from ddpgraph.testing import run_distributed

from . import fsdp2_gpu_workers as w

pytestmark = pytest.mark.timeout(600)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize(
    ("kind", "calls", "clip", "mp", "amp"),
    [
        ("foreach", 1, 1.0, False, False),
        ("fused", 1, 1.0, False, False),
        ("foreach", 1, None, True, False),
        ("foreach", 1, 0.5, False, True),
        ("foreach", 2, 1.0, False, False),
        ("fused", 2, 1.0, True, False),
    ],
    ids=["foreach-clip", "fused-clip", "mp-bf16", "amp-bf16", "accumulate-2", "fused-mp-acc-2"],
)
def test_graphed_fsdp2_step_is_bitwise_the_eager_fsdp2_loop(rt, kind, calls, clip, mp, amp):
    r = w.graphed_vs_eager(20, kind, calls, clip, mp, amp)
    # every call after the warm-up (DEFAULT_WARMUP windows) replays
    assert r["phase"] == "graphed" and r["replays"] == (20 - DEFAULT_WARMUP) * calls
    assert r["graphed"] == r["eager"]
    _same(r["graphed_params"], r["eager_params"])


@pytest.mark.parametrize("calls", [1, 2])
def test_explicit_prefetch_and_the_scripts_own_sync_flag_replay_bitwise(rt, calls):
    """Issue 31 item 5: unshard() before each step used to crash after 4 replays ("parameter 0
    ... was replaced since capture"); the script's set_requires_gradient_sync is the window.

    Every call after the warm-up replays: the warm-up is DEFAULT_WARMUP optimizer steps (12;
    FSDP2 allows a capture after 2), i.e. 12 * calls calls. Issue 42 item 3 read "4 and 8 replays"
    at 16 steps as calls gone eager, but 16 - 12 = 4 windows were all that was left to replay
    (the test expected >= 5); it now runs 20 steps and asserts the exact count, printing every
    call that did not replay with the report (captures with their step, fallbacks, re-captures)
    when it fails."""
    steps = 20
    r = w.script_habits_graphed_vs_eager(steps, calls)
    warmup = DEFAULT_WARMUP * calls
    not_replayed = [c for c in r["eager_calls"] if c[0] >= warmup]
    why = f"calls not replayed after the warm-up: {not_replayed}\n{r['report']}"
    assert r["phase"] == "graphed", why
    assert r["eager_steps"] == warmup and not_replayed == [], why
    assert r["replays"] == steps * calls - warmup, why
    assert r["graphed"] == r["eager"]
    _same(r["graphed_params"], r["eager_params"])


def test_three_accumulate_calls_on_fsdp2_run_eagerly_with_the_reason(rt):
    # measured: one graph for every micro-batch of a window drifted from eager FSDP2 (the first
    # creates FSDP2's unsharded accumulator, the later ones add to it)
    model = w.sharded(mp=True)
    opt = w.adamw(model, "fused", graph_safe=False)
    with pytest.raises(CaptureError, match="accumulate_calls=3 with FSDP2"):
        TrainStep(model, opt, nn.CrossEntropyLoss(), accumulate_calls=3, graph="always")


def test_steps_per_replay_on_fsdp2_is_bitwise_the_eager_trainstep(rt):
    eager = w.steps_per_replay_run(4, "never")
    graphed = w.steps_per_replay_run(4, "always")
    _same(graphed, eager)


def test_evaluation_of_a_sharded_model_is_graphed_and_equals_its_forward(rt):
    model = w.sharded()
    step = TrainStep(model, w.adamw(model, "foreach", graph_safe=False), nn.CrossEntropyLoss())
    data = w.batches(14)
    for x, y in data:
        step(x, y)
    x = data[0][0]
    outs = [step.evaluate(x).clone() for _ in range(5)]
    assert step.report().eval_replays == 3
    with torch.no_grad():
        model.eval()
        expected = model(x)
        model.train()
    for out in outs:
        assert torch.equal(out, expected)
    step(*data[1])  # training goes on after evaluation graphs
    assert step.phase.value == "graphed"


def test_cpu_offload_is_refused_under_graphs(rt):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = w.Blocks().cuda()
    for layer in model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    with pytest.raises(CaptureError, match="CPUOffloadPolicy"):
        TrainStep(model, torch.optim.AdamW(model.parameters()), graph="always")


@pytest.mark.parametrize("world_size", [4, 8])
def test_fake_world_captures_and_replays_the_sharded_step_without_host_syncs(world_size):
    (r,) = run_distributed(w.fake_world, 1, init=False, args=(world_size, 24), timeout=540)
    assert r["phase"] == "graphed", r["fallbacks"]
    assert r["replays"] >= 10 and r["checked_replays"] >= 10
    assert r["sharded_numel"] < r["numel"] / 2  # this rank holds its shard, not the model
    print(f"world {world_size}: peak eager {r['eager_peak']} graphed {r['graphed_peak']}")
    assert r["graphed_peak"] <= 1.5 * r["eager_peak"], r


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_real_collectives_inside_the_graph_match_the_eager_fsdp2_loop_on_every_rank():
    world = torch.cuda.device_count()
    results = run_distributed(
        w.nccl_graphed_vs_eager, world, backend="nccl", args=(20,), timeout=540
    )
    for rank, r in enumerate(results):
        assert r["phase"] == "graphed", rank
        assert r["graphed"] == r["eager"], rank
        _same(r["graphed_params"], r["eager_params"])
    for r in results[1:]:
        _same(r["graphed_params"], results[0]["graphed_params"])
