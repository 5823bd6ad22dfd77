"""DeviceData (the data set on the device, gathered inside the step) and steps_per_replay."""

from __future__ import annotations

import copy
import itertools
import math
import re

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from ddpgraph import ConfigError, DeviceData, TrainStep
from ddpgraph.testing import CpuGraphs, run_distributed

from . import device_data_workers as workers

pytestmark = pytest.mark.timeout(180)


def _sampler_batches(n, replicas, rank, batch, shuffle, seed, epoch):
    data = TensorDataset(torch.arange(n))
    sampler = DistributedSampler(
        data, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
    )
    sampler.set_epoch(epoch)
    return [list(b) for b in BatchSampler(sampler, batch, drop_last=True)]


# ------------------------------------------------------------------- the order
@pytest.mark.parametrize(
    ("n", "replicas", "batch", "shuffle", "seed"),
    [
        (103, 1, 8, True, 0),
        (103, 2, 8, True, 5),
        (100, 3, 7, True, 1),
        (64, 2, 4, False, 0),
        (17, 4, 2, True, 9),
    ],
)
def test_each_epoch_is_the_distributed_samplers_batches(n, replicas, batch, shuffle, seed):
    for rank in range(replicas):
        data = DeviceData(
            torch.arange(n),
            batch_size=batch,
            shuffle=shuffle,
            seed=seed,
            num_replicas=replicas,
            rank=rank,
        )
        for epoch in range(3):
            expected = _sampler_batches(n, replicas, rank, batch, shuffle, seed, epoch)
            assert data.indices(epoch).tolist() == expected
            assert len(data) == len(expected)


def test_iterating_yields_what_a_dataloader_yields_epoch_after_epoch():
    x, y = torch.randn(50, 3), torch.arange(50)
    data = DeviceData(x, y, batch_size=6, seed=2, num_replicas=2, rank=1)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, seed=2, drop_last=True)
    loader = DataLoader(dataset, sampler=BatchSampler(sampler, 6, drop_last=True), batch_size=None)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        ours = list(data)
        theirs = list(loader)
        assert len(ours) == len(theirs) == len(data)
        for (a, b), (c, d) in zip(ours, theirs):
            assert torch.equal(a, c) and torch.equal(b, d)
    assert (data.epoch, data.position) == (3, 0)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_k_gathers_per_call_run_across_epoch_ends_in_order(k):
    """As TrainStep uses it: k device gathers, then the host counts k (the window moves on)."""
    data = DeviceData(torch.arange(40), batch_size=4, seed=1)  # 10 batches an epoch
    expected = torch.cat([data.indices(e).view(-1) for e in range(5)])
    seen = []
    for _ in range(40 // k):
        seen += [data.next_batch()[0] for _ in range(k)]
        data.advance(k)
    assert torch.equal(torch.cat(seen), expected[: len(seen) * 4])


def test_channels_last_images_are_gathered_channels_last_with_the_same_values():
    images = torch.randn(24, 3, 5, 4)
    plain = DeviceData(images, batch_size=4, seed=0)
    nhwc = DeviceData(images, batch_size=4, seed=0, channels_last=True)
    for (a,), (b,) in zip(plain.next_batches(3), nhwc.next_batches(3)):
        assert a.is_contiguous() and b.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(a, b)


def test_state_dict_resumes_at_the_same_batch_and_refuses_another_data_set():
    data = DeviceData(torch.arange(40), batch_size=4, seed=1)
    for _ in range(13):
        data.next_batch()
    data.advance(13)
    state = data.state_dict()
    assert (state["epoch"], state["batches"]) == (1, 3)
    follow = [data.next_batch()[0] for _ in range(9)]
    again = DeviceData(torch.arange(40), batch_size=4, seed=1)
    again.load_state_dict(state)
    assert all(torch.equal(a, again.next_batch()[0]) for a in follow)
    other = DeviceData(torch.arange(40), batch_size=5, seed=1)
    with pytest.raises(ConfigError, match=r"batch_size=4 \(here 5\)"):
        other.load_state_dict(state)
    with pytest.raises(ConfigError, match="batch 99 of an epoch of 10"):
        again.load_state_dict({**state, "batches": 99})


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((), {"batch_size": 4}, "at least one tensor"),
        (([1, 2, 3],), {"batch_size": 1}, "tensor 0 is a list"),
        ((torch.zeros(5), torch.zeros(6)), {"batch_size": 1}, r"lengths along dim 0: \[5, 6\]"),
        ((torch.tensor(1.0),), {"batch_size": 1}, "0-dim"),
        ((torch.zeros(5),), {"batch_size": 0}, "batch_size=0 must be an integer >= 1"),
        ((torch.zeros(5),), {"batch_size": True}, "batch_size=True"),
        ((torch.zeros(5),), {"batch_size": 8}, r"5 samples, 5 per rank .* batch_size <= 5"),
        ((torch.zeros(10),), {"batch_size": 4, "num_replicas": 4}, r"2 per rank over 4 rank"),
        ((torch.zeros(5),), {"batch_size": 1, "rank": 2, "num_replicas": 2}, "rank=2 must be"),
        ((torch.zeros(5),), {"batch_size": 1, "shuffle": "yes"}, "shuffle='yes'"),
    ],
)
def test_bad_device_data_is_refused(args, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DeviceData(*args, **kwargs)


# -------------------------------------------------------------- TrainStep(data)
@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake-graphs"])
@pytest.mark.parametrize("k", [1, 4, 5])
def test_k_steps_per_call_equal_one_step_calls_and_the_plain_loop(k, fake):
    total = 42  # 12 batches an epoch: calls cross epoch ends; the last call is shorter
    result = workers.k_vs_one_vs_plain(k, total, fake)
    ours, one, plain = result["k"], result["one"], result["plain"]
    assert torch.equal(ours["losses"], plain["losses"])
    assert torch.equal(one["losses"], plain["losses"])
    for a, b, c in zip(ours["params"], one["params"], plain["params"]):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert ours["epoch"] == (3, 6) and ours["steps"] == total
    assert ours["lr"] == one["lr"]
    if fake:
        assert ours["mode"] == "graphed" and ours["replays"] >= (total - 16) // k - 1


def test_two_ranks_shard_the_data_and_k_steps_equal_the_ddp_loop():
    results = run_distributed(workers.k_vs_one_vs_plain, world_size=2, args=(4, 30, True))
    for r in results:
        assert torch.equal(r["k"]["losses"], r["plain"]["losses"])
        assert torch.equal(r["one"]["losses"], r["plain"]["losses"])
        for a, b in zip(r["k"]["params"], r["plain"]["params"]):
            assert torch.equal(a, b)
    assert not torch.equal(results[0]["k"]["losses"], results[1]["k"]["losses"])  # own shards
    for a, b in zip(results[0]["k"]["params"], results[1]["k"]["params"]):
        assert torch.equal(a, b)


def test_a_scheduler_stepped_by_the_loop_is_refused_on_every_rank():
    for message in run_distributed(workers.scheduler_stepped_outside, world_size=2):
        assert "stepped outside the TrainStep (last_epoch 2 -> 3)" in message
        assert "remove scheduler.step()" in message


def test_resuming_from_state_dicts_at_a_call_boundary_is_exact():
    def build():
        model, optimizer, scheduler = workers.model_and_optimizer()
        data = DeviceData(*workers.data_set(), batch_size=workers.BATCH, seed=workers.SEED)
        step = TrainStep(
            model, optimizer, nn.CrossEntropyLoss(), scheduler=scheduler, steps_per_replay=4
        )
        return model, data, step

    model, data, step = build()
    losses = [step(data).clone() for _ in range(4)]
    saved = copy.deepcopy((step.state_dict(), data.state_dict()))
    losses += [step(data).clone() for _ in range(5)]
    model2, data2, step2 = build()
    step2.load_state_dict(saved[0])
    data2.load_state_dict(saved[1])
    resumed = [step2(data2).clone() for _ in range(5)]
    assert torch.equal(torch.cat(resumed), torch.cat(losses[4:]))
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_reduce_lr_on_plateau_is_left_to_the_script():
    model, optimizer, _ = workers.model_and_optimizer()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    data = DeviceData(*workers.data_set(), batch_size=workers.BATCH)
    step = TrainStep(model, optimizer, nn.CrossEntropyLoss(), scheduler=plateau, steps_per_replay=3)
    step(data)
    plateau.step(1.0)
    plateau.step(2.0)  # worse: halves the LR
    step(data)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def _step(**kwargs):
    model, optimizer, scheduler = workers.model_and_optimizer()
    return TrainStep(model, optimizer, nn.CrossEntropyLoss(), scheduler=scheduler, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps_per_replay": 0}, "steps_per_replay=0 must be an integer >= 1"),
        ({"steps_per_replay": True}, "steps_per_replay=True"),
        ({"steps_per_replay": 2, "accumulate_calls": 2}, "accumulate within each step"),
    ],
)
def test_bad_steps_per_replay_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _step(**kwargs)


def test_calls_that_do_not_fit_the_options_are_refused():
    data = DeviceData(*workers.data_set(), batch_size=workers.BATCH)  # 12 batches an epoch
    x, y = data.peek()
    with pytest.raises(ConfigError, match=r"call step\(data\) with a ddpgraph.DeviceData"):
        _step(steps_per_replay=4)(x, y)
    with pytest.raises(ConfigError, match=r"takes a ddpgraph\.DeviceData as its one argument"):
        _step()(x, y, steps=2)
    for steps in (0, 5, 2.0):
        with pytest.raises(ConfigError, match=rf"steps={steps!r}\): steps must be .* 1 to"):
            _step(steps_per_replay=4)(data, steps=steps)
    with pytest.raises(ConfigError, match="has 12 batches per epoch on this rank"):
        _step(steps_per_replay=13)(data)
    with pytest.raises(ConfigError, match="accumulate_calls=2 takes one micro-batch"):
        _step(accumulate_calls=2)(data)


def test_a_call_reports_its_steps_and_the_report_counts_training_steps():
    data = DeviceData(*workers.data_set(), batch_size=workers.BATCH)
    step = _step(steps_per_replay=4, engine=CpuGraphs())
    for _ in itertools.repeat(None, 8):
        step(data)
    report = step.report()
    assert (report.steps, report.eager_steps, report.replays) == (32, 12, 5)
    assert "steps/replay=4" in str(report) and re.search(
        r"4 steps of DeviceData #\d+ batches \(8, 8\)", str(report)
    )


def test_evaluate_between_calls_uses_the_trained_model_and_leaves_the_position():
    data = DeviceData(*workers.data_set(), batch_size=workers.BATCH)
    step = _step(steps_per_replay=4, engine=CpuGraphs())
    x, _ = data.peek()
    for _ in range(6):  # warm-up, capture, replays
        step(data)
        position = (data.epoch, data.position)
        out = step.evaluate(x).clone()
        with torch.no_grad():
            assert torch.equal(out, step.model(x))
        assert (data.epoch, data.position) == position
    assert step.report().mode == "graphed" and step.report().evaluations == 6


@pytest.mark.parametrize(
    "options",
    [
        {"accumulate": 2},
        {"clip_grad_norm": 0.05},
        {"amp": "bf16"},
        {"amp": "fp16"},
        {"compile": {"backend": "eager"}},
    ],
    ids=["accumulate", "clip", "bf16", "fp16", "compile"],
)
def test_each_step_of_a_multi_step_call_keeps_the_step_options(options):
    def run(k, options=options):
        model, optimizer, scheduler = workers.model_and_optimizer()
        data = DeviceData(*workers.data_set(), batch_size=workers.BATCH, seed=workers.SEED)
        step = TrainStep(
            model,
            optimizer,
            nn.CrossEntropyLoss(),
            scheduler=scheduler,
            steps_per_replay=k,
            **options,
            engine=CpuGraphs(),
        )
        losses = torch.cat([step(data).clone() for _ in range(24 // k)])
        return losses, [p.detach().clone() for p in model.parameters()], step.report()

    three, one, without = run(3), run(1), run(3, {})
    assert three[2].mode == "graphed", str(three[2])
    assert torch.equal(three[0], one[0])
    for a, b in zip(three[1], one[1]):
        assert torch.equal(a, b)
    # the option took effect (compile with the eager backend computes the same bits)
    assert torch.equal(three[0], without[0]) == ("compile" in options)


def test_a_mapping_device_data_feeds_model_keyword_arguments_as_step_batch_does():
    """HF style: DeviceData({"inputs": x, "labels": y}) and loss_fn=None train as the loop that
    calls model(**batch) on the DataLoader's batches."""
    from .step_workers import ComputesItsLoss, as_the_step_steps

    x, y = torch.randn(96, 8), torch.randint(3, (96,))

    def build():
        torch.manual_seed(0)
        model = ComputesItsLoss()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, optimizer = build()
    data = DeviceData({"inputs": x, "labels": y}, batch_size=8, seed=4)
    assert data.kind == "mapping" and data.names == ("inputs", "labels")
    step = TrainStep(model, optimizer, steps_per_replay=3, engine=CpuGraphs())
    ours = torch.cat([step(data).clone() for _ in range(10)])
    assert step.report().mode == "graphed"

    reference, ref_optimizer = build()
    as_the_step_steps(ref_optimizer)  # fused SGD, LR tensor: the optimizer the graphed step steps
    plain = DeviceData({"inputs": x, "labels": y}, batch_size=8, seed=4)
    theirs = []
    batches = itertools.chain(plain, plain, plain)  # the same batches, as dicts, host-driven
    for batch in itertools.islice(batches, 30):
        assert set(batch) == {"inputs", "labels"}
        ref_optimizer.zero_grad()
        loss = reference(**batch).loss
        loss.backward()
        ref_optimizer.step()
        theirs.append(loss.detach())
    assert torch.equal(ours, torch.stack(theirs))
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="string keys"):
        DeviceData({0: x}, batch_size=8)


# ------------------------------------------------------- schedulers and failures
def _plain_losses(total, make_scheduler):
    return workers.plain_loop(total, make_scheduler)["losses"]


def _data_losses(total, k, make_scheduler):
    model, optimizer, _ = workers.model_and_optimizer()
    scheduler = make_scheduler(optimizer)
    data = DeviceData(*workers.data_set(), batch_size=workers.BATCH, seed=workers.SEED)
    step = TrainStep(
        model, optimizer, nn.CrossEntropyLoss(), scheduler=scheduler, steps_per_replay=k
    )
    return torch.cat([step(data).clone() for _ in range(total // k)])


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.5, total_steps=60, cycle_momentum=False
        ),
        lambda opt: torch.optim.lr_scheduler.ChainedScheduler(
            [
                torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97),
                torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
            ]
        ),
        lambda opt: torch.optim.lr_scheduler.SequentialLR(
            opt,
            [
                torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=6),
                torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30),
            ],
            milestones=[6],
        ),
    ],
    ids=["one-cycle", "chained", "sequential"],
)
def test_torch_schedulers_step_per_step_inside_a_call_as_in_the_plain_loop(make_scheduler):
    assert torch.equal(_data_losses(36, 3, make_scheduler), _plain_losses(36, make_scheduler))


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=60),
        lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1),
    ],
    ids=["one-cycle", "cyclic"],
)
def test_a_scheduler_that_cycles_momentum_is_refused_naming_the_fix(make_scheduler):
    with pytest.raises(ConfigError, match=r"cycle_momentum=True\) changes the momentum"):
        _data_losses(6, 3, make_scheduler)


def test_the_lr_tensor_holds_the_schedulers_latest_value_after_a_call():
    """The CUDA path's LR tensors (here on the CPU): each step reads its own value, and after
    the call the tensor holds what the scheduler says next, as an eager loop leaves it."""
    from ddpgraph.step.feed import StepwiseLR

    _, optimizer, scheduler = workers.model_and_optimizer()
    lr = torch.tensor(0.1)
    optimizer.param_groups[0]["lr"] = lr
    stepwise = StepwiseLR(optimizer, scheduler, [lr], max_steps=4)
    stepwise.prepare(4)
    seen = []
    for j in range(4):
        stepwise.apply(j)
        seen.append(float(lr))
    stepwise.finish()
    expected = [0.05 * (1 + math.cos(math.pi * i / 50)) for i in range(5)]
    assert seen == pytest.approx(expected[:4], rel=1e-6)
    assert float(lr) == pytest.approx(expected[4], rel=1e-6)
    assert optimizer.param_groups[0]["lr"] is lr


class _FailsOnce(nn.Module):
    """Records each forward's input; raises on the ``at``-th forward."""

    def __init__(self, net, at):
        super().__init__()
        self.net, self.at, self.inputs = net, at, []

    def forward(self, x):
        self.inputs.append(x.clone())
        if len(self.inputs) == self.at:
            raise RuntimeError("boom (an out-of-memory, say)")
        return self.net(x)


def test_a_call_that_fails_midway_leaves_no_batch_or_lr_skipped():
    model, optimizer, scheduler = workers.model_and_optimizer()
    data = DeviceData(*workers.data_set(), batch_size=workers.BATCH, seed=workers.SEED)
    failing = _FailsOnce(model, at=6)  # the 2nd step of the 2nd call
    step = TrainStep(
        failing, optimizer, nn.CrossEntropyLoss(), scheduler=scheduler, steps_per_replay=4
    )
    step(data)
    state = (data.epoch, data.position, scheduler.last_epoch, step.report().steps)
    lr = optimizer.param_groups[0]["lr"]
    with pytest.raises(RuntimeError, match="boom"):
        step(data)
    assert (data.epoch, data.position, scheduler.last_epoch, step.report().steps) == state
    assert optimizer.param_groups[0]["lr"] == lr
    step(data)
    # the retried call starts with the batch the failed one started with
    assert torch.equal(failing.inputs[6], failing.inputs[4])
    assert torch.equal(failing.inputs[7], failing.inputs[5])


def test_a_call_without_a_scheduler_that_fails_midway_skips_no_batch():
    """The same on the path without a scheduler (no LR staged: the replayed path, which keeps
    its checks and its batch per DeviceData): the data's position and the step count go back,
    the retried call gathers the batches the failed one began with, and a call with another
    step count after whole calls is checked again."""
    model, optimizer, _ = workers.model_and_optimizer()
    data = DeviceData(*workers.data_set(), batch_size=workers.BATCH, seed=workers.SEED)
    failing = _FailsOnce(model, at=6)
    step = TrainStep(failing, optimizer, nn.CrossEntropyLoss(), steps_per_replay=4)
    step(data)
    state = (data.epoch, data.position, step.report().steps)
    with pytest.raises(RuntimeError, match="boom"):
        step(data)
    assert (data.epoch, data.position, step.report().steps) == state
    step(data)
    assert torch.equal(failing.inputs[6], failing.inputs[4])
    assert torch.equal(failing.inputs[7], failing.inputs[5])
    with pytest.raises(ConfigError, match="steps must be an integer from 1 to"):
        step(data, steps=5)
    step(data, steps=1)
    assert step.report().steps == 4 + 4 + 1


def test_a_second_device_data_gets_no_graph_of_the_first():
    first = DeviceData(*workers.data_set(), batch_size=workers.BATCH, seed=1)
    second = DeviceData(*workers.data_set(), batch_size=workers.BATCH, seed=2)
    step = _step(steps_per_replay=4, engine=CpuGraphs())
    for _ in range(5):
        step(first)
    replays = step.report().replays
    step(second)  # same shapes, other tensors: eager (on_new_shape="eager"), never a replay
    assert replays > 0 and step.report().replays == replays
    assert "DeviceData #" in str(step.report())


def test_a_scheduler_state_loaded_back_is_accepted():
    model, optimizer, scheduler = workers.model_and_optimizer()
    data = DeviceData(*workers.data_set(), batch_size=workers.BATCH)
    step = TrainStep(
        model, optimizer, nn.CrossEntropyLoss(), scheduler=scheduler, steps_per_replay=2
    )
    saved = scheduler.state_dict()
    step(data)
    step(data)
    scheduler.load_state_dict(saved)  # rolled back: not a step taken outside
    step(data)
    assert scheduler.last_epoch == 2


def test_a_transformers_gpt2_with_padded_masked_batches_trains_as_its_own_loop():
    """A real model fed the way its users feed it: GPT-2 (transformers) on token ids with an
    attention mask and -100 labels on the padding, K=4 steps per call, against the loop a
    script writes (``loss = model(**batch).loss``) over the same batches."""
    transformers = pytest.importorskip("transformers")
    from .step_workers import float_lr_step_as_the_step

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(100, (64, 16), generator=gen)
    lengths = torch.randint(4, 17, (64,), generator=gen)
    mask = (torch.arange(16) < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    columns = {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def build():
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2,
                                         n_head=2)  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optimizer, torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=24)

    model, optimizer, scheduler = build()
    data = DeviceData(columns, batch_size=8, seed=1)
    step = TrainStep(model, optimizer, scheduler=scheduler, steps_per_replay=4, engine=CpuGraphs())
    ours = torch.cat([step(data).clone() for _ in range(6)])
    assert step.report().mode == "graphed", str(step.report())

    reference, ref_optimizer, ref_scheduler = build()
    # capturable AdamW, the LR tensor filled from the float schedule: as step(data) steps it
    ref_step = float_lr_step_as_the_step(ref_optimizer)
    plain = DeviceData(columns, batch_size=8, seed=1)
    theirs = []
    for batch in itertools.islice(itertools.chain(plain, plain, plain), 24):
        ref_optimizer.zero_grad()
        loss = reference(**batch).loss
        loss.backward()
        ref_step()
        ref_scheduler.step()
        theirs.append(loss.detach())
    assert torch.equal(ours, torch.stack(theirs))
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
