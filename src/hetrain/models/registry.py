"""Named example models for ``hetrain profile --example NAME`` (and other commands).

Each :class:`ExampleModel` builds the chain (an ``nn.Sequential`` whose child ``l`` is layer
``l`` of profiles and plans) and a random input batch of a given size. The published-config
models use the published sizes with random weights (no download).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hetrain.models.charlm import CHARLM, CharGPTConfig, char_gpt


@dataclass(frozen=True)
class ExampleModel:
    """``build()`` -> the chain; ``make_input(n, generator, device)`` -> a batch of ``n``
    samples; ``description`` says what it is (one line); ``large``: too costly to run on this
    CPU for counting, so ``hetrain profile`` counts it on the ``meta`` device by default."""

    name: str
    description: str
    build: Callable[[], nn.Sequential]
    make_input: Callable[..., torch.Tensor]
    large: bool = False


def _tokens(vocab: int, seq: int):
    def make(n: int, generator: torch.Generator | None = None, device="cpu") -> torch.Tensor:
        x = torch.randint(0, vocab, (n, seq), generator=generator)
        return x.to(device)

    return make


def _images(shape: tuple[int, ...]):
    def make(n: int, generator: torch.Generator | None = None, device="cpu") -> torch.Tensor:
        return torch.randn((n, *shape), generator=generator).to(device)

    return make


def _charlm() -> nn.Sequential:
    return char_gpt(CHARLM)  # the model hetrain train --example charlm trains


def _digits() -> nn.Sequential:
    from hetrain.models.digits import digits_cnn

    return digits_cnn()


def _gpt2_small() -> nn.Sequential:
    return char_gpt(GPT2_SMALL)


def _bert_base() -> nn.Sequential:
    from hetrain.models.bert import bert_chain

    return bert_chain()


def _resnet50() -> nn.Sequential:
    from hetrain.models.resnet import resnet_chain

    return resnet_chain()


#: Radford et al. 2019 / Hugging Face ``gpt2``: 12 layers, 768 wide, 12 heads, 1024 context,
#: vocabulary 50257 (the head is not tied to the embedding here: the tie would span stages).
GPT2_SMALL = CharGPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_embd=768, n_head=12)

EXAMPLES: dict[str, ExampleModel] = {
    "charlm": ExampleModel(
        "charlm",
        f"character-level GPT ({CHARLM.describe()})",
        _charlm,
        _tokens(CHARLM.vocab_size, CHARLM.block_size),
    ),
    "digits": ExampleModel("digits", "small CNN for 8x8 digits", _digits, _images((1, 8, 8))),
    "gpt2-small": ExampleModel(
        "gpt2-small",
        "GPT-2 small shape (124M + untied head), context 1024",
        _gpt2_small,
        _tokens(50257, 1024),
        large=True,
    ),
    "bert-base": ExampleModel(
        "bert-base",
        "BERT-base shape (110M), sequence 512",
        _bert_base,
        _tokens(30522, 512),
        large=True,
    ),
    "resnet50": ExampleModel(
        "resnet50",
        "ResNet-50 shape (25.6M), 224x224 images",
        _resnet50,
        _images((3, 224, 224)),
        large=True,
    ),
}


def get_example(name: str) -> ExampleModel:
    """The example called ``name``.

    Raises:
        KeyError: unknown name (the message lists the known ones).
    """
    try:
        return EXAMPLES[name]
    except KeyError:
        raise KeyError(f"unknown example {name!r}; expected one of {sorted(EXAMPLES)}") from None
