"""The example tasks of ``hetrain train --example NAME`` (:func:`example_task`), each a
:class:`~hetrain.runtime.data.Task` over the sample sources of :mod:`hetrain.runtime.data`:

- ``charlm``: :func:`hetrain.models.char_gpt` on the standard library's ``pydoc_data.topics``
  text (about 465k characters); a sample is a window of ``block_size + 1`` characters, input
  the first ``block_size``, target the last ``block_size``. The last 10% of the text is the
  validation split. Quality: mean validation cross-entropy (nats per character).
- ``digits``: :func:`hetrain.models.digits_cnn` on ``sklearn.datasets.load_digits`` (1797
  8x8 images, pixel values scaled to [0, 1]); a seeded 80/20 split. Quality: validation
  accuracy.
- ``gpt2``, ``bert``, ``resnet``: the Hugging Face models of :mod:`hetrain.models.hf` on the
  bytes of the same text (``gpt2``: next byte; ``bert``: 15 % masked bytes) or on the digits
  upsampled to 32x32 (``resnet``).

Importing this module imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hetrain.errors import InputError
from hetrain.runtime.data import CharWindows, Task, TensorSource, _mean_loss, cast_inputs

# ---- charlm ----------------------------------------------------------------------------------

CHARLM_BLOCK_SIZE = 64  # = hetrain.models.charlm.CHARLM.block_size
_CHAR_REPLACE = {"’": "'", "‘": "'", "“": '"', "”": '"', "…": ".", "—": "-", "–": "-"}


LM_DEFAULTS: dict[str, Any] = {
    "steps": 300,
    "batch": 32,
    "lr": 3e-3,
    "optimizer": "adamw",
    "microbatch_size": 8,
    "warmup_steps": 20,
    "grad_clip_norm": 1.0,
    "weight_decay": 0.01,
}
"""Training defaults of the text examples (``charlm``, ``gpt2``; ``bert`` trains 200 steps at
learning rate 2e-3)."""


def charlm_vocab() -> str:
    """The 96 symbols: newline then printable ASCII 32..126 (index = token id)."""
    return "\n" + "".join(chr(c) for c in range(32, 127))


def charlm_text() -> str:
    """The training text: every topic of ``pydoc_data.topics`` in sorted key order."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


def encode_chars(text: str) -> torch.Tensor:
    """Token ids ``(len(text),)`` int64 over :func:`charlm_vocab`; typographic quotes and
    dashes become their ASCII forms, other characters ``?``."""
    vocab = {c: i for i, c in enumerate(charlm_vocab())}
    unknown = vocab["?"]
    ids = [vocab.get(_CHAR_REPLACE.get(c, c), unknown) for c in text]
    return torch.tensor(ids, dtype=torch.long)


def charlm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all characters: logits ``(N, T, V)``, targets ``(N, T)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def charlm_task(val_windows: int = 256, text: str | None = None) -> Task:
    """The ``charlm`` example: a 4-block, 64-wide character transformer (context 64).

    Defaults (chosen so that ``hetrain train --example charlm`` runs in a few minutes on two
    CPU cores): 300 steps of global batch 32, AdamW lr 3e-3 with 20 warm-up steps and cosine
    decay to 10%, clipping at global norm 1.0. Stated quality: validation loss <= 2.2 nats per
    character (a unigram model scores about 3.1, uniform guessing ln 96 = 4.56). ``text``
    replaces the default text (``--data FILE``).
    """
    from hetrain.models import char_gpt
    from hetrain.models.charlm import CHARLM

    tokens = encode_chars(charlm_text() if text is None else text)
    if len(tokens) < 20 * (CHARLM_BLOCK_SIZE + 1):
        raise InputError(
            "--data", "", f"expected at least {20 * (CHARLM_BLOCK_SIZE + 1)} characters"
        )
    split = int(0.9 * len(tokens))
    cfg = CHARLM  # the one source of the example's sizes (hetrain profile uses it too)
    train = CharWindows(tokens[:split], cfg.block_size)
    val_all = CharWindows(tokens[split:], cfg.block_size)
    # fixed, evenly spaced validation windows (deterministic, independent of the seed)
    stride = max(len(val_all) // val_windows, 1)
    starts = torch.arange(0, len(val_all), stride)[:val_windows]
    vx, vy = val_all.batch(starts.numpy())
    val = TensorSource(vx, vy)

    def evaluate(model: nn.Module, dtype: torch.dtype) -> dict[str, float]:
        loss = _mean_loss(model, charlm_loss, val, 64, len(val), dtype)
        return {"val_loss": loss, "val_bits_per_char": loss / math.log(2)}

    return Task(
        name="charlm",
        build_model=lambda: char_gpt(cfg),
        train=train,
        val=val,
        loss_fn=charlm_loss,
        evaluate=evaluate,
        quality_metric="val_loss",
        quality_target=2.2,
        higher_is_better=False,
        defaults=dict(LM_DEFAULTS),
    )


# ---- digits ---------------------------------------------------------------------------------


IMAGE_DEFAULTS: dict[str, Any] = {
    "steps": 150,
    "batch": 64,
    "lr": 2e-3,
    "optimizer": "adamw",
    "microbatch_size": 16,
    "warmup_steps": 10,
    "grad_clip_norm": None,
    "weight_decay": 0.0,
}
"""Training defaults of the image examples (``digits``, ``resnet``)."""


def digits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy: logits ``(N, 10)``, targets ``(N,)`` int64."""
    return F.cross_entropy(logits, targets)


def digits_task(seed: int = 0) -> Task:
    """The ``digits`` example: :func:`hetrain.models.digits_cnn` on scikit-learn's digits.

    Defaults: 150 steps of global batch 64, AdamW lr 2e-3, 10 warm-up steps, cosine decay.
    Stated quality: validation accuracy >= 0.95 on the 20% split (360 images).
    """
    from sklearn.datasets import load_digits

    from hetrain.models import digits_cnn

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.from_numpy(np.random.default_rng(12345).permutation(len(x)))
    n_val = len(x) // 5
    val = TensorSource(x[perm[:n_val]], y[perm[:n_val]])
    train = TensorSource(x[perm[n_val:]], y[perm[n_val:]])

    def evaluate(model: nn.Module, dtype: torch.dtype) -> dict[str, float]:
        with torch.no_grad():
            out = model(cast_inputs(val.inputs, dtype))
            acc = float((out.argmax(-1) == val.targets).float().mean())
            loss = float(digits_loss(out, val.targets))
        return {"val_accuracy": acc, "val_loss": loss}

    return Task(
        name="digits",
        build_model=digits_cnn,
        train=train,
        val=val,
        loss_fn=digits_loss,
        evaluate=evaluate,
        quality_metric="val_accuracy",
        quality_target=0.95,
        higher_is_better=True,
        defaults=dict(IMAGE_DEFAULTS),
    )


# ---- Hugging Face GPT-2, BERT, ResNet (models/hf.py) ----------------------------------------

HF_CONTEXT = 64


def pydoc_bytes() -> torch.Tensor:
    """The ``pydoc_data.topics`` text as UTF-8 bytes ``(n,)`` int64 (vocabulary 256)."""
    data = charlm_text().encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def model_logits(out: Any) -> torch.Tensor:
    """The logits of a model's output (a Hugging Face ``ModelOutput`` or a tensor)."""
    return out.logits if hasattr(out, "logits") else out


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits ``(N, T, V)`` (or an HF output), targets
    ``(N, T)``."""
    logits = model_logits(out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def masked_lm_loss(out: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-LM loss as ``(sum, count)`` over the masked tokens (targets ``-100`` elsewhere):
    the engine divides by the count of the whole global batch (docs/model.md §5)."""
    logits = model_logits(out)
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )
    return total, (targets != -100).sum()


@dataclass(frozen=True)
class MaskedWindows:
    """BERT masked-LM samples over byte windows: sample ``i`` is ``tokens[i : i+T]`` with 15 %
    of its positions (at least one) replaced by [MASK]; targets are the original bytes there
    and ``-100`` elsewhere. The masked positions of sample ``i`` depend only on ``(seed, i)``
    (``numpy.random.default_rng([seed, i])``), not on the plan."""

    tokens: torch.Tensor
    block_size: int
    mask_id: int
    seed: int = 0
    rate: float = 0.15

    def __len__(self) -> int:
        return max(len(self.tokens) - self.block_size, 0)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)[:, None] + torch.arange(self.block_size)
        win = self.tokens[idx]
        picked = np.zeros(win.shape, dtype=bool)
        for row, i in enumerate(np.asarray(indices)):
            rng = np.random.default_rng([self.seed, int(i)])
            p = rng.random(self.block_size) < self.rate
            p[rng.integers(self.block_size)] = True
            picked[row] = p
        mask = torch.from_numpy(picked)
        targets = torch.where(mask, win, torch.full_like(win, -100))
        inputs = torch.where(mask, torch.full_like(win, self.mask_id), win)
        return inputs, targets


def _byte_split(val_windows: int, make, block: int):
    tokens = pydoc_bytes()
    split = int(0.9 * len(tokens))
    train = make(tokens[:split])
    val_all = make(tokens[split:])
    stride = max(len(val_all) // val_windows, 1)
    starts = np.arange(0, len(val_all), stride)[:val_windows]
    vx, vy = val_all.batch(starts)
    return train, TensorSource(vx, vy)


def gpt2_task(size: str = "tiny") -> Task:
    """``--example gpt2``: Hugging Face ``GPT2LMHeadModel`` (:func:`hetrain.models.hf.gpt2_model`,
    head tied to the embedding, dropout 0.1, ``use_cache=False``) on the bytes of
    ``pydoc_data.topics`` (context 64). Defaults (tiny): 300 steps of global batch 32, AdamW lr
    3e-3, 20 warm-up steps, cosine decay, clipping at 1.0. Stated quality: validation loss <=
    2.3 nats per byte (unigram bytes score about 3.2, uniform ln 256 = 5.5)."""
    from hetrain.models.hf import gpt2_model

    train, val = _byte_split(256, lambda t: CharWindows(t, HF_CONTEXT), HF_CONTEXT)

    def evaluate(model: nn.Module, dtype: torch.dtype) -> dict[str, float]:
        loss = _mean_loss(model, lm_loss, val, 64, len(val), dtype)
        return {"val_loss": loss, "val_bits_per_byte": loss / math.log(2)}

    return Task(
        name="gpt2",
        build_model=lambda: gpt2_model(size, 0.1, HF_CONTEXT),
        train=train,
        val=val,
        loss_fn=lm_loss,
        evaluate=evaluate,
        quality_metric="val_loss",
        quality_target=2.3 if size == "tiny" else None,
        defaults=dict(LM_DEFAULTS),
    )


def bert_task(size: str = "tiny") -> Task:
    """``--example bert``: Hugging Face ``BertForMaskedLM`` (decoder tied to the word
    embedding, dropout 0.1) on byte windows of ``pydoc_data.topics`` with 15 % masking; the
    loss is a ``(sum, count)`` over the masked bytes. Quality: masked-byte validation loss."""
    from hetrain.models.hf import MASK_ID, bert_model

    train, val = _byte_split(256, lambda t: MaskedWindows(t, HF_CONTEXT, MASK_ID), HF_CONTEXT)

    def evaluate(model: nn.Module, dtype: torch.dtype) -> dict[str, float]:
        total = count = 0.0
        with torch.no_grad():
            for start in range(0, len(val), 64):
                x, y = val.batch(np.arange(start, min(start + 64, len(val))))
                s, c = masked_lm_loss(model(x), y)
                total, count = total + float(s), count + float(c)
        return {"val_loss": total / max(count, 1.0)}

    return Task(
        name="bert",
        build_model=lambda: bert_model(size, 0.1, HF_CONTEXT),
        train=train,
        val=val,
        loss_fn=masked_lm_loss,
        evaluate=evaluate,
        quality_metric="val_loss",
        defaults={**LM_DEFAULTS, "steps": 200, "lr": 2e-3},
    )


def resnet_task(size: str = "tiny") -> Task:
    """``--example resnet``: Hugging Face ``ResNetForImageClassification`` (bottleneck blocks,
    BatchNorm) on scikit-learn's digits upsampled to 32x32 (bilinear), seeded 80/20 split.
    Quality: validation accuracy. BatchNorm: give ``--norm-block G`` for plan-independent
    statistics (otherwise per micro-batch)."""
    from sklearn.datasets import load_digits

    from hetrain.models.hf import resnet_model

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.from_numpy(np.random.default_rng(12345).permutation(len(x)))
    n_val = len(x) // 5
    val = TensorSource(x[perm[:n_val]], y[perm[:n_val]])
    train = TensorSource(x[perm[n_val:]], y[perm[n_val:]])

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model_logits(out), targets)

    def evaluate(model: nn.Module, dtype: torch.dtype) -> dict[str, float]:
        with torch.no_grad():
            out = model_logits(model(cast_inputs(val.inputs, dtype)))
            acc = float((out.argmax(-1) == val.targets).float().mean())
        return {"val_accuracy": acc, "val_loss": float(F.cross_entropy(out, val.targets))}

    return Task(
        name="resnet",
        build_model=lambda: resnet_model(size),
        train=train,
        val=val,
        loss_fn=loss,
        evaluate=evaluate,
        quality_metric="val_accuracy",
        higher_is_better=True,
        defaults=dict(IMAGE_DEFAULTS),
    )


EXAMPLES: dict[str, Callable[..., Task]] = {
    "charlm": charlm_task,
    "digits": digits_task,
    "gpt2": gpt2_task,
    "bert": bert_task,
    "resnet": resnet_task,
}
HF_EXAMPLES = ("gpt2", "bert", "resnet")


def example_task(name: str, size: str = "tiny") -> Task:
    """The example task ``name`` (``charlm``, ``digits``, or the Hugging Face ``gpt2``,
    ``bert``, ``resnet`` of ``size`` tiny, small or base).

    Raises:
        InputError: unknown name or size.
    """
    if name not in EXAMPLES:
        raise InputError("--example", "", f"expected one of {', '.join(EXAMPLES)}, got {name!r}")
    if name in HF_EXAMPLES:
        from hetrain.models.hf import _size

        return EXAMPLES[name](_size(size))
    return EXAMPLES[name]()
