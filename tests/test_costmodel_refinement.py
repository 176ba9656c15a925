"""The opt-in update-time and group-jitter refinement of the cost model
(``TrainingConfig.update_time_s_per_param_byte`` / ``group_time_jitter``) against
hand-computed numbers and seeded synthetic timings, and its calibration
(:func:`hetrain.calibration.fit_update_time`, :func:`hetrain.calibration.relative_jitter`)."""

from __future__ import annotations

import numpy as np
import pytest

from hetrain.calibration import (
    ClusterEstimator,
    fit_step_overhead,
    fit_update_time,
    relative_jitter,
)
from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import TrainingConfig, evaluate_plan, expected_max_normal
from hetrain.plan import plan_from_dict
from hetrain.profile import profile_from_dict

# 4 devices, 1 TFLOP/s, κ = 1 ms, λ = 0.5 ms per layer, one node (800 Gbit/s, no latency)
STATE = cluster_from_dict(
    {
        "links": {"intra_node_gbps": 800, "latency_us": 0},
        "devices": [
            {"id": f"w{i}", "node": "n", "tflops": 1.0, "memory_gib": 64, "nic_gbps": 800,
             "microbatch_overhead_ms": 1.0, "layer_overhead_ms": 0.5}
            for i in range(4)
        ],
    }
).state()  # fmt: skip
# 4 layers of f = 1e9, w = 2e9 FLOP/sample and 1e6 parameter bytes each
PROFILE = profile_from_dict(
    {"layers": [{"name": f"l{i}", "fwd_flops": 1e9, "activation_bytes": 1e3,
                 "param_bytes": 1e6} for i in range(4)]}
).arrays()  # fmt: skip
DP4 = {"groups": [{"devices": [f"w{i}"], "stages": [[0, 4]], "microbatch_size": 2, "batch": 2}
                  for i in range(4)]}  # fmt: skip
PIPE = {"groups": [{"devices": ["w0", "w1"], "stages": [[0, 2], [2, 4]], "microbatch_size": 2,
                    "batch": 8}]}  # fmt: skip


def _eval(plan, **config):
    return evaluate_plan(plan_from_dict(plan), STATE, PROFILE, TrainingConfig(batch=8, **config))


def test_refinement_off_is_spec_and_on_adds_straggler_and_update_by_hand():
    spec = _eval(DP4)
    # T_g = μ·12e9/1e12 + κ + 4 λ = 24 + 1 + 2 = 27 ms; T_sync = 2·3/4·4e6 B / 1e11 B/s
    assert spec.group_times_s == pytest.approx((0.027,) * 4)
    sync = 1.5 * 4e6 / 1e11
    assert spec.iteration_time_s == pytest.approx(0.027 + sync)
    assert _eval(DP4, update_time_s_per_param_byte=0.0, group_time_jitter=0.0) == spec
    omega, sigma = 1e-9, 0.04  # 1 ms per MB held; 4 % jitter
    got = _eval(DP4, update_time_s_per_param_byte=omega, group_time_jitter=sigma)
    # E[max of 4 equal N(T, (σT)²)] = T (1 + 1.0294 σ) (Harter 1961); update ω · 4e6 B = 4 ms
    want = 0.027 * (1 + 1.0294 * sigma) + sync + omega * 4e6
    assert got.iteration_time_s == pytest.approx(want, rel=1e-4)
    # one group: no straggler term; the update of the device with the most bytes (2e6 B each)
    pipe = _eval(PIPE)
    refined = _eval(PIPE, update_time_s_per_param_byte=omega, group_time_jitter=sigma)
    assert refined.iteration_time_s == pytest.approx(pipe.iteration_time_s + omega * 2e6)


def test_expected_max_matches_seeded_monte_carlo_for_unequal_groups():
    rng = np.random.default_rng(12)
    times = np.array([0.50, 0.45, 0.52, 0.30])
    sigma = 0.05
    draws = rng.normal(times, sigma * times, size=(200_000, 4)).max(axis=1)
    assert expected_max_normal(times, sigma) == pytest.approx(draws.mean(), rel=1e-3)
    assert expected_max_normal(times, 0.0) == 0.52
    assert expected_max_normal([0.4, 0.0], sigma) == 0.4  # an idle group does not straggle
    with pytest.raises(ValueError, match="group_time_jitter"):
        expected_max_normal(times, -0.1)


def _expected_max_by_quadrature(times, sigma) -> float:
    """``∫ (1 − Π Φ) dx`` from 0 by scipy's adaptive quadrature (QUADPACK), break points at
    each group's mean and ±3 σ: the reference for :func:`expected_max_normal`."""
    from scipy import integrate
    from scipy.special import ndtr

    t = np.array([x for x in times if x > 0])
    sd = sigma * t
    lo, hi = max(0.0, float(np.min(t - 8 * sd))), float(np.max(t + 8 * sd))
    breaks = sorted({float(v) for v in np.concatenate([t, t - 3 * sd, t + 3 * sd]).clip(lo, hi)})
    value, _ = integrate.quad(
        lambda x: 1.0 - float(np.prod(ndtr((x - t) / sd))), lo, hi,
        points=breaks[:50], limit=500, epsabs=1e-14, epsrel=1e-12,
    )  # fmt: skip
    return lo + value


@pytest.mark.parametrize("seed", range(3))
def test_expected_max_equals_adaptive_quadrature_on_random_groups(seed):
    """2-40 groups, some idle, near-equal or spread times, σ in 0.005-0.12: the pruned
    257-point trapezoid equals QUADPACK to 1e-12 (relative)."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        size = int(rng.integers(2, 41))
        sigma = float(rng.uniform(0.005, 0.12))
        times = rng.uniform(0.05, 1.0, size) * (rng.random(size) < 0.9)
        if rng.random() < 0.3:  # near-equal groups: every one counts
            times = times.max() * rng.uniform(0.97, 1.0, size)
        if (times > 0).sum() < 2:
            continue
        want = _expected_max_by_quadrature(times, sigma)
        assert expected_max_normal(times, sigma) == pytest.approx(want, rel=1e-12)


def test_calibration_recovers_known_update_time_and_jitter_from_seeded_timings():
    rng = np.random.default_rng(5)
    omega, sigma = 5e-10, 0.03
    theta = rng.uniform(1e5, 4e6, size=40)
    fit = fit_update_time(theta, omega * theta * rng.normal(1, 0.02, size=40))
    assert fit.time_s_per_param_byte == pytest.approx(omega, rel=0.02)
    assert 0.01 < fit.rms_rel_error < 0.03 and fit.num_points == 40
    # 4 devices x 30 iterations of times jittering by σ around their own levels, plus stalls
    levels = [0.3, 0.35, 0.5, 0.9]
    series = [lvl * rng.normal(1, sigma, size=30) for lvl in levels]
    series[2][7] *= 3.0  # a one-off stall must not inflate σ
    assert relative_jitter(series) == pytest.approx(sigma, rel=0.2)
    with pytest.raises(ValueError, match="at least 2"):
        relative_jitter([[0.3]])
    with pytest.raises(ValueError, match="> 0"):
        fit_update_time([1e6, 0.0], [1e-3, 1e-3])


def test_training_config_rejects_bad_refinement_values():
    for field in ("update_time_s_per_param_byte", "group_time_jitter", "step_overhead_s"):
        for bad in (-1e-9, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=field):
                TrainingConfig(batch=8, **{field: bad})


IDLE_W3 = {"groups": [*DP4["groups"][:3], {"devices": ["w3"], "stages": [[0, 4]],
                                             "microbatch_size": 1, "batch": 0}]}  # fmt: skip


def test_step_overhead_adds_a_fixed_time_charged_like_the_rest():
    base = _eval(DP4, update_time_s_per_param_byte=1e-9)
    got = _eval(DP4, update_time_s_per_param_byte=1e-9, step_overhead_s=0.005)
    assert got.iteration_time_s == pytest.approx(base.iteration_time_s + 0.005)
    assert got.group_times_s == base.group_times_s  # not a group's time: the same for all plans
    # money and energy are T times the used devices' rates: the fixed time is charged too
    for key in ("money", "energy"):
        assert got.cost[key] == pytest.approx(
            base.cost[key] * got.iteration_time_s / base.iteration_time_s
        )
    # a pipeline pays the same F (it is per iteration, not per micro-batch or stage)
    assert _eval(PIPE, step_overhead_s=0.005).iteration_time_s == pytest.approx(
        _eval(PIPE).iteration_time_s + 0.005
    )
    # with one of four groups idle: still F once
    assert _eval(IDLE_W3, step_overhead_s=0.005).iteration_time_s == pytest.approx(
        _eval(IDLE_W3).iteration_time_s + 0.005
    )


def test_step_overhead_fit_is_a_floored_median_and_the_estimator_tracks_the_residual():
    measured = [0.110, 0.112, 0.109, 0.300, 0.111]  # one stalled iteration
    assert fit_step_overhead(measured, [0.1] * 5) == pytest.approx(0.011)
    assert fit_step_overhead([0.09, 0.095], [0.1, 0.1]) == 0.0  # over-predicted: no negative F
    with pytest.raises(ValueError, match="as many"):
        fit_step_overhead([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="finite"):
        fit_step_overhead([float("nan")], [0.1])
    est = ClusterEstimator(["w0", "w1"])
    assert est.step_overhead_s() is None
    rng = np.random.default_rng(3)
    for _ in range(30):
        est.observe_iteration(0.2 + 0.02 + rng.normal(0, 0.001), 0.2)
    assert est.step_overhead_s() == pytest.approx(0.02, abs=0.002)
    # one stall is rejected; a lasting change of the residual is followed
    assert est.observe_iteration(0.9, 0.2) is False
    assert est.step_overhead_s() == pytest.approx(0.02, abs=0.002)
    for _ in range(4):
        est.observe_iteration(0.25, 0.2)
    assert est.step_overhead_s() == pytest.approx(0.05, abs=0.003)
    for _ in range(10):
        est.observe_iteration(0.15, 0.2)  # the model now over-predicts: F floors at 0
    assert est.step_overhead_s() == 0.0
    with pytest.raises(ValueError, match="observe_iteration"):
        est.observe_iteration(0.0, 0.2)
