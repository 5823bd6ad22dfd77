"""Small built-in models, one per ``--model``, sized to train in seconds on a CPU."""

from __future__ import annotations

import torch
from torch import nn

from .data import NUM_CLASSES, SAMPLE_SHAPES


def build_model(name: str, *, num_classes: int = NUM_CLASSES) -> nn.Module:
    builders = {"mlp": _mlp, "resnet": _resnet, "transformer": _transformer}
    if name not in builders:
        raise ValueError(f"model={name!r} is not built in; choose one of {sorted(builders)}")
    return builders[name](num_classes)


def _mlp(num_classes: int) -> nn.Module:
    (features,) = SAMPLE_SHAPES["mlp"]
    return nn.Sequential(
        nn.Linear(features, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, num_classes),
    )


class BasicBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def _resnet(num_classes: int) -> nn.Module:
    channels = SAMPLE_SHAPES["resnet"][0]
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, 1, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        BasicBlock(16, 16),
        BasicBlock(16, 32, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


class SmallTransformer(nn.Module):
    def __init__(self, num_classes: int, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        seq_len, features = SAMPLE_SHAPES["transformer"]
        self.embed = nn.Linear(features, width)
        self.position = nn.Parameter(torch.zeros(1, seq_len, width))
        layer = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=2 * width, dropout=0.1, batch_first=True
        )
        # The nested-tensor fast path only applies to padded inference batches; it warns otherwise.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(x) + self.position)
        logits: torch.Tensor = self.head(hidden.mean(dim=1))
        return logits


def _transformer(num_classes: int) -> nn.Module:
    return SmallTransformer(num_classes)
