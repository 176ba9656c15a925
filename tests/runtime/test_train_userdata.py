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


class DropoutLM(TinyLM):
    """TinyLM with dropout on the embeddings and after every block."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.emb(input_ids))
        for block in self.blocks:
            h = self.drop(block(h, attention_mask))
        return self.head(h)


def test_dropout_with_a_padding_collate_fn_is_the_same_under_every_plan(tmp_path):
    """Dropout on variable-length dicts padded by the user's ``collate_fn``: a sample's draws
    depend on its padded shape, so the global batch is padded once whatever the plan. Under
    an uneven hybrid (micro-batches of 2 and 3 rows) and a 3-stage pipeline (2 rows), the
    losses and weights equal ``--workers 1``'s, and dropout does act (the losses differ from
    the same run without it)."""
    data = token_dicts()
    torch.manual_seed(0)
    start = DropoutLM().state_dict()

    def run(name: str, p: float = 0.3, **kw):
        model = DropoutLM()  # train() loads the trained weights into the model it is given
        model.load_state_dict(start)
        model.drop.p = p
        return _hetrain(tmp_path, name, model, data, token_loss, collate_fn=pad_collate, **kw)

    one = run("one", workers=1)
    _assert_same(run("hybrid", plan=PLANS["hybrid"], workers=3), one)
    _assert_same(run("pipeline-3", plan=PLANS["pipeline-3"], workers=3), one)
    without = run("no-dropout", p=0.0, workers=1)
    assert min(abs(a - b) for a, b in zip(without[0], one[0], strict=True)) > 1e-3


class TableBlock(Block):
    """A block that also mixes its output with its own ``[WIDTH, WIDTH]`` table through
    dropout (a tensor without a sample dimension, as DeBERTa-v2's relative positions), then
    drops out the hidden states with the same module (a second draw site of one path)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.eye(WIDTH) + 0.1 * torch.randn(WIDTH, WIDTH))
        self.drop = nn.Dropout(0.3)

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = super().forward(h, attention_mask) @ self.drop(self.table)
        return self.drop(h)


class TableLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TableBlock() for _ in range(BLOCKS)])


def test_dropout_on_a_tensor_without_a_sample_dimension_is_the_same_under_every_plan(tmp_path):
    """Dropout on a ``[WIDTH, WIDTH]`` table inside each block: its rows are no samples, so
    it draws once per step (the same mask in every micro-batch, as one device's one forward):
    the hybrid (micro-batches of 2 and 3 rows; 3 does not divide the table's 8 rows) and the
    3-stage pipeline (2 rows, which do) equal ``--workers 1``."""
    from hetrain.runtime.cut_chains import call_inputs
    from hetrain.runtime.data import as_source
    from hetrain.runtime.randomness import batch_free_draw_sites

    data = token_dicts()
    torch.manual_seed(0)
    start = TableLM().state_dict()
    x, _ = as_source(data, collate_fn=pad_collate).batch(np.arange(2))
    model = TableLM()
    sites = batch_free_draw_sites(model, x, call_inputs)
    assert sites == {(f"blocks.{i}.drop", 0) for i in range(BLOCKS)}

    def run(name: str, **kw):
        model = TableLM()
        model.load_state_dict(start)
        return _hetrain(tmp_path, name, model, data, token_loss, collate_fn=pad_collate, **kw)

    one = run("one", workers=1)
    _assert_same(run("hybrid", plan=PLANS["hybrid"], workers=3), one)
    _assert_same(run("pipeline-3", plan=PLANS["pipeline-3"], workers=3), one)


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


def _no_decay(name: str) -> bool:
    return name.endswith("bias") or ".norm." in name


def _user_groups(model: nn.Module) -> list[dict]:
    """The transformers convention: weight decay except on norms and biases (the second
    group also at half the learning rate), named by name and by parameter object."""
    named = list(model.named_parameters())
    return [
        {"params": [n for n, _ in named if not _no_decay(n)], "weight_decay": 0.05},
        {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0, "lr": LR / 2},
    ]


def _torch_groups(model: nn.Module) -> list[dict]:
    """:func:`_user_groups` as torch.optim takes them (parameter objects only)."""
    named = dict(model.named_parameters())
    return [
        {**g, "params": [named[p] if isinstance(p, str) else p for p in g["params"]]}
        for g in _user_groups(model)
    ]


def _user_optimizer(groups):
    return torch.optim.Adam(groups, lr=LR, betas=(0.8, 0.99), foreach=False)


@pytest.mark.parametrize("resume", [False, True])
def test_user_optimizer_with_two_parameter_groups_trains_like_a_plain_loop(tmp_path, resume):
    """``optimizer`` a callable over param groups (torch's Adam, not hetrain's AdamW) and
    ``param_groups`` by name and by parameter: under a 3-rank hybrid, equal to the same
    optimizer and groups in a plain loop. ``resume``: 2 steps under a 3-stage pipeline with a
    checkpoint each step, then resumed under the hybrid for the last step (each group's
    state re-partitioned through the checkpoint)."""
    data = token_dicts()
    torch.manual_seed(0)
    model = TinyLM()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    kw = dict(collate_fn=pad_collate, workers=3, optimizer=_user_optimizer)
    if resume:
        ckpt = tmp_path / "ckpt"
        first = TinyLM()
        first.load_state_dict(start)
        hetrain.train(
            model=first,
            dataset=data,
            loss_fn=token_loss,
            steps=STEPS - 1,
            batch=BATCH,
            dtype="float64",
            lr_schedule="constant",
            run_dir=tmp_path / "first",
            report=False,
            plan=PLANS["pipeline-3"],
            checkpoint_dir=ckpt,
            checkpoint_every=1,
            param_groups=_user_groups(first),
            **kw,
        )
        kw["checkpoint_dir"] = ckpt
    got = _hetrain_groups(tmp_path, model, data, kw)
    ref_model = TinyLM()
    ref_model.load_state_dict(start)
    ref = plain_loop(
        ref_model, data, lambda m: _user_optimizer(_torch_groups(m)), token_loss, pad_collate
    )
    if resume:  # the resumed run logs its own step only
        ref = (ref[0][-1:], ref[1])
    _assert_same(got, ref)


def _hetrain_groups(tmp_path, model, data, kw):
    run = tmp_path / "groups"
    summary = hetrain.train(
        model=model,
        dataset=data,
        loss_fn=token_loss,
        steps=STEPS,
        batch=BATCH,
        dtype="float64",
        lr_schedule="constant",
        run_dir=run,
        report=False,
        plan=PLANS["hybrid"],
        param_groups=_user_groups(model),
        **kw,
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("event") == "step"]
    return losses, torch.load(summary["model_path"], weights_only=True)


def _groups_through_plan_changes(rank, world, start, plans):
    from hetrain.plan import plan_from_dict
    from hetrain.runtime.cutting import cut_module
    from hetrain.runtime.data import as_source
    from hetrain.runtime.engine import Worker
    from hetrain.runtime.optim import OptimizerSpec, check_factory, resolve_param_groups

    model = TinyLM()
    model.load_state_dict(start)
    source = as_source(token_dicts(), collate_fn=pad_collate)
    groups = resolve_param_groups(model, _user_groups(model))
    lr, state_factor = check_factory(_user_optimizer, groups)
    spec = OptimizerSpec(
        name="user", lr=lr, factory=_user_optimizer, param_groups=groups,
        measured_state_factor=state_factor,
    )  # fmt: skip
    chain = cut_module(model, source.batch(np.arange(2))[0])
    worker = Worker(chain, plan_from_dict(plans[0]), f"w{rank}", token_loss, spec,
                    dtype=torch.float64)  # fmt: skip
    perm, losses, moved = _perm(len(source), 0), [], 0
    for t in range(STEPS):
        if t > 0:
            moved += worker.apply_plan(plan_from_dict(plans[t])).transfers
        x, y = source.batch(perm[t * BATCH : (t + 1) * BATCH])
        losses.append(worker.step(x, y, t).loss)
    return losses, worker.full_state_dict(), moved


def test_parameter_groups_follow_their_parameters_through_plan_changes(tmp_path):
    """The user's Adam with two groups (different weight decay and learning rate): plans
    changed after every step (data parallel -> 3-stage pipeline -> hybrid) move each layer's
    optimizer with its groups; the run equals a plain loop."""
    from hetrain.runtime.testing import run_ranks

    torch.manual_seed(0)
    model = TinyLM()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    dp = {"groups": [_g([f"w{i}"], [[0, LAYERS]], 2, b) for i, b in enumerate((5, 4, 3))]}
    plans = [dp, PLANS["pipeline-3"], PLANS["hybrid"]]
    results = run_ranks(_groups_through_plan_changes, 3, tmp_path, args=(start, plans),
                        timeout_s=240)  # fmt: skip
    assert sum(r[2] for r in results) > 0  # layers moved
    ref_model = TinyLM()
    ref_model.load_state_dict(start)
    ref = plain_loop(
        ref_model, data=token_dicts(), make_opt=lambda m: _user_optimizer(_torch_groups(m)),
        loss_fn=token_loss, collate=pad_collate,
    )  # fmt: skip
    _assert_same((results[0][0], results[0][1]), ref)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"optimizer": torch.optim.LBFGS}, "LBFGS.*closure"),
        ({"optimizer": lambda g: "sgd"}, "expected a torch.optim.Optimizer, got str"),
        ({"optimizer": torch.optim.SGD, "lr": 0.1}, "--lr.*not used with the user's own"),
        ({"param_groups": [{"params": ["emb.weight"]}]}, "'blocks.0.lin.weight' is in no group"),
        ({"param_groups": [{"params": ["nope"]}]}, "no parameter named 'nope'"),
        ({"param_groups": [{"params": ["emb.weight"]}, {"params": ["emb.weight"]}]}, "also in"),
        ({"param_groups": "all"}, "expected a list"),
    ],
)
def test_what_the_optimizer_cannot_honour_is_refused_naming_it(kw, message):
    """Bad optimizers and groups are one InputError (exit 2) before any rank starts."""
    from hetrain.errors import InputError
    from hetrain.runtime.api import RunConfig, build_job, task_from_objects

    torch.manual_seed(0)
    model = TinyLM()
    kw = dict(kw)
    optimizer = kw.pop("optimizer", None)
    param_groups = kw.pop("param_groups", None)
    with pytest.raises(InputError, match=message):
        task = task_from_objects(
            model, token_dicts(), token_loss, collate_fn=pad_collate, param_groups=param_groups
        )
        build_job(task, RunConfig(workers=1, steps=1, batch=4, optimizer=optimizer, **kw))


def test_a_group_option_the_optimizer_does_not_know_is_refused():
    """A misspelt option would be kept by torch.optim and never used: refused, naming it."""
    from hetrain.errors import InputError
    from hetrain.runtime.optim import check_factory

    groups = ((("a",), {"weight_decy": 0.0}),)
    with pytest.raises(InputError, match="weight_decy.*not an option of AdamW"):
        check_factory(torch.optim.AdamW, groups)
    lr, state = check_factory(torch.optim.AdamW, ((("a",), {"lr": 0.5}),))
    assert (lr, state) == (0.5, 2.0)
    assert check_factory(torch.optim.SGD, ((("a",), {"lr": 0.1}),))[1] == 0.0


def test_a_factory_gives_its_optimizer_and_groups_and_unknown_keys_are_refused(
    tmp_path, monkeypatch
):
    """``--model`` factories: the ``optimizer`` and ``param_groups`` keys are used (they were
    silently ignored), any key hetrain does not know is an InputError naming it."""
    from hetrain.errors import InputError
    from hetrain.runtime.api import task_from_factory

    (tmp_path / "userfactory.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "def make(extra=None):\n"
        "    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))\n"
        "    data = (torch.randn(8, 3), torch.randint(0, 2, (8,)))\n"
        "    out = {'model': m, 'dataset': data, 'loss_fn': nn.functional.cross_entropy,\n"
        "           'optimizer': lambda g: torch.optim.SGD(g, lr=0.1),\n"
        "           'param_groups': [{'params': ['0.weight', '1.weight']},\n"
        "                            {'params': ['0.bias', '1.bias'], 'lr': 0.0}]}\n"
        "    return {**out, **(extra or {})}\n"
        "def typo():\n"
        "    return make({'optimiser': None})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = task_from_factory("userfactory:make")
    assert task.optimizer is not None
    assert task.param_groups == (
        (("0.weight", "1.weight"), {}),
        (("0.bias", "1.bias"), {"lr": 0.0}),
    )
    with pytest.raises(InputError, match="unknown keys 'optimiser'"):
        task_from_factory("userfactory:typo")


class Counter(nn.Module):
    """Counts the samples its training forwards saw (a buffer ``forward`` changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += x.shape[0]
        return x


def _bn_model(counter: bool = True, norm: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(16, momentum=None) if norm else nn.Identity()
    parts = [nn.Linear(6, 16), bn, nn.ReLU(), nn.Dropout(0.2)]
    return nn.Sequential(*parts, *([Counter()] if counter else []), nn.Linear(16, 3))


def _bn_data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)


@pytest.mark.parametrize("norm", [True, False], ids=["batchnorm1d", "counter-only"])
def test_startup_leaves_every_parameter_and_buffer_bit_identical(tmp_path, norm):
    """A BatchNorm1d (cumulative statistics; or none), dropout and a buffer ``forward``
    updates: one step under a fixed 2-rank plan with the start-up's profiling and calibration
    (adaptive) ends bit-identical, parameters and every buffer, to the same step without
    them (the calibration trained BatchNorm1d on 1-sample micro-batches, and its forwards
    counted)."""
    plan = {"groups": [_g(["w0"], [[0, 6]], 2, 4), _g(["w1"], [[0, 6]], 2, 4)]}
    states = {}
    for adaptive in (True, False):
        summary = hetrain.train(
            model=_bn_model(norm=norm),
            dataset=_bn_data(),
            loss_fn=F.cross_entropy,
            workers=2,
            steps=1,
            batch=8,
            lr=0.05,
            plan=plan,
            adaptive=adaptive,
            norm_block=2,
            run_dir=tmp_path / str(adaptive),
            report=False,
        )
        states[adaptive] = torch.load(summary["model_path"], weights_only=True)
    assert states[True].keys() == states[False].keys()
    for key, value in states[False].items():
        assert torch.equal(states[True][key], value), key
    if norm:
        assert int(states[True]["1.num_batches_tracked"]) == 1  # the one training step
    assert int(states[True]["4.seen"]) == 4  # the 4 samples of the first group, nothing else


def test_startup_restores_what_the_model_changes(tmp_path):
    """:func:`unchanged` puts back values, dtypes, devices, reassigned buffer objects,
    training flags and torch's random state after a training forward, a dtype change and an
    optimizer step."""
    from hetrain.runtime.startup import unchanged

    model = _bn_model()
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    objects = dict(model.state_dict(keep_vars=True))
    rng = torch.get_rng_state()
    with unchanged(model):
        model.train().double()
        model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        model[4].seen = torch.tensor(99)  # a forward that reassigns its buffer
    after = model.state_dict(keep_vars=True)
    for key, value in before.items():
        assert after[key] is objects[key] and after[key].dtype == value.dtype, key
        assert torch.equal(after[key], value), key
    assert all(p.grad is None for p in model.parameters())
    assert not any(m.training for m in model.modules())
    assert torch.equal(torch.get_rng_state(), rng)


def test_forward_updated_buffers_are_named_in_a_warning_and_refused_by_exact(capsys):
    """A buffer ``forward`` changes: one start-up warning line naming it (its value depends on
    the plan), and with ``exact`` an InputError (exit 2) before any rank starts. BatchNorm
    statistics under a norm block are not named; without a norm block ``exact`` refuses them
    too."""
    from hetrain.errors import InputError
    from hetrain.runtime.api import RunConfig, build_job, task_from_objects

    def job(model, **kw):
        task = task_from_objects(model, _bn_data(), F.cross_entropy)
        return build_job(task, RunConfig(workers=2, steps=1, batch=8, **kw))

    job(_bn_model(), norm_block=2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning: forward changes buffer(s) 4.seen" in err[0]
    assert "depend on the plan" in err[0] and "num_batches" not in err[0]
    with pytest.raises(InputError, match=r"4\.seen.*depend on the plan \(--exact\)"):
        job(_bn_model(), norm_block=2, exact=True)
    job(_bn_model(counter=False), norm_block=2, exact=True)  # BatchNorm under a norm block
    assert "warning" not in capsys.readouterr().err
    with pytest.raises(InputError, match=r"1\.running_mean.*\(--exact\)"):
        job(_bn_model(counter=False), exact=True)


#: torch.optim classes (every one but LBFGS), each with options that use its state
OPTIMIZERS = {
    "SGD-nesterov": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True),
    "Adam-amsgrad": lambda g: torch.optim.Adam(g, lr=0.01, amsgrad=True),
    "AdamW": lambda g: torch.optim.AdamW(g, lr=0.01),
    "Adamax": lambda g: torch.optim.Adamax(g, lr=0.01),
    "NAdam": lambda g: torch.optim.NAdam(g, lr=0.01),
    "RAdam": lambda g: torch.optim.RAdam(g, lr=0.01),
    "RMSprop": lambda g: torch.optim.RMSprop(g, lr=0.01, momentum=0.5, centered=True),
    "Adagrad": lambda g: torch.optim.Adagrad(g, lr=0.05),
    "Adadelta": lambda g: torch.optim.Adadelta(g, lr=0.5),
    "ASGD": lambda g: torch.optim.ASGD(g, lr=0.05),
    "Rprop": lambda g: torch.optim.Rprop(g, lr=0.01),
}


def _every_optimizer(rank, world, start, plans):
    from hetrain.plan import plan_from_dict
    from hetrain.runtime.cutting import cut_module
    from hetrain.runtime.data import as_source
    from hetrain.runtime.engine import Worker
    from hetrain.runtime.optim import OptimizerSpec, resolve_param_groups

    source = as_source(token_dicts(), collate_fn=pad_collate)
    perm, out = _perm(len(source), 0), {}
    for name, factory in OPTIMIZERS.items():
        model = TinyLM()
        model.load_state_dict(start)
        groups = resolve_param_groups(model, _user_groups(model))
        spec = OptimizerSpec(name="user", factory=factory, param_groups=groups)
        chain = cut_module(model, source.batch(np.arange(2))[0])
        worker = Worker(chain, plan_from_dict(plans[0]), f"w{rank}", token_loss, spec,
                        dtype=torch.float64)  # fmt: skip
        losses = []
        for t in range(STEPS):
            if t > 0:
                worker.apply_plan(plan_from_dict(plans[t]))
            x, y = source.batch(perm[t * BATCH : (t + 1) * BATCH])
            losses.append(worker.step(x, y, t).loss)
        out[name] = (losses, worker.full_state_dict())
    return out


def test_every_torch_optimizer_with_groups_trains_like_a_plain_loop(tmp_path):
    """The population of torch.optim classes (all but LBFGS), each with two parameter groups
    whose options differ (weight decay, learning rate), through two plan changes on 3 ranks:
    every one equals the same optimizer over the whole model in a plain loop."""
    from hetrain.runtime.testing import run_ranks

    torch.manual_seed(0)
    start = {k: v.clone() for k, v in TinyLM().state_dict().items()}
    plans = [PLANS["hybrid"], PLANS["pipeline-3"], PLANS["hybrid"]]
    results = run_ranks(_every_optimizer, 3, tmp_path, args=(start, plans), timeout_s=400)
    for name, factory in OPTIMIZERS.items():
        ref_model = TinyLM()
        ref_model.load_state_dict(start)
        ref = plain_loop(
            ref_model, data=token_dicts(), make_opt=lambda m, f=factory: f(_torch_groups(m)),
            loss_fn=token_loss, collate=pad_collate,
        )  # fmt: skip
        try:
            _assert_same(results[0][name], ref)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


@pytest.mark.parametrize("name", ["gpt2", "bert", "resnet", "charlm", "digits"])
def test_the_example_models_change_no_buffer_but_batchnorm_statistics(name):
    """No false alarm over the examples' models (tiny sizes): a training forward changes no
    buffer of GPT-2, BERT, the character LM or the digits CNN, and only BatchNorm statistics of
    ResNet; the model is left as it was."""
    from hetrain.runtime.examples import example_task
    from hetrain.runtime.startup import check_forward_buffers, forward_changed_buffers

    task = example_task(name)
    torch.manual_seed(0)
    model = task.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, _ = task.train.batch(np.arange(2))
    others, batchnorm = forward_changed_buffers(model, x)
    assert others == []
    assert bool(batchnorm) == (name == "resnet")
    assert check_forward_buffers(model, x, norm_block=2, exact=True, source=name) is None
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
