"""``step.grad_norm``: the total gradient norm of each update, as the eager loop's
``clip_grad_norm_`` returns it (issue: llm.c prints it, transformers' Trainer logs it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpgraph import ConfigError, DeviceData, TrainStep
from ddpgraph.testing import CpuGraphs, run_distributed

from . import step_workers
from .step_workers import batches, make_model

pytestmark = pytest.mark.timeout(240)


def eager_norms(data, *, clip, accumulate_calls=1, graph_safe=False):
    """The loop scripts write: backward, clip_grad_norm_ (or get_total_norm), step.
    ``graph_safe``: its SGD is the one a graphed step steps (fused, the LR in a tensor), the
    reference for a CpuGraphs run."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if graph_safe:
        step_workers.as_the_step_steps(opt)
    norms = []
    for i, (x, y) in enumerate(data):
        loss = nn.functional.cross_entropy(model(x), y) / accumulate_calls
        loss.backward()
        if (i + 1) % accumulate_calls:
            continue
        params = [p for p in model.parameters() if p.grad is not None]
        if clip is None:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True))
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip, foreach=True))
        opt.step()
        opt.zero_grad()
    return norms, list(model.parameters())


def step_norms(data, *, engine, **options):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), engine=engine, **options)
    norms = []
    for x, y in data:
        step(x, y)
        norms.append(None if step.grad_norm is None else step.grad_norm.clone())
    return norms, list(model.parameters()), step


@pytest.mark.parametrize("engine", [None, CpuGraphs()], ids=["eager", "graphed"])
@pytest.mark.parametrize(
    ("options", "clip"),
    [({"clip_grad_norm": 0.5}, 0.5), ({"grad_norm": True}, None)],
    ids=["clipped", "measured"],
)
def test_the_grad_norm_is_the_eager_loops_bit_for_bit(engine, options, clip):
    data = batches(20, 8)
    ours, params, step = step_norms(data, engine=engine, **options)
    theirs, their_params = eager_norms(data, clip=clip, graph_safe=engine is not None)
    if engine is not None:
        assert step.report().replays > 0, str(step.report())
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a is not None and a.dim() == 0 and torch.equal(a, b)
    for a, b in zip(params, their_params):
        assert torch.equal(a, b)


def test_without_clipping_or_measuring_there_is_no_grad_norm():
    ours, _, _ = step_norms(batches(3, 8), engine=None)
    assert ours == [None, None, None]


def test_accumulate_calls_gives_the_norm_on_the_call_that_steps():
    data = batches(48, 8)
    ours, params, step = step_norms(
        data, engine=CpuGraphs(), clip_grad_norm=1.0, accumulate_calls=3
    )
    theirs, their_params = eager_norms(data, clip=1.0, accumulate_calls=3, graph_safe=True)
    assert [n is None for n in ours] == [(i + 1) % 3 != 0 for i in range(48)]
    for a, b in zip([n for n in ours if n is not None], theirs):
        assert torch.equal(a, b)
    for a, b in zip(params, their_params):
        assert torch.equal(a, b)
    assert step.report().replays > 0


def test_a_multi_step_call_gives_one_norm_per_step():
    x, y = torch.randn(96, 8), torch.randint(4, (96,))

    def run(k):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = TrainStep(
            model, opt, nn.CrossEntropyLoss(), grad_norm=True, steps_per_replay=k,
            engine=CpuGraphs(),
        )  # fmt: skip
        data = DeviceData(x, y, batch_size=8, seed=2)
        norms = []
        for _ in range(24 // k):
            step(data)
            assert step.grad_norm is not None and step.grad_norm.shape == (k,)
            norms.append(step.grad_norm.clone())
        return torch.cat(norms)

    assert torch.equal(run(4), run(1))


def test_grad_norm_must_be_a_bool():
    model = make_model()
    with pytest.raises(ConfigError, match="grad_norm=1 must be True or False"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_norm=1)


def test_the_grad_norm_on_two_ranks_is_the_ddp_loops():
    results = run_distributed(step_workers.grad_norm_vs_ddp, 2, args=(20,), timeout=180)
    for result in results:
        assert result["replays"] > 0
        for a, b in zip(result["ours"], result["theirs"]):
            assert torch.equal(a, b)
