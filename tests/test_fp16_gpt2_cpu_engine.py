"""The fp16 GPT-2 family of tests/gpu on the CPU engine (issue 47).

On the H100 at 5713d53 (torch 2.11, transformers 5.17) the graphed fp16 GPT-2 parts from the eager
autocast + GradScaler loop right after the capture step (``transformer.h.0.attn.c_attn.bias``
4.1e-5 to 5.6e-5), and is bitwise equal to the same loop told, from that step on, that a CUDA graph
is being captured (``test_fp16_gpt2_bisect_gpu``'s ``capture-branches`` variants). The cause is
transformers' capture branch (:mod:`tests.hf_capture`): the captured forward calls SDPA with a
causal mask where the eager one passes ``is_causal=True``, and on CUDA that picks another kernel.
The key bias shows it most: its true gradient is zero (softmax ignores a shift shared by a row's
scores), so what the kernels compute for it is rounding, which AdamW scales up to an LR-sized step.

These tests show what the CPU engine sees of it: transformers takes its capture branch inside the
engine's capture, as on CUDA (this fails on the old stand-in, whose capture transformers never
saw), and the graphed run still equals the GradScaler loop bitwise, because the CPU's SDPA kernel
computes both calls alike. So the CPU engine reproduces the program; the arithmetic that differs
is CUDA's choice of attention kernel, which no CPU run has.
"""

from __future__ import annotations

import pytest
import torch

from ddpgraph import TrainStep
from ddpgraph.step.optim import make_graph_safe
from ddpgraph.testing import CpuGraphs

from .hf_capture import sdpa_calls

pytestmark = pytest.mark.timeout(600)

STEPS = 15
CAPTURE_STEP = 12  # the default 12 eager warm-up steps (0-11), then the capture
SCALER = {"init_scale": 2.0**24, "growth_interval": 25}  # test_amp_gpu's: overflows first


def _model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500)
    return transformers.GPT2LMHeadModel(config)  # dropout 0.1 everywhere, SDPA attention


def _data(masked: bool) -> list[dict[str, torch.Tensor]]:
    """Batches as the GPU tests build them; ``masked`` adds an all-ones attention mask, which
    every transformers 5 version turns into an explicit SDPA mask while captured."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(500, (4, 32), generator=gen)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if masked:
            batch["attention_mask"] = torch.ones_like(ids)
        out.append(batch)
    return out


def _gradscaler_loop(data):
    """The eager loop of tests/gpu/test_amp_gpu.py on the CPU: autocast fp16, GradScaler, the
    same fused AdamW made graph-safe (LR tensor, capturable) as the graphed step's."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    make_graph_safe(opt, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    torch.manual_seed(1)
    losses, params = [], []
    for batch in data:
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().float())
        params.append([p.detach().clone() for p in model.parameters()])
    return torch.stack(losses), params, scaler


def _graphed(data):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = TrainStep(model, opt, amp="fp16", grad_scaler=SCALER, engine=CpuGraphs())
    torch.manual_seed(1)
    losses, params = [], []
    with sdpa_calls() as calls:
        for batch in data:
            losses.append(step(batch).clone())
            params.append([p.detach().clone() for p in model.parameters()])
    return torch.stack(losses), params, step, calls


@pytest.mark.parametrize("masked", [False, True], ids=["no-attention-mask", "attention-mask"])
def test_gpt2_fp16_graphed_on_the_cpu_engine_equals_the_gradscaler_loop_bitwise(masked):
    transformers = pytest.importorskip("transformers")
    data = _data(masked)
    ref_losses, ref_params, scaler = _gradscaler_loop(data)
    losses, params, step, calls = _graphed(data)
    report = step.report()
    assert report.engine == "cpu-recorded" and report.mode == "graphed", str(report)
    assert report.replays == STEPS - CAPTURE_STEP, str(report)
    assert report.skipped_steps >= 1, str(report)  # the run meets overflows

    # Python ran for the warm-up and the capture only: 2 layers x 13 forwards
    assert len(calls) == 2 * (CAPTURE_STEP + 1), calls
    eager, captured = calls[: 2 * CAPTURE_STEP], calls[2 * CAPTURE_STEP :]
    assert not any(c["capturing"] for c in eager) and all(c["capturing"] for c in captured)
    assert all(not c["mask"] and c["is_causal"] for c in eager), eager
    # transformers' capture branch, inside the CPU engine's capture as inside CUDA's
    old_skip = tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 18)
    if masked or old_skip:
        assert all(c["mask"] and not c["is_causal"] for c in captured), captured
    else:  # transformers >= 5.18 keeps is_causal while capturing when no mask is passed
        assert all(not c["mask"] and c["is_causal"] for c in captured), captured

    # ... and still bitwise: the CPU's SDPA computes both calls alike
    for i in range(STEPS):
        assert torch.equal(losses[i], ref_losses[i]), f"loss at step {i}"
        for a, b in zip(params[i], ref_params[i]):
            assert torch.equal(a, b), f"parameters after step {i}"
    assert float(step.loss_scale) == scaler.get_scale()
