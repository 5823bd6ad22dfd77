"""Issue 25 item 7 / issue 42 item 6: which part of HF GPT-2 makes fp16 graphed differ from
autocast + GradScaler (1.86e-5 on the H200, bitwise on the CPU and for ddpgraph's transformer).
Written without a GPU in the session that wrote it (issue 42); run with ``-s`` to print each
comparison.

The optimizer is ruled out by construction: every reference below steps the same fused AdamW
the graphed step uses (``make_graph_safe``: capturable, the LR in a device tensor), and the
report lists no change for a fused AdamW (measured 0: ``optim_diff``). What is left is measured
three ways, each run through 40 steps with overflows (warm-up: steps 0-11, capture at step 12):

* ``graphed`` vs ``gradscaler``: the failing comparison of ``test_amp_gpu``;
* ``trainstep-eager`` vs ``gradscaler``: TrainStep's fp16 path (its loss scaler, the side
  stream, its DDP) without any graph: if this differs, the cause is ddpgraph's fp16 code, not
  the graph;
* ``graphed`` vs ``gradscaler-capture-branches``: the reference with transformers told, from
  step 12 on, that a CUDA graph is being captured (``is_cuda_stream_capturing``, which its
  ``is_tracing`` reads to skip host-synchronising checks such as the causal-mask skip and the
  packed-sequence test of ``masking_utils``). The replays repeat the code transformers ran while
  being captured; if this comparison is equal, the difference is transformers' capture branch,
  not ddpgraph's graphed path.

Each failure names the first step whose loss differs (a forward difference: at the capture step
12 it is the captured forward itself) and the first step whose parameters differ, with the
tensors that differ most there (an update difference shows in the parameters one step before
the loss).

Found (issue 47; H100, 5713d53, transformers 5.17): ``graphed`` vs ``gradscaler`` failed for all
three variants from the capture step on, while ``trainstep-eager`` and ``capture-branches`` were
bitwise equal: the cause is transformers' capture branch, an explicit causal mask for SDPA (no
FlashAttention) where eager passes ``is_causal=True`` (tests/hf_capture.py). Where this
transformers makes that difference, ``graphed`` vs ``gradscaler`` is an expected failure, after
checking that the runs agree bitwise up to the capture; from transformers 5.18 on, GPT-2 without
an attention mask keeps ``is_causal`` while captured, and the comparison must hold bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpgraph import CaptureError, TrainStep
from ddpgraph.step.optim import make_graph_safe

from ..hf_capture import masks_while_capturing, transformers_sees_a_capture
from . import test_amp_gpu as amp

pytestmark = pytest.mark.timeout(600)

STEPS = 40
CAPTURE_STEP = 12  # DEFAULT_WARMUP eager steps (0-11), then the capture's replay
VARIANTS = {
    "as-tested": {},  # dropout 0.1 everywhere, SDPA attention: the failing case
    "no-dropout": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "no-attn-dropout": {"attn_pdrop": 0.0},
}


def _model(options: dict[str, Any]):
    transformers = pytest.importorskip("transformers")
    options = dict(options)
    attn = options.pop("attn_implementation", None)
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, **options)
    if attn is not None:
        config._attn_implementation = attn
    return transformers.GPT2LMHeadModel(config)


def _data():
    gen = torch.Generator(device="cuda").manual_seed(3)
    ids = [torch.randint(1000, (8, 64), device="cuda", generator=gen) for _ in range(STEPS)]
    return [{"input_ids": i, "labels": i.clone()} for i in ids]


def _snapshot(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _gradscaler(options: dict[str, Any], data, *, capture_branches: bool = False):
    """The eager loop of ``test_amp_gpu`` (DDP, autocast, GradScaler, the graph-safe fused
    AdamW): its losses and parameters after every step."""
    torch.manual_seed(0)
    model = _model(options).cuda()
    opt = amp._opt(model)
    make_graph_safe(opt, torch.device("cuda"))  # the same LR tensor and capturable flags
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=True)
    scaler = torch.amp.GradScaler("cuda", **amp.SCALER)
    torch.manual_seed(1)
    losses, params = [], []
    for i, batch in enumerate(data):
        opt.zero_grad(set_to_none=False)
        with transformers_sees_a_capture(capture_branches and i >= CAPTURE_STEP):
            with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
                loss = amp._own(ddp, batch)
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().float())
        params.append(_snapshot(model))
    torch.cuda.synchronize()
    return torch.stack(losses), params, [name for name, _ in model.named_parameters()]


def _trainstep(options: dict[str, Any], data, graph: str):
    torch.manual_seed(0)
    model = _model(options).cuda()
    opt = amp._opt(model)
    if graph == "never":  # the graph-safe optimizer the graphed run and the references use
        make_graph_safe(opt, torch.device("cuda"))
    step = TrainStep(model, opt, None, amp="fp16", grad_scaler=amp.SCALER, graph=graph)
    torch.manual_seed(1)
    losses, params = [], []
    for batch in data:
        losses.append(step(batch).clone())
        params.append(_snapshot(model))
    torch.cuda.synchronize()
    return torch.stack(losses), params, step


def _first_difference(ours, theirs, names: list[str]) -> str | None:
    """Where two runs part: the first step whose loss differs, the first whose parameters do
    (with the three tensors that differ most there); None when bitwise equal throughout."""
    (our_losses, our_params), (their_losses, their_params) = ours, theirs
    loss_at = next(
        (i for i in range(STEPS) if not torch.equal(our_losses[i], their_losses[i])), None
    )
    param_at = next(
        (
            i
            for i in range(STEPS)
            if not all(torch.equal(a, b) for a, b in zip(our_params[i], their_params[i]))
        ),
        None,
    )
    if loss_at is None and param_at is None:
        return None
    worst = ""
    if param_at is not None:
        sizes = [
            (float((a.float() - b.float()).abs().max()), name)
            for a, b, name in zip(our_params[param_at], their_params[param_at], names)
            if not torch.equal(a, b)
        ]
        worst = f"; there {len(sizes)} tensors differ, most: {sorted(sizes, reverse=True)[:3]}"
    return (
        f"first differing loss at step {loss_at}, first differing parameters after step "
        f"{param_at} (warm-up 0-{CAPTURE_STEP - 1}, capture at {CAPTURE_STEP}){worst}"
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    ("ours", "reference"),
    [
        ("graphed", "gradscaler"),
        ("trainstep-eager", "gradscaler"),
        ("graphed", "gradscaler-capture-branches"),
    ],
)
def test_gpt2_fp16_variant_equals_gradscaler(rt, variant, ours, reference):
    data = _data()
    options = VARIANTS[variant]
    their_losses, their_params, names = _gradscaler(
        options, data, capture_branches=reference == "gradscaler-capture-branches"
    )
    graph = "always" if ours == "graphed" else "never"
    our_losses, our_params, step = _trainstep(options, data, graph)
    report = step.report()
    if ours == "graphed":
        assert report.replays == STEPS - CAPTURE_STEP, str(report)
        assert report.optimizer_changes == [], str(report)  # fused AdamW: the script's own
    assert report.skipped_steps >= 1, str(report)  # the run meets overflows
    where = _first_difference((our_losses, our_params), (their_losses, their_params), names)
    print(f"\n{variant}, {ours} vs {reference}: {where or 'bitwise equal'}")
    plain = ours == "graphed" and reference == "gradscaler"
    if where is not None and plain and masks_while_capturing(_model(options).cuda(), data[0]):
        agree = all(
            torch.equal(our_losses[i], their_losses[i])
            and all(torch.equal(a, b) for a, b in zip(our_params[i], their_params[i]))
            for i in range(CAPTURE_STEP)
        )
        assert agree, f"{variant}: the runs part before the capture: {where}"
        pytest.xfail(
            f"this transformers builds a causal mask for SDPA while captured where eager "
            f"passes is_causal=True (another CUDA kernel): {where}"
        )
    assert where is None, f"{variant}, {ours} vs {reference}: {where}"


def test_gpt2_with_eager_attention_is_refused_at_capture_naming_transformers(rt):
    """transformers' eager-attention mask copies a pageable CPU tensor to the GPU inside the
    forward (``masking_utils``), which a CUDA graph cannot hold: a correct refusal, with the
    library line named, under graph="always"."""
    data = _data()

    def build(graph: str) -> TrainStep:
        torch.manual_seed(0)
        model = _model({"attn_implementation": "eager"}).cuda()
        opt = amp._opt(model)
        return TrainStep(model, opt, None, amp="fp16", grad_scaler=amp.SCALER, graph=graph)

    strict = build("always")
    with pytest.raises(CaptureError, match=r"(?s)CPU tensor is pinned.*transformers"):
        for batch in data[: CAPTURE_STEP + 1]:
            strict(batch)
    # graph="auto" keeps training eagerly, with the same reason in the report
    step = build("auto")
    for batch in data[: CAPTURE_STEP + 2]:
        step(batch)
    report = step.report()
    assert report.mode == "eager" and report.replays == 0, str(report)
    assert any("pinned" in reason for reason in report.fallbacks), str(report)
