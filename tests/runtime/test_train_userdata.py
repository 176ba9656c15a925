"""Data, optimizers and start-up as a user of ``transformers`` brings them (issue 18):
dict data sets with a padding ``collate_fn``, the user's optimizer with parameter groups,
parameters without a gradient, and a start-up that never changes the model. Each run of
``hetrain.train`` under a fixed plan is compared with a plain PyTorch loop over the whole
global batch (no hetrain code in the reference)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import hetrain

VOCAB, WIDTH, BLOCKS = 11, 8, 3
STEPS, BATCH, LR = 3, 12, 0.02


class Block(nn.Module):
    """A causal mixing block: each position adds a function of the mean of the non-padding
    positions up to it (padding at the end changes no earlier position)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        mean = (h * m).cumsum(1) / m.cumsum(1).clamp(min=1.0)
        return h + torch.tanh(self.lin(self.norm(mean)))


class TinyLM(nn.Module):
    """Called as ``model(input_ids=..., attention_mask=...)``, like a ``transformers`` model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        for block in self.blocks:
            h = block(h, attention_mask)
        return self.head(h)


def token_dicts(n: int = STEPS * BATCH) -> list[dict[str, torch.Tensor]]:
    """``n`` samples of 3 to 9 tokens: ``{"input_ids", "labels"}`` (next-token targets)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 10, (1,), generator=g))
        seq = torch.randint(1, VOCAB, (length + 1,), generator=g)
        out.append({"input_ids": seq[:-1], "labels": seq[1:]})
    return out


def pad_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the longest sample: ids with 0, the mask 1/0, labels with -100."""
    width = max(len(i["input_ids"]) for i in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n], mask[row, :n], labels[row, :n] = item["input_ids"], 1, item["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def token_loss(logits: torch.Tensor, labels: torch.Tensor):
    """``(sum, count)`` cross-entropy over the non-padding tokens."""
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return total, (labels != -100).sum()


def _perm(n: int, seed: int) -> np.ndarray:
    # the documented sampler of docs/runtime.md: one seeded permutation per epoch
    return np.random.default_rng([seed, 0]).permutation(n)


def plain_loop(model: nn.Module, data, make_opt, loss_fn, collate, seed: int = 0):
    """One model, the whole global batch collated at once, ``(sum, count)`` divided by the
    batch's count; returns the losses and the final state."""
    model = model.double()
    opt = make_opt(model)
    perm = _perm(len(data), seed)
    losses = []
    for t in range(STEPS):
        batch = collate([data[int(i)] for i in perm[t * BATCH : (t + 1) * BATCH]])
        labels = batch.pop("labels")
        opt.zero_grad(set_to_none=True)
        total, count = loss_fn(model(**batch), labels)
        loss = total / count
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _g(devices, stages, mb, batch):
    return {"devices": devices, "stages": stages, "microbatch_size": mb, "batch": batch}


LAYERS = BLOCKS + 2  # prefix (embedding), the blocks, suffix (head)
PLANS = {
    "hybrid": {
        "groups": [
            _g(["w0", "w1"], [[0, 2], [2, LAYERS]], 2, 7),
            _g(["w2"], [[0, LAYERS]], 3, 5),
        ]
    },
    "pipeline-3": {"groups": [_g(["w1", "w0", "w2"], [[0, 1], [1, 3], [3, LAYERS]], 2, BATCH)]},
}


def _hetrain(tmp_path, name, model, data, loss_fn, **kw):
    run = tmp_path / name
    summary = hetrain.train(
        model=model,
        dataset=data,
        loss_fn=loss_fn,
        steps=STEPS,
        batch=BATCH,
        lr=LR,
        dtype="float64",
        lr_schedule="constant",
        run_dir=run,
        report=False,
        **kw,
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("event") == "step"]
    # the exported state_dict in the training dtype (float64; ``model`` gets float32 copies)
    return losses, torch.load(summary["model_path"], weights_only=True)


def _assert_same(got, ref):
    (losses, state), (ref_losses, ref_state) = got, ref
    torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=1e-12)
    assert state.keys() == ref_state.keys()
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-9, atol=1e-12, msg=key)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_dict_dataset_with_a_padding_collate_fn_trains_like_a_plain_loop(tmp_path, plan):
    """A list of dicts of variable-length sequences, padded per micro-batch by the user's
    ``collate_fn``, called as ``model(input_ids=..., attention_mask=...)`` with ``labels``
    going to a ``(sum, count)`` loss over the real tokens: under an uneven hybrid and a
    3-stage pipeline, equal to a plain loop that pads the whole global batch at once."""
    data = token_dicts()
    torch.manual_seed(0)
    model = TinyLM()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    got = _hetrain(
        tmp_path,
        plan,
        model,
        data,
        token_loss,
        collate_fn=pad_collate,
        plan=PLANS[plan],
        workers=3,
    )
    ref_model = TinyLM()
    ref_model.load_state_dict(start)
    ref = plain_loop(
        ref_model,
        data,
        lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0, foreach=False),
        token_loss,
        pad_collate,
    )
    assert len(set(ref[0])) == STEPS  # it trains
    _assert_same(got, ref)


def test_dict_samples_split_into_keyword_inputs_and_targets():
    """Dicts (targets under ``labels`` or the given ``target_key``) and ``(dict, target)``
    pairs collate into keyword inputs and targets, row ``i`` from sample ``i``; a missing key
    or a failing ``collate_fn`` is one InputError before training."""
    from hetrain.errors import InputError
    from hetrain.runtime.data import as_source

    items = [{"input_ids": torch.arange(4) + i, "labels": torch.tensor(i)} for i in range(5)]
    x, y = as_source(items).batch(np.array([3, 1]))
    assert set(x) == {"input_ids"} and torch.equal(y, torch.tensor([3, 1]))
    assert torch.equal(x["input_ids"][0], torch.arange(4) + 3)
    renamed = [{"ids": i["input_ids"], "y": i["labels"]} for i in items]
    x, y = as_source(renamed, target_key="y").batch(np.array([2]))
    assert set(x) == {"ids"} and y.tolist() == [2]
    pairs = [({"ids": i["input_ids"]}, i["labels"]) for i in items]
    x, y = as_source(pairs).batch(np.array([4, 0]))
    assert torch.equal(x["ids"][1], torch.arange(4)) and y.tolist() == [4, 0]
    with pytest.raises(InputError, match="target key 'labels'"):
        as_source(renamed)
    with pytest.raises(InputError, match="collate_fn.*ZeroDivisionError"):
        as_source(items, collate_fn=lambda batch: 1 / 0)


class UnusedParts(TinyLM):
    """TinyLM with a Linear that ``forward`` never uses and a scale used only in ``eval()``."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(WIDTH, 3)
        self.eval_scale = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits = super().forward(input_ids, attention_mask)
        return logits if self.training else logits * self.eval_scale


def test_parameters_without_a_gradient_are_not_stepped_under_a_hybrid_plan(tmp_path):
    """AdamW with weight decay: a parameter that gets no gradient in a step is skipped (as
    torch.optim does in one process), under an uneven hybrid of 3 ranks: the unused Linear
    and the eval-only scale end bit-identical to their start, and the whole run equals a
    plain loop."""
    data = token_dicts()
    torch.manual_seed(0)
    model = UnusedParts()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    got = _hetrain(
        tmp_path,
        "hybrid",
        model,
        data,
        token_loss,
        collate_fn=pad_collate,
        plan=PLANS["hybrid"],
        workers=3,
        weight_decay=0.1,
    )
    for key in ("unused.weight", "unused.bias", "eval_scale"):
        assert torch.equal(got[1][key], start[key].double()), key
    ref_model = UnusedParts()
    ref_model.load_state_dict(start)
    ref = plain_loop(
        ref_model,
        data,
        lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1, foreach=False),
        token_loss,
        pad_collate,
    )
    _assert_same(got, ref)
