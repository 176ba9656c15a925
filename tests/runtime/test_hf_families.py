"""The transformer families people train today, cut at their default blocks, train exactly
(docs/runtime.md "Any model"): decoders with rotary position embeddings and grouped-query
attention (Llama, Mistral, Qwen2, Gemma, Phi, GPT-NeoX), a mixture of experts (Mixtral top-2
routing), encoder-decoders (T5, BART), encoder MLMs (BERT, RoBERTa), GPT-2 and Llama on padded
batches (a padding ``attention_mask``), and vision (ViT, ConvNeXt, ResNet).

Each architecture is built from a tiny config of its own class (float64, dropout 0.1, tied
weights where the model ties them, ``use_cache=False``, clipping on) and trained on 4 forked
gloo ranks under an uneven data-parallel plan, an uneven 4-stage pipeline whose first and last
stages hold the tied tensors, a hybrid, and a run with two plan changes: losses and final
weights equal ``--workers 1`` (one rank of the same engine) at ``rtol 1e-9, atol 1e-12``. With
dropout 0, the run with two plan changes (every plan kind) also equals a plain PyTorch loop over
the whole batch (no hetrain code). Gemma (RMSNorm) and ConvNeXt (channels-first LayerNorm)
compute in float32 inside whatever the dtype, so a micro-batch's partial sums are float32-rounded:
they are compared at ``rtol 1e-4, atol 1e-7``. ConvNeXt runs without stochastic depth (drawn with
``torch.rand``, which hetrain cannot make plan-invariant). One 4-rank launch and one 1-rank
launch per architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetrain.plan import plan_from_dict
from hetrain.runtime import OptimizerSpec, Worker
from hetrain.runtime.cutting import cut_module
from hetrain.runtime.testing import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.multiprocess

STEPS = 3
BATCH = 16
CLIP = 0.05
VOCAB = 48
SEQ = 8
DROPOUT = 0.1
SPEC = OptimizerSpec("adamw", lr=3e-3, weight_decay=0.01)


# ---- models: tiny configs of each family's own config class -------------------------------


def _decoder(model_cls: str, config_cls: str, dropout: float, **extra: Any) -> nn.Module:
    """A rotary decoder with grouped-query attention (4 query heads, 2 key/value heads)."""
    cfg = getattr(transformers, config_cls)(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=dropout,
        use_cache=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    return getattr(transformers, model_cls)(cfg)


def _llama(d: float) -> nn.Module:
    return _decoder("LlamaForCausalLM", "LlamaConfig", d)


def _mistral(d: float) -> nn.Module:
    return _decoder("MistralForCausalLM", "MistralConfig", d, sliding_window=6)


def _qwen2(d: float) -> nn.Module:
    return _decoder("Qwen2ForCausalLM", "Qwen2Config", d, tie_word_embeddings=True)


def _gemma(d: float) -> nn.Module:  # ties its head to the embedding
    return _decoder("GemmaForCausalLM", "GemmaConfig", d, head_dim=4)


def _phi(d: float) -> nn.Module:  # partial rotary, biases, parallel attention and MLP
    return _decoder("PhiForCausalLM", "PhiConfig", d, resid_pdrop=d, embd_pdrop=d)


def _mixtral(d: float) -> nn.Module:  # 4 experts, top-2 routing (values decide the experts)
    return _decoder(
        "MixtralForCausalLM",
        "MixtralConfig",
        d,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation="eager",  # torch's grouped mm has no float64 kernel on CPU
    )


def _neox(d: float) -> nn.Module:
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=32,
        hidden_dropout=d,
        attention_dropout=d,
        use_cache=False,
    )
    return transformers.GPTNeoXForCausalLM(cfg)


def _gpt2(d: float) -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=3,
        n_head=2,
        resid_pdrop=d,
        embd_pdrop=d,
        attn_pdrop=d,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _t5(d: float) -> nn.Module:  # encoder output feeds every decoder block; ties its head
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=d,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=2,
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _bart(d: float) -> nn.Module:
    cfg = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        dropout=d,
        attention_dropout=d,
        activation_dropout=d,
        use_cache=False,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return transformers.BartForConditionalGeneration(cfg)


def _bert(d: float) -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=d,
        attention_probs_dropout_prob=d,
        pad_token_id=0,
    )
    return transformers.BertForMaskedLM(cfg)


def _roberta(d: float) -> nn.Module:  # position ids from the input ids (padding index 1)
    cfg = transformers.RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQ + 2,
        hidden_dropout_prob=d,
        attention_probs_dropout_prob=d,
        pad_token_id=1,
    )
    return transformers.RobertaForMaskedLM(cfg)


def _vit(d: float) -> nn.Module:
    cfg = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=5,
        hidden_dropout_prob=d,
        attention_probs_dropout_prob=d,
    )
    return transformers.ViTForImageClassification(cfg)


def _convnext(d: float) -> nn.Module:
    # no dropout: its stochastic depth draws with torch.rand, which hetrain cannot make
    # plan-invariant (it warns at start-up, docs/runtime.md "Randomness")
    cfg = transformers.ConvNextConfig(
        num_channels=1, num_stages=3, hidden_sizes=[8, 8, 16], depths=[1, 1, 2], num_labels=5
    )
    return transformers.ConvNextForImageClassification(cfg)


def _resnet(d: float) -> nn.Module:  # BatchNorm with running statistics (eval), no dropout
    cfg = transformers.ResNetConfig(
        num_channels=1,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 2],
        layer_type="bottleneck",
        num_labels=5,
    )
    return transformers.ResNetForImageClassification(cfg).eval()


# ---- data and losses ------------------------------------------------------------------------


def _tokens(padded: bool = False) -> Callable[[], tuple[Any, Any]]:
    """Next-token data; ``padded``: dict inputs with a padding ``attention_mask`` (left
    padding on a quarter of the samples, right padding on another quarter; padded targets
    -100)."""

    def data() -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(1)
        seq = torch.randint(3, VOCAB, (STEPS * BATCH, SEQ + 1), generator=g)
        ids, targets = seq[:, :-1], seq[:, 1:].clone()
        if not padded:
            return ids, targets
        mask = torch.ones_like(ids)
        lengths = torch.randint(3, SEQ + 1, (len(ids),), generator=g)
        for r, n in enumerate(lengths.tolist()):
            if r % 4 == 1:
                mask[r, : SEQ - n] = 0  # left padding
            elif r % 4 == 2:
                mask[r, n:] = 0  # right padding
        ids = torch.where(mask.bool(), ids, torch.zeros_like(ids))
        targets[mask == 0] = -100
        return {"input_ids": ids, "attention_mask": mask}, targets

    return data


def _seq2seq() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(2)
    src = torch.randint(3, VOCAB, (STEPS * BATCH, SEQ), generator=g)
    tgt = torch.randint(3, VOCAB, (STEPS * BATCH, 6), generator=g)
    return {"input_ids": src, "decoder_input_ids": tgt[:, :-1]}, tgt[:, 1:]


def _masked(pad_id: int) -> Callable[[], tuple[Any, Any]]:
    """Masked LM: 15-60 % of each sample's positions predicted (target -100 elsewhere)."""

    def data() -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(3, VOCAB, (STEPS * BATCH, SEQ), generator=g)
        rate = torch.rand(STEPS * BATCH, 1, generator=g) * 0.45 + 0.15
        picked = torch.rand(ids.shape, generator=g) < rate
        picked[:, 0] = True
        targets = torch.where(picked, ids, torch.full_like(ids, -100))
        inputs = torch.where(picked, torch.full_like(ids, VOCAB - 1), ids)
        inputs[::5, -2:] = pad_id  # some padding tokens
        return inputs, targets

    return data


def _images(size: int) -> Callable[[], tuple[Any, Any]]:
    def data() -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(4)
        x = torch.randn(STEPS * BATCH, 1, size, size, generator=g, dtype=torch.float64)
        return x, torch.randint(0, 5, (STEPS * BATCH,), generator=g)

    return data


def _token_loss(out: Any, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over the predicted tokens, and their count (docs/model.md §5)."""
    logits = out.logits
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
    )
    return total, (target != -100).sum()


def _class_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, target)


@dataclass(frozen=True)
class Family:
    build: Callable[[float], nn.Module]
    data: Callable[[], tuple[Any, Any]]
    loss: Callable[[Any, Any], Any]
    tied: tuple[str, str] | None = None  # two names of one tensor (embedding, head)
    #: computes in float32 inside whatever the dtype (Gemma's RMSNorm, ConvNeXt's channels-
    #: first LayerNorm): partial sums of a micro-batch are float32-rounded, so plans agree to
    #: float32 precision only (AdamW amplifies it), and are compared at rtol 1e-4, atol 1e-7
    float32_internal: bool = False


FAMILIES = {
    "llama-padded": Family(_llama, _tokens(padded=True), _token_loss),
    "mistral": Family(_mistral, _tokens(), _token_loss),
    "qwen2-tied": Family(
        _qwen2, _tokens(), _token_loss, ("model.embed_tokens.weight", "lm_head.weight")
    ),
    "gemma": Family(
        _gemma,
        _tokens(),
        _token_loss,
        ("model.embed_tokens.weight", "lm_head.weight"),
        float32_internal=True,
    ),
    "phi": Family(_phi, _tokens(), _token_loss),
    "gpt-neox": Family(_neox, _tokens(), _token_loss),
    "mixtral": Family(_mixtral, _tokens(), _token_loss),
    "t5": Family(_t5, _seq2seq, _token_loss, ("shared.weight", "lm_head.weight")),
    "bart": Family(_bart, _seq2seq, _token_loss, ("model.shared.weight", "lm_head.weight")),
    "bert": Family(
        _bert,
        _masked(0),
        _token_loss,
        ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"),
    ),
    "roberta": Family(
        _roberta,
        _masked(1),
        _token_loss,
        ("roberta.embeddings.word_embeddings.weight", "lm_head.decoder.weight"),
    ),
    "gpt2-padded": Family(
        _gpt2, _tokens(padded=True), _token_loss, ("transformer.wte.weight", "lm_head.weight")
    ),
    "vit": Family(_vit, _images(8), _class_loss),
    "convnext": Family(_convnext, _images(16), _class_loss, float32_internal=True),
    "resnet": Family(_resnet, _images(16), _class_loss),
}


# ---- plans ----------------------------------------------------------------------------------


def _g(devices: list[str], stages: list[list[int]], mb: int, batch: int) -> dict:
    return {"devices": devices, "stages": stages, "microbatch_size": mb, "batch": batch}


def _plans(layers: int) -> dict[str, list[dict]]:
    """4-rank plans over ``layers`` layers (prefix, one per block, suffix)."""
    last = layers
    dp = {
        "groups": [
            _g([f"w{i}"], [[0, last]], mb, b)
            for i, (b, mb) in enumerate(zip([7, 3, 2, 4], [3, 2, 2, 4], strict=True))
        ]
    }
    # uneven 4 stages: the first holds the prefix (embedding), the last the suffix (head)
    pipe = {"groups": [_g(["w2", "w0", "w3", "w1"], [[0, 1], [1, 2], [2, 4], [4, last]], 3, 16)]}
    hybrid = {
        "schedule": "gpipe",
        "groups": [
            _g(["w0", "w1"], [[0, 2], [2, last]], 4, 10),
            _g(["w3", "w2"], [[0, last - 1], [last - 1, last]], 3, 6),
        ],
    }
    return {
        "dp-uneven": [dp],
        "pipeline-4": [pipe],
        "hybrid": [hybrid],
        "two-changes": [dp, pipe, hybrid],
    }


def _batch(data: tuple[Any, Any], step: int) -> tuple[Any, Any]:
    rows = slice(step * BATCH, (step + 1) * BATCH)
    x, y = data
    x = {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]
    return x, y[rows]


def _example(x: Any) -> Any:
    """Two samples to record the forward on (the model is still float32 then)."""
    if isinstance(x, dict):
        return {k: v[:2] for k, v in x.items()}
    return x[:2].float() if x.is_floating_point() else x[:2]


def _train_all(rank: int, world: int, name: str, runs: list[tuple[float, list[dict]]]):
    """Every run of one family on this rank: ``(dropout, plans)`` with a plan change after
    each step but the last, as many as ``plans`` has. Returns per run the losses and (rank
    0) the final state dict."""
    fam = FAMILIES[name]
    data = fam.data()
    out = []
    for dropout, plans in runs:
        torch.manual_seed(0)
        model = fam.build(dropout)
        x0, _ = _batch(data, 0)
        chain = cut_module(model, _example(x0))
        worker = Worker(
            chain,
            plan_from_dict(plans[0]),
            f"w{rank}",
            fam.loss,
            SPEC,
            dtype=torch.float64,
            grad_clip_norm=CLIP,
            seed=7,
        )
        losses = []
        for t in range(STEPS):
            if 0 < t < len(plans):
                worker.apply_plan(plan_from_dict(plans[t]))
            losses.append(worker.step(*_batch(data, t), t).loss)
        state = worker.full_state_dict()
        out.append((losses, state if rank == 0 else None))
    return out


def _plain_loop(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Reference without hetrain code: the model with dropout 0 on the whole batch, torch's
    AdamW and ``clip_grad_norm_``; a ``(sum, count)`` loss is back-propagated as a sum and
    the gradients divided by the batch's count (dividing the loss first changes a padded
    Llama's gradients by 1e-7 of their largest element, which AdamW's ``eps`` turns into
    1e-8 weight differences)."""
    fam = FAMILIES[name]
    torch.manual_seed(0)
    model = fam.build(0.0).to(torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=SPEC.lr, weight_decay=SPEC.weight_decay, foreach=False)
    data = fam.data()
    losses = []
    for t in range(STEPS):
        x, y = _batch(data, t)
        opt.zero_grad(set_to_none=True)
        out = model(**x) if isinstance(x, dict) else model(x)
        value = fam.loss(out, y)
        if isinstance(value, tuple):
            value[0].backward()
            for p in params:
                if p.grad is not None:
                    p.grad /= value[1]
            loss = value[0] / value[1]
        else:
            loss = value
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _close(
    got: tuple[list[float], dict], ref: tuple[list[float], dict], what: str, loose: bool
) -> None:
    rtol, atol = (1e-4, 1e-7) if loose else (1e-9, 1e-12)
    torch.testing.assert_close(
        got[0], ref[0], rtol=rtol, atol=atol, msg=lambda m: f"{what}: losses: {m}"
    )
    assert set(got[1]) == set(ref[1]), what
    for key, value in ref[1].items():
        torch.testing.assert_close(
            got[1][key].to(value.dtype),
            value,
            rtol=rtol,
            atol=atol,
            msg=lambda m, key=key: f"{what}: {key}: {m}",
        )


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_like_one_process(tmp_path, name):
    fam = FAMILIES[name]
    torch.manual_seed(0)
    model = fam.build(DROPOUT)
    x0, _ = _batch(fam.data(), 0)
    layers = cut_module(model, _example(x0)).num_layers
    assert layers >= 5
    plans = _plans(layers)
    kinds = list(plans)
    runs = [(DROPOUT, plans[k]) for k in kinds] + [(0.0, plans["two-changes"])]
    results = run_ranks(_train_all, 4, tmp_path / "four", args=(name, runs), timeout_s=420)
    one = [{"groups": [_g(["w0"], [[0, layers]], BATCH, BATCH)]}]
    (ref,) = run_ranks(_train_all, 1, tmp_path / "one", args=(name, [(DROPOUT, one)]))[0]
    assert len(set(ref[0])) == STEPS  # it trains
    loose = fam.float32_internal
    for k, kind in enumerate(kinds):
        for rank in range(4):  # every rank reports the same losses
            _close((results[rank][k][0], {}), (ref[0], {}), f"{name} {kind} rank {rank}", loose)
        _close(results[0][k], ref, f"{name} {kind} vs --workers 1", loose)
        if fam.tied is not None:
            a, b = fam.tied
            assert torch.equal(results[0][k][1][a], results[0][k][1][b])
    plain = _plain_loop(name)
    _close(results[0][-1], plain, f"{name} two-changes, dropout 0, vs plain loop", loose)
