"""The planner's objective equals an independent brute force over all plans:

* 32 random tiny instances (<= 4 devices, <= 6 layers, B <= 16), equal to 1e-9;
* 50 random instances of 5 devices and 20 of 6 (4-5 layers, B 6-8, as in issue 12), within
  0.1 % (in fact equal: the exhaustive search is exact there);

one or several nodes; without queues, with a money queue, an energy queue or both (objective
``V·T + Σ_j Q_j y_j``); 1F1B and GPipe memory; docs/model.md (v3)'s per-layer overhead, frozen
parameters and shared tensors; a norm block on some. ``test_instances_cover_the_cases``
checks that the instances and their optimal plans cover these cases and every plan shape.
"""

from __future__ import annotations

import copy
import random

import pytest
from brute_force import brute_force_objective, device_kind

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
            "param_bytes": rng.choice([1e5, 1e6, 5e7, 3e8]) * rng.uniform(0.5, 2),
        }
        for i in range(num_layers)
    ]
    total_param = sum(ly["param_bytes"] for ly in layers)
    devices = []
    for d in range(num_dev):
        # memory from "model fits easily" down to "needs a pipeline"
        mem = total_param * 4 * rng.choice([0.4, 0.7, 1.2, 3.0]) / 2**30 + rng.choice([0.01, 0.5])
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
    # docs/model.md (v3) inputs, drawn after the rest so the v2 parts of each instance stay as they
    # were
    if seed % 4 == 1:  # per-layer overhead λ
        for dev in devices:
            dev["layer_overhead_ms"] = rng.choice([0.0, 0.2, 1.0])
        if seed % 8 == 5:  # per-layer overhead weights ν_l (docs/model.md §3), own generator
            nu = random.Random(seed).choices([0.2, 1.0, 2.5], k=len(layers))
            for ly, weight in zip(layers, nu, strict=True):
                ly["overhead_weight"] = weight
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
WIDE_SEEDS = [(5, seed) for seed in range(50)] + [(6, seed) for seed in range(20)]

KINDS = [("v100", 13.2), ("p100", 8.5), ("t4", 6.3), ("k80", 2.9), ("a100", 19.5)]


def wide_instance(num_dev: int, seed: int) -> dict:
    """A random instance of ``num_dev`` devices of the kinds of issue 12 (4-5 layers of 1-3
    GFLOP, B 6-8, NICs down to 0.79 Gbit/s), with its queues, schedule and norm block."""
    rng = random.Random(1000 * num_dev + seed)
    num_layers = rng.randint(4, 5)
    num_nodes = rng.choice([1, 2, 3, num_dev])
    # light models favour data parallelism, heavy ones pipelines (the all-reduce)
    param_scale = rng.choice([1e5, 1e6, 5e7, 3e8])
    layers = [
        {"name": f"l{i}", "fwd_flops": rng.uniform(1e9, 3e9),
         "activation_bytes": rng.choice([1e4, 1e6, 2e7]) * rng.uniform(0.5, 2),
         "param_bytes": param_scale * rng.uniform(0.5, 2)}
        for i in range(num_layers)
    ]  # fmt: skip
    total_param = sum(ly["param_bytes"] for ly in layers)
    devices = []
    for d in range(num_dev):
        kind, tflops = rng.choice(KINDS)
        devices.append(
            {
                "id": f"{kind}-{d}",
                "node": f"n{rng.randrange(num_nodes)}",
                "tflops": tflops * rng.uniform(0.9, 1.1),
                "memory_gib": total_param * 4 * rng.choice([0.4, 0.7, 1.2, 3.0]) / 2**30
                + rng.choice([0.01, 0.5]),
                "nic_gbps": rng.choice([0.79, 10.0, 100.0]),
                "price_per_hour": rng.uniform(0.5, 5.0),
                "power_w": rng.uniform(50, 400),
                "microbatch_overhead_ms": rng.choice([0.0, 0.5, 3.0]),
                "layer_overhead_ms": rng.choice([0.0, 0.0, 0.3]),
            }
        )
    profile: dict = {"name": f"w{num_dev}-{seed}", "layers": layers}
    if seed % 4 == 3:
        for ly in layers:
            ly["frozen_param_bytes"] = rng.choice([0.0, 1e7, 2e8])
    if seed % 3 == 2:  # per-layer overhead weights ν_l (docs/model.md §3), own generator
        nu = random.Random(seed).choices([0.2, 1.0, 2.5], k=num_layers)
        for ly, weight in zip(layers, nu, strict=True):
            ly["overhead_weight"] = weight
    if seed % 5 == 1:
        profile["shared"] = [
            {"name": "tied", "bytes": rng.choice([2e7, 2e8]), "layers": [0, num_layers - 1],
             "frozen": seed % 10 == 6}
        ]  # fmt: skip
    batch = rng.randint(6, 8)
    kind = seed % 4  # none, money, energy, both
    queues = {}
    if kind in (1, 3):
        queues["money"] = rng.choice([300.0, 3000.0])
    if kind in (2, 3):
        queues["energy"] = rng.choice([1e-3, 1e-2])
    return {
        "cluster": {
            "links": {
                "intra_node_gbps": rng.choice([100.0, 800.0]),
                "latency_us": rng.choice([0, 20]),
            },
            "devices": devices,
        },  # fmt: skip
        "profile": profile,
        "batch": batch,
        "queues": queues,
        "schedule": "gpipe" if seed % 6 == 5 else "1f1b",
        "norm_block": 2 if seed % 7 == 3 and batch % 2 == 0 else None,
    }


def _check(case: dict, rel: float) -> None:
    state = cluster_from_dict(case["cluster"]).state()
    arrays = profile_from_dict(case["profile"]).arrays()
    queues = case["queues"] or None
    config = TrainingConfig(
        batch=case["batch"], schedule=case["schedule"], norm_block=case["norm_block"]
    )
    expected = brute_force_objective(
        case["cluster"], case["profile"], case["batch"],
        queue_money=case["queues"].get("money", 0.0),
        queue_energy=case["queues"].get("energy", 0.0),
        schedule=case["schedule"], norm_block=case["norm_block"],
    )  # fmt: skip
    if expected == float("inf"):
        with pytest.raises(NoFeasiblePlanError):
            best_plan(state, arrays, config, queues=queues)
        return
    plan = best_plan(state, arrays, config, queues=queues)
    ev = evaluate_plan(plan, state, arrays, config)
    assert ev.fits
    assert plan.global_batch == case["batch"]
    got = ev.objective(1.0, queues)
    assert got >= expected * (1 - 1e-9)  # the brute force is the optimum
    assert got <= expected * (1 + rel)
    assert plan.iteration_time_s == ev.iteration_time_s


def tiny_case(seed: int) -> dict:
    cluster, profile, batch = random_instance(seed)
    # with a money queue on odd seeds: V*T + Q*y_money, Q chosen to matter (~ V / price)
    q = 0.0 if seed % 2 == 0 else random.Random(seed).choice([300.0, 3000.0])
    return {
        "cluster": cluster,
        "profile": profile,
        "batch": batch,
        "queues": {"money": q} if q else {},
        "schedule": "gpipe" if seed % 3 == 2 else "1f1b",
        "norm_block": None,
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_planner_matches_brute_force(seed: int) -> None:
    _check(tiny_case(seed), 1e-9)


@pytest.mark.parametrize(("num_devices", "seed"), WIDE_SEEDS)
def test_planner_matches_brute_force_at_5_and_6_devices(num_devices: int, seed: int) -> None:
    _check(wide_instance(num_devices, seed), 1e-3)


def with_measured_times(case: dict, seed: int) -> dict:
    """``case`` with measured per-layer times (docs/model.md §3, §7) for most of its device
    kinds: 1-3 micro-batch sizes, per layer ``t(μ) = o + μ p`` with ``p`` the FLOP model's
    per-sample time times 0.3-3 (layers run at their own speed), ``o`` 0-2 ms, and ±30 %
    noise per measured size (so some layers' times fall between sizes and the
    extrapolation may reach 0). Devices without an id of the form ``kind-<n>`` get an
    explicit ``kind`` shared by some of them."""
    rng = random.Random(7919 * seed + len(case["cluster"]["devices"]))
    case = copy.deepcopy(case)
    devices = case["cluster"]["devices"]
    for d in devices:
        if device_kind(d) == d["id"]:
            d["kind"] = rng.choice(["ka", "kb", "kc"])
    kinds = sorted({device_kind(d) for d in devices})
    layers = case["profile"]["layers"]
    tflops = {device_kind(d): d["tflops"] for d in devices}
    measured = {}
    for kind in kinds:
        if rng.random() < 0.25:
            continue  # this kind keeps the FLOP model
        sizes = rng.choice([[1], [2], [1, 4], [1, 2, 8], [2, 3, 16]])
        fwd, bwd = [], []
        slope = [
            3 * ly["fwd_flops"] / (tflops[kind] * 1e12) * rng.uniform(0.3, 3.0) for ly in layers
        ]
        offset = [rng.uniform(0.0, 2e-3) for _ in layers]
        for mu in sizes:
            row = [(o + mu * p) * rng.uniform(0.7, 1.3) for o, p in zip(offset, slope, strict=True)]
            fwd.append([t / 3 for t in row])
            bwd.append([2 * t / 3 for t in row])
        measured[kind] = {"microbatch_sizes": sizes, "fwd_s": fwd, "bwd_s": bwd}
    if not measured:
        kind = kinds[0]
        measured[kind] = {"microbatch_sizes": [1], "fwd_s": [[1e-3] * len(layers)],
                          "bwd_s": [[2e-3] * len(layers)]}  # fmt: skip
    case["profile"]["measured_times"] = measured
    return case


MEASURED_SEEDS = list(range(24))
MEASURED_WIDE_SEEDS = [(5, seed) for seed in range(12)] + [(6, seed) for seed in range(4)]


@pytest.mark.parametrize("seed", MEASURED_SEEDS)
def test_planner_matches_brute_force_with_measured_times(seed: int) -> None:
    _check(with_measured_times(tiny_case(seed), seed), 1e-9)


@pytest.mark.parametrize(("num_devices", "seed"), MEASURED_WIDE_SEEDS)
def test_planner_matches_brute_force_with_measured_times_at_5_and_6_devices(
    num_devices: int, seed: int
) -> None:
    _check(with_measured_times(wide_instance(num_devices, seed), seed), 1e-3)


def _shape(plan) -> str:
    sizes = [len(g.devices) for g in plan.groups]
    if len(sizes) == 1:
        return "single device" if sizes[0] == 1 else "pipeline"
    return "data parallel" if max(sizes) == 1 else "hybrid"


def test_instances_cover_the_cases() -> None:
    """The instances include one and several nodes at every size, 5 and 6 devices, every kind
    of queue, both schedules, the v3 inputs and a norm block; and the optimal plans of the
    tiny instances (computed here: fast) take every shape — one device, a pipeline, pure data
    parallelism and a hybrid."""
    cases = [tiny_case(s) for s in SEEDS] + [wide_instance(n, s) for n, s in WIDE_SEEDS]
    sizes = [len(c["cluster"]["devices"]) for c in cases]
    assert sizes.count(5) >= 50 and sizes.count(6) >= 20
    nodes = {
        (len(c["cluster"]["devices"]), len({d["node"] for d in c["cluster"]["devices"]}) > 1)
        for c in cases
    }
    for n in (4, 5, 6):
        assert (n, True) in nodes and (n, False) in nodes
    queue_kinds = {tuple(sorted(c["queues"])) for c in cases}
    assert queue_kinds >= {(), ("money",), ("energy",), ("energy", "money")}
    assert {c["schedule"] for c in cases} == {"1f1b", "gpipe"}
    assert any(c["norm_block"] for c in cases)
    assert any(c["profile"].get("shared") for c in cases)
    assert any(t.get("frozen") for c in cases for t in c["profile"].get("shared", []))
    assert any(ly.get("frozen_param_bytes") for c in cases for ly in c["profile"]["layers"])
    assert any(d.get("layer_overhead_ms") for c in cases for d in c["cluster"]["devices"])
    assert any(
        ly.get("overhead_weight", 1.0) != 1.0 for c in cases for ly in c["profile"]["layers"]
    )
    shapes = set()
    for seed in SEEDS:
        case = tiny_case(seed)
        state = cluster_from_dict(case["cluster"]).state()
        arrays = profile_from_dict(case["profile"]).arrays()
        config = TrainingConfig(batch=case["batch"], schedule=case["schedule"])
        try:
            plan = best_plan(state, arrays, config, queues=case["queues"] or None)
        except NoFeasiblePlanError:
            continue
        shapes.add(_shape(plan))
    assert shapes == {"single device", "pipeline", "data parallel", "hybrid"}
