"""Real transformers models fed what users feed them (padded, attention-masked, variable-length
batches in pad_batch buckets), graphed by TrainStep: the table of which graph and why not."""

from __future__ import annotations

import pytest
import torch

from ddpgraph.bench_hf import ARCHITECTURES, HEADLINE, masked_batches
from ddpgraph.optim import make_graph_safe

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)

# architecture -> expected mode with transformers >= 5 and SDPA attention (and why, when eager)
EXPECTED = {name: "graphed" for name in ARCHITECTURES}


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
    _, _, report = _train(name, batches, "auto")
    assert report.mode == EXPECTED[name], str(report)
