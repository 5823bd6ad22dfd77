"""``parallel.ddp.norm_as_unbucketed`` on CUDA: gradients laid out as DDP's bucket views (odd
sizes put the views after them off the foreach norm kernel's 4-element vector grid) are normed
as the same gradients each in an allocation of its own (a DDP script's, torch's default
``gradient_as_bucket_view=False``), bit for bit. How often torch's foreach norm of the views
themselves parts from that is printed: the cause of torchvision ``train.py --clip-grad-norm``'s
data-seed-2 difference (``benchmarks/results/torchvision-amp-adamw-2-h100-d77237d.json``)."""

from __future__ import annotations

import pytest
import torch

from ddpgraph.step.parallel.ddp import norm_as_unbucketed

pytestmark = pytest.mark.timeout(300)

# a ResNet-like bucket: a 10-class head's bias first (odd: every view after it is off the
# grid), conv weights, a size over one 64 Ki-element chunk that is not a multiple of 4
SIZES = [10, 64 * 3 * 7 * 7, 257, 65536 + 3, 512 * 512, 1000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucket_views_are_normed_as_their_own_allocations(dtype):
    total_norm = torch.nn.utils.get_total_norm
    apart = 0
    for seed in range(20):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        bucket = torch.randn(sum(SIZES), device="cuda", generator=generator).to(dtype)
        views = list(torch.split(bucket, SIZES))
        alone = [view.clone() for view in views]
        assert torch.equal(norm_as_unbucketed(views), total_norm(alone, foreach=True)), seed
        apart += not torch.equal(total_norm(views, foreach=True), total_norm(alone, foreach=True))
    print(f"{dtype}: torch's foreach norm of the views themselves parted in {apart} of 20 seeds")
