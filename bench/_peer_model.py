"""The model and data of ``bench/pipelining_peer.py``: 8 equal MLP blocks (``Linear(H, H)`` +
``Tanh``) and a fixed random classification set. ``make`` is a ``hetrain train --model``
factory (``bench._peer_model:make``); :data:`HIDDEN` and :data:`SAMPLES` are read from the
environment (``HETRAIN_PEER_HIDDEN``, ``HETRAIN_PEER_SAMPLES``) so the bench's own loop and
the ``hetrain train`` runs it starts build the same model."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

BLOCKS = 8
HIDDEN = int(os.environ.get("HETRAIN_PEER_HIDDEN", "512"))
SAMPLES = int(os.environ.get("HETRAIN_PEER_SAMPLES", "4096"))


def build_model(hidden: int = HIDDEN) -> nn.Sequential:
    """8 equal blocks; the last block's outputs are the logits over ``hidden`` classes."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(8)])


def make_data(samples: int = SAMPLES, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` inputs ``(N, hidden)`` and integer targets in ``[0, hidden)`` (seed 0)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, hidden, generator=g)
    y = torch.randint(0, hidden, (samples,), generator=g)
    return x, y


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the micro-batch."""
    return F.cross_entropy(out, target)


def make() -> dict:
    """``hetrain train --model bench._peer_model:make``."""
    return {"model": build_model(), "dataset": make_data(), "loss_fn": loss_fn}
