"""Any model trains exactly (docs/model.md §5): Hugging Face GPT-2 and BERT (tied weights), HF
ResNet,
a chain with a frozen layer and tuple activations, and a masked-token ``(sum, count)`` loss, on 4
forked gloo ranks under an uneven data-parallel plan, an uneven 4-stage pipeline whose first and
last stages hold the tied tensor, a hybrid, and a run with two mid-run plan changes: losses and
final weights equal a plain PyTorch loop on the whole batch (float64, clipping on).

With dropout on (HF GPT-2 and BERT, ``dropout=0.1``) and with BatchNorm in training mode (HF
ResNet, norm block 2), the reference is ``--workers 1`` (one rank of the same engine): random
draws and ghost batch statistics are plan-invariant (randomness.py, norm.py), so every plan
must give the one-rank result.
"""

from __future__ import annotations

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

STEPS = 5
BATCH = 16
CLIP = 0.05
VOCAB = 32
SEQ = 8
NORM_BLOCK = 2


def _decay(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


SPEC = OptimizerSpec("adamw", lr=3e-3, weight_decay=0.01, lr_schedule=_decay)


# ---- models ---------------------------------------------------------------------------------


def _gpt2(DROPOUT: float = 0.0) -> nn.Module:  # noqa: N803
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=16,
        n_layer=4,
        n_head=2,
        resid_pdrop=DROPOUT,
        embd_pdrop=DROPOUT,
        attn_pdrop=DROPOUT,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _bert(DROPOUT: float = 0.0) -> nn.Module:  # noqa: N803
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=DROPOUT,
        attention_probs_dropout_prob=DROPOUT,
        pad_token_id=0,
    )
    return transformers.BertForMaskedLM(cfg)


def _resnet(train_bn: bool = False) -> nn.Module:
    cfg = transformers.ResNetConfig(
        num_channels=1,
        embedding_size=8,
        hidden_sizes=[16, 16],
        depths=[2, 2],
        layer_type="bottleneck",
        num_labels=10,
    )
    model = transformers.ResNetForImageClassification(cfg)
    return model if train_bn else model.eval()  # eval: BN uses running statistics


class _Embed(nn.Module):
    """ids ``(N, T)`` -> ``(hidden (N, T, C), mask (N, T) bool)``: a tuple activation."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 12)

    def forward(self, ids: torch.Tensor):
        return self.emb(ids), ids != 0


class _Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, pair):
        h, mask = pair
        return h + torch.tanh(self.lin(h)) * mask[..., None], mask


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(12, VOCAB)

    def forward(self, pair):
        return self.out(pair[0])


def _frozen_chain() -> nn.Module:
    model = nn.Sequential(_Embed(), _Mix(), _Mix(), _Mix(), _Head())
    for p in model[2].parameters():  # fine-tuning: one frozen layer
        p.requires_grad_(False)
    return model


# ---- data and losses ------------------------------------------------------------------------


def _tokens():
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _masked_tokens():
    """BERT-style masked LM: 15-60 % of the positions of each sample are predicted (a different
    count per sample), the others have target -100."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (STEPS * BATCH, SEQ), generator=g)
    rate = torch.rand(STEPS * BATCH, 1, generator=g) * 0.45 + 0.15
    picked = torch.rand(ids.shape, generator=g) < rate
    picked[:, 0] = True
    targets = torch.where(picked, ids, torch.full_like(ids, -100))
    inputs = torch.where(picked, torch.full_like(ids, 1), ids)
    return inputs, targets


def _images():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS * BATCH, 1, 16, 16, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 10, (STEPS * BATCH,), generator=g)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _lm_loss(out, target):
    logits = _logits(out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _masked_loss(out, target):
    logits = _logits(out)
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
    )
    return total, (target != -100).sum()


def _class_loss(out, target):
    return F.cross_entropy(_logits(out), target)


# name -> (builder, data, loss, layers)
MODELS = {
    "gpt2": (_gpt2, _tokens, _lm_loss, 6),
    "bert-masked": (_bert, _masked_tokens, _masked_loss, 5),
    "resnet": (_resnet, _images, _class_loss, 6),
    "frozen-tuple": (_frozen_chain, _tokens, _lm_loss, 5),
    "gpt2-dropout": (lambda: _gpt2(0.1), _tokens, _lm_loss, 6),
    "bert-masked-dropout": (lambda: _bert(0.1), _masked_tokens, _masked_loss, 5),
    "resnet-batchnorm": (lambda: _resnet(True), _images, _class_loss, 6),
}
#: models whose reference is one rank of the engine (random draws, ghost BatchNorm)
ONE_RANK_REFERENCE = {"gpt2-dropout", "bert-masked-dropout", "resnet-batchnorm"}


def _batch(data, step):
    x, y = data
    rows = slice(step * BATCH, (step + 1) * BATCH)
    return x[rows], y[rows]


def _plain_loop(name: str):
    """Reference without hetrain code: one model, the whole batch, torch's AdamW and
    ``clip_grad_norm_``; a ``(sum, count)`` loss is divided by the batch's count."""
    build, data_fn, loss_fn, _ = MODELS[name]
    torch.manual_seed(0)
    model = build().to(torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=SPEC.lr, weight_decay=SPEC.weight_decay, foreach=False)
    data = data_fn()
    losses = []
    for t in range(STEPS):
        x, y = _batch(data, t)
        opt.zero_grad(set_to_none=True)
        value = loss_fn(model(x), y)
        loss = value[0] / value[1] if isinstance(value, tuple) else value
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        for group in opt.param_groups:
            group["lr"] = SPEC.lr * _decay(t)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _train(rank, world, name, plans, change_at):
    norm_block = NORM_BLOCK if name == "resnet-batchnorm" else None
    build, data_fn, loss_fn, _ = MODELS[name]
    torch.manual_seed(0)
    model = build()
    data = data_fn()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    chain = cut_module(
        model, data[0][:2].to(torch.float32 if data[0].is_floating_point() else data[0].dtype)
    )
    worker = Worker(
        chain,
        plan_from_dict(plans[0]),
        f"w{rank}",
        loss_fn,
        SPEC,
        dtype=torch.float64,
        grad_clip_norm=CLIP,
        seed=7,
        norm_block=norm_block,
    )
    losses = []
    moved = 0
    for t in range(STEPS):
        if t in change_at:
            moved += worker.apply_plan(plan_from_dict(plans[change_at.index(t) + 1])).transfers
        x, y = _batch(data, t)
        losses.append(worker.step(x, y, t).loss)
    return losses, worker.full_state_dict(), moved, initial if rank == 0 else None


def _g(devices, stages, mb, batch):
    return {"devices": devices, "stages": stages, "microbatch_size": mb, "batch": batch}


def _plans(layers: int, even: bool = False) -> dict[str, list[dict]]:
    """Plans on 4 ranks; ``even``: every share and micro-batch size a multiple of 2 (the
    norm block)."""
    last = layers
    shares, mbs = ([6, 2, 2, 6], [2, 2, 2, 4]) if even else ([7, 3, 2, 4], [3, 2, 2, 4])
    dp = {
        "groups": [
            _g([f"w{i}"], [[0, last]], mb, b)
            for i, (b, mb) in enumerate(zip(shares, mbs, strict=True))
        ]
    }
    # uneven 4 stages: the first (prefix, tied embedding) and the last (suffix, tied head)
    pipe = {
        "groups": [
            _g(["w2", "w0", "w3", "w1"], [[0, 1], [1, 2], [2, 4], [4, last]], 2 if even else 3, 16)
        ]
    }
    hybrid = {
        "schedule": "gpipe",
        "groups": [
            _g(["w0", "w1"], [[0, 2], [2, last]], 4, 10),
            _g(["w3", "w2"], [[0, last - 1], [last - 1, last]], 2 if even else 3, 6),
        ],
    }
    return {
        "dp-uneven": [dp],
        "pipeline-4": [pipe],
        "hybrid": [hybrid],
        "two-changes": [dp, pipe, hybrid],
    }


ALL_PLANS = ("dp-uneven", "pipeline-4", "hybrid", "two-changes")
CASES = [
    *[("gpt2", p) for p in ALL_PLANS],
    *[("bert-masked", p) for p in ALL_PLANS],
    *[("gpt2-dropout", p) for p in ALL_PLANS],
    *[("bert-masked-dropout", p) for p in ("pipeline-4", "two-changes")],
    *[("resnet-batchnorm", p) for p in ALL_PLANS],
    *[("resnet", p) for p in ("pipeline-4",)],
    *[("frozen-tuple", p) for p in ("pipeline-4", "two-changes")],
]


@pytest.mark.parametrize(("model", "plan"), CASES)
def test_any_model_trains_like_one_process(tmp_path, model, plan):
    layers = MODELS[model][3]
    plans = _plans(layers, even=model == "resnet-batchnorm")[plan]
    change_at = [1, 3][: len(plans) - 1]
    results = run_ranks(_train, 4, tmp_path, args=(model, plans, change_at), timeout_s=240)
    if model in ONE_RANK_REFERENCE:
        one = {"groups": [_g(["w0"], [[0, layers]], BATCH, BATCH)]}
        ref = run_ranks(_train, 1, tmp_path / "one", args=(model, [one], []), timeout_s=240)
        ref_losses, ref_state = ref[0][0], ref[0][1]
        assert len(set(ref_losses)) == STEPS  # it trains
    else:
        ref_losses, ref_state = _plain_loop(model)
    for losses, _, _, _ in results:
        torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=1e-12)
    state = results[0][1]
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-12, msg=key)
    if change_at:
        assert results[0][2] > 0 or any(r[2] > 0 for r in results)
    if model == "frozen-tuple":
        initial = results[0][3]
        for key in ("2.lin.weight", "2.lin.bias"):
            assert torch.equal(state[key], initial[key].to(torch.float64))
        assert not torch.equal(state["1.lin.weight"], initial["1.lin.weight"].to(torch.float64))


def test_tied_weights_stay_tied_and_one_tensor_in_the_export(tmp_path):
    """The GPT-2 head and embedding are one tensor in the export (both keys), equal after
    training under the 4-stage pipeline where they live on two ranks."""
    plans = _plans(6)["pipeline-4"]
    results = run_ranks(_train, 4, tmp_path, args=("gpt2", plans, []), timeout_s=240)
    state = results[0][1]
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


def _save_then_resume(rank, world, plans):
    """3 steps under ``plans[0]``, per-rank ``layer_state_dict`` (each tensor once, the tied
    one under ``shared.``), then fresh weights under ``plans[1]`` load the merged dict and run
    2 more steps."""
    _, data_fn, loss_fn, _ = MODELS["gpt2"]
    data = data_fn()

    def make(plan):
        torch.manual_seed(0 if plan is plans[0] else 5)  # resumed from other initial weights
        model = _gpt2()
        chain = cut_module(model, data[0][:2])
        return Worker(
            chain,
            plan_from_dict(plan),
            f"w{rank}",
            loss_fn,
            SPEC,
            dtype=torch.float64,
            grad_clip_norm=CLIP,
        )

    worker = make(plans[0])
    losses = [worker.step(*_batch(data, t), t).loss for t in range(3)]
    mine = {k: v.clone() for k, v in worker.layer_state_dict().items()}
    parts = [None] * world
    torch.distributed.all_gather_object(parts, mine)
    merged = {k: v for part in parts for k, v in part.items()}
    worker = make(plans[1])
    worker.load_layer_state_dict(merged)
    losses += [worker.step(*_batch(data, t), t).loss for t in range(3, STEPS)]
    return losses, worker.full_state_dict(), sorted(mine)


def test_checkpoint_holds_the_tied_tensor_once_and_resumes_exactly(tmp_path):
    plans = _plans(6)
    results = run_ranks(
        _save_then_resume, 4, tmp_path, args=([plans["pipeline-4"][0], plans["hybrid"][0]],)
    )
    ref_losses, ref_state = _plain_loop("gpt2")
    keys = [k for r in results for k in r[2]]
    assert keys.count("shared.transformer.wte.weight") == 1  # saved once across the world
    assert "optim.shared.transformer.wte.weight.exp_avg" in keys
    for losses, _, _ in results:
        torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=1e-12)
    for key, value in ref_state.items():
        torch.testing.assert_close(results[0][1][key], value, rtol=1e-9, atol=1e-12, msg=key)
