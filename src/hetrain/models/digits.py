"""A small CNN for ``sklearn.datasets.load_digits`` (8x8 grey images, 10 classes)."""

from __future__ import annotations

from torch import nn


def digits_cnn(channels: int = 16, hidden: int = 128, num_classes: int = 10) -> nn.Sequential:
    """Build the digits CNN as a chain of 6 pipeline layers.

    Input ``(N, 1, 8, 8)`` float, output logits ``(N, num_classes)``. No BatchNorm and no dropout,
    so the result does not depend on how the batch is split into micro-batches.
    """
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.MaxPool2d(2), nn.Flatten()),
        nn.Sequential(nn.Linear(2 * channels * 16, hidden), nn.ReLU()),
        nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        nn.Linear(hidden, num_classes),
    )
