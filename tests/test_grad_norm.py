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


def _bucket_views(sizes, dtype=torch.float32):
    """Gradients laid out as DDP's ``gradient_as_bucket_view`` lays them: views one after
    another into a flat bucket, so one after an odd-sized one starts off the 16-byte grid."""
    bucket = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0), dtype=dtype)
    return list(torch.split(bucket, sizes))


def test_the_norm_copies_exactly_the_bucket_views_off_the_kernels_vector_grid(monkeypatch):
    """``norm_as_unbucketed`` hands torch's foreach norm each gradient aligned to its 4-element
    vectors as it is, and a copy (its own allocation) of each one that is not: the layout of a
    DDP script's own gradients (torch's gradient_as_bucket_view=False), whose norms the foreach
    kernel on CUDA sums in its vectorized order; the total is torch's over those."""
    from ddpgraph.step.parallel import ddp

    grads = _bucket_views([8, 3, 16, 5, 64, 1, 7])
    handed = []
    total_norm = torch.nn.utils.get_total_norm

    def seen(tensors, *args, **kwargs):
        handed.extend(tensors)
        return total_norm(tensors, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "get_total_norm", seen)
    total = ddp.norm_as_unbucketed(grads)
    off_grid = [g.data_ptr() % 16 != 0 for g in grads]
    assert off_grid == [False, False, True, True, False, False, True], off_grid
    for grad, given, off in zip(grads, handed, off_grid, strict=True):
        assert (given.data_ptr() == grad.data_ptr()) is not off
        assert given.data_ptr() % 16 == 0 and torch.equal(given, grad)
    alone = [g.clone() for g in grads]
    assert torch.equal(total, total_norm(alone, foreach=True))


def test_the_steps_ddp_takes_that_norm_unless_the_script_chose_the_bucket_views(monkeypatch):
    """Clipping and ``grad_norm`` go through ``norm_as_unbucketed`` where the step chose
    gradient_as_bucket_view=True (its default); a script that passed the flag itself (its own
    DDP's gradients were views) gets torch's ``clip_grad_norm_`` on the views, as it did."""
    results = run_distributed(step_workers.norm_paths, 1, timeout=180)
    assert results == [{"default": (2, 2), "bucket_views_said": (0, 0), "copies_said": (0, 0)}]


def test_a_sparse_gradient_is_normed_as_torch_norms_it():
    """A sparse gradient (``nn.Embedding(sparse=True)``, which DDP takes) has no data pointer
    and is no bucket view: it goes to torch's norm as it is."""
    from ddpgraph.step.parallel import ddp

    embedding = nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 2, 2])).sum().backward()
    grads = [embedding.weight.grad, *_bucket_views([3, 5])]
    assert grads[0].is_sparse
    total = ddp.norm_as_unbucketed(grads)
    assert torch.equal(total, torch.nn.utils.get_total_norm(grads, foreach=True))
