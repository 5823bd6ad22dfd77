from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ddpgraph import CaptureError, ConfigError, TrainStep
from ddpgraph.facts import ddp_count_allows_capture
from ddpgraph.step.optim import make_graph_safe
from ddpgraph.testing import run_distributed

from . import step_workers
from .step_workers import batches, make_model

pytestmark = pytest.mark.timeout(120)


def manual_steps(model, opt, data, *, clip=None):
    loss_fn = nn.CrossEntropyLoss()
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_eager_step_matches_a_hand_written_loop_bitwise():
    data = batches(5, 8)
    ref = make_model()
    manual_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), data)
    model = make_model()
    step = TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss()
    )
    for x, y in data:
        loss = step(x, y)
        assert loss.dim() == 0
    assert step.mode == "eager" and step.model is model  # no process group: no DDP
    for a, b in zip(params(ref), params(model)):
        assert torch.equal(a, b)
    report = step.report()
    assert report.steps == 5 and report.eager_steps == 5 and report.replays == 0
    assert "not CUDA" in report.fallbacks[0]


def test_clipping_matches_clip_grad_norm():
    data = batches(3, 8)
    ref = make_model()
    manual_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.5), data, clip=0.01)
    model = make_model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        nn.CrossEntropyLoss(),
        clip_grad_norm=0.01,
    )
    for x, y in data:
        step(x, y)
    for a, b in zip(params(ref), params(model)):
        torch.testing.assert_close(a, b)
    unclipped = make_model()
    manual_steps(unclipped, torch.optim.SGD(unclipped.parameters(), lr=0.5), data)
    assert not torch.allclose(params(unclipped)[0], params(model)[0])


def test_accumulation_equals_the_full_batch():
    data = batches(3, 8)
    full, accum = make_model(), make_model()
    s_full = TrainStep(full, torch.optim.SGD(full.parameters(), lr=0.1), nn.CrossEntropyLoss())
    s_acc = TrainStep(
        accum, torch.optim.SGD(accum.parameters(), lr=0.1), nn.CrossEntropyLoss(), accumulate=4
    )
    for x, y in data:
        torch.testing.assert_close(s_full(x, y), s_acc(x, y))
    for a, b in zip(params(full), params(accum)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match=r"accumulate=4 splits.*\(6, 8\).*divisible by 4"):
        s_acc(torch.randn(6, 8), torch.randint(4, (6,)))


def test_lr_schedule_is_followed():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.0 if i >= 1 else 1.0)
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), scheduler=sched)
    ((x, y),) = batches(1, 8)
    step(x, y)
    sched.step()
    before = params(model)
    step(x, y)  # lr is 0 now: nothing moves
    for a, b in zip(before, params(model)):
        assert torch.equal(a, b)


def test_state_dict_round_trip_resumes_exactly():
    data = batches(10, 8)

    def fresh():
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, opt, sched, TrainStep(model, opt, nn.CrossEntropyLoss(), scheduler=sched)

    model, _, sched, step = fresh()
    for x, y in data[:5]:
        step(x, y)
        sched.step()
    saved = copy.deepcopy(step.state_dict())  # as torch.save would freeze it
    for x, y in data[5:]:
        step(x, y)
        sched.step()
    model2, opt2, sched2, step2 = fresh()
    step2(*data[0])  # create state, which load_state_dict must copy into, not replace
    exp_avg_before = opt2.state[next(iter(model2.parameters()))]["exp_avg"]
    step2.load_state_dict(saved)
    assert opt2.state[next(iter(model2.parameters()))]["exp_avg"] is exp_avg_before
    assert sched2.last_epoch == 5 and step2.report().steps == 5
    for x, y in data[5:]:
        step2(x, y)
        sched2.step()
    for a, b in zip(params(model), params(model2)):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match=r"lacks \['optimizer'\]"):
        step2.load_state_dict({"model": saved["model"]})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"graph": "sometimes"}, "graph='sometimes' must be one of"),
        ({"amp": "fp8"}, "amp='fp8' is not a precision TrainStep knows"),
        ({"grad_scaler": {"init_scale": 8.0}}, "scales fp16 losses, but amp=None"),
        ({"amp": "fp16", "grad_scaler": {"growth": 2}}, "unknown option 'growth'"),
        ({"accumulate": 0}, "accumulate=0 must be an integer >= 1"),
        ({"accumulate": True}, "accumulate=True must be an integer >= 1"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm=-1.0 must be a positive, finite number"),
        ({"clip_grad_norm": "1"}, "clip_grad_norm='1' must be a positive, finite number"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm=nan must be a positive"),
        ({"on_new_shape": "pad"}, "on_new_shape='pad' must be one of"),
        ({"warmup": 0}, "warmup=0 must be an integer >= 1"),
        ({"warmup": True}, "warmup=True must be an integer >= 1"),
        ({"channels_last": "yes"}, "channels_last='yes' must be True or False"),
        ({"sync_every_call": 1}, "sync_every_call=1 must be True or False"),
        ({"sync_every_call": True}, "sync_every_call=True with accumulate_calls=1 changes nothing"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, message):
    model = make_model()
    with pytest.raises(ConfigError, match=message):
        TrainStep(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), **kwargs
        )


def test_bad_calls_are_named():
    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out, y: out - 1)
    with pytest.raises(ValueError, match=r"got 1 tensor\(s\); call step\(\*inputs, target\)"):
        step(torch.randn(2, 8))
    with pytest.raises(TypeError, match=r"batch element 1 is list \[1, 2\], not a tensor"):
        step(torch.randn(2, 8), [1, 2])
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor, got \(2, 4\)"):
        step(torch.randn(2, 8), torch.zeros(2))


def test_graph_always_without_cuda_and_ddp_input_are_refused():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CaptureError, match=r"graph='always'\) cannot capture: the model is on cpu"):
        TrainStep(model, opt, nn.CrossEntropyLoss(), graph="always")
    with pytest.raises(ConfigError, match="not callable"):
        TrainStep(model, opt, "mse")


def test_ddp_warmup_rule():
    assert [n for n in range(0, 205) if ddp_count_allows_capture(n)][:3] == [11, 12, 13]
    assert not ddp_count_allows_capture(100) and not ddp_count_allows_capture(200)
    assert ddp_count_allows_capture(101)
    # a forward after 99 records iteration 100's timers, which the next eager forward reads
    assert not ddp_count_allows_capture(99) and not ddp_count_allows_capture(199)
    assert not ddp_count_allows_capture(12, sample_rate=13)


WARMUPS = [None, 1, 5, 30, 100]


def test_warmup_under_ddp_is_raised_to_a_count_ddp_does_not_time():
    """DDP times its first 10 iterations (the step stops its later sampling, so 100 stays)."""
    (planned,) = run_distributed(step_workers.planned_warmups, 1, args=(WARMUPS,), timeout=120)
    assert planned == [12, 12, 12, 30, 100]


def test_warmup_without_ddp_is_the_count_asked_for():
    """No DDP underneath (no process group): no iteration is timed, ``warmup=n`` is n (it was
    silently raised to DDP's 12)."""
    assert step_workers.planned_warmups(WARMUPS) == [12, 1, 5, 30, 100]


def test_optimizers_are_made_graph_safe_or_refused():
    model = make_model()
    adam = torch.optim.AdamW(model.parameters(), lr=0.01)
    plan = make_graph_safe(adam, torch.device("cpu"))
    assert adam.param_groups[0]["capturable"] is True
    assert isinstance(adam.param_groups[0]["lr"], torch.Tensor)
    adam.param_groups[0]["lr"] = 0.5  # what an old-style scheduler does
    plan.sync_lr()
    assert adam.param_groups[0]["lr"] is plan.lr_tensors[0]
    assert float(plan.lr_tensors[0]) == 0.5
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert "fused=True" in make_graph_safe(sgd, torch.device("cpu")).changes
    with pytest.raises(CaptureError, match="LBFGS cannot be stepped inside a CUDA graph"):
        make_graph_safe(torch.optim.LBFGS(model.parameters()), torch.device("cpu"))


def test_ddp_over_gloo_with_two_ranks_matches_one_process():
    results = run_distributed(step_workers.ddp_train, 2, args=(6,), timeout=90)
    assert results[0]["is_ddp"] == "DistributedDataParallel"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "DDP ranks must hold identical parameters"
    single = make_model()
    manual_steps(single, torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9), batches(6, 8))
    for a, b in zip(results[0]["params"], params(single)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("compile_arg", "message"),
    [
        ("yes", "compile='yes' must be True, False or a dict"),
        ({"mode": "reduce-overhead"}, "asks Inductor for CUDA graphs of its own"),
        ({"options": {"triton.cudagraphs": True}}, "asks Inductor for CUDA graphs of its own"),
    ],
)
def test_bad_compile_options(compile_arg, message):
    model = make_model()
    with pytest.raises(ConfigError, match=message):
        TrainStep(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            compile=compile_arg,
        )


def test_compile_runs_on_cpu_and_matches_eager():
    data = batches(3, 8)
    ref = make_model()
    manual_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data)
    model = make_model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        compile={"backend": "aot_eager"},
    )
    for x, y in data:
        step(x, y)
    assert hasattr(step.model, "_orig_mod")
    assert set(step.state_dict()["model"]) == set(ref.state_dict())  # no "_orig_mod." prefix
    for a, b in zip(params(ref), params(model)):
        torch.testing.assert_close(a, b)


def test_compile_failure_falls_back_to_the_plain_module_with_a_warning():
    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend exploded")

    torch._dynamo.reset()
    data = batches(2, 8)
    ref = make_model()
    manual_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data)
    model = make_model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        compile={"backend": broken_backend},
    )
    with pytest.warns(UserWarning, match="torch.compile failed, so the model runs uncompiled"):
        for x, y in data:
            step(x, y)
    assert step.model is model
    assert any("torch.compile failed" in f for f in step.report().fallbacks)
    for a, b in zip(params(ref), params(model)):
        assert torch.equal(a, b), "the failed compile must not have changed the model"


def test_channels_last_converts_model_and_inputs():
    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.seen = None

        def forward(self, x):
            self.seen = x.is_contiguous(memory_format=torch.channels_last)
            return self.conv(x).mean(dim=(2, 3))

    model = Conv()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        channels_last=True,
    )
    step(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))
    assert model.seen is True
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)


# ----------------------------------------------------- batches, loss, evaluation, phases
def test_mapping_batch_with_model_computed_loss_matches_loss_fn():
    data = batches(4, 8)
    hf = step_workers.ComputesItsLoss()
    step = TrainStep(hf, torch.optim.SGD(hf.parameters(), lr=0.1))
    for x, y in data:
        loss = step({"inputs": x, "labels": y})
        assert loss.dim() == 0
    ref = make_model()
    manual_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data)
    for a, b in zip(params(ref), params(hf.net)):
        assert torch.equal(a, b)


def test_mapping_batch_with_a_loss_fn_gets_the_mapping():
    seen = []

    def loss_fn(output, batch):
        seen.append(sorted(batch))
        return nn.functional.cross_entropy(output.logits, batch["labels"])

    hf = step_workers.ComputesItsLoss()
    step = TrainStep(hf, torch.optim.SGD(hf.parameters(), lr=0.1), loss_fn)
    x, y = batches(1, 8)[0]
    step({"inputs": x, "labels": y})
    assert seen == [["inputs", "labels"]]


def test_scalar_output_and_positional_inputs_without_loss_fn():
    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.net(x), y)

    model = Scalar()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = batches(3, 8)
    for x, y in data:
        step(x, y)
    ref = make_model()
    manual_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data)
    for a, b in zip(params(ref), params(model.net)):
        assert torch.equal(a, b)


def test_model_without_a_loss_is_named_with_the_fix():
    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, _ = batches(1, 8)[0]
    with pytest.raises(ValueError, match=r"returned a tensor of shape \(8, 4\); pass labels"):
        step(x)


def test_bad_mapping_entries_are_named():
    hf = step_workers.ComputesItsLoss()
    step = TrainStep(hf, torch.optim.SGD(hf.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"batch\['labels'\] is list \[0, 1\], not a tensor"):
        step({"inputs": torch.zeros(2, 8), "labels": [0, 1]})
    with pytest.raises(ValueError, match="empty mapping"):
        step({})


def test_accumulation_splits_mapping_batches():
    data = batches(2, 8)
    hf = step_workers.ComputesItsLoss()
    step = TrainStep(hf, torch.optim.SGD(hf.parameters(), lr=0.1), accumulate=2)
    for x, y in data:
        step({"inputs": x, "labels": y})
    ref = make_model()
    manual_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data)
    for a, b in zip(params(ref), params(hf.net)):
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match=r"accumulate=2 .* \{'inputs': \(3, 8\)"):
        step({"inputs": torch.zeros(3, 8), "labels": torch.zeros(3, dtype=torch.long)})


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))


def test_evaluate_is_eval_mode_without_grad_and_restores_train_mode():
    model = bn_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    for x, y in batches(3, 8):
        step(x, y)
    x, _ = batches(1, 8, seed=5)[0]
    out = step.evaluate(x)
    assert model.training and not out.requires_grad
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        expected = reference(x)
    assert torch.equal(out, expected)  # running statistics, no dropout
    assert torch.equal(step.evaluate(x), out)  # deterministic: dropout is off
    assert step.report().evaluations == 2


def test_evaluate_takes_mappings():
    hf = step_workers.ComputesItsLoss()
    step = TrainStep(hf, torch.optim.SGD(hf.parameters(), lr=0.1))
    x, y = batches(1, 8)[0]
    out = step.evaluate({"inputs": x, "labels": y})
    assert torch.equal(out.loss, nn.functional.cross_entropy(hf.net(x), y))


def test_phase_is_one_explicit_state():
    from ddpgraph.step import Phase

    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    assert step.phase is Phase.EAGER and step.mode == "eager"
    step(*batches(1, 8)[0])
    assert step.report().eager_steps == 1
    step.close()  # nothing to free on the CPU; still safe
    assert step.phase is Phase.CLOSED


def test_a_closed_step_refuses_to_train_instead_of_running_eagerly():
    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    step.close()
    with pytest.raises(CaptureError, match=r"step\(\) on a TrainStep after close\(\)"):
        step(*batches(1, 8)[0])
    with pytest.raises(CaptureError, match=r"evaluate\(\) on a TrainStep after close"):
        step.evaluate(batches(1, 8)[0][0])


def test_warnings_point_at_the_users_line():
    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    with pytest.warns(UserWarning, match="continues eagerly") as record:
        step._runner.warn_or_raise("a reason")
    assert record[0].filename == __file__


def test_ddp_mapping_batches_match_tuple_batches_on_two_ranks():
    results = run_distributed(step_workers.mapping_vs_tuple, world_size=2, args=(5,), timeout=90)
    for result in results:
        assert result["ddp"] == "DistributedDataParallel"
        for a, b in zip(result["mapping"], result["tuple"]):
            assert torch.equal(a, b)
    for a, b in zip(results[0]["mapping"], results[1]["mapping"]):
        assert torch.equal(a, b)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "cpu-graphs"])
def test_ranks_with_different_numbers_of_calls_are_told_so_not_gloos_closed_connection(graphed):
    from ddpgraph import DistributedStateError

    results = run_distributed(
        step_workers.uneven_calls, 2, args=(graphed,), timeout=240, return_exceptions=True
    )
    first, second = results
    assert second == "finished"  # the rank with fewer batches cannot know
    assert isinstance(first, DistributedStateError), first
    message = str(first)
    assert message.startswith("TrainStep call 6 on rank 0: a peer rank left"), message
    assert "the same number of times" in message and "drop_last=True" in message
    assert "by peer" in message  # gloo's own line ("Connection closed/reset by peer"), quoted
