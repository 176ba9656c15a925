"""The planner's fast paths (issue 12, planning time) against the plain computations they
replace: they must give the same values and the same first-index tie-breaking, since the
plans depend on both."""

from __future__ import annotations

import numpy as np
import pytest

from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import profile_prefix
from hetrain.planner.partition import SplitTable, envelope_splits, envelope_splits_many, pareto
from hetrain.planner.shares import GroupOptions, ShareProblem, _min_max_step
from hetrain.profile import profile_from_dict


def _monotone(rng: np.random.Generator, size: int) -> np.ndarray:
    """Non-decreasing times from 0, with ties and an infeasible (inf) tail."""
    values = rng.choice([0.5, 1.0, 1.5, 2.0, 3.0], size) if rng.random() < 0.5 else rng.random(size)
    out = np.sort(values)
    out[0] = 0.0
    if rng.random() < 0.5:
        out[int(rng.integers(1, size)) :] = np.inf
    return out


@pytest.mark.parametrize("seed", range(5))
def test_min_max_step_equals_the_quadratic_scan(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(40):
        size = int(rng.integers(64, 200))  # (the binary-search path: B >= 63)
        f, g = _monotone(rng, size), _monotone(rng, size)
        b = np.arange(size)[:, None]
        x = np.arange(size)[None, :]
        vals = np.where(x <= b, np.maximum(f[np.clip(b - x, 0, None)], g[x]), np.inf)
        want_arg = np.argmin(vals, axis=1)
        got, got_arg = _min_max_step(f, g)
        np.testing.assert_array_equal(got_arg, want_arg)
        np.testing.assert_array_equal(got, vals[np.arange(size), want_arg])


@pytest.mark.parametrize("seed", range(5))
def test_pareto_sweep_keeps_the_same_splits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(100):
        count = int(rng.integers(2, 30))
        fill = rng.choice([1.0, 2.0, 3.0], count)
        bottleneck = rng.choice([0.5, 1.0, 1.5], count)
        nmax = np.full(count, 7, dtype=np.int64)
        bounds = rng.integers(0, 9, (count, 3))
        kept = pareto(SplitTable(bounds, fill, bottleneck, nmax, 2))
        # the definition: q is dropped iff some p != q is no worse in A and M and (better in
        # one of them, or equal and listed first)
        want = [
            q for q in range(count)
            if not any(
                p != q and fill[p] <= fill[q] and bottleneck[p] <= bottleneck[q]
                and (fill[p] < fill[q] or bottleneck[p] < bottleneck[q] or p < q)
                for p in range(count)
            )
        ]  # fmt: skip
        np.testing.assert_array_equal(kept.bounds, bounds[want])
        np.testing.assert_array_equal(kept.fill_s, fill[want])


def test_envelope_of_several_micro_batch_sizes_equals_one_at_a_time() -> None:
    """One call for many μ (stacked stage matrices, memory levels per μ, one DP pass) gives
    each μ's table exactly; memory-tight devices exercise the halved levels."""
    rng = np.random.default_rng(7)
    devices = [
        {"id": f"d{i}", "node": f"n{i % 2}", "tflops": float(rng.uniform(1, 50)),
         "memory_gib": float(rng.choice([0.5, 1.0, 2.0])), "nic_gbps": float(rng.choice([1, 100])),
         "microbatch_overhead_ms": 1.0, "layer_overhead_ms": float(rng.choice([0.0, 0.3]))}
        for i in range(4)
    ]  # fmt: skip
    layers = [
        {"fwd_flops": float(rng.uniform(1e9, 5e10)),
         "activation_bytes": float(rng.uniform(1e6, 3e7)),
         "param_bytes": float(rng.uniform(1e7, 6e7))}
        for _ in range(14)
    ]  # fmt: skip
    state = cluster_from_dict({"devices": devices}).state()
    prefix = profile_prefix(profile_from_dict({"layers": layers}).arrays())
    mus = [1, 2, 3, 5, 8, 13]
    for schedule in ("1f1b", "gpipe"):
        for k in (1, 2, 3, 4):
            devs = np.arange(k)
            designs = [-(-40 // mu) for mu in mus]
            tops = [min(n, k) if schedule == "1f1b" else n for n in designs]
            many = envelope_splits_many(state, prefix, devs, mus, 2.0, schedule, tops,
                                        n_caps=designs, cache={})  # fmt: skip
            assert any(len(t) for t in many)
            for mu, top, cap, got in zip(mus, tops, designs, many, strict=True):
                want = envelope_splits(state, prefix, devs, mu, 2.0, schedule, top, n_cap=cap)
                np.testing.assert_array_equal(got.bounds, want.bounds)
                np.testing.assert_array_equal(got.fill_s, want.fill_s)
                np.testing.assert_array_equal(got.bottleneck_s, want.bottleneck_s)
                np.testing.assert_array_equal(got.max_microbatches, want.max_microbatches)
                assert got.microbatch_size == want.microbatch_size == mu


@pytest.mark.parametrize("seed", range(5))
def test_lp_bound_newton_matches_bisection_and_stays_below(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(50):
        groups = []
        for _ in range(int(rng.integers(1, 6))):
            count = int(rng.integers(1, 10))
            mu = rng.integers(1, 30, count)
            bottleneck = rng.uniform(1e-3, 1.0, count)
            fill = bottleneck * rng.uniform(1.0, 6.0, count)
            groups.append(GroupOptions(mu, fill, bottleneck, rng.integers(1, 50, count),
                                       np.zeros((count, 2), np.int64)))  # fmt: skip
        problem = ShareProblem(groups, int(rng.integers(1, 3000)), rng.integers(1, 4, len(groups)))
        alpha = problem._bottleneck / problem._mu
        delta = problem._fill - problem._bottleneck
        bisected = problem._lp_bound_bisection(alpha, delta)
        newton = problem.lp_bound_s()
        assert newton == pytest.approx(bisected, rel=2e-12)
        # a lower bound: the relaxed capacity at it does not exceed B
        per = np.maximum((newton - delta) / alpha, 0.0)
        per_group = np.maximum.reduceat(per, problem._starts)
        assert float(np.dot(per_group, problem.counts)) <= problem.batch * (1 + 1e-9)
