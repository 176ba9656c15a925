"""Exactness of the engine: hybrid plans (and a mid-run plan change) train exactly like one
process on the whole batch (gloo, 2-4 forked ranks, float64 unless stated)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from hetrain.models import CharGPTConfig, char_gpt, digits_cnn
from hetrain.plan import plan_from_dict
from hetrain.runtime import OptimizerSpec, Worker
from hetrain.runtime.optim import set_lr
from hetrain.runtime.testing import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 5
BATCH = 24
CLIP = 0.1


def _decay(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


SPECS = {
    "sgd": OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=1e-3, lr_schedule=_decay),
    "adamw": OptimizerSpec("adamw", lr=3e-3, weight_decay=0.01, lr_schedule=_decay),
}


@functools.cache
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images[: STEPS * 2 * BATCH], dtype=torch.float64)[:, None] / 16.0
    y = torch.tensor(data.target[: STEPS * 2 * BATCH], dtype=torch.int64)
    return x, y


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 16, (STEPS * 2 * BATCH, 9), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


MODELS = {
    "digits": (lambda: digits_cnn(channels=4, hidden=16), _digits, F.cross_entropy),
    "charlm": (
        lambda: char_gpt(
            CharGPTConfig(vocab_size=16, block_size=8, n_layer=2, n_embd=16, n_head=2)
        ),
        _tokens,
        _lm_loss,
    ),
}


def _batch(data, step):
    x, y = data
    rows = slice(step * BATCH, (step + 1) * BATCH)
    return x[rows], y[rows]


def _reference(model_name, opt_name, dtype, steps, clip=CLIP):
    build, data_fn, loss_fn = MODELS[model_name]
    torch.manual_seed(0)
    model = build().to(dtype)
    spec = SPECS[opt_name]
    opt = spec.build(model.parameters())
    data = data_fn()
    losses = []
    for t in range(steps):
        x, y = _batch(data, t)
        if x.is_floating_point():
            x = x.to(dtype)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        set_lr(opt, spec.lr_at(t))
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _train(rank, world, model_name, opt_name, dtype, plans, change_at, steps, clip=CLIP):
    build, data_fn, loss_fn = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    worker = Worker(
        model,
        plan_from_dict(plans[0]),
        f"w{rank}",
        loss_fn,
        SPECS[opt_name],
        dtype=dtype,
        grad_clip_norm=clip,
    )
    data = data_fn()
    losses, norms = [], []
    moved = 0
    for t in range(steps):
        if t == change_at:
            moved = worker.apply_plan(plan_from_dict(plans[1])).transfers
        x, y = _batch(data, t)
        result = worker.step(x, y, t)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    return losses, norms, worker.full_state_dict(), moved


def _group(devices, stages, mb, batch):
    return {"devices": devices, "stages": stages, "microbatch_size": mb, "batch": batch}


# Digits CNN has 6 layers; the char-GPT here has 4 (embedding, 2 blocks, head).
# case -> (model, optimizer, dtype, world size, plans, step of the plan change or None)
CASES = {
    # pure data parallel, uneven shares and micro-batch sizes (last micro-batch smaller)
    "dp-uneven-sgd": (
        "digits",
        "sgd",
        "float64",
        3,
        [
            {
                "groups": [
                    _group(["w0"], [[0, 6]], 4, 10),
                    _group(["w1"], [[0, 6]], 6, 6),
                    _group(["w2"], [[0, 6]], 3, 8),
                ]
            }
        ],
        None,
    ),
    # pure pipeline, 3 stages, 5 micro-batches (last one of 4 rows)
    "pipeline-1f1b-adamw": (
        "digits",
        "adamw",
        "float64",
        3,
        [{"groups": [_group(["w0", "w1", "w2"], [[0, 2], [2, 4], [4, 6]], 5, 24)]}],
        None,
    ),
    # hybrid: two pipelines with different splits, uneven shares
    "hybrid-gpipe-sgd": (
        "digits",
        "sgd",
        "float64",
        4,
        [
            {
                "schedule": "gpipe",
                "groups": [
                    _group(["w0", "w1"], [[0, 3], [3, 6]], 4, 14),
                    _group(["w2", "w3"], [[0, 1], [1, 6]], 3, 10),
                ],
            }
        ],
        None,
    ),
    # hybrid with an idle group (b_g = 0) that must stay in step; int64 token inputs
    "hybrid-idle-charlm-adamw": (
        "charlm",
        "adamw",
        "float64",
        4,
        [
            {
                "groups": [
                    _group(["w0", "w1"], [[0, 2], [2, 4]], 5, 17),
                    _group(["w2"], [[0, 4]], 7, 7),
                    _group(["w3"], [[0, 4]], 4, 0),
                ]
            }
        ],
        None,
    ),
    # float32 tolerances, 1F1B pipeline of the transformer next to a single-device group
    "hybrid-float32-charlm-sgd": (
        "charlm",
        "sgd",
        "float32",
        3,
        [
            {
                "groups": [
                    _group(["w0", "w1"], [[0, 3], [3, 4]], 3, 15),
                    _group(["w2"], [[0, 4]], 9, 9),
                ]
            }
        ],
        None,
    ),
    # mid-run plan change: every layer and its AdamW state moves (new groups, new splits)
    "change-hybrid-adamw": (
        "digits",
        "adamw",
        "float64",
        4,
        [
            {
                "groups": [
                    _group(["w0", "w1"], [[0, 3], [3, 6]], 4, 14),
                    _group(["w2", "w3"], [[0, 1], [1, 6]], 3, 10),
                ]
            },
            {
                "schedule": "gpipe",
                "groups": [
                    _group(["w3", "w0", "w1"], [[0, 2], [2, 4], [4, 6]], 3, 20),
                    _group(["w2"], [[0, 6]], 4, 4),
                ],
            },
        ],
        2,
    ),
    # mid-run plan change with SGD momentum: pipeline -> data parallel leaving a rank unused
    "change-pipeline-to-dp-sgd": (
        "charlm",
        "sgd",
        "float64",
        3,
        [
            {"groups": [_group(["w0", "w1", "w2"], [[0, 1], [1, 3], [3, 4]], 6, 24)]},
            {"groups": [_group(["w2"], [[0, 4]], 5, 13), _group(["w1"], [[0, 4]], 11, 11)]},
        ],
        3,
    ),
}

TOLERANCES = {
    "float64": {"rtol": 1e-9, "atol": 1e-12},
    "float32": {"rtol": 1e-4, "atol": 1e-6},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_trains_like_one_process(case, tmp_path):
    model_name, opt_name, dtype_name, world, plans, change_at = CASES[case]
    dtype = getattr(torch, dtype_name)
    results = run_ranks(
        _train, world, tmp_path, args=(model_name, opt_name, dtype, plans, change_at, STEPS)
    )
    ref_losses, ref_state = _reference(model_name, opt_name, dtype, STEPS)
    tol = TOLERANCES[dtype_name]
    for losses, *_ in results:  # the same loss on every rank
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    assert max(results[0][1]) > CLIP  # clipping was active
    state = results[0][2]
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, **tol, msg=key)
    assert all(r[2] is None for r in results[1:])
    if change_at is not None:  # layers really moved between ranks
        assert results[0][3] >= 4


def test_an_idle_replica_beside_a_pipeline_stays_in_step_and_takes_over(tmp_path):
    """A pipeline of two ranks beside an idle replica of the whole model (a start-up plan that
    leaves a slow device out), no clipping, then a plan where the idle rank trains alone from
    its own replica: equal to one process. Every layer had one active owner, so the step's
    got-gradient flags travelled late, and the idle rank's optimizer skipped every tensor."""
    plans = [
        {"groups": [_group(["w0", "w1"], [[0, 3], [3, 6]], 4, 24), _group(["w2"], [[0, 6]], 1, 0)]},
        {"groups": [_group(["w2"], [[0, 6]], 6, 24)]},
    ]
    dtype = torch.float64
    results = run_ranks(_train, 3, tmp_path, args=("digits", "adamw", dtype, plans, 3, STEPS, None))
    ref_losses, ref_state = _reference("digits", "adamw", dtype, STEPS, clip=None)
    for losses, *_ in results:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), **TOLERANCES["float64"]
        )
    assert results[0][3] == 0  # w2 trained from its own replica: nothing moved
    for key, value in ref_state.items():
        torch.testing.assert_close(results[0][2][key], value, **TOLERANCES["float64"], msg=key)


def _checkpoint_roundtrip(rank, world, plans, steps, switch_at):
    build, data_fn, loss_fn = MODELS["digits"]
    data = data_fn()
    torch.manual_seed(0)
    spec = SPECS["adamw"]
    worker = Worker(
        build(),
        plan_from_dict(plans[0]),
        f"w{rank}",
        loss_fn,
        spec,
        dtype=torch.float64,
        grad_clip_norm=CLIP,
    )
    losses = [worker.step(*_batch(data, t), t).loss for t in range(switch_at)]
    saved = worker.layer_state_dict()
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, saved)
    merged = {}
    for part in gathered:
        assert not set(part) & set(merged)  # each layer saved by exactly one rank
        merged.update(part)
    torch.manual_seed(123)  # different initial weights: everything must come from `merged`
    resumed = Worker(
        build(),
        plan_from_dict(plans[1]),
        f"w{rank}",
        loss_fn,
        spec,
        dtype=torch.float64,
        grad_clip_norm=CLIP,
    )
    resumed.load_layer_state_dict(merged)
    losses += [resumed.step(*_batch(data, t), t).loss for t in range(switch_at, steps)]
    return losses, sorted(merged), resumed.full_state_dict()


def test_layer_state_dict_resumes_exactly_under_another_plan(tmp_path):
    plans = [
        {"groups": [_group(["w0", "w1"], [[0, 4], [4, 6]], 5, 16), _group(["w2"], [[0, 6]], 8, 8)]},
        {"groups": [_group(["w2", "w0", "w1"], [[0, 1], [1, 5], [5, 6]], 7, 24)]},
    ]
    results = run_ranks(_checkpoint_roundtrip, 3, tmp_path, args=(plans, 4, 2))
    ref_losses, ref_state = _reference("digits", "adamw", torch.float64, 4)
    tol = TOLERANCES["float64"]
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(ref_losses), **tol)
    keys = results[0][1]
    assert {k[len("layers.") :] for k in keys if k.startswith("layers.")} == set(ref_state)
    assert "optim.0.0.weight.exp_avg_sq" in keys and "optim.5.bias.step" in keys
    for key, value in ref_state.items():
        torch.testing.assert_close(results[0][2][key], value, **tol, msg=key)


def _random_plan(rng, world, num_layers, batch):
    """A random valid plan: a random subset of the ranks in random groups and orders, random
    stage splits, micro-batch sizes, schedule and shares (some groups may be idle)."""
    devices = [f"w{r}" for r in rng.sample(range(world), rng.randint(1, world))]
    cuts = sorted(rng.sample(range(1, len(devices)), rng.randint(0, len(devices) - 1)))
    members = [devices[a:b] for a, b in zip([0, *cuts], [*cuts, len(devices)], strict=True)]
    members = [m[:num_layers] for m in members]
    shares = [0] * len(members)
    active = rng.sample(range(len(members)), rng.randint(1, len(members)))
    for _ in range(batch):  # uneven shares; groups not in `active` stay idle
        shares[rng.choice(active)] += 1
    groups = []
    for m, share in zip(members, shares, strict=True):
        splits = sorted(rng.sample(range(1, num_layers), len(m) - 1))
        bounds = [0, *splits, num_layers]
        groups.append(
            _group(m, [[bounds[i], bounds[i + 1]] for i in range(len(m))], rng.randint(1, 9), share)
        )
    return {"schedule": rng.choice(["1f1b", "gpipe"]), "groups": groups}


def _random_replans(rank, world, plans):
    build, data_fn, loss_fn = MODELS["digits"]
    data = data_fn()
    torch.manual_seed(0)
    worker = Worker(
        build(),
        plan_from_dict(plans[0]),
        f"w{rank}",
        loss_fn,
        SPECS["adamw"],
        dtype=torch.float64,
        grad_clip_norm=CLIP,
        allow_unused_ranks=True,
        overlap_grad_sync=False,  # the other tests cover the overlapped all-reduce
        bucket_cap_bytes=4096,  # several buckets per owner set
    )
    losses = []
    for t, plan in enumerate(plans):
        if t > 0:
            worker.apply_plan(plan_from_dict(plan))
        losses.append(worker.step(*_batch(data, t), t).loss)
    return losses, worker.full_state_dict()


def test_a_new_random_plan_every_step_trains_like_one_process(tmp_path):
    import random

    rng = random.Random(3)
    plans = [_random_plan(rng, 4, 6, BATCH) for _ in range(STEPS)]
    assert len({str(p) for p in plans}) == STEPS
    groups = [g for p in plans for g in p["groups"]]
    assert any(g["batch"] == 0 for g in groups)  # an idle group
    assert any(len(g["devices"]) > 1 for g in groups)  # a pipeline
    assert any(sum(len(g["devices"]) for g in p["groups"]) < 4 for p in plans)  # unused ranks
    results = run_ranks(_random_replans, 4, tmp_path, args=(plans,))
    ref_losses, ref_state = _reference("digits", "adamw", torch.float64, STEPS)
    tol = TOLERANCES["float64"]
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(ref_losses), **tol)
    for key, value in ref_state.items():
        torch.testing.assert_close(results[0][1][key], value, **tol, msg=key)
