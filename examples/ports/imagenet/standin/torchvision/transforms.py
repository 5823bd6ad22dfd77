"""The transforms ``imagenet/main.py`` builds for ``--dummy`` data; the stand-in's images are
already tensors in [0, 1], so ``ToTensor`` passes them through."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class ToTensor:
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std


class Compose:
    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        for transform in self.transforms:
            image = transform(image)
        return image


def __getattr__(name: str):
    raise AttributeError(f"torchvision.transforms.{name} is not in the stand-in ({__file__}).")
