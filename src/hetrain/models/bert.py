"""A BERT-style encoder as a chain: ``[Embeddings, EncoderLayer × n_layer, MLMHead]``.

Shapes follow Devlin et al., "BERT" (NAACL 2019) and the published ``bert-base-uncased``
configuration (hidden 768, 12 layers, 12 heads, intermediate 3072, vocabulary 30522, 512
positions, 2 token types, post-LayerNorm, GELU). Random weights; no dropout (profiles and
runs do not depend on random state). The MLM head's decoder is not tied to the word
embedding (the tie would span pipeline stages). Input ``(N, T)`` int64 token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class BertConfig:
    """Sizes of :func:`bert_chain` (defaults: bert-base)."""

    vocab_size: int = 30522
    max_position: int = 512
    type_vocab_size: int = 2
    hidden: int = 768
    n_layer: int = 12
    n_head: int = 12
    intermediate: int = 3072
    layer_norm_eps: float = 1e-12


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm: ``(N, T)`` -> ``(N, T, H)``."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_position, cfg.hidden)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.ln = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        types = torch.zeros_like(pos)
        return self.ln(self.word(idx) + self.pos(pos)[None] + self.token_type(types)[None])


class BertLayer(nn.Module):
    """Post-norm encoder layer (bidirectional self-attention + GELU MLP), ``(N,T,H)->(N,T,H)``."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.hidden, cfg.intermediate)
        self.fc2 = nn.Linear(cfg.intermediate, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        hd = c // self.n_head
        q, k, v = (
            z.view(n, t, self.n_head, hd).transpose(1, 2) for z in self.qkv(x).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v)
        x = self.ln1(x + self.proj(y.transpose(1, 2).reshape(n, t, c)))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class BertMLMHead(nn.Module):
    """Masked-LM head: dense + GELU + LayerNorm + decoder, ``(N,T,H) -> (N,T,vocab)``."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(F.gelu(self.dense(x))))


def bert_chain(cfg: BertConfig | None = None) -> nn.Sequential:
    """Build ``[BertEmbeddings, BertLayer × n_layer, BertMLMHead]`` (``n_layer + 2`` layers)."""
    cfg = cfg or BertConfig()
    return nn.Sequential(
        BertEmbeddings(cfg), *[BertLayer(cfg) for _ in range(cfg.n_layer)], BertMLMHead(cfg)
    )
