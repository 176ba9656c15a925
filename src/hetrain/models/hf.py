"""The paper's three workloads from their standard definitions (Hugging Face ``transformers``):
``GPT2LMHeadModel``, ``BertForMaskedLM`` and ``ResNetForImageClassification``, built from a
config with random weights (no download), with their tied weights, dropout and BatchNorm as in
the originals.

Sizes: ``tiny`` trains on a laptop CPU in minutes; ``small`` is a few times larger; ``base`` is
the published shape (GPT-2 small: 12 layers, 768 wide, 12 heads, context 1024, vocabulary
50257; BERT-base: 12 layers, 768 wide, sequence 512, vocabulary 30522; ResNet-50: bottleneck
depths 3-4-6-3, widths 256-2048, 224x224 RGB images, 1000 classes). The ``tiny``/``small``
language models read bytes (vocabulary 256, BERT adds a [MASK] id 256).
"""

from __future__ import annotations

from typing import Any

from torch import nn

SIZES = ("tiny", "small", "base")
MASK_ID = 256  # BERT's [MASK] for byte inputs
BYTE_VOCAB = 256


def _size(size: str) -> str:
    if size not in SIZES:
        from hetrain.errors import InputError

        raise InputError("--size", "", f"expected tiny, small or base, got {size!r}")
    return size


def gpt2_config(size: str = "tiny", dropout: float = 0.1, context: int = 64) -> Any:
    """``GPT2Config`` of ``size`` (``use_cache=False``: no key/value cache in training)."""
    from transformers import GPT2Config

    shape = {
        "tiny": {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": BYTE_VOCAB},
        "small": {"n_layer": 6, "n_embd": 192, "n_head": 6, "vocab_size": BYTE_VOCAB},
        "base": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257},
    }[_size(size)]
    return GPT2Config(
        **shape,
        n_positions=1024 if size == "base" else context,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )


def gpt2_model(size: str = "tiny", dropout: float = 0.1, context: int = 64) -> nn.Module:
    """``GPT2LMHeadModel`` (head tied to the token embedding) with random weights."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(gpt2_config(size, dropout, context))


def bert_config(size: str = "tiny", dropout: float = 0.1, context: int = 64) -> Any:
    from transformers import BertConfig

    shape = {
        "tiny": {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4},
        "small": {"num_hidden_layers": 6, "hidden_size": 192, "num_attention_heads": 6},
        "base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12},
    }[_size(size)]
    return BertConfig(
        **shape,
        vocab_size=30522 if size == "base" else BYTE_VOCAB + 1,
        intermediate_size=4 * shape["hidden_size"],
        max_position_embeddings=512 if size == "base" else context,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=0,
        tie_word_embeddings=True,
    )


def bert_model(size: str = "tiny", dropout: float = 0.1, context: int = 64) -> nn.Module:
    """``BertForMaskedLM`` (decoder tied to the word embedding) with random weights."""
    from transformers import BertForMaskedLM

    return BertForMaskedLM(bert_config(size, dropout, context))


def resnet_config(size: str = "tiny") -> Any:
    from transformers import ResNetConfig

    if _size(size) == "base":  # ResNet-50
        return ResNetConfig(
            num_channels=3,
            embedding_size=64,
            hidden_sizes=[256, 512, 1024, 2048],
            depths=[3, 4, 6, 3],
            layer_type="bottleneck",
            num_labels=1000,
        )
    width = 16 if size == "tiny" else 32
    return ResNetConfig(
        num_channels=1,
        embedding_size=width,
        hidden_sizes=[2 * width, 4 * width],
        depths=[2, 2] if size == "tiny" else [3, 3],
        layer_type="bottleneck",
        num_labels=10,
    )


def resnet_model(size: str = "tiny") -> nn.Module:
    """``ResNetForImageClassification`` (BatchNorm in every block) with random weights."""
    from transformers import ResNetForImageClassification

    return ResNetForImageClassification(resnet_config(size))


def llama_config(size: str = "tiny", dropout: float = 0.1, context: int = 64) -> Any:
    """``LlamaConfig`` of ``size``: rotary position embeddings, grouped-query attention (half
    as many key/value heads as query heads), RMSNorm, SwiGLU; ``tiny``/``small`` read bytes
    (vocabulary 256), ``base`` is Llama-2 7B's shape (32 layers, 4096 wide, 32 heads,
    feed-forward 11008, vocabulary 32000, context 4096). ``use_cache=False``; the head is not
    tied (as Llama's)."""
    from transformers import LlamaConfig

    shape = {
        "tiny": {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4},
        "small": {"num_hidden_layers": 6, "hidden_size": 192, "num_attention_heads": 6},
        "base": {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32},
    }[_size(size)]
    heads = shape["num_attention_heads"]
    return LlamaConfig(
        **shape,
        num_key_value_heads=heads if size == "base" else heads // 2,
        intermediate_size=11008 if size == "base" else 4 * shape["hidden_size"],
        vocab_size=32000 if size == "base" else BYTE_VOCAB,
        max_position_embeddings=4096 if size == "base" else context,
        attention_dropout=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )


def llama_model(size: str = "tiny", dropout: float = 0.1, context: int = 64) -> nn.Module:
    """``LlamaForCausalLM`` with random weights."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(size, dropout, context))
