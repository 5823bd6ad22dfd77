"""fp16 inside the graph: TrainStep against eager DDP + torch.amp.GradScaler with the same fused
optimizer, 200 steps with overflows (forced by huge batches, and by a too-high initial scale).

For HF GPT-2 the eager loop takes transformers' capture branches from the capture step on (what
transformers runs inside the graph: an explicit SDPA mask where eager passes ``is_causal=True``
up to transformers 5.17; see tests/hf_capture.py). The plain loop is compared in
test_fp16_gpt2_bisect_gpu.py, which names the difference when transformers makes one."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpgraph import TrainStep
from ddpgraph.step.optim import make_graph_safe

from ..hf_capture import transformers_sees_a_capture
from .test_step_gpu import make_batches, transformer

pytestmark = pytest.mark.timeout(600)

STEPS = 200
CAPTURE_STEP = 12  # DEFAULT_WARMUP eager steps (0-11), then the capture's replay


def _transformer_data():
    batches = make_batches(transformer, STEPS)
    return [(x * 1e6, y) if i in (40, 41, 120) else (x, y) for i, (x, y) in enumerate(batches)]


def _gpt2_data():
    gen = torch.Generator(device="cuda").manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1000, (8, 64), device="cuda", generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000)
    return transformers.GPT2LMHeadModel(config)


SCALER = {"init_scale": 2.0**24, "growth_interval": 25}


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _eager_gradscaler(model_fn, data, loss_fn, *, capture_branches=False):
    """The eager loop; ``capture_branches``: transformers is told from the capture step on that
    a CUDA graph is being captured, so it runs the forward the graph holds."""
    torch.manual_seed(0)
    model = model_fn().cuda()
    opt = _opt(model)
    make_graph_safe(opt, torch.device("cuda"))  # the same LR tensor and capturable flags
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=True)
    scaler = torch.amp.GradScaler("cuda", **SCALER)
    torch.manual_seed(1)
    losses = []
    for i, batch in enumerate(data):
        opt.zero_grad(set_to_none=False)
        with transformers_sees_a_capture(capture_branches and i >= CAPTURE_STEP):
            with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
                loss = loss_fn(ddp, batch)
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().float())
    torch.cuda.synchronize()
    return model, torch.stack(losses), scaler


def _graphed(model_fn, data, loss_fn):
    torch.manual_seed(0)
    model = model_fn().cuda()
    step = TrainStep(model, _opt(model), loss_fn, amp="fp16", grad_scaler=SCALER, graph="always")
    torch.manual_seed(1)
    losses = [step(*b).clone() if isinstance(b, tuple) else step(b).clone() for b in data]
    torch.cuda.synchronize()
    return model, torch.stack(losses), step


def _ce(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _own(model, batch):
    return model(**batch).loss


@pytest.mark.parametrize("case", ["transformer", "gpt2"])
def test_fp16_graphed_equals_eager_gradscaler_bitwise_through_overflows(rt, case):
    if case == "transformer":
        model_fn, data, eager_loss, loss_fn = (
            transformer,
            _transformer_data(),
            _ce,
            nn.CrossEntropyLoss(),
        )
    else:
        model_fn, data, eager_loss, loss_fn = _gpt2, _gpt2_data(), _own, None
    reference, ref_losses, scaler = _eager_gradscaler(
        model_fn, data, eager_loss, capture_branches=case == "gpt2"
    )
    model, losses, step = _graphed(model_fn, data, loss_fn)
    report = step.report()
    assert report.mode == "graphed" and report.replays == STEPS - CAPTURE_STEP, str(report)
    assert report.skipped_steps >= 3, str(report)  # the test meets overflows
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0, equal_nan=True)
    assert float(step.loss_scale) == scaler.get_scale()
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def _no_sync_loop(model_fn, data, k):
    """The loop nanoGPT and accelerate write: no_sync for k-1 micro-batches, then step."""
    import contextlib

    torch.manual_seed(0)
    model = model_fn().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    make_graph_safe(opt, torch.device("cuda"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=True)
    torch.manual_seed(1)
    losses = []
    opt.zero_grad(set_to_none=False)
    for i, (x, y) in enumerate(data):
        last = (i + 1) % k == 0
        with contextlib.nullcontext() if last else ddp.no_sync():
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                loss = nn.functional.cross_entropy(ddp(x), y)
            (loss / k).backward()
        losses.append(loss.detach().float())
        if last:
            opt.step()
            opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    return model, torch.stack(losses)


def test_accumulate_calls_graphed_equals_the_no_sync_loop_bitwise(rt):
    k = 4
    data = make_batches(transformer, 30 * k)  # dropout 0.1: the draws between calls must match
    reference, ref_losses = _no_sync_loop(transformer, data, k)
    torch.manual_seed(0)
    model = transformer().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = TrainStep(
        model, opt, nn.CrossEntropyLoss(), amp="bf16", accumulate_calls=k, graph="always"
    )
    torch.manual_seed(1)
    losses = torch.stack([step(x, y).clone() for x, y in data])
    torch.cuda.synchronize()
    report = step.report()
    assert report.mode == "graphed" and len(report.captures) == 2, str(report)
    assert report.replays == (30 - 12) * k, str(report)
    assert torch.equal(losses, ref_losses)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
