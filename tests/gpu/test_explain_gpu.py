"""explain_exception() on capture errors raised by the real CUDA runtime (needs CUDA).

The capture errors' own message is the same for every cause; only the frames of the traceback
(torch chains the first error to the "previous error during capture" raised on exit) tell the
causes apart, so these check that the frames torch really produces put the right cause first.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpgraph.errors import explain_exception
from ddpgraph.step.graphs import _release_rng_from_failed_capture


def _capture_error(step: Callable[[], object], stream: torch.cuda.Stream) -> BaseException:
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            step()
    except RuntimeError as exc:
        # a failed capture leaves the CUDA generator in capture mode (later randn would raise
        # "Offset increment outside graph capture"); TrainStep ends it the same way
        _release_rng_from_failed_capture(stream)
        return exc
    pytest.fail("the capture did not fail")


def test_a_host_sync_inside_capture_is_explained_as_a_host_sync():
    x = torch.ones(4, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def step() -> object:
        return (x * 2).sum().item()  # the host sync

    found = explain_exception(_capture_error(step, stream))
    assert found is not None and found.id == "capture-not-permitted", found
    assert found.causes[0].id == "host-sync", [c.id for c in found.causes]


def test_ddp_captured_after_three_forwards_is_explained_by_the_warmup_count(rt):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    x = torch.randn(4, 8, device=rt.device)
    with torch.cuda.stream(stream):  # DDP on the capture stream: only the count is wrong
        model = DistributedDataParallel(nn.Linear(8, 8).to(rt.device))
        for _ in range(3):  # DDP times iterations 1..10: the 4th forward cannot be captured
            model(x).sum().backward()
    torch.cuda.current_stream().wait_stream(stream)

    found = explain_exception(_capture_error(lambda: model(x).sum().backward(), stream))
    assert found is not None and found.id == "capture-not-permitted", found
    assert found.causes[0].id == "ddp-warmup", [c.id for c in found.causes]


def test_a_boolean_mask_index_inside_capture_is_explained_as_a_data_dependent_shape():
    # TRL's fused LM-head loss on CUDA does this (hidden_states[mask]); nonzero syncs underneath
    hidden = torch.randn(2, 6, 4, device="cuda")
    labels = torch.tensor([[1, -100, 2, 3, -100, 4], [5, 6, -100, 7, 8, 9]], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def step() -> object:
        mask = labels != -100
        return hidden[mask].sum()

    found = explain_exception(_capture_error(step, stream))
    assert found is not None and found.id == "capture-not-permitted", found
    assert found.causes[0].id == "data-dependent-shape", [c.id for c in found.causes]
