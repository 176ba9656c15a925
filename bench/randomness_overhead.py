"""Cost of plan-invariant randomness and ghost BatchNorm per micro-batch forward+backward.

Interleaved timing (median of rounds, this thread's CPU time: ``time.thread_time``, far less
sensitive than the wall clock to other processes on a shared machine) of one training
forward+backward, with and without the engine's per-micro-batch contexts
(``InvariantRandomness.forward`` + ``NormBlocks.forward``):
- the char-GPT without dropout (the contexts only check the generator state);
- Hugging Face GPT-2 tiny with dropout 0.1 (mode on: hashed masks; SDPA with dropout written
  out in torch ops, where plain torch on CPU runs ATen's math kernel with ``bernoulli_``
  masks) against torch's own (plan-dependent) dropout, at B=16, T=32 and at the ``gpt2``
  example's B=32, T=64; Llama tiny (``models/hf.py``: rotary, grouped-query attention,
  attention dropout 0.1 only) at B=32, T=64;
- a small ResNet-style Conv+BatchNorm chain, ghost BN (G=4) against torch's BatchNorm.

Run: ``.venv/bin/python bench/randomness_overhead.py`` (writes nothing; results are copied to
``bench/results/randomness_overhead.txt``).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from hetrain.models import CharGPTConfig, char_gpt
from hetrain.models.hf import llama_model
from hetrain.runtime.norm import NormBlocks
from hetrain.runtime.randomness import InvariantRandomness


def _time(fn, rounds: int = 15, reps: int = 5) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(reps):
            fn()
        out.append((time.thread_time() - t0) / reps)
    return statistics.median(out)


def _pair(name: str, model: nn.Module, x: torch.Tensor, loss, norm_block=None) -> None:
    rng = InvariantRandomness(model, seed=0)
    norm = NormBlocks(model, norm_block)
    rows = torch.arange(x.shape[0])

    def plain():
        loss(model(x)).backward()

    def hooked():
        with rng.forward(step=0, sample_index=rows), norm.forward():
            y = model(x)
        loss(y).backward()

    for f in (plain, hooked):
        f()
    a, b = [], []
    for _ in range(3):  # interleave against drifting machine load
        a.append(_time(plain))
        b.append(_time(hooked))
    ta, tb = min(a), min(b)
    print(
        f"{name:44s} plain {ta * 1e3:8.2f} ms  hetrain {tb * 1e3:8.2f} ms  ratio {tb / ta:5.2f}"
        f"  (mode {'on' if rng.is_active() else 'off'})"
    )


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gpt = char_gpt(CharGPTConfig(vocab_size=64, block_size=32, n_layer=2, n_embd=64, n_head=4))
    tokens = torch.randint(0, 64, (16, 32))
    _pair("char-GPT, no dropout (B=16, T=32)", gpt, tokens, lambda y: y.float().mean())

    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, vocab_size=256, n_positions=64, use_cache=False
    )
    cfg._attn_implementation = "sdpa"
    hf = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 256, (16, 32))
    _pair("HF GPT-2 tiny, dropout 0.1 (B=16, T=32)", hf, ids, lambda y: y.logits.mean())
    ids = torch.randint(0, 256, (32, 64))
    _pair("HF GPT-2 tiny, dropout 0.1 (B=32, T=64)", hf, ids, lambda y: y.logits.mean())
    llama = llama_model("tiny", 0.1, 64).train()
    _pair("HF Llama tiny, dropout 0.1 (B=32, T=64)", llama, ids, lambda y: y.logits.mean())

    conv = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    images = torch.randn(16, 3, 16, 16)
    _pair("Conv+BatchNorm2d, ghost G=4 (B=16, 16x16)", conv, images, lambda y: y.mean(), 4)


if __name__ == "__main__":
    main()
