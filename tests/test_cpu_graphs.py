"""The CPU engine judges like the GPU (issue 47): a capture records the tensor operations of the
call and a replay runs only those, on the same tensors; capture refuses what CUDA capture refuses
with CUDA's error and ``explain``'s cause; the optimizer takes its CUDA path.

Each test here failed on the old stand-in, which "replayed" by running the Python body again."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddpgraph import TrainStep
from ddpgraph.step.optim import make_graph_safe
from ddpgraph.step.recording import CUDA_CAPTURE_ERROR, CaptureRefused, record
from ddpgraph.testing import CpuGraphs, run_distributed

from . import cpu_graph_workers as workers
from .step_workers import as_the_step_steps, batches, make_model

pytestmark = pytest.mark.timeout(180)

WARMUP = 12


def graphed(model, opt, loss_fn, **kwargs):
    return TrainStep(model, opt, loss_fn, engine=CpuGraphs(), **kwargs)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def eager_reference(data, make_opt, loss_fn=None, each=None):
    """The script's own loop with the optimizer the step steps (graph-safe: fused SGD or
    capturable AdamW, the LR in a tensor), as the GPU tests compare."""
    model = make_model()
    opt = make_opt(model)
    make_graph_safe(opt, torch.device("cpu"))
    loss_fn = loss_fn or nn.functional.cross_entropy
    losses = []
    for i, (x, y) in enumerate(data):
        if each is not None:
            each(i, opt)
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return model, losses


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), (p - q).abs().max()


# ---------------------------------------------------------------- host code runs at capture only
def test_python_in_the_loss_runs_in_warm_up_and_capture_but_not_in_replays():
    calls = []

    def counting_loss(out, y):
        calls.append(1)
        return nn.functional.cross_entropy(out, y)

    model = make_model()
    step = graphed(model, sgd(model), counting_loss)
    for x, y in batches(20, 8):
        step(x, y)
    assert step.report().replays == 20 - WARMUP
    assert len(calls) == WARMUP + 1  # 12 eager steps and the capture; no replay runs Python


def test_a_python_float_read_by_the_loss_keeps_its_value_at_capture():
    scale = {"value": 1.0}

    def scaled_loss(out, y):
        return nn.functional.cross_entropy(out, y) * scale["value"]

    model = make_model()
    step = graphed(model, sgd(model), scaled_loss)
    data = batches(20, 8)
    for i, (x, y) in enumerate(data):
        scale["value"] = float(i)  # the script changes it every step
        loss = step(x, y)
    # the last replay used the capture's value (12.0), as a CUDA graph does
    ref_model = make_model()
    ref_opt = sgd(ref_model)
    make_graph_safe(ref_opt, torch.device("cpu"))
    for i, (x, y) in enumerate(data):
        ref_opt.zero_grad(set_to_none=False)
        ref = nn.functional.cross_entropy(ref_model(x), y) * float(min(i, WARMUP))
        ref.backward()
        ref_opt.step()
    assert torch.equal(loss, ref.detach())
    assert_same_parameters(model, ref_model)


def test_host_code_outside_the_graph_still_runs_on_every_call_the_lr_sync():
    """A scheduler's LR reaches each replay through the LR tensor, synced before each replay."""
    model = make_model()
    opt = sgd(model)
    step = graphed(model, opt, nn.CrossEntropyLoss())
    data = batches(24, 8)

    def decay(i, o):
        for group in o.param_groups:
            group["lr"] = 0.1 * 0.9**i

    for i, (x, y) in enumerate(data):
        decay(i, opt)
        step(x, y)
    ref, _ = eager_reference(data, sgd, each=decay)
    assert step.report().replays == 24 - WARMUP
    assert_same_parameters(model, ref)


# ---------------------------------------------------------------- static outputs
def test_a_graph_output_kept_across_calls_is_overwritten_as_on_cuda():
    model = make_model()
    step = graphed(model, sgd(model), nn.CrossEntropyLoss())
    outputs = []
    for x, y in batches(16, 8):
        step(x, y)
        outputs.append(step.output)
    replayed = outputs[WARMUP:]
    # every kept step.output of a replay is the one graph-owned tensor, holding the last values
    assert all(o.data_ptr() == replayed[0].data_ptr() for o in replayed)
    assert all(torch.equal(o, replayed[-1]) for o in replayed)


def test_the_returned_loss_can_be_kept_and_averaged_as_accelerates_example_does():
    """Accelerate's gradient_accumulation_for_autoregressive_models.py appends loss.detach() to a
    list and averages it at the window's end: each call's own loss, not the last one k times."""
    model = make_model()
    step = graphed(model, sgd(model), nn.CrossEntropyLoss(), accumulate_calls=4)
    data = batches(80, 8)
    kept = [step(x, y).detach() for x, y in data]
    ref_model = make_model()
    ref_opt = sgd(ref_model)
    make_graph_safe(ref_opt, torch.device("cpu"))
    plain = TrainStep(ref_model, ref_opt, nn.CrossEntropyLoss(), graph="never", accumulate_calls=4)
    ref = [plain(x, y).detach() for x, y in data]
    assert step.report().replays == 80 - WARMUP * 4
    assert all(torch.equal(a, b) for a, b in zip(kept, ref))
    assert len({float(loss) for loss in kept[-8:]}) == 8  # not one overwritten tensor


# ---------------------------------------------------------------- what capture refuses
def _refused(fn, *tensors):
    with pytest.raises(CaptureRefused) as caught:
        record(lambda: fn(*tensors))
    first, *rest = str(caught.value).splitlines()
    assert first == CUDA_CAPTURE_ERROR
    return rest[0]


@pytest.mark.parametrize(
    "name, fn, why",
    [
        ("item", lambda x: x.sum().item(), "host read"),
        ("float", lambda x: float(x.sum()), "host read"),
        ("truth test", lambda x: bool(x.sum() > 0), "host read"),
        ("torch.equal", lambda x: torch.equal(x, x), "host read"),
        ("x[mask]", lambda x: x[x > 0], "data-dependent shape"),
        ("x[labels != -100]", lambda x: x[torch.tensor([1, -100, 2]) != -100], "data-dependent"),
        ("index_put_ by mask", lambda x: x.clone().index_put_((x > 0,), torch.tensor(0.0)), "data"),
        ("masked_fill is fine, masked_select is not", lambda x: x.masked_select(x > 0), "data"),
        ("nonzero", lambda x: x.nonzero(), "data-dependent shape"),
        ("argwhere", lambda x: torch.argwhere(x), "data-dependent shape"),
        ("unique", lambda x: x.unique(), "data-dependent shape"),
        ("one-argument where", lambda x: torch.where(x > 0), "data-dependent shape"),
        (
            "repeat_interleave by a tensor",
            lambda x: x.repeat_interleave(torch.tensor([1, 2, 0])),
            "data-dependent shape",
        ),
        ("bincount", lambda x: torch.bincount(torch.tensor([0, 2])), "data-dependent shape"),
    ],
)
def test_capture_refuses_what_cuda_capture_refuses_with_cudas_error(name, fn, why):
    assert why in _refused(fn, torch.tensor([1.0, -2.0, 3.0]))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.where(x > 0, x, 0.0),
        lambda x: x.masked_fill(x > 0, 0.0),
        lambda x: x[torch.tensor([0, 2])],  # an integer index: fixed shape
        lambda x: x.repeat_interleave(2),
        lambda x: torch.nonzero_static(x, size=3),
    ],
)
def test_capture_allows_the_fixed_shape_forms(fn):
    result, program = record(lambda: fn(torch.tensor([1.0, -2.0, 3.0])))
    assert len(program) >= 1 and isinstance(result, torch.Tensor)


def test_an_item_in_the_loss_is_refused_at_capture_naming_the_host_sync_and_the_line():
    def printing_loss(out, y):
        loss = nn.functional.cross_entropy(out, y)
        print(loss.item())  # the line the fallback names
        return loss

    model = make_model()
    step = graphed(model, sgd(model), printing_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(16, 8):
            step(x, y)
    report = step.report()
    assert report.replays == 0 and report.mode == "eager"
    reason = report.fallbacks[0]
    assert CUDA_CAPTURE_ERROR in reason
    assert "print(loss.item())" in reason and "test_cpu_graphs.py" in reason
    assert "host synchronisation" in reason  # explain's cause, first
    assert any(CUDA_CAPTURE_ERROR in str(w.message) for w in caught)


def test_a_boolean_mask_in_the_loss_is_refused_naming_a_data_dependent_shape():
    def masked_loss(out, y):
        keep = y != 3
        return nn.functional.cross_entropy(out[keep], y[keep])

    model = make_model()
    step = graphed(model, sgd(model), masked_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in batches(16, 8):
            step(x, y)
    reason = step.report().fallbacks[0]
    assert "out[keep]" in reason and "data-dependent shape" in reason


# ---------------------------------------------------------------- capture runs nothing
def test_a_failed_capture_leaves_parameters_optimizer_state_buffers_and_rng_as_they_were():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    make_graph_safe(opt, torch.device("cpu"))
    x, y = batches(1, 8)[0]
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.random.get_rng_state()

    def step_then_host_read():
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()  # refused after everything above ran

    with pytest.raises(CaptureRefused):
        record(step_then_host_read)
    after = (model.state_dict(), opt.state_dict())
    for key, value in before[0].items():
        assert torch.equal(value, after[0][key]), key
    for i, state in before[1]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, after[1]["state"][i][key]), (i, key)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert torch.equal(rng, torch.random.get_rng_state())


# ---------------------------------------------------------------- the optimizer's CUDA path
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
        # their for-loop paths read a tensor LR on the host (alpha=-lr): refused at capture
        # until the step took the foreach path; pytorch/examples' MNIST steps Adadelta
        lambda m: torch.optim.Adadelta(m.parameters(), lr=1.0),
        lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.9),
    ],
    ids=["sgd-momentum", "adam", "adamw", "adadelta", "rmsprop"],
)
def test_replays_equal_the_eager_loop_with_the_optimizer_the_step_steps(make_opt):
    model = make_model()
    step = graphed(model, make_opt(model), nn.CrossEntropyLoss())
    data = batches(24, 8)
    losses = [step(x, y) for x, y in data]
    ref, ref_losses = eager_reference(data, make_opt)
    assert step.report().replays == 24 - WARMUP
    assert_same_parameters(model, ref)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))


def test_the_report_names_the_engine_and_the_optimizer_changes_measured_on_the_cpu():
    model = make_model()
    step = graphed(model, torch.optim.AdamW(model.parameters(), lr=1e-3), nn.CrossEntropyLoss())
    report = step.report()
    assert report.engine == "cpu-recorded" and "engine=cpu-recorded" in str(report)
    changes = " ".join(report.optimizer_changes)
    assert "capturable=True" in changes and "max |Δparam|" in changes
    plain = make_model()
    eager = TrainStep(plain, sgd(plain), nn.CrossEntropyLoss(), graph="never")
    assert eager.report().engine is None


def graphed_and_eager_with_dropout(make):
    """The step's losses and model against the eager loop's, both from ``make()`` with the
    same generator state before the first call (their dropout draws the same numbers)."""
    data = batches(20, 8)
    model = make()
    step = graphed(model, sgd(model), nn.CrossEntropyLoss())
    torch.manual_seed(7)
    losses = [step(x, y) for x, y in data]
    ref = make()
    opt = sgd(ref)
    make_graph_safe(opt, torch.device("cpu"))
    torch.manual_seed(7)
    ref_losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.detach())
    assert step.report().replays == 20 - WARMUP
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert_same_parameters(model, ref)
    return losses


def test_dropout_draws_new_numbers_on_each_replay_as_the_eager_loop_does():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))

    losses = graphed_and_eager_with_dropout(make)
    assert len({float(v) for v in losses[WARMUP:]}) == 20 - WARMUP


class _CheckpointedDropout(nn.Module):
    """Activation checkpointing over a dropout block: the recompute in backward must draw the
    forward's mask (torch.utils.checkpoint saves and restores the generator's state for it)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed, self.a = nn.Linear(8, 8), nn.Linear(8, 16)
        self.drop, self.b = nn.Dropout(0.3), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the block's input requires grad (as a transformer layer's does), or the reentrant
        # form would give its parameters no gradient at all
        block = lambda t: self.drop(torch.relu(self.a(t)))  # noqa: E731
        return self.b(checkpoint(block, self.embed(x), use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_recompute_draws_its_forwards_numbers_on_every_replay(reentrant):
    # CUDA capture (torch 2.10+, pytorch#162505) takes checkpoint's state read and restore as a
    # rewind of the generator's offset; recorded without it, a replay's recompute drew the next
    # numbers and the run parted from the eager loop at the first replay
    def make():
        torch.manual_seed(0)
        return _CheckpointedDropout(reentrant)

    graphed_and_eager_with_dropout(make)


_READ_BEFORE = torch.random.get_rng_state()


@pytest.mark.parametrize(
    "name, fn",
    [
        ("torch.manual_seed", lambda: torch.manual_seed(3)),
        ("torch.random.manual_seed", lambda: torch.random.manual_seed(3)),
        ("torch.seed", lambda: torch.seed()),
        ("a state read before the capture", lambda: torch.set_rng_state(_READ_BEFORE)),
    ],
)
def test_a_seed_or_a_foreign_state_set_during_capture_is_refused_with_cudas_error(name, fn):
    originals = (torch.manual_seed, torch.seed, torch.get_rng_state, torch.set_rng_state)
    state = torch.random.get_rng_state()
    with pytest.raises(CaptureRefused, match="set_current_seed can be called during stream"):
        record(fn)
    assert (torch.manual_seed, torch.seed, torch.get_rng_state, torch.set_rng_state) == originals
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_state_read_and_set_back_in_a_capture_is_replayed_as_a_rewind():
    def draw_twice():
        state = torch.get_rng_state()
        first = torch.rand(3)
        torch.set_rng_state(state)
        return first, torch.rand(3)

    (first, second), program = record(draw_twice)
    drawn = []
    for _ in range(3):
        program.replay()
        assert torch.equal(first, second)  # the rewind: the same numbers twice in one replay
        drawn.append(first.clone())
    assert not torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[1], drawn[2])


# ---------------------------------------------------------------- collectives
@pytest.mark.timeout(240)
def test_ddp_replays_send_the_recorded_gloo_all_reduce_and_equal_eager_ddp():
    results = run_distributed(workers.ddp_batchnorm_replays, 2, timeout=200)
    for result in results:
        assert result["replays"] == 20 - WARMUP, result
        assert result["max_param_diff"] == 0.0 and result["max_buffer_diff"] == 0.0, result
    # the ranks saw different data and still hold one model: the all-reduce ran in the replays
    assert results[0]["checksum"] == results[1]["checksum"]


@pytest.mark.timeout(240)
def test_ranks_agree_when_the_first_capture_waits_for_a_repeated_batch():
    """Rank 0's call 13 is a short batch, rank 1's a full one: both wait (one tiny all-reduce a
    call) and capture together at call 15, the first both of whose batches repeat their
    predecessors'; rank 1 capturing alone at 13 would leave the collectives unpaired."""
    for result in run_distributed(workers.ddp_ranks_disagree_on_the_short_batch, 2, timeout=200):
        assert result == {"captured_at": [15], "replays": 2, "params_equal": True}, result


@pytest.mark.timeout(240)
def test_fsdp2_replays_send_the_recorded_all_gathers_and_equal_the_fsdp2_loop():
    for result in run_distributed(workers.fsdp2_replays, 2, timeout=200):
        assert result == {"replays": 16 - 3, "losses_equal": True, "params_equal": True}


def test_inductor_compiled_models_are_not_recorded_and_aot_eager_ones_are():
    """Inductor's kernels run below the dispatcher: the CPU engine would replay without them,
    so it refuses them by name; aot_eager's graphs run ATen operations and are recorded."""
    model = make_model()
    with pytest.warns(UserWarning, match="cannot record torch.compile's Inductor kernels"):
        step = graphed(model, sgd(model), nn.CrossEntropyLoss(), compile=True)
    assert step.report().replays == 0 and "aot_eager" in step.report().fallbacks[0]
    model = make_model()
    step = graphed(model, sgd(model), nn.CrossEntropyLoss(), compile={"backend": "aot_eager"})
    data = batches(16, 8)
    losses = [step(x, y) for x, y in data]
    ref_model = make_model()
    ref = TrainStep(
        ref_model, as_the_step_steps(sgd(ref_model)), nn.CrossEntropyLoss(), graph="never",
        compile={"backend": "aot_eager"},
    )  # fmt: skip
    ref_losses = [ref(x, y) for x, y in data]
    assert step.report().replays == 16 - WARMUP
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert_same_parameters(model, ref_model)


@pytest.mark.timeout(240)
def test_a_replayed_functional_all_reduce_is_waited_before_its_result_is_read():
    """Regression: the replay copied a functional collective's result before its Work finished
    (its wait is registered on the new tensor; the recorded wait_tensor reads the capture's),
    so each rank read its own unreduced value: FSDP2's all-reduced grad norm differed by rank."""
    results = run_distributed(workers.functional_all_reduce_replays, 2, timeout=200)
    # replay i: rank r gives 2 * i * (r + 1); the sum over ranks 2 * i * 3, plus 1
    expected = [[2.0 * i * 3 + 1] * 4 for i in (1, 2, 3)]
    assert results == [expected, expected]


def test_a_warmup_that_ends_on_an_epochs_short_batch_still_replays_the_full_batches():
    """Epochs of 12 full batches (4 rows) and a short one (2 rows), the default warm-up of 12
    calls: the first capture waits for a batch like its predecessor (call 15: 13 is the short
    one, 14 the first after it), so the full batches replay and only the tails run eagerly.
    Seen on an H100 in complete_cv_example.py (800 images in batches of 64, warm-up 12): the
    graph fixed on the epoch's tail, 36 of 39 steps eager (`eager=36 replays=3` here too
    before the wait, when this test was a strict xfail)."""
    torch.manual_seed(0)
    model = make_model()
    step = graphed(model, sgd(model), nn.CrossEntropyLoss())
    full, short = batches(12, 4), batches(1, 2)
    data = (full + short) * 3
    losses = [step(x, y) for x, y in data]
    report = step.report()
    assert len(report.captures) == 1 and report.captures[0].signature.leaves[0].shape == (4, 8), (
        str(report)
    )
    assert report.captures[0].at_step == 15, str(report)
    # 15-25 and 27-38 replayed; the 12 warm-up steps, 13 and 14, and the tails 26 and 39 eager
    assert (report.replays, report.eager_steps) == (11 + 12, 12 + 2 + 2), str(report)
    ref, ref_losses = eager_reference(data, sgd)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert_same_parameters(model, ref)


def test_the_first_capture_waits_three_steps_at_most_for_a_repeated_batch():
    """Batches whose shape changes on every call (dynamic padding, nothing repeats): the first
    capture waits three steps past the warm-up, then takes the batch at hand."""
    torch.manual_seed(0)
    model = make_model()
    step = graphed(model, sgd(model), nn.CrossEntropyLoss())
    for i in range(20):
        x, y = batches(1, 2 + i % 2)[0]  # 2, 3, 2, 3, ... rows
        step(x, y)
    report = step.report()
    assert [c.at_step for c in report.captures] == [WARMUP + 4], str(report)


def test_with_on_new_shape_capture_the_first_capture_does_not_wait():
    """Every new shape gets its own graph there: the tail's graph costs nothing."""
    torch.manual_seed(0)
    model = make_model()
    step = graphed(model, sgd(model), nn.CrossEntropyLoss(), on_new_shape="capture")
    for x, y in batches(12, 4) + batches(1, 2) + batches(3, 4):
        step(x, y)
    assert [c.at_step for c in step.report().captures] == [13, 14], str(step.report())
