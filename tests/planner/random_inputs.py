"""Seeded random model profiles shared by the planner's property tests."""

from __future__ import annotations

import numpy as np


def random_profile(rng: np.random.Generator, min_layers: int, max_layers: int) -> dict:
    """A docs/model.md §7 profile object with ``min_layers..max_layers`` (inclusive) layers of
    random
    FLOPs (1e9-5e11 per sample), activation bytes (1e5-5e7) and parameter bytes (~1e6-1e9)."""
    num_layers = int(rng.integers(min_layers, max_layers + 1))
    return {
        "layers": [
            {"name": f"l{i}", "fwd_flops": float(rng.uniform(1e9, 5e11)),
             "activation_bytes": float(rng.uniform(1e5, 5e7)),
             "param_bytes": float(rng.choice([1e6, 1e8, 1e9]) * rng.uniform(0.5, 1.5))}
            for i in range(num_layers)
        ]
    }  # fmt: skip


MEASURED_KINDS = [("a100", 312.0, 40.0, 100.0), ("v100", 125.0, 16.0, 25.0),
                  ("t4", 65.0, 16.0, 10.0), ("k80", 8.7, 12.0, 10.0),
                  ("gh", 990.0, 96.0, 200.0)]  # fmt: skip


def measured_times_case(seed: int) -> dict:
    """A seeded planning instance with measured per-layer times (docs/model.md §3, §7):
    5-16 devices of 2-4 kinds on 1-4 nodes, 8-30 layers, ``B`` 16-128; every kind but
    (sometimes) one has measured times at 1-3 micro-batch sizes, per layer
    ``t(μ) = o + μ p`` (``p`` the FLOP model's per-sample time times 0.3-3, ``o`` 0-2 ms) with
    ±30 % noise per size. Returns ``{"cluster", "profile", "batch"}`` (plain dicts)."""
    rng = np.random.default_rng(10_000 + seed)
    num_dev = int(rng.integers(5, 17))
    picked = rng.choice(len(MEASURED_KINDS), int(rng.integers(2, 5)), replace=False)
    kinds = [MEASURED_KINDS[int(i)] for i in picked]
    profile = random_profile(rng, 8, 30)
    total_param = sum(ly["param_bytes"] for ly in profile["layers"])
    num_nodes = int(rng.integers(1, 5))
    devices = []
    for d in range(num_dev):
        name, tflops, mem_gib, nic = kinds[int(rng.integers(len(kinds)))]
        devices.append({
            "id": f"{name}-{d}", "node": f"n{int(rng.integers(num_nodes))}", "tflops": tflops,
            "memory_gib": max(mem_gib, total_param * 4 * float(rng.choice([0.3, 0.6, 1.5]))
                              / 2**30),
            "nic_gbps": nic, "microbatch_overhead_ms": float(rng.choice([0.0, 1.0])),
        })  # fmt: skip
    measured = {}
    skip = str(rng.choice([k[0] for k in kinds])) if rng.random() < 0.5 else None
    for name, tflops, _, _ in kinds:
        if name == skip:
            continue  # this kind keeps the FLOP model
        sizes = [[1], [1, 4], [1, 2, 8], [2, 3, 16]][int(rng.integers(4))]
        slope = [3 * ly["fwd_flops"] / (tflops * 1e12) * float(rng.uniform(0.3, 3.0))
                 for ly in profile["layers"]]  # fmt: skip
        offset = [float(rng.uniform(0.0, 2e-3)) for _ in profile["layers"]]
        fwd, bwd = [], []
        for mu in sizes:
            row = [(o + mu * p) * float(rng.uniform(0.7, 1.3))
                   for o, p in zip(offset, slope, strict=True)]  # fmt: skip
            fwd.append([t / 3 for t in row])
            bwd.append([2 * t / 3 for t in row])
        measured[name] = {"microbatch_sizes": sizes, "fwd_s": fwd, "bwd_s": bwd}
    profile["name"] = f"m{seed}"
    profile["measured_times"] = measured
    batch = int(rng.choice([16, 32, 64, 96, 128]))
    return {"cluster": {"devices": devices}, "profile": profile, "batch": batch}
