"""A learnable synthetic classification set: each class is a fixed random pattern plus noise.

The patterns are drawn from ``seed`` and the noise from ``seed`` and the split, so every rank
builds the same tensors without any file or download, and a model's accuracy climbs well above
chance (1 / classes) within a few hundred steps.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

# Per-sample input shape of each built-in model.
SAMPLE_SHAPES: dict[str, tuple[int, ...]] = {
    "mlp": (64,),
    "resnet": (3, 16, 16),
    "transformer": (16, 32),
}
NUM_CLASSES = 10


def synthetic_patterns(
    shape: tuple[int, ...],
    *,
    num_samples: int,
    seed: int,
    split: str = "train",
    num_classes: int = NUM_CLASSES,
    noise: float = 2.5,
) -> TensorDataset:
    """``num_samples`` pairs (pattern[label] + noise * N(0, 1), label), float32 inputs, int64 labels."""
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be at least 1")
    patterns = torch.randn((num_classes, *shape), generator=torch.Generator().manual_seed(seed))
    split_offset = {"train": 1, "eval": 2}[split]
    # modulo torch's seed range (2**64), so that every seed --seed takes has a noise seed
    gen = torch.Generator().manual_seed((seed * 1000 + split_offset) % 2**64)
    labels = torch.randint(num_classes, (num_samples,), generator=gen)
    inputs = patterns[labels] + noise * torch.randn((num_samples, *shape), generator=gen)
    return TensorDataset(inputs, labels)
