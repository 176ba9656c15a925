"""Partitioner envelope and share solver against brute force on random small inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import profile_prefix, stage_memory_bytes, stage_times_s
from hetrain.planner.partition import enumerate_splits, envelope_splits
from hetrain.planner.shares import GroupOptions, ShareProblem
from hetrain.profile import profile_from_dict


def _random_group(seed: int):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 5))
    num_layers = int(rng.integers(k, 9))
    devices = [
        {"id": f"d{i}", "node": f"n{rng.integers(2)}", "tflops": float(rng.uniform(0.5, 4)),
         "memory_gib": float(rng.choice([0.3, 1.0, 50.0])), "nic_gbps": float(rng.choice([1, 100])),
         "microbatch_overhead_ms": float(rng.choice([0, 2]))}
        for i in range(k)
    ]  # fmt: skip
    layers = [
        {"fwd_flops": float(rng.uniform(1e8, 3e9)),
         "activation_bytes": float(rng.uniform(1e4, 1e7)),
         "param_bytes": float(rng.uniform(1e6, 1e8))}
        for _ in range(num_layers)
    ]  # fmt: skip
    state = cluster_from_dict({"links": {"latency_us": 10}, "devices": devices}).state()
    prefix = profile_prefix(profile_from_dict({"layers": layers}).arrays())
    return state, prefix, np.arange(k)


@pytest.mark.parametrize("seed", range(12))
def test_envelope_is_optimal_for_every_n(seed: int) -> None:
    """min over the envelope of A + (n-1) M equals the min over all splits that fit n_design
    micro-batches, for every n <= n_design (exact candidate bottlenecks)."""
    state, prefix, devs = _random_group(seed)
    mu, n_design = 2, 6
    env = envelope_splits(state, prefix, devs, mu, 2.0, "1f1b", n_design, exact=True)
    best_all = {n: np.inf for n in range(1, n_design + 1)}
    for bounds in enumerate_splits(prefix.num_layers, len(devs)):
        mem = stage_memory_bytes(prefix, bounds, mu, n_design, 2.0, "1f1b")
        if np.any(mem > state.memory_bytes[devs]):
            continue
        c, e = stage_times_s(state, prefix, devs, bounds, mu)
        fill, worst = c.sum() + e.sum(), max(c.max(), e.max() if len(e) else 0.0)
        for n in best_all:
            best_all[n] = min(best_all[n], fill + (n - 1) * worst)
    for n, want in best_all.items():
        got = np.min(env.fill_s + (n - 1) * env.bottleneck_s) if len(env) else np.inf
        assert got == pytest.approx(want, rel=1e-12) if np.isfinite(want) else got == want


def _random_options(rng, k_opts: int) -> GroupOptions:
    mu = rng.integers(1, 6, k_opts)
    bottleneck = rng.uniform(0.5, 3.0, k_opts) * mu
    fill = bottleneck * rng.uniform(1.0, 4.0, k_opts)
    nmax = rng.choice([1, 2, 5, 10**9], k_opts)
    return GroupOptions(mu, fill, bottleneck, nmax, np.zeros((k_opts, 2), np.int64))


@pytest.mark.parametrize("seed", range(20))
def test_shares_bisection_dp_and_brute_force_agree(seed: int) -> None:
    rng = np.random.default_rng(seed)
    groups = [_random_options(rng, int(rng.integers(1, 4))) for _ in range(int(rng.integers(1, 4)))]
    batch = int(rng.integers(1, 13))
    problem = ShareProblem(groups, batch)
    # brute force over every share vector (b_g >= 0)
    best = np.inf
    for shares in itertools.product(range(batch + 1), repeat=len(groups)):
        if sum(shares) == batch:
            best = min(best, max(g.time_for(b)[0] for g, b in zip(groups, shares, strict=True)))
    dp = problem._solve_dp()
    bis = problem._solve_bisection()
    if not np.isfinite(best):
        assert dp is None and bis is None
        return
    assert dp.max_group_time_s == pytest.approx(best, rel=1e-12)
    assert bis.max_group_time_s == pytest.approx(best, rel=1e-9)
    assert int(bis.shares.sum()) == batch and int(dp.shares.sum()) == batch
    assert problem.lp_bound_s() <= best * (1 + 1e-9)


def test_counts_equal_expanded_groups() -> None:
    rng = np.random.default_rng(7)
    a, b = _random_options(rng, 3), _random_options(rng, 2)
    merged = ShareProblem([a, b], 40, counts=[3, 2])._solve_bisection()
    expanded = ShareProblem([a, a, a, b, b], 40)._solve_dp()
    assert merged.max_group_time_s == pytest.approx(expanded.max_group_time_s, rel=1e-9)
    assert len(merged.shares) == 5 and merged.shares.sum() == 40
