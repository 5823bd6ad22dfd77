"""What transformers does differently while a CUDA graph captures, for the fp16 GPT-2 tests
(tests/test_fp16_gpt2_cpu_engine.py and tests/gpu/test_fp16_gpt2_bisect_gpu.py, test_amp_gpu.py).

transformers' ``is_tracing()`` (``transformers/utils/import_utils.py``) is true while
``torch.cuda.is_current_stream_capturing()`` is, and its SDPA mask code then declines to skip the
causal mask (``masking_utils._ignore_causal_mask_sdpa``): the captured forward calls
``scaled_dot_product_attention(q, k, v, attn_mask=<(b, 1, t, t) additive mask>, is_causal=False)``
where the eager forward calls ``(q, k, v, attn_mask=None, is_causal=True)``. Up to transformers
5.17 it declines even without an attention mask (``if is_tracing(padding_mask): return False``);
from 5.18 only when a 2-D attention mask is passed (``padding_mask is not None and
is_tracing(padding_mask)``: reading the mask's values would be a host sync). On CUDA a mask takes
SDPA off FlashAttention (torch's ``sdp_utils_cpp.h``, ``check_for_attn_mask``: "Flash Attention
does not support non-null attn_mask"), so the graph holds other kernels than the eager loop runs;
on the CPU both calls reach ``_scaled_dot_product_flash_attention_for_cpu``, whose masked scores
become exact zeros, and agree bitwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def transformers_sees_a_capture(on: bool) -> Iterator[None]:
    """transformers' ``is_cuda_stream_capturing`` answering True (what it answers while
    TrainStep captures the step), so an eager run takes its capture branches."""
    if not on:
        yield
        return
    from transformers.utils import import_utils

    saved = import_utils.is_cuda_stream_capturing
    import_utils.is_cuda_stream_capturing = lambda: True
    try:
        yield
    finally:
        import_utils.is_cuda_stream_capturing = saved


@contextlib.contextmanager
def sdpa_calls() -> Iterator[list[dict[str, Any]]]:
    """Each ``torch.nn.functional.scaled_dot_product_attention`` call transformers makes (it
    looks the function up at call time): whether transformers saw a capture, whether a mask was
    passed, and ``is_causal``. Python runs at capture, never on replay, so replays add nothing."""
    from transformers.utils import import_utils

    calls: list[dict[str, Any]] = []
    real: Callable[..., torch.Tensor] = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        calls.append(
            {
                "capturing": import_utils.is_cuda_stream_capturing(),  # as transformers sees it
                "mask": mask is not None,
                "is_causal": bool(kwargs.get("is_causal", False)),
            }
        )
        return real(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        yield calls
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


def masks_while_capturing(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> bool:
    """Whether this transformers builds an attention mask for ``batch`` while a capture runs
    where its eager forward passes none (one forward each way, without autograd)."""
    seen = []
    with torch.no_grad():
        for capturing in (False, True):
            with transformers_sees_a_capture(capturing), sdpa_calls() as calls:
                model(**batch)
            seen.append([c["mask"] for c in calls])
    return seen[0] != seen[1]
