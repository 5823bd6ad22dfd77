"""Real transformers models fed what users feed them (padded, attention-masked, variable-length
batches in pad_batch buckets), graphed by TrainStep: the table of which graph and why not."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from ddpgraph.bench.hf import ARCHITECTURES, HEADLINE, masked_batches
from ddpgraph.step.optim import make_graph_safe

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)

# architecture -> (mode, what the fallback says) with transformers 5.17 and SDPA attention,
# measured on an H200 (benchmarks/results/hf-masked-h200.json has the ratios)
EXPECTED: dict[str, tuple[str, str | None]] = {name: ("graphed", None) for name in ARCHITECTURES}
# Mistral with use_cache=True (its default) builds a sliding-window KV cache from a CPU tensor in
# every forward (transformers/cache_utils.py); the explanation says use_cache=False, which graphs
EXPECTED["mistral"] = (
    "eager",
    r"(?s)Cannot copy between CPU and CUDA tensors.*transformers/cache_utils.py.*use_cache = False",
)


def _train(name, batches, graph):
    from ddpgraph import TrainStep

    _, make = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = make().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if graph == "never":
        make_graph_safe(opt, torch.device("cuda"))
    step = TrainStep(model, opt, graph=graph, on_new_shape="capture")
    torch.manual_seed(1)
    losses = torch.stack([step(b).clone() for b in batches])
    torch.cuda.synchronize()
    params = [p.detach().float().clone() for p in model.parameters()]
    return losses, params, step.report()


def _max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("name", HEADLINE)
def test_headline_models_with_masks_are_graphed_within_eager_noise(rt, name):
    kind, _ = ARCHITECTURES[name]
    batches = masked_batches(kind, 30, torch.device("cuda"))
    losses, graphed, report = _train(name, batches, "always")
    _, eager, _ = _train(name, batches, "never")
    _, eager_again, _ = _train(name, batches, "never")
    noise = _max_diff(eager, eager_again)
    assert report.mode == "graphed" and not report.fallbacks, str(report)
    assert torch.isfinite(losses).all()
    assert _max_diff(graphed, eager) <= max(4 * noise, 1e-4), (_max_diff(graphed, eager), noise)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architecture_sweep_graphs_as_the_table_says(rt, name):
    kind, _ = ARCHITECTURES[name]
    batches = masked_batches(kind, 20, torch.device("cuda"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning is checked in the report
        _, _, report = _train(name, batches, "auto")
    mode, reason = EXPECTED[name]
    assert report.mode == mode, str(report)
    if reason is not None:
        assert re.search(reason, report.fallbacks[0]), report.fallbacks[0]
