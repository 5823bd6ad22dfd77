"""Graphed TrainStep against eager DDP on one GPU: bitwise equal, guards, fallbacks."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ddpgraph import CaptureError, ConfigError, TrainStep
from ddpgraph.demo.models import build_model
from ddpgraph.step.optim import make_graph_safe

pytestmark = pytest.mark.timeout(600)

REPLAYS = 32


def mlp() -> nn.Module:
    return build_model("mlp")


def resnet() -> nn.Module:
    return build_model("resnet")  # BatchNorm buffers


def transformer() -> nn.Module:
    return build_model("transformer")  # dropout 0.1: graph-safe RNG must match eager


SHAPES = {mlp: (64,), resnet: (3, 16, 16), transformer: (16, 32)}


def make_batches(model_fn, n: int, batch: int = 32, *, sizes=None):
    gen = torch.Generator(device="cuda").manual_seed(123)
    sizes = sizes or [batch] * n
    return [
        (
            torch.randn((b, *SHAPES[model_fn]), device="cuda", generator=gen),
            torch.randint(10, (b,), device="cuda", generator=gen),
        )
        for b in sizes
    ]


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def train(
    model_fn,
    opt_fn,
    batches,
    *,
    graph,
    schedule=False,
    reload_at=None,
    reload_with="step",
    **kwargs,
):
    torch.manual_seed(0)
    model = model_fn().cuda()
    opt = opt_fn(model.parameters())
    if graph == "never":
        make_graph_safe(opt, torch.device("cuda"))  # the same arithmetic as the graphed run
    sched = (
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(batches)) if schedule else None
    )
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), graph=graph, scheduler=sched, **kwargs)
    torch.manual_seed(1)  # dropout's stream
    losses, saved = [], None
    for i, batch in enumerate(batches):
        if reload_at is not None and i == reload_at[0]:
            saved = copy.deepcopy(step.state_dict())
        if reload_at is not None and i == reload_at[1]:
            if reload_with == "optimizer":  # the script's own habit
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["optimizer"])
            else:
                step.load_state_dict(saved)
        losses.append(step(*batch).clone())
        if sched is not None:
            sched.step()
    torch.cuda.synchronize()
    return {
        "losses": torch.stack(losses),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": [
            (k, v.clone())
            for s in opt.state.values()
            for k, v in sorted(s.items())
            if isinstance(v, torch.Tensor)
        ],
        "report": step.report(),
        "step": step,
    }


def assert_bitwise(graphed, eager):
    assert torch.equal(graphed["losses"], eager["losses"]), (graphed["losses"], eager["losses"])
    for name, value in eager["state"].items():
        assert torch.equal(graphed["state"][name], value), name
    assert len(graphed["opt"]) == len(eager["opt"])
    for (k1, a), (k2, b) in zip(graphed["opt"], eager["opt"]):
        assert k1 == k2 and torch.equal(a, b), k1


CASES = {
    "mlp-sgd": (mlp, sgd, {}),
    "mlp-adamw-cosine": (mlp, adamw, {"schedule": True}),
    "resnet-bn-sgd-clip": (resnet, sgd, {"clip_grad_norm": 0.5}),
    "transformer-dropout-adamw-bf16": (transformer, adamw, {"amp": "bf16"}),
    "mlp-sgd-accumulate4": (mlp, sgd, {"accumulate": 4}),
    "mlp-adamw-reload": (mlp, adamw, {"reload_at": (20, 30)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_graphed_equals_eager_bitwise(rt, case):
    model_fn, opt_fn, kwargs = CASES[case]
    batches = make_batches(model_fn, 12 + 1 + REPLAYS)
    graphed = train(model_fn, opt_fn, batches, graph="always", **kwargs)
    eager = train(model_fn, opt_fn, batches, graph="never", **kwargs)
    report = graphed["report"]
    assert report.mode == "graphed" and len(report.captures) == 1, str(report)
    assert report.replays == REPLAYS + 1 and report.warmup_steps == 12, str(report)
    assert not report.fallbacks
    assert_bitwise(graphed, eager)


def test_new_shape_captures_a_second_graph_in_the_same_pool(rt):
    sizes = [32] * 13 + [16, 32] * 16
    batches = make_batches(mlp, 0, sizes=sizes)
    graphed = train(mlp, sgd, batches, graph="always", on_new_shape="capture")
    eager = train(mlp, sgd, batches, graph="never")
    assert len(graphed["report"].captures) == 2, str(graphed["report"])
    assert graphed["report"].eager_steps == 12
    assert_bitwise(graphed, eager)


def test_new_shape_eager_and_error_policies(rt):
    batches = make_batches(mlp, 0, sizes=[32] * 14 + [16])
    eager_policy = train(mlp, sgd, batches, graph="always", on_new_shape="eager")
    assert eager_policy["report"].eager_steps == 13 and eager_policy["report"].replays == 2
    with pytest.raises(ValueError, match=r"on_new_shape='error'\) got a batch of \(16, 64\)"):
        train(mlp, sgd, batches, graph="always", on_new_shape="error")


def test_torchvision_resnet50_graphed_equals_eager(rt):
    torchvision = pytest.importorskip("torchvision")

    def resnet50():
        return torchvision.models.resnet50(weights=None, num_classes=10)

    SHAPES[resnet50] = (3, 64, 64)
    batches = make_batches(resnet50, 12 + 1 + REPLAYS, batch=8)
    graphed = train(resnet50, sgd, batches, graph="always")
    eager = train(resnet50, sgd, batches, graph="never")
    assert graphed["report"].mode == "graphed"
    assert_bitwise(graphed, eager)


def test_moved_parameter_storage_is_followed_and_a_new_parameter_object_refused(rt):
    """Issue 31 item 7: ``p.data = ...`` after capture (what ``model.to()`` does where it moves
    memory) drops the graphs and captures again over the new memory; equal to the eager run
    doing the same. A new nn.Parameter object is refused, naming it."""

    def run(graph):
        torch.manual_seed(0)
        model = mlp().cuda()
        opt = adamw(model.parameters())
        make_graph_safe(opt, torch.device("cuda"))
        step = TrainStep(model, opt, nn.CrossEntropyLoss(), graph=graph)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, batch in enumerate(make_batches(mlp, 30)):
                if i == 15:
                    for p in model.parameters():
                        p.data = p.data.clone()
                step(*batch)
        torch.cuda.synchronize()
        return model, step, [str(w.message) for w in caught]

    model, step, messages = run("auto")
    eager, _, _ = run("never")
    assert step.report().recaptures and any("moved to new memory" in m for m in messages)
    assert step.report().replays > 30 - 15 - 13, str(step.report())
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a, b)
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    with pytest.raises(ConfigError, match=r"parameter '0.weight'.*new nn.Parameter"):
        step(*make_batches(mlp, 1)[0])


def _wrap_in_autocast(model: nn.Module) -> None:
    original = model.forward

    def forward(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return original(x).float()

    model.forward = forward


def test_a_forward_wrapped_after_capture_is_captured_again(rt):
    """accelerate's prepare_model under bf16 replaces ``model.forward`` with an autocast
    wrapper: on CUDA the storage does not move but the graph baked the old forward."""

    def run(graph):
        torch.manual_seed(0)
        model = mlp().cuda()
        opt = adamw(model.parameters())
        make_graph_safe(opt, torch.device("cuda"))
        step = TrainStep(model, opt, nn.CrossEntropyLoss(), graph=graph)
        for i, batch in enumerate(make_batches(mlp, 30)):
            if i == 15:
                _wrap_in_autocast(model)
            step(*batch)
        torch.cuda.synchronize()
        return model, step

    model, step = run("auto")
    eager, _ = run("never")
    assert any("forward replaced" in r for r in step.report().recaptures), str(step.report())
    assert len(step.report().captures) == 2
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a, b)


def test_optimizer_load_state_dict_after_capture_is_copied_into_the_graph(rt):
    """nanoGPT's and imagenet's resume: optimizer.load_state_dict() on the optimizer itself."""
    batches = make_batches(mlp, 12 + 1 + REPLAYS)
    graphed = train(
        mlp, adamw, batches, graph="always", reload_at=(20, 30), reload_with="optimizer"
    )
    eager = train(mlp, adamw, batches, graph="never", reload_at=(20, 30), reload_with="optimizer")
    report = graphed["report"]
    assert report.mode == "graphed" and len(report.captures) == 1, str(report)
    assert report.replays == REPLAYS + 1
    assert_bitwise(graphed, eager)


def sync_in_loss(output, target):
    loss = nn.functional.cross_entropy(output, target)
    if loss.item() > 1e9:  # a host sync, the classic capture breaker
        print("diverged")
    return loss


def synchronize_in_loss(output, target):
    torch.cuda.synchronize()  # not a tensor op: passes the sync check, fails the capture
    return nn.functional.cross_entropy(output, target)


def run_with_loss(loss_fn, batches, graph, model_fn=mlp):
    torch.manual_seed(0)
    model = model_fn().cuda()
    opt = sgd(model.parameters())
    if graph == "never":
        make_graph_safe(opt, torch.device("cuda"))
    step = TrainStep(model, opt, loss_fn, graph=graph)
    for batch in batches:
        step(*batch)
    torch.cuda.synchronize()
    return step, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_host_sync_does_not_veto_capture_but_names_the_line_when_capture_fails(rt):
    batches = make_batches(mlp, 16)
    with pytest.warns(
        UserWarning,
        match=r"(?s)capture failed.*likely cause, seen in warm-up: a host sync inside the step "
        r".*test_step_gpu.py:\d+ `if loss.item",
    ):
        step, state = run_with_loss(sync_in_loss, batches, "auto")
    assert step.mode == "eager" and step.report().replays == 0
    _, reference = run_with_loss(sync_in_loss, batches, "never")
    for name in reference:
        assert torch.equal(state[name], reference[name]), name
    with pytest.raises(CaptureError, match=r"(?s)capture failed.*host sync inside the step"):
        run_with_loss(sync_in_loss, batches, "always")


def test_failed_capture_warns_with_the_first_error_and_leaves_state_unchanged(rt):
    # the transformer's dropout draws random numbers after the failed capture: the generator
    # must have left capture mode
    batches = make_batches(transformer, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, state = run_with_loss(synchronize_in_loss, batches, "auto", transformer)
    messages = [str(w.message) for w in caught if "capture failed" in str(w.message)]
    assert messages, [str(w.message) for w in caught]
    assert "previous error" not in messages[0]
    assert step.mode == "eager"
    _, reference = run_with_loss(synchronize_in_loss, batches, "never", transformer)
    for name in reference:
        assert torch.equal(state[name], reference[name]), name
    with pytest.raises(CaptureError, match="capture failed"):
        run_with_loss(synchronize_in_loss, batches, "always", transformer)
    torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5)  # the generator still works


def _max_difference(a, b):
    diffs = [(a["losses"] - b["losses"]).abs().max()]
    diffs += [(a["state"][k].float() - v.float()).abs().max() for k, v in b["state"].items()]
    return float(torch.stack(diffs).max())


def test_compiled_and_graphed_matches_compiled_eager(rt):
    """Bitwise where Inductor is deterministic; otherwise within compiled eager's own noise."""
    batches = make_batches(mlp, 12 + 1 + REPLAYS)
    graphed = train(mlp, sgd, batches, graph="always", compile=True)
    eager = train(mlp, sgd, batches, graph="never", compile=True)
    eager_again = train(mlp, sgd, batches, graph="never", compile=True)
    assert graphed["report"].mode == "graphed" and not graphed["report"].fallbacks
    noise = _max_difference(eager_again, eager)
    assert _max_difference(graphed, eager) <= noise, (noise, _max_difference(graphed, eager))


def test_channels_last_resnet_graphed_equals_eager(rt):
    batches = make_batches(resnet, 12 + 1 + REPLAYS)
    graphed = train(resnet, sgd, batches, graph="always", channels_last=True)
    eager = train(resnet, sgd, batches, graph="never", channels_last=True)
    assert graphed["report"].mode == "graphed"
    assert_bitwise(graphed, eager)


@pytest.mark.parametrize("clip", [0.5, None], ids=["clipped", "measured"])
def test_the_graphed_grad_norm_equals_the_eager_steps_bitwise(rt, clip):
    """step.grad_norm replayed on CUDA against the same step run eagerly (graph="never"); the
    eager step's norm is clip_grad_norm_'s / get_total_norm's (tests/test_grad_norm.py, CPU).
    Against a bare loop without DDP (same capturable AdamW) the graphed norms differed in the
    last bit on the H200 (0.7334 vs 0.7334, not equal); the cause is not isolated yet."""
    batches = make_batches(mlp, 12 + 1 + REPLAYS)
    options = {"clip_grad_norm": clip} if clip else {"grad_norm": True}
    norms = {}
    for graph in ("always", "never"):
        torch.manual_seed(0)
        model = mlp().to(rt.device)
        opt = adamw(model.parameters())
        if graph == "never":
            make_graph_safe(opt, rt.device)  # the same arithmetic as the graphed run
        step = TrainStep(model, opt, nn.CrossEntropyLoss(), graph=graph, **options)
        seen = []
        for x, y in batches:
            step(x, y)
            seen.append(step.grad_norm.clone())
        norms[graph] = torch.stack(seen)
        if graph == "always":
            assert step.report().replays == REPLAYS + 1, str(step.report())
    assert torch.equal(norms["always"], norms["never"])


def test_returned_losses_kept_without_clone_are_each_calls_own_and_step_output_is_the_graphs(rt):
    """Issue 47: a script that keeps the returned loss (Accelerate's autoregressive example
    appends loss.detach() and averages a window) holds each call's loss; step.output stays
    graph-owned (one tensor, overwritten by every replay)."""
    batches = make_batches(mlp, 12 + 1 + 8)
    torch.manual_seed(0)
    model = mlp().cuda()
    step = TrainStep(model, sgd(model.parameters()), nn.CrossEntropyLoss(), graph="always")
    kept, outputs = [], []
    for batch in batches:
        kept.append(step(*batch).detach())
        outputs.append(step.output)
    eager = train(mlp, sgd, batches, graph="never")
    assert torch.equal(torch.stack(kept), eager["losses"])
    replayed = outputs[12:]
    assert len({o.data_ptr() for o in replayed}) == 1
    assert all(torch.equal(o, replayed[-1]) for o in replayed)
