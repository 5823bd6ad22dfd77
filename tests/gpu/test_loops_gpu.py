"""Real training loops on one GPU: new shapes at any DDP count, evaluation graphs, HF and timm
models, mapping batches through shape buckets, and graph memory returned by close()."""

from __future__ import annotations

import copy
import gc
import random

import pytest
import torch
from torch import nn

import ddpgraph.step
import ddpgraph.step.parallel.ddp
from ddpgraph import TrainStep

from .test_step_gpu import adamw, assert_bitwise, make_batches, mlp, resnet, sgd, train

pytestmark = pytest.mark.timeout(600)


def _sizes_with_new_shapes_at(counts: list[int], steps: int) -> list[int]:
    """Batch sizes for ``steps`` steps: 32 mostly, a size never seen before at each count."""
    rng = random.Random(0)
    sizes, known = [], [32]
    for i in range(steps):
        if i in counts:
            known.append(8 + len(known))
            sizes.append(known[-1])
        else:
            sizes.append(rng.choice(known))
    return sizes


@pytest.mark.parametrize("ddp_sampling", ["off", "default"])
def test_new_shapes_at_any_count_for_260_steps_match_eager(rt, monkeypatch, ddp_sampling):
    """Captures at DDP counts 98..101 and 198..201 (the old crash: step 116, 'invalid argument')."""
    if ddp_sampling == "default":  # as where DDP lacks the private setter: the count rule alone
        monkeypatch.setattr(ddpgraph.step.parallel.ddp, "_stop_ddp_sampling", lambda ddp: 100)
    sizes = _sizes_with_new_shapes_at([40, 98, 99, 100, 101, 198, 199, 200, 201], 260)
    batches = make_batches(mlp, 0, sizes=sizes)
    graphed = train(mlp, adamw, batches, graph="always", on_new_shape="capture")
    eager = train(mlp, adamw, batches, graph="never")
    report = graphed["report"]
    assert report.mode == "graphed" and len(report.captures) >= 6, str(report)
    assert report.replays > 200, str(report)
    assert_bitwise(graphed, eager)


def _interleaved(model_fn, opt_fn, batches, eval_batches, *, graph):
    torch.manual_seed(0)
    model = model_fn().cuda()
    opt = opt_fn(model.parameters())
    if graph == "never":
        ddpgraph.step.optim.make_graph_safe(opt, torch.device("cuda"))
    step = TrainStep(model, opt, nn.CrossEntropyLoss(), graph=graph)
    outputs = []
    for i, batch in enumerate(batches):
        step(*batch)
        if i % 5 == 4:
            for x, _ in eval_batches:
                outputs.append(step.evaluate(x).clone())
            assert model.training
    torch.cuda.synchronize()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return step, outputs, state


def test_eval_graph_matches_eager_eval_and_switching_never_recaptures(rt):
    batches = make_batches(resnet, 40)
    eval_batches = make_batches(resnet, 2, batch=16)
    step, graphed, state = _interleaved(resnet, sgd, batches, eval_batches, graph="always")
    _, eager, reference = _interleaved(resnet, sgd, batches, eval_batches, graph="never")
    kinds = [c.kind for c in step.report().captures]
    assert kinds.count("train") == 1 and kinds.count("eval") == 1, str(step.report())
    assert step.report().eval_replays > 0
    for a, b in zip(graphed, eager):
        assert torch.equal(a, b)
    for name, value in reference.items():
        assert torch.equal(state[name], value), name


def _gpt2(dropout: float):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=1000,
        n_positions=256,
        n_embd=256,
        n_layer=4,
        n_head=4,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return lambda: transformers.GPT2LMHeadModel(config)


def _lm_batches(n: int, *, with_mask: bool):
    from ddpgraph import pad_batch

    gen = torch.Generator(device="cuda").manual_seed(7)
    rng = random.Random(7)
    out = []
    for _ in range(n):
        length = rng.randint(32, 256)
        ids = torch.randint(1000, (16, length), device="cuda", generator=gen)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if with_mask:
            batch["attention_mask"] = torch.ones_like(ids)
        out.append(pad_batch(batch, multiple=64, dim=1))
    return out


def _train_lm(model_fn, batches, *, graph):
    torch.manual_seed(0)
    model = model_fn().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if graph == "never":
        ddpgraph.step.optim.make_graph_safe(opt, torch.device("cuda"))
    step = TrainStep(model, opt, graph=graph, on_new_shape="capture")
    torch.manual_seed(1)
    losses = [step(batch).clone() for batch in batches]
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
    }


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_hf_gpt2_mapping_batches_in_buckets_match_eager(rt, dropout):
    """Right padding needs no attention mask in a causal LM: real positions never attend to
    later ones, and padded labels (-100) drop out of the loss."""
    model_fn = _gpt2(dropout)
    batches = _lm_batches(48, with_mask=False)
    graphed = _train_lm(model_fn, batches, graph="always")
    eager = _train_lm(model_fn, batches, graph="never")
    report = graphed["report"]
    assert report.mode == "graphed" and 2 <= len(report.captures) <= 4, str(report)
    assert_bitwise(graphed, eager)


def test_hf_gpt2_with_an_attention_mask_is_graphed_and_matches_eager(rt):
    """transformers 5.x checks the mask on the host in eager mode (the warm-up sees a sync) but
    skips the check while a stream is capturing: the capture decides, and it succeeds."""
    batches = _lm_batches(40, with_mask=True)
    graphed = _train_lm(_gpt2(0.0), batches, graph="always")
    eager = _train_lm(_gpt2(0.0), batches, graph="never")
    assert graphed["report"].mode == "graphed" and not graphed["report"].fallbacks
    assert_bitwise(graphed, eager)


def test_timm_vit_graphed_is_within_eager_noise(rt):
    timm = pytest.importorskip("timm")

    def vit():
        return timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64)

    from .test_step_gpu import SHAPES, _max_difference

    SHAPES[vit] = (3, 64, 64)
    batches = make_batches(vit, 30, batch=16)
    graphed = train(vit, adamw, batches, graph="always")
    eager = train(vit, adamw, batches, graph="never")
    eager_again = train(vit, adamw, batches, graph="never")
    assert graphed["report"].mode == "graphed"
    noise = _max_difference(eager_again, eager)
    assert _max_difference(graphed, eager) <= max(noise, 1e-6) * 4, (
        noise,
        _max_difference(graphed, eager),
    )


def test_close_frees_the_graphs_and_dropping_the_step_returns_the_memory(rt):
    stream = ddpgraph.step.streams.capture_stream(torch.device("cuda"))
    with torch.cuda.stream(stream):  # its cuBLAS workspace lives as long as the process
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    batches = make_batches(mlp, 20, batch=4096)  # a pool of tens of MiB
    run = train(mlp, sgd, batches, graph="always", on_new_shape="capture")
    step = run["step"]
    step(*make_batches(mlp, 1, batch=2048)[0])  # a second graph in the pool
    torch.cuda.synchronize()
    graphed_reserved = torch.cuda.memory_reserved()
    step.close()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < graphed_reserved
    assert step.mode == "closed"
    with pytest.raises(ddpgraph.CaptureError, match=r"after close\(\)"):
        step(*batches[0])
    del step, run, batches  # the batches were made after the baseline too
    gc.collect()
    torch.cuda.empty_cache()
    # what stays is process-lifetime state of torch's (the CUDA generator's graph-safe seed and
    # offset tensors, made at the first capture): bytes, not the graphs' megabytes
    numbers = {
        "graphed_reserved": graphed_reserved,
        "reserved": (reserved, torch.cuda.memory_reserved()),
        "allocated": (allocated, torch.cuda.memory_allocated()),
    }
    assert torch.cuda.memory_allocated() - allocated <= 2**20, numbers
    assert torch.cuda.memory_reserved() - reserved <= 2 * 2**20, numbers
    assert graphed_reserved - reserved > 4 * 2**20, numbers  # the test measures something


def test_an_eval_of_a_new_shape_between_replays_leaves_training_bitwise(rt):
    batches = make_batches(mlp, 30)
    probe = make_batches(mlp, 1, batch=7)[0][0]
    graphed = train(mlp, sgd, batches, graph="always")
    step = graphed["step"]
    for _ in range(3):
        out = step.evaluate(probe)
    model = copy.deepcopy(ddpgraph.step.parallel.unwrap(step.model)).eval()
    with torch.no_grad():
        assert torch.equal(out, model(probe))
