"""The best plan is pure data parallel, pure pipeline or a hybrid depending on the numbers;
each test says why with hand-computed times (docs/model.md §3)."""

from __future__ import annotations

import pytest

from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.planner import best_plan
from hetrain.profile import profile_from_dict


def _plan(cluster: dict, layers: list[dict], batch: int):
    state = cluster_from_dict(cluster).state()
    profile = profile_from_dict({"name": "m", "layers": layers}).arrays()
    config = TrainingConfig(batch=batch)
    plan = best_plan(state, profile, config)
    return plan, evaluate_plan(plan, state, profile, config)


def _dev(name: str, node: str, tflops: float, gib: float, nic_gbps: float) -> dict:
    return {"id": name, "node": node, "tflops": tflops, "memory_gib": gib, "nic_gbps": nic_gbps}


def test_uneven_data_parallel() -> None:
    # a: 1 TFLOP/s, b: 3 TFLOP/s on one node; 2 layers of 3e9 FLOP/sample (f + 2f) -> 6 ms per
    # sample on a, 2 ms on b. Parameters are tiny (1 kB/layer): sync = 2*(1/2)*2e3/1e9 = 2 µs.
    # Activations are huge (1e8 B/sample) over an 8 Gbit/s link (1e9 B/s): a pipeline boundary
    # costs mu * 0.2 s. Best: data parallel with shares 2 (a) and 6 (b): both take 12 ms,
    # T = 12 ms + 2 µs = T_LB (8 * 6e9 / 4e12 = 12 ms) + sync. Even shares would take 4*6 = 24 ms.
    cluster = {
        "links": {"intra_node_gbps": 8, "latency_us": 0},
        "devices": [_dev("a", "n0", 1, 10, 8), _dev("b", "n0", 3, 10, 8)],
    }
    layers = [{"fwd_flops": 1e9, "activation_bytes": 1e8, "param_bytes": 1e3}] * 2
    plan, ev = _plan(cluster, layers, 8)
    assert sorted((g.devices, g.batch) for g in plan.groups) == [(("a",), 2), (("b",), 6)]
    assert ev.group_times_s == pytest.approx((12e-3, 12e-3), rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(12e-3 + 2e-6, rel=1e-9)
    assert ev.lower_bound_s == pytest.approx(12e-3)


def test_pure_pipeline() -> None:
    # Two 1 TFLOP/s devices on different nodes with a 1 Gbit/s NIC (1.25e8 B/s); 2 layers of
    # 3e9 FLOP/sample (3 ms) and 1 GB of parameters each; activations 1 kB/sample.
    # Data parallel: sync = 2*(1/2)*2e9/1.25e8 = 16 s. One device alone: 8 * 6 ms = 48 ms.
    # Pipeline a -> b, mu = 1: C = 3 ms, E = 2e3/1.25e8 = 16 µs, A = 6.016 ms, M = 3 ms,
    # T = 6.016 + 7 * 3 = 27.016 ms (mu = 2 would give 12.032 + 3 * 6 = 30.032 ms).
    cluster = {
        "links": {"intra_node_gbps": 800, "latency_us": 0},
        "devices": [_dev("a", "n0", 1, 100, 1), _dev("b", "n1", 1, 100, 1)],
    }
    layers = [{"fwd_flops": 1e9, "activation_bytes": 1e3, "param_bytes": 1e9}] * 2
    plan, ev = _plan(cluster, layers, 8)
    assert len(plan.groups) == 1
    (group,) = plan.groups
    assert len(group.devices) == 2 and group.stages == ((0, 1), (1, 2))
    assert group.microbatch_size == 1 and group.batch == 8
    assert ev.iteration_time_s == pytest.approx(27.016e-3, rel=1e-9)
    assert ev.sync_time_s == 0.0


def test_hybrid_pipelines_across_nodes_data_parallel_inside() -> None:
    # Nodes n0 = {a, b}, n1 = {c, d}; 1 TFLOP/s each; intra-node 800 Gbit/s (1e11 B/s), NIC
    # 100 Gbit/s (1.25e10 B/s). 4 layers of 3 ms/sample, 1e8 B parameters each, 1 MB
    # activations. Memory 1.2 GiB: the whole model needs 4e8 * (2 + 2) = 1.6e9 B > 1.29e9 B, so
    # no device holds it alone (no pure data parallel); two layers (8e8 B) fit.
    # Hybrid: groups (a, c) and (b, d), stages [0, 2) on n0 and [2, 4) on n1, b_g = 4, mu = 1:
    #   A = 6 + 6 ms + E (2e6 / 1.25e10 = 0.16 ms) = 12.16 ms, M = 6 ms, T_g = 12.16 + 3*6 =
    #   30.16 ms; each layer's two owners share a node -> intra-node all-reduce:
    #   sync = 2 * (1/2) * 2e8 / 1e11 = 2 ms; T = 32.16 ms.
    # Pure pipeline a, b, c, d (1 layer each, mu = 1, 8 micro-batches): A = 12 ms + 0.02 + 0.16
    #   + 0.02 ms = 12.2 ms, M = 3 ms, T = 12.2 + 7 * 3 = 33.2 ms.
    # Groups = nodes instead: same T_g but owners on different nodes -> NIC all-reduce
    #   2e8 / 1.25e10 = 16 ms; T = 46.16 ms.
    cluster = {
        "links": {"intra_node_gbps": 800, "latency_us": 0},
        "devices": [
            _dev("a", "n0", 1, 1.2, 100), _dev("b", "n0", 1, 1.2, 100),
            _dev("c", "n1", 1, 1.2, 100), _dev("d", "n1", 1, 1.2, 100),
        ],
    }  # fmt: skip
    layers = [{"fwd_flops": 1e9, "activation_bytes": 1e6, "param_bytes": 1e8}] * 4
    plan, ev = _plan(cluster, layers, 8)
    assert len(plan.groups) == 2
    nodes = {"a": 0, "b": 0, "c": 1, "d": 1}
    for g in plan.groups:
        assert [nodes[d] for d in g.devices] == [0, 1]
        assert g.stages == ((0, 2), (2, 4)) and g.batch == 4 and g.microbatch_size == 1
    assert ev.sync_time_s == pytest.approx(2e-3, rel=1e-9)
    assert ev.iteration_time_s == pytest.approx(32.16e-3, rel=1e-9)
