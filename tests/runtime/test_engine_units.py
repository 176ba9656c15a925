"""Pure pieces of the engine: schedules, layouts, buckets, migration transfers, emulation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.errors import InputError
from hetrain.plan import plan_from_dict
from hetrain.runtime.data_parallel import build_buckets
from hetrain.runtime.emulation import Emulation
from hetrain.runtime.layout import build_layout
from hetrain.runtime.migrate import plan_transfers
from hetrain.runtime.optim import OptimizerSpec, clip_coefficient
from hetrain.runtime.stages import schedule_ops


def _plan(*groups, schedule="1f1b"):
    return plan_from_dict(
        {
            "schedule": schedule,
            "groups": [
                {"devices": d, "stages": s, "microbatch_size": m, "batch": b}
                for d, s, m, b in groups
            ],
        }
    )


@pytest.mark.parametrize("stages,n", [(1, 3), (3, 2), (4, 7), (2, 1)])
def test_1f1b_keeps_at_most_k_minus_stage_microbatches_alive(stages, n):
    for k in range(stages):
        ops = schedule_ops("1f1b", stages, k, n)
        assert [i for op, i in ops if op == "F"] == list(range(n))
        assert [i for op, i in ops if op == "B"] == list(range(n))
        alive = peak = 0
        for op, _ in ops:
            alive += 1 if op == "F" else -1
            peak = max(peak, alive)
        assert peak == min(n, stages - k)  # docs/model.md §3 h_k under 1F1B
    gpipe = schedule_ops("gpipe", stages, 0, n)
    assert gpipe[:n] == [("F", i) for i in range(n)]
    with pytest.raises(ValueError, match="schedule"):
        schedule_ops("zb", 2, 0, 2)


def test_layout_offsets_microbatches_and_owners():
    plan = _plan(
        (["b", "a"], [[0, 2], [2, 5]], 4, 10), (["c"], [[0, 5]], 3, 0), (["d"], [[0, 5]], 5, 6)
    )
    lay = build_layout(plan, ["a", "b", "c", "d"], 5)
    assert [g.offset for g in lay.groups] == [0, 10, 10]
    assert lay.groups[0].microbatches() == [(0, 4), (4, 8), (8, 10)]
    assert lay.groups[2].microbatches() == [(10, 15), (15, 16)]
    assert lay.owners[1] == (1, 2, 3) and lay.owners[3] == (0, 2, 3)
    assert lay.active_owners[3] == (0, 3) and lay.canonical == (1, 1, 0, 0, 0)
    assert lay.owned_layers(0) == (2, 3, 4) and lay.position(2) == (1, 0)
    buckets = build_buckets(lay)
    assert [(b.layers, b.active, b.idle) for b in buckets] == [
        ((0, 1), (1, 3), (2,)),
        ((2, 3, 4), (0, 3), (2,)),
    ]
    capped = build_buckets(lay, [10, 10, 10, 10, 10], cap_bytes=20)
    assert [b.layers for b in capped] == [(0, 1), (2, 3), (4,)]
    with pytest.raises(InputError, match="world size 5"):
        build_layout(plan, ["a", "b", "c", "d", "e"], 5)
    with pytest.raises(InputError, match="'d'"):
        build_layout(plan, ["a", "b", "c"], 5)


def test_plan_transfers_move_each_missing_layer_once_from_an_old_owner():
    old = build_layout(
        _plan((["a", "b"], [[0, 2], [2, 4]], 2, 8), (["c"], [[0, 4]], 2, 8)), ["a", "b", "c"], 4
    )
    new = build_layout(
        _plan((["b", "c", "a"], [[0, 1], [1, 2], [2, 4]], 2, 16)), ["a", "b", "c"], 4
    )
    moves = plan_transfers(old, new)
    assert {(t.layer, t.dst) for t in moves} == {(0, 1), (2, 0), (3, 0)}
    for t in moves:
        assert t.src in old.owners[t.layer] and t.dst not in old.owners[t.layer]
    assert plan_transfers(old, old) == []


def test_emulation_link_rules_and_validation():
    em = Emulation(
        nic_bandwidth_bytes_per_s={"a": 100.0, "b": 50.0},
        node={"a": "n0", "c": "n0"},
        intra_node_bandwidth_bytes_per_s=1000.0,
        latency_s=0.5,
    )
    assert em.link_bandwidth("a", "b") == 50.0
    assert em.link_bandwidth("a", "c") == 1000.0
    assert em.transfer_time_s("b", "a", 100) == pytest.approx(2.5)
    assert math.isinf(Emulation().link_bandwidth("x", "y")) and not Emulation().limits_links()
    with pytest.raises(ValueError, match="slowdown"):
        Emulation(slowdown={"a": 0.5})
    with pytest.raises(ValueError, match="bandwidth"):
        Emulation(nic_bandwidth_bytes_per_s={"a": 0.0})


def test_optimizer_spec_and_clip_coefficient():
    spec = OptimizerSpec("adamw", lr=0.1, lr_schedule=lambda t: 0.5**t)
    assert spec.lr_at(2) == pytest.approx(0.025) and spec.state_factor == 2.0
    assert OptimizerSpec("sgd", momentum=0.9).state_factor == 1.0
    with pytest.raises(ValueError, match="optimizer.name"):
        OptimizerSpec("lamb")
    with pytest.raises(ValueError, match="optimizer.lr"):
        OptimizerSpec(lr=-1.0)
    assert clip_coefficient(10.0, 1.0) == pytest.approx(0.1)
    assert clip_coefficient(0.5, 1.0) == 1.0 and clip_coefficient(5.0, None) == 1.0


def test_emulation_from_cluster_state_and_microbatch_overhead():
    from hetrain.cluster import cluster_from_dict
    from hetrain.runtime.emulation import slow_down

    spec = cluster_from_dict(
        {
            "links": {"intra_node_gbps": 80, "latency_us": 20},
            "devices": [
                {
                    "id": "a",
                    "node": "n0",
                    "tflops": 1,
                    "memory_gib": 1,
                    "nic_gbps": 8,
                    "microbatch_overhead_ms": 3.0,
                },
                {"id": "b", "node": "n0", "tflops": 1, "memory_gib": 1, "nic_gbps": 8},
                {"id": "c", "node": "n1", "tflops": 1, "memory_gib": 1, "nic_gbps": 4},
            ],
        }
    )
    em = Emulation.from_cluster_state(spec.state(), {"c": 2.0}, overhead=True)
    assert em.link_bandwidth("a", "b") == pytest.approx(1e10)  # 80 Gbit/s intra-node
    assert em.link_bandwidth("a", "c") == pytest.approx(5e8)  # min NIC, 4 Gbit/s
    assert em.latency_s == pytest.approx(2e-5) and em.overhead_of("a") == pytest.approx(3e-3)
    assert em.slowdown_of("c") == 2.0 and em.overhead_of("b") == 0.0
    slept = slow_down(em, "a", 0.001, microbatch=True)  # factor 1, κ = 3 ms
    assert slept >= 3e-3
    assert slow_down(em, "c", 0.004) >= 4e-3  # (2 - 1) x 4 ms


@st.composite
def _plans(draw, world=5, num_layers=6):
    """A random valid plan over devices d0..d{world-1} (some unused, some groups idle)."""
    devices = draw(st.permutations([f"d{i}" for i in range(world)]))
    used = devices[: draw(st.integers(1, world))]
    cuts = sorted(
        draw(st.sets(st.integers(1, len(used) - 1), max_size=len(used) - 1))
        if len(used) > 1
        else set()
    )
    members = [used[a:b] for a, b in zip([0, *cuts], [*cuts, len(used)], strict=True)]
    groups = []
    for i, m in enumerate(members):
        m = m[:num_layers]
        splits = sorted(
            draw(st.sets(st.integers(1, num_layers - 1), min_size=len(m) - 1, max_size=len(m) - 1))
        )
        bounds = [0, *splits, num_layers]
        batch = draw(st.integers(1 if i == 0 else 0, 20))
        groups.append(
            {
                "devices": m,
                "stages": [[bounds[k], bounds[k + 1]] for k in range(len(m))],
                "microbatch_size": draw(st.integers(1, 8)),
                "batch": batch,
            }
        )
    return plan_from_dict({"groups": groups})


RANK_DEVICES = [f"d{i}" for i in range(5)]


@settings(max_examples=60, deadline=None)
@given(old=_plans(), new=_plans(), cap=st.integers(1, 40))
def test_layout_buckets_and_transfers_invariants(old, new, cap):
    a = build_layout(old, RANK_DEVICES, 6, require_all=False)
    b = build_layout(new, RANK_DEVICES, 6, require_all=False)
    for lay in (a, b):
        for layer in range(6):  # one owner per group, canonical = first active group's owner
            assert len(lay.owners[layer]) == len(lay.groups)
            first_active = next(g for g in lay.groups if g.active)
            assert lay.canonical[layer] in first_active.ranks
        for g in lay.groups:  # micro-batches tile the group's rows
            rows = [r for s, e in g.microbatches() for r in range(s, e)]
            assert rows == list(range(g.offset, g.offset + g.batch))
    buckets = build_buckets(b, [10] * 6, cap_bytes=cap)
    assert [layer for bk in buckets for layer in bk.layers] == list(range(6))
    for bk in buckets:
        assert set(bk.active) | set(bk.idle) == set(b.owners[bk.layers[0]])
        assert len(bk.layers) == 1 or 10 * len(bk.layers) <= cap
    holders = {layer: set(a.owners[layer]) for layer in range(6)}
    for t in plan_transfers(a, b):  # sources already hold the layer when it is sent
        assert t.src in holders[t.layer] and t.dst not in holders[t.layer]
        holders[t.layer].add(t.dst)
    for layer in range(6):
        assert set(b.owners[layer]) <= holders[layer]


class _DictStore:
    """A key-value store with ``set`` and a blocking-free ``multi_get`` (missing keys raise,
    as a store times out), counting requests."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.requests = 0

    def set(self, key: str, value: bytes) -> None:
        self.requests += 1
        self.values[key] = bytes(value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.requests += 1
        return [self.values[k] for k in keys]


@settings(max_examples=25, deadline=None)
@given(
    world=st.integers(1, 6),
    steps=st.integers(1, 8),
    length=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_store_sums_sum_every_rank_in_rank_order_with_reused_keys(world, steps, length, seed):
    """Every rank posts its vector of each step and reads the previous step's, as the engine
    does: each read is the float64 sum over the ranks in rank order, of that step only (keys
    are reused modulo STORE_SLOTS), one store request per post and per read."""
    import numpy as np
    import torch

    from hetrain.runtime.step_result import STORE_SLOTS, StoreSums

    rng = np.random.default_rng(seed)
    store = _DictStore()
    ranks = [StoreSums(store, "p", r, world, timeout_s=1.0) for r in range(world)]
    vectors = rng.normal(size=(steps, world, length)) * 10.0 ** rng.integers(-3, 4, size=length)
    fetches: list[list] = []
    for t in range(steps):
        fetches.append(
            [
                ranks[r].post(t, torch.tensor(vectors[t, r], dtype=torch.float64))
                for r in range(world)
            ]
        )
        if t >= 1:
            for r in range(world):
                expected = vectors[t - 1, 0].copy()
                for k in range(1, world):
                    expected = expected + vectors[t - 1, k]
                assert fetches[t - 1][r]() == expected.tolist()
    assert len(store.values) == min(steps, STORE_SLOTS) * world
    assert store.requests == steps * world + (steps - 1) * world


def test_store_sums_wait_for_a_stale_key_then_fail_with_one_line():
    """A key that still holds an older step is waited for; past the timeout, one line names
    the step."""
    import torch

    from hetrain.runtime.step_result import STORE_SLOTS, StoreSums

    store = _DictStore()
    a, b = (StoreSums(store, "p", r, 2, timeout_s=0.05) for r in range(2))
    a.post(0, torch.ones(2, dtype=torch.float64))
    b.post(0, torch.ones(2, dtype=torch.float64))
    fetch = a.post(STORE_SLOTS, torch.ones(2, dtype=torch.float64))  # rank b still at step 0
    with pytest.raises(RuntimeError, match=f"no value of step {STORE_SLOTS} from every rank"):
        fetch()
    b.post(STORE_SLOTS, torch.full((2,), 2.0, dtype=torch.float64))
    assert fetch() == [3.0, 3.0]
