"""docs/model.md §3 cost model against hand-computed numbers."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import TrainingConfig, evaluate_plan, lower_bound_s
from hetrain.plan import plan_from_dict
from hetrain.profile import profile_from_dict

# 1 TFLOP/s device a (node n0, κ 1 ms), 2 TFLOP/s device b (node n1), 1 TFLOP/s device c (n0).
# nic 8 Gbit/s = 1e9 B/s, intra-node 800 Gbit/s = 1e11 B/s, latency 10 µs.
CLUSTER = {
    "links": {"intra_node_gbps": 800, "latency_us": 10},
    "devices": [
        {"id": "a", "node": "n0", "tflops": 1, "memory_gib": 1, "nic_gbps": 8,
         "power_w": 100, "price_per_hour": 3.6, "microbatch_overhead_ms": 1.0},
        {"id": "b", "node": "n1", "tflops": 2, "memory_gib": 2, "nic_gbps": 8,
         "power_w": 200, "price_per_hour": 7.2},
        {"id": "c", "node": "n0", "tflops": 1, "memory_gib": 2, "nic_gbps": 8,
         "power_w": 100, "price_per_hour": 3.6},
    ],
}  # fmt: skip
# 4 layers: f = 1e9, w = 2e9 (default) -> 3e9 FLOP/sample/layer; a = 1e6, m = 2e6 B/sample;
# p = 1e8 B per layer.
PROFILE = {
    "name": "toy",
    "layers": [
        {"name": f"l{i}", "fwd_flops": 1e9, "activation_bytes": 1e6,
         "activation_memory_bytes": 2e6, "param_bytes": 1e8}
        for i in range(4)
    ],
}  # fmt: skip
HYBRID = {
    "groups": [
        {"devices": ["a", "b"], "stages": [[0, 1], [1, 4]], "microbatch_size": 2, "batch": 6},
        {"devices": ["c"], "stages": [[0, 4]], "microbatch_size": 4, "batch": 2},
    ]
}


def _evaluate(plan: dict, schedule: str = "1f1b", batch: int = 8, cluster=CLUSTER):
    state = cluster_from_dict(cluster).state()
    profile = profile_from_dict(PROFILE).arrays()
    p = plan_from_dict({**plan, "schedule": schedule})
    return evaluate_plan(p, state, profile, TrainingConfig(batch=batch))


def test_hybrid_plan_by_hand() -> None:
    ev = _evaluate(HYBRID)
    # group 0: C1 = 2*3e9/1e12 + 1e-3 = 7e-3; C2 = 2*9e9/2e12 = 9e-3;
    # E1 = 2 * 2*1e6 / 1e9 + 2*10e-6 = 4.02e-3 (a, b on different nodes -> min nic)
    # A = 20.02e-3, M = 9e-3, n = ceil(6/2) = 3 -> T0 = 20.02e-3 + 2 * 9e-3 = 38.02e-3
    assert ev.stage_compute_s[0] == pytest.approx((7e-3, 9e-3), rel=1e-12)
    assert ev.stage_transfer_s[0] == pytest.approx((4.02e-3,), rel=1e-12)
    assert ev.group_times_s[0] == pytest.approx(38.02e-3, rel=1e-12)
    # group 1: C = 4 * 12e9 / 1e12 = 48e-3, n = 1
    assert ev.group_times_s[1] == pytest.approx(48e-3, rel=1e-12)
    # sync, G' = 2: layer 0 owned by a (n0) and c (n0) -> node-local; layers 1..3 by b (n1), c
    # t_a = 2*10e-6 + 2*(1/2)*1e8/1e11 (intra) = 1.02e-3
    # t_b = 2e-5 + 3e8/1e9 = 0.30002 ; t_c = 2e-5 + 4e8/1e9 (not all local -> nic) = 0.40002
    assert ev.sync_times_s["a"] == pytest.approx(1.02e-3, rel=1e-12)
    assert ev.sync_times_s["b"] == pytest.approx(0.30002, rel=1e-12)
    assert ev.sync_times_s["c"] == pytest.approx(0.40002, rel=1e-12)
    assert ev.sync_time_s == pytest.approx(0.40002, rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(0.44802, rel=1e-12)
    # money: (0.001 + 0.002 + 0.001) $/s * T ; energy: 400 W * T
    assert ev.cost["money"] == pytest.approx(0.004 * 0.44802, rel=1e-12)
    assert ev.cost["energy"] == pytest.approx(400 * 0.44802, rel=1e-12)
    # memory, 1F1B, o = 2: a: 1e8*4 + min(3, 2)*2*2e6 = 4.08e8; b: 3e8*4 + min(3,1)*2*6e6
    # c: 4e8*4 + 1*4*8e6
    assert ev.memory_bytes == pytest.approx({"a": 4.08e8, "b": 1.212e9, "c": 1.632e9})
    assert ev.fits
    # T_LB = 8 * 12e9 / 4e12
    assert ev.lower_bound_s == pytest.approx(0.024, rel=1e-12)
    assert ev.ratio_to_lower_bound == pytest.approx(0.44802 / 0.024)


def test_gpipe_memory_keeps_all_microbatches() -> None:
    ev = _evaluate(HYBRID, schedule="gpipe")
    # h_k = n = 3 for both stages of group 0
    assert ev.memory_bytes["a"] == pytest.approx(4e8 + 3 * 2 * 2e6)
    assert ev.memory_bytes["b"] == pytest.approx(1.2e9 + 3 * 2 * 6e6)
    assert ev.iteration_time_s == pytest.approx(0.44802, rel=1e-12)  # time is unchanged


def test_intra_node_sync_and_idle_group() -> None:
    # a and c share node n0: pure data parallel, every layer's owners on n0 -> intra-node beta
    plan = {
        "groups": [
            {"devices": ["a"], "stages": [[0, 4]], "microbatch_size": 1, "batch": 3},
            {"devices": ["c"], "stages": [[0, 4]], "microbatch_size": 5, "batch": 5},
            {"devices": ["b"], "stages": [[0, 4]], "microbatch_size": 1, "batch": 0},
        ]
    }
    ev = _evaluate(plan)
    # a: n=3, C = 12e9/1e12 + 1e-3 = 13e-3 -> T = 3 * 13e-3; c: n = 1, C = 5*12e-3 = 60e-3
    assert ev.group_times_s == pytest.approx((39e-3, 60e-3, 0.0), rel=1e-12)
    # G' = 2 (b idle): t = 2*1e-5 + 2*(1/2)*4e8/1e11 = 4.02e-3
    assert ev.sync_time_s == pytest.approx(4.02e-3, rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(64.02e-3, rel=1e-12)
    # b idle: neither used nor charged
    assert ev.cost["money"] == pytest.approx(0.002 * 64.02e-3, rel=1e-12)
    assert "b" not in ev.sync_times_s
    # b holds its replica: params + grads + Adam state, no activations
    assert ev.memory_bytes["b"] == pytest.approx(4e8 * 4)


def test_inter_node_sync_uses_nic() -> None:
    plan = {
        "groups": [
            {"devices": ["a"], "stages": [[0, 4]], "microbatch_size": 1, "batch": 4},
            {"devices": ["b"], "stages": [[0, 4]], "microbatch_size": 1, "batch": 4},
        ]
    }
    ev = _evaluate(plan)
    # b is on n1: t = 2e-5 + 4e8 / 1e9 for both
    assert ev.sync_time_s == pytest.approx(0.40002, rel=1e-12)


def test_out_of_memory_and_json_dict() -> None:
    cluster = {**CLUSTER, "devices": [dict(d) for d in CLUSTER["devices"]]}
    cluster["devices"][2]["memory_gib"] = 1  # c needs 1.632e9 > 2^30 bytes
    ev = _evaluate(HYBRID, cluster=cluster)
    assert not ev.fits
    assert ev.out_of_memory == ["c"]
    out = ev.to_json_dict()
    assert set(out) == {"iteration_time_s", "lower_bound_s", "sync_time_s", "group_times_s",
                        "cost", "fits", "devices"}  # fmt: skip
    assert out["devices"]["c"] == {"memory_bytes": 1.632e9, "memory_limit_bytes": 2.0**30}
    assert out["fits"] is False


def test_lower_bound_counts_available_devices_only() -> None:
    state = cluster_from_dict(CLUSTER).state()
    profile = profile_from_dict(PROFILE).arrays()
    state = state.with_changes(available=state.available & [True, False, True])
    assert lower_bound_s(state, profile, 8) == pytest.approx(8 * 12e9 / 2e12)
    assert math.isfinite(lower_bound_s(state, profile, 1))


def test_config_validates() -> None:
    with pytest.raises(ValueError, match="batch"):
        TrainingConfig(batch=0)
    with pytest.raises(ValueError, match="schedule"):
        TrainingConfig(batch=1, schedule="zb")


def test_planning_path_does_not_import_torch() -> None:
    code = (
        "import sys, hetrain.planner, hetrain.commands.plan, hetrain.costmodel; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
