"""A ResNet-50-shaped CNN as a chain: ``[Stem, Bottleneck × 16, Head]`` (18 layers).

He et al., "Deep Residual Learning for Image Recognition" (CVPR 2016), Table 1 (50-layer:
blocks [3, 4, 6, 3], widths 64-128-256-512, expansion 4), with the stride on the 3×3
convolution as in torchvision's ``resnet50`` (v1.5). Random weights. Input ``(N, 3, H, W)``
float (224×224 in the published setting); output logits ``(N, num_classes)``.
BatchNorm uses batch statistics in training, so results depend on the micro-batch split (as in
any pipeline-parallel ResNet); use ``norm="group"`` for micro-batch-independent numerics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(32, channels), channels)
    raise ValueError(f"norm: expected 'batch' or 'group', got {kind!r}")


class Stem(nn.Module):
    """7×7/2 convolution, norm, ReLU, 3×3/2 max-pool: ``(N,3,H,W) -> (N,64,H/4,W/4)``."""

    def __init__(self, width: int = 64, norm: str = "batch") -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn = _norm(norm, width)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.bn(self.conv(x))))


class Bottleneck(nn.Module):
    """1×1 -> 3×3 (stride) -> 1×1 (×4) with a projection shortcut when the shape changes."""

    def __init__(self, cin: int, width: int, stride: int = 1, norm: str = "batch") -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = _norm(norm, width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = _norm(norm, width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = _norm(norm, cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _norm(norm, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class Head(nn.Module):
    """Global average pool + linear classifier: ``(N,C,h,w) -> (N,num_classes)``."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def resnet_chain(
    blocks: Sequence[int] = (3, 4, 6, 3),
    widths: Sequence[int] = (64, 128, 256, 512),
    num_classes: int = 1000,
    norm: str = "batch",
) -> nn.Sequential:
    """Build ``[Stem, Bottleneck × sum(blocks), Head]``; defaults give ResNet-50
    (25,557,032 parameters)."""
    layers: list[nn.Module] = [Stem(widths[0], norm)]
    cin = widths[0]
    for stage, (n, w) in enumerate(zip(blocks, widths, strict=True)):
        for i in range(n):
            stride = 2 if (i == 0 and stage > 0) else 1
            layers.append(Bottleneck(cin, w, stride, norm))
            cin = w * 4
    layers.append(Head(cin, num_classes))
    return nn.Sequential(*layers)
