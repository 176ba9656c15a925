"""A character-level GPT-style transformer: embedding, N pre-norm blocks, head.

The chain is ``[Embedding, Block × n_layer, Head]`` (``n_layer + 2`` pipeline layers). Input
``(N, T)`` int64 token ids with ``T <= block_size``, output logits ``(N, T, vocab_size)``.
No dropout, so results do not depend on micro-batching or random state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class CharGPTConfig:
    """Sizes of :func:`char_gpt`: ``vocab_size`` tokens, context ``block_size`` tokens,
    ``n_layer`` blocks of width ``n_embd`` with ``n_head`` attention heads. The defaults are
    the ``charlm`` example (:data:`CHARLM`)."""

    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4

    def describe(self) -> str:
        """One line: ``"4 blocks, 64 wide, 4 heads, context 64, vocabulary 96"``."""
        return (
            f"{self.n_layer} blocks, {self.n_embd} wide, {self.n_head} heads, "
            f"context {self.block_size}, vocabulary {self.vocab_size}"
        )


#: The model of the ``charlm`` example, the one source of its sizes: ``hetrain train --example
#: charlm`` trains it and ``hetrain profile --example charlm`` profiles it (96 symbols: newline
#: and printable ASCII).
CHARLM = CharGPTConfig(vocab_size=96, block_size=64, n_layer=4, n_embd=64, n_head=4)


class Embedding(nn.Module):
    """Token + learned position embedding: ``(N, T)`` ids -> ``(N, T, n_embd)``."""

    def __init__(self, cfg: CharGPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        return self.tok(idx) + self.pos(pos)[None]


class Block(nn.Module):
    """Pre-norm transformer block (causal self-attention + MLP), ``(N, T, C) -> (N, T, C)``."""

    def __init__(self, cfg: CharGPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(n, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(n, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(n, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(n, t, c))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm + linear head: ``(N, T, C) -> (N, T, vocab_size)``."""

    def __init__(self, cfg: CharGPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.out = nn.Linear(cfg.n_embd, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def char_gpt(cfg: CharGPTConfig | None = None) -> nn.Sequential:
    """Build the chain ``[Embedding, Block × n_layer, Head]`` for ``cfg`` (default: the
    ``charlm`` example, :data:`CHARLM`)."""
    cfg = cfg or CHARLM
    return nn.Sequential(Embedding(cfg), *[Block(cfg) for _ in range(cfg.n_layer)], Head(cfg))
