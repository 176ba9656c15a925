"""The planner's objective equals an independent brute force over all plans on random tiny
instances (<= 4 devices, <= 6 layers, B <= 16; one or several nodes; with and without a money
queue; 1F1B and GPipe memory)."""

from __future__ import annotations

import random

import pytest
from brute_force import brute_force_objective

from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.errors import NoFeasiblePlanError
from hetrain.planner import best_plan
from hetrain.profile import profile_from_dict


def random_instance(seed: int) -> tuple[dict, dict, int]:
    rng = random.Random(seed)
    num_dev = rng.choice([1, 2, 2, 3, 3, 3, 4, 4])
    num_layers = rng.randint(max(1, num_dev - 1), 6)
    num_nodes = rng.choice([1, 2, num_dev])
    layers = [
        {
            "name": f"l{i}",
            "fwd_flops": rng.uniform(1e8, 4e9),
            "activation_bytes": rng.choice([1e4, 1e6, 2e7]) * rng.uniform(0.5, 2),
            "param_bytes": rng.choice([1e6, 5e7, 3e8]) * rng.uniform(0.5, 2),
        }
        for i in range(num_layers)
    ]
    total_param = sum(ly["param_bytes"] for ly in layers)
    devices = []
    for d in range(num_dev):
        # memory from "model fits easily" down to "needs a pipeline"
        mem = total_param * 4 * rng.choice([0.4, 0.7, 1.2, 3.0]) / 2**30 + 0.01
        devices.append(
            {
                "id": f"d{d}",
                "node": f"n{rng.randrange(num_nodes)}",
                "tflops": rng.choice([0.5, 1.0, 2.0, 4.0]) * rng.uniform(0.8, 1.2),
                "memory_gib": mem,
                "nic_gbps": rng.choice([1.0, 10.0, 100.0]),
                "price_per_hour": rng.uniform(0.5, 5.0),
                "power_w": rng.uniform(50, 400),
                "microbatch_overhead_ms": rng.choice([0.0, 0.5, 3.0]),
            }
        )
    cluster = {
        "links": {"intra_node_gbps": rng.choice([100.0, 800.0]), "latency_us": rng.choice([0, 20])},
        "devices": devices,
    }
    batch = rng.randint(1, 16)
    profile: dict = {"name": f"r{seed}", "layers": layers}
    # SPEC v3 inputs, drawn after the rest so the v2 parts of each instance stay as they were
    if seed % 4 == 1:  # per-layer overhead λ
        for dev in devices:
            dev["layer_overhead_ms"] = rng.choice([0.0, 0.2, 1.0])
    if seed % 4 == 3:  # frozen parameters
        for ly in layers:
            ly["frozen_param_bytes"] = rng.choice([0.0, 1e7, 2e8])
    if seed % 5 in (1, 2) and num_layers >= 2:  # a tied tensor (first and last layer)
        profile["shared"] = [
            {"name": "tied", "bytes": rng.choice([2e7, 2e8]), "layers": [0, num_layers - 1],
             "frozen": seed % 5 == 2}
        ]  # fmt: skip
    return cluster, profile, batch


SEEDS = list(range(32))


@pytest.mark.parametrize("seed", SEEDS)
def test_planner_matches_brute_force(seed: int) -> None:
    cluster, profile, batch = random_instance(seed)
    state = cluster_from_dict(cluster).state()
    arrays = profile_from_dict(profile).arrays()
    schedule = "gpipe" if seed % 3 == 2 else "1f1b"
    config = TrainingConfig(batch=batch, schedule=schedule)
    # with a money queue on odd seeds: V*T + Q*y_money, Q chosen to matter (~ V / price)
    q = 0.0 if seed % 2 == 0 else random.Random(seed).choice([300.0, 3000.0])
    queues = {"money": q} if q else None
    expected = brute_force_objective(cluster, profile, batch, queue_money=q, schedule=schedule)
    if expected == float("inf"):
        with pytest.raises(NoFeasiblePlanError):
            best_plan(state, arrays, config, queues=queues)
        return
    plan = best_plan(state, arrays, config, queues=queues)
    ev = evaluate_plan(plan, state, arrays, config)
    assert ev.fits
    assert plan.global_batch == batch
    assert ev.objective(1.0, queues) == pytest.approx(expected, rel=1e-9)
    assert plan.iteration_time_s == ev.iteration_time_s


def test_instances_cover_the_cases() -> None:
    """The random instances include several nodes, a money queue, and plans of every shape."""
    shapes = set()
    for seed in SEEDS:
        cluster, profile, batch = random_instance(seed)
        nodes = {d["node"] for d in cluster["devices"]}
        shapes.add(("multi-node" if len(nodes) > 1 else "one-node", len(cluster["devices"])))
    assert ("multi-node", 4) in shapes and ("one-node", 4) in shapes or len(shapes) >= 5
