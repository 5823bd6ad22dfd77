"""``FakeData``: image ``i`` and its label come from a generator seeded with ``i + random_offset``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import Dataset


class FakeData(Dataset):
    def __init__(
        self,
        size: int = 1000,
        image_size: tuple[int, int, int] = (3, 224, 224),
        num_classes: int = 10,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        random_offset: int = 0,
    ) -> None:
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.transform, self.target_transform = transform, target_transform
        self.random_offset = random_offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index >= self.size:
            raise IndexError(f"{type(self).__name__} index out of range")
        g = torch.Generator().manual_seed(index + self.random_offset)
        image = torch.rand(self.image_size, generator=g)
        target = int(torch.randint(0, self.num_classes, (1,), generator=g))
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


def __getattr__(name: str):
    raise AttributeError(f"torchvision.datasets.{name} is not in the stand-in ({__file__}).")
