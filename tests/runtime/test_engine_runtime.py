"""Engine measurements, emulation and bad input (gloo, 2 forked ranks)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetrain.errors import InputError
from hetrain.models import digits_cnn
from hetrain.plan import plan_from_dict
from hetrain.runtime import Emulation, OptimizerSpec, Worker, gather_measurements
from hetrain.runtime.engine import check_exact_layers
from hetrain.runtime.testing import run_ranks

pytestmark = pytest.mark.multiprocess


def _group(devices, stages, mb, batch):
    return {"devices": devices, "stages": stages, "microbatch_size": mb, "batch": batch}


def _data(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _cnn_worker(rank: int, plan: dict, spec: OptimizerSpec, **kw) -> Worker:
    """Rank ``rank``'s Worker of the digits CNN (16 channels, 64 hidden; seed 0) under
    ``plan``, cross-entropy loss."""
    torch.manual_seed(0)
    model = digits_cnn(channels=16, hidden=64)
    return Worker(model, plan_from_dict(plan), f"w{rank}", F.cross_entropy, spec, **kw)


def _measure(rank, world, plan, emulation, steps, autocast=False, cap_bytes=64 * 2**20):
    worker = _cnn_worker(
        rank, plan, OptimizerSpec("sgd", lr=0.05), emulation=emulation,
        autocast_bf16=autocast, bucket_cap_bytes=cap_bytes,
    )  # fmt: skip
    x, y = _data(plan_from_dict(plan).global_batch)
    return [gather_measurements(worker.step(x, y, t)) for t in range(steps)]


def test_slowdown_grows_measured_compute_time(tmp_path):
    plan = {"groups": [_group(["w0"], [[0, 6]], 64, 128), _group(["w1"], [[0, 6]], 64, 128)]}
    emulation = Emulation(slowdown={"w1": 3.0})
    steps = run_ranks(_measure, 2, tmp_path, args=(plan, emulation, 8))[0]
    assert [m["device_id"] for m in steps[0]] == ["w0", "w1"]
    # least-disturbed step of each rank (the CPU is shared): factor 3, loose bound
    fast = min(s[0]["compute_time_s"] for s in steps[1:])
    slow = min(s[1]["compute_time_s"] for s in steps[1:])
    assert slow / fast > 2.0
    for s in steps:
        assert s[0]["emulated_compute_time_s"] == 0.0
        own = s[1]["compute_time_s"] - s[1]["emulated_compute_time_s"]
        assert s[1]["emulated_compute_time_s"] >= 1.99 * own  # slept (3 - 1) x its compute
        assert s[0]["loss"] == s[1]["loss"]


def test_link_emulation_delays_transfers(tmp_path):
    # 2 stages, 4 micro-batches of 8 rows; activation after layer 4 is 8 x 64 float32 = 2 KiB
    plan = {"groups": [_group(["w0", "w1"], [[0, 4], [4, 6]], 8, 32)]}
    msg_bytes = 8 * 64 * 4
    emulation = Emulation(
        link_bandwidth_bytes_per_s={("w0", "w1"): msg_bytes / 0.02}, latency_s=0.01
    )
    steps = run_ranks(_measure, 2, tmp_path, args=(plan, emulation, 2))[0]
    for s in steps:
        first, second = s
        assert second["bytes_received"] == 4 * msg_bytes  # activations of 4 micro-batches
        assert first["bytes_received"] == 4 * msg_bytes  # their gradients
        assert first["bytes_sent"] == second["bytes_received"]
        # four activations share one emulated link (20 ms each + 10 ms latency): the last
        # arrives >= 30 + 3 x 20 ms after the first is sent, and its gradient needs >= 30 ms
        # more on the way back, all inside stage 0's step
        assert first["iteration_time_s"] >= 0.12
        assert first["link_time_s"]["w1"] >= 0.03 and second["link_time_s"]["w0"] >= 0.03
        assert first["stage"] == (0, 4) and second["num_microbatches"] == 4


def _bad_inputs(rank, world):
    loss, spec = F.cross_entropy, OptimizerSpec("sgd", lr=0.1)
    full = [_group(["w0", "w1"], [[0, 3], [3, 6]], 2, 8)]
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except ValueError as exc:  # InputError is a ValueError
            out[name] = (type(exc).__name__, str(exc))

    def make(plan, model=None, **kw):
        return Worker(model or digits_cnn(4, 8), plan_from_dict(plan), f"w{rank}", loss, spec, **kw)

    attempt("world", lambda: make({"groups": [_group(["w0"], [[0, 6]], 2, 8)]}))
    attempt("unknown", lambda: make({"groups": [_group(["w0", "gpu9"], [[0, 3], [3, 6]], 2, 8)]}))
    attempt("cover", lambda: make({"groups": [_group(["w0", "w1"], [[0, 3], [3, 5]], 2, 8)]}))
    bn = nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), nn.Flatten(), nn.Linear(72, 10)
    )
    three = {"groups": [_group(["w0", "w1"], [[0, 1], [1, 3]], 2, 8)]}
    attempt("batchnorm", lambda: make(three, bn, norm_block=4))  # μ = 2
    attempt("batchnorm-ok", lambda: make(three, bn, norm_block=2))
    drop = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(64, 10))
    attempt(
        "dropout", lambda: make({"groups": [_group(["w0", "w1"], [[0, 1], [1, 3]], 2, 8)]}, drop)
    )
    uneven = [_group(["w0"], [[0, 6]], 2, 4 + rank), _group(["w1"], [[0, 6]], 2, 4 - rank)]
    attempt("plans", lambda: make({"groups": uneven}))
    attempt("models", lambda: make({"groups": full}, digits_cnn(4, 8 + rank)))
    worker = make({"groups": full})
    attempt(
        "replan",
        lambda: worker.apply_plan(
            plan_from_dict({"groups": [_group(["w0", "w7"], [[0, 3], [3, 6]], 2, 8)]})
        ),
    )
    x, y = _data(8)
    attempt("batch", lambda: worker.step(x[:5], y[:5], 0))
    out["after"] = worker.step(x, y, 0).loss  # the worker still trains after refused input
    return out


def test_bad_plans_and_layers_raise_clear_errors_on_every_rank(tmp_path):
    results = run_ranks(_bad_inputs, 2, tmp_path, timeout_s=60, pg_timeout_s=20)
    assert results[0] == results[1] | {"after": results[0]["after"]}
    r = results[0]
    assert r["world"][0] == "InputError" and "world size 2" in r["world"][1]
    assert r["unknown"][0] == "InputError" and "'gpu9'" in r["unknown"][1]
    assert r["cover"][0] == "InputError" and "covering layers [0, 6)" in r["cover"][1]
    assert r["batchnorm"][0] == "InputError" and r["batchnorm"][1] == (
        "plan: groups[0]: share 8 and micro-batch size 2 must be multiples of the norm block 4 "
        "(--norm-block)"
    )
    assert r["batchnorm-ok"] is None and r["dropout"] is None  # norm.py, randomness.py
    assert r["replan"][0] == "InputError" and "'w7'" in r["replan"][1]
    assert r["plans"][0] == "ValueError" and "different plans" in r["plans"][1]
    assert r["models"][0] == "ValueError" and "different model structures" in r["models"][1]
    assert r["batch"][0] == "ValueError" and "global batch of 8 rows" in r["batch"][1]
    assert math.isfinite(r["after"]) and r["after"] > 0


def test_check_exact_layers_accepts_dropout_and_batchnorm_but_not_tied_tensors():
    check_exact_layers(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.BatchNorm1d(3)))
    assert issubclass(InputError, ValueError)
    emb, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    # tied input/output embedding: accepted (docs/model.md (v3) shared tensors)
    head.weight = emb.weight
    check_exact_layers(nn.Sequential(emb, nn.ReLU(), head))


def test_bf16_autocast_sends_bf16_activations_and_tracks_float32(tmp_path):
    plan = {"groups": [_group(["w0", "w1"], [[0, 4], [4, 6]], 8, 32)]}
    steps = run_ranks(_measure, 2, tmp_path, args=(plan, None, 3, True))[0]
    torch.manual_seed(0)
    model = digits_cnn(channels=16, hidden=64)
    opt = OptimizerSpec("sgd", lr=0.05).build(model.parameters())
    x, y = _data(32)
    for s in steps:
        assert s[1]["bytes_received"] == 4 * 8 * 64 * 2  # bfloat16 activations
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        assert s[0]["loss"] == pytest.approx(loss.item(), rel=3e-2)


def _under_caller_autocast(rank, world, caller_autocast):
    plan = {"groups": [_group(["w0", "w1"], [[0, 4], [4, 6]], 8, 32)]}
    worker = _cnn_worker(rank, plan, OptimizerSpec("sgd", lr=0.05))
    x, y = _data(32)
    out = []
    for t in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=caller_autocast):
            r = worker.step(x, y, t)
        out.append((r.loss, r.bytes_received))
    return out


def test_forward_ignores_an_autocast_of_the_caller_without_bf16(tmp_path):
    """Without ``autocast_bf16`` the forward runs with autocast off even inside the caller's
    ``torch.autocast``: float32 activations (4 bytes each, bf16 would be 2) and the first
    step's loss bit for bit as outside it (the backward runs in the caller's autocast, so
    later steps may differ)."""
    inside = run_ranks(_under_caller_autocast, 2, tmp_path / "in", args=(True,))
    outside = run_ranks(_under_caller_autocast, 2, tmp_path / "out", args=(False,))
    assert inside[1][0][0] == outside[1][0][0]
    assert [received for _, received in inside[1]] == [4 * 8 * 64 * 4] * 2


def test_gradient_traffic_is_proportional_to_the_parameters_a_rank_holds(tmp_path):
    # group 0 pipelines layers [0, 4) | [4, 6); group 1 holds everything on one rank
    plan = {
        "groups": [_group(["w0", "w1"], [[0, 4], [4, 6]], 4, 12), _group(["w2"], [[0, 6]], 6, 6)]
    }
    steps = run_ranks(_measure, 3, tmp_path, args=(plan, None, 1))[0]
    model = digits_cnn(channels=16, hidden=64)
    layer_bytes = [sum(p.numel() * 4 for p in layer.parameters()) for layer in model]
    ranks = steps[0]
    assert ranks[0]["sync_bytes"] == sum(layer_bytes[:4])
    assert ranks[1]["sync_bytes"] == sum(layer_bytes[4:])
    assert ranks[2]["sync_bytes"] == sum(layer_bytes)
    assert [r["batch"] for r in ranks] == [12, 12, 6]
    assert ranks[0]["num_microbatches"] == 3 and ranks[1]["stage"] == (4, 6)


def _migrate(rank, world, emulation):
    before = {"groups": [_group(["w0", "w1"], [[0, 4], [4, 6]], 4, 8)]}
    after = {"groups": [_group(["w0", "w1"], [[0, 2], [2, 6]], 4, 8)]}
    worker = _cnn_worker(
        rank, before, OptimizerSpec("sgd", lr=0.1, momentum=0.9), emulation=emulation
    )
    x, y = _data(8)
    worker.step(x, y, 0)
    return worker.apply_plan(plan_from_dict(after)), worker.owned_layers


def test_migration_moves_parameters_and_momentum_over_emulated_links(tmp_path):
    bandwidth = 2e6  # bytes/s between w0 and w1
    emulation = Emulation(nic_bandwidth_bytes_per_s={"w0": bandwidth, "w1": bandwidth})
    (sent, owned0), (received, owned1) = run_ranks(_migrate, 2, tmp_path, args=(emulation,))
    assert owned0 == (0, 1) and owned1 == (2, 3, 4, 5)
    assert sent.transfers == received.transfers == 2  # layers 2 (no parameters) and 3
    moved = digits_cnn(channels=16, hidden=64)[3]
    param_bytes = sum(p.numel() * 4 for p in moved.parameters())
    assert sent.bytes_sent == received.bytes_received >= 2 * param_bytes  # + momentum buffers
    assert received.time_s >= received.bytes_received / bandwidth


class _Masked(nn.Module):
    """A layer whose forward uses a non-persistent buffer (not in ``state_dict``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.register_buffer("mask", torch.tril(torch.ones(6, 6)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.linear.weight * self.mask).T


def _masked_chain() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), _Masked(), nn.Tanh(), nn.Linear(6, 3))


def _masked_train(rank, world, plans):
    torch.manual_seed(0)
    worker = Worker(
        _masked_chain(),
        plan_from_dict(plans[0]),
        f"w{rank}",
        F.mse_loss,
        OptimizerSpec("sgd", lr=0.1, momentum=0.9),
        dtype=torch.float64,
    )
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    losses = [worker.step(x, y, 0).loss]
    worker.apply_plan(plan_from_dict(plans[1]))  # the masked layer moves from w0 to w1
    losses += [worker.step(x, y, t).loss for t in (1, 2)]
    return losses


def test_migrated_layer_keeps_its_non_persistent_buffers(tmp_path):
    plans = [
        {"groups": [_group(["w0", "w1"], [[0, 2], [2, 4]], 3, 8)]},
        {"groups": [_group(["w0", "w1"], [[0, 1], [1, 4]], 3, 8)]},
    ]
    losses = run_ranks(_masked_train, 2, tmp_path, args=(plans,))[0]
    torch.manual_seed(0)
    model = _masked_chain().to(torch.float64)
    opt = OptimizerSpec("sgd", lr=0.1, momentum=0.9).build(model.parameters())
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    ref = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.mse_loss(model(x.double()), y.double())
        loss.backward()
        opt.step()
        ref.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-9, atol=1e-12)


DIGITS_LAYER_BYTES = [640, 18560, 0, 131328, 16640, 2600]  # digits_cnn(16, 64), float32


def test_emulated_gradient_buckets_share_the_link_one_after_the_other(tmp_path):
    # one micro-batch, every layer its own bucket (cap 1 byte): 5 buckets with parameters on
    # a 2-rank link; a ring all-reduce of n bytes among 2 needs n / bw (docs/model.md §3, G' = 2)
    bw = 150_000.0  # bytes/s: the buckets need 4.3, 124, 875, 111, 17 ms, 1.13 s in all
    plan = {"groups": [_group(["w0"], [[0, 6]], 16, 16), _group(["w1"], [[0, 6]], 16, 16)]}
    emulation = Emulation(node={"w0": "a", "w1": "b"}, nic_bandwidth_bytes_per_s={"w0": bw})
    steps = run_ranks(_measure, 2, tmp_path, args=(plan, emulation, 3, False, 1))[0]
    total_s = sum(DIGITS_LAYER_BYTES) / bw
    for s in steps:
        for r in s:
            # serialised: the last bucket ends >= sum of durations after the first could
            # start (during the backward); in parallel it would be the longest one, 0.88 s
            # (0.78 of the sum: the 0.95 margin absorbs scheduling on a loaded machine)
            assert r["sync_time_s"] + r["backward_time_s"] >= 0.95 * total_s
            assert r["sync_bytes"] == sum(DIGITS_LAYER_BYTES)


def test_emulated_slow_device_has_its_gradients_only_after_its_emulated_backward(tmp_path):
    # one bucket (default cap) is launched during the real backward, then the engine sleeps
    # (50 - 1) x that backward; the emulated device only has the gradients after the sleep,
    # so the all-reduce (0.2 s) is not hidden behind it
    plan = {"groups": [_group(["w0"], [[0, 6]], 16, 16), _group(["w1"], [[0, 6]], 16, 16)]}
    bw = sum(DIGITS_LAYER_BYTES) / 0.2
    emulation = Emulation(
        slowdown={"w0": 50.0, "w1": 50.0},
        node={"w0": "a", "w1": "b"},
        nic_bandwidth_bytes_per_s={"w0": bw},
    )
    steps = run_ranks(_measure, 2, tmp_path, args=(plan, emulation, 3))[0]
    for s in steps[1:]:
        for r in s:
            # 0.2 s of emulated link; hidden behind the sleep it would be about 0 (the
            # margin absorbs scheduling on a loaded machine)
            assert r["sync_time_s"] >= 0.15
