"""Fit of speed and κ on synthetic timings with known values; online estimator."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hetrain.calibration import ClusterEstimator, EwmaEstimator, fit_speed_kappa
from hetrain.catalog import make_cluster


def test_fit_recovers_known_speed_and_kappa_without_noise():
    mu = np.array([1, 2, 4, 8, 16])
    flops = 3.0e9  # per sample
    speed, kappa = 2.5e12, 4e-3
    t = mu * flops / speed + kappa
    fit = fit_speed_kappa(mu, flops, t)
    assert fit.speed_flops == pytest.approx(speed, rel=1e-9)
    assert fit.kappa_s == pytest.approx(kappa, rel=1e-9)
    assert fit.rms_rel_error < 1e-12
    assert fit.predict_s(32, flops) == pytest.approx(32 * flops / speed + kappa)


def test_fit_with_noise_and_mixed_layers():
    rng = np.random.default_rng(0)
    speed, kappa = 8e11, 1.5e-3
    mu = np.repeat([1, 2, 4, 8, 16, 32], 5)
    flops = rng.choice([1e8, 4e8, 9e8], size=mu.size)  # different layers/stages
    t = (mu * flops / speed + kappa) * rng.normal(1.0, 0.03, size=mu.size)
    fit = fit_speed_kappa(mu, flops, t)
    assert fit.speed_flops == pytest.approx(speed, rel=0.03)
    assert fit.kappa_s == pytest.approx(kappa, rel=0.15)
    assert 0.015 < fit.rms_rel_error < 0.05  # reports the 3 % noise
    assert fit.num_points == 30


def test_fit_clamps_negative_kappa_and_rejects_bad_data():
    mu = np.array([1, 2, 4])
    t = mu * 1e-3 - 1e-4  # would need κ < 0
    fit = fit_speed_kappa(mu, 1e9, t)
    assert fit.kappa_s == 0.0 and fit.speed_flops > 0
    assert fit.max_abs_rel_error > 0.01
    with pytest.raises(ValueError, match="at least 2"):
        fit_speed_kappa([4], 1e9, [0.1])
    with pytest.raises(ValueError, match="> 0"):
        fit_speed_kappa([1, 2], 1e9, [0.1, 0.0])
    with pytest.raises(ValueError, match="does not grow"):
        fit_speed_kappa([1, 2, 4], 1e9, [0.4, 0.2, 0.1])
    with pytest.raises(ValueError, match="finite"):
        fit_speed_kappa([1, 2], 1e9, [0.1, float("nan")])


def test_ewma_rejects_single_outliers_but_follows_a_level_shift():
    rng = np.random.default_rng(1)
    est = EwmaEstimator(alpha=0.3, threshold=4.0, max_consecutive_outliers=3)
    for _ in range(30):
        est.update(100.0 * rng.normal(1, 0.01))
    assert est.value == pytest.approx(100.0, rel=0.02)
    assert est.update(400.0) is False  # a one-off stall
    assert est.value == pytest.approx(100.0, rel=0.02)
    assert est.update(101.0) is True
    # the device really slows down to 50: three consistent samples switch the level
    accepted = [est.update(50.0 * rng.normal(1, 0.01)) for _ in range(3)]
    assert accepted == [False, False, True]
    assert est.value == pytest.approx(50.0, rel=0.03)
    for _ in range(5):
        est.update(50.0)
    assert est.value == pytest.approx(50.0, rel=0.02)
    with pytest.raises(ValueError):
        EwmaEstimator(alpha=0.0)
    with pytest.raises(ValueError):
        est.update(float("inf"))


def test_cluster_estimator_updates_speed_and_nic_of_the_state():
    spec = make_cluster({"V100-16": 2})
    state = spec.state()
    est = ClusterEstimator(state.ids, kappa_s={"v100-16-0": 0.002}, latency_s=1e-4)
    # device 0: 4 micro-batches, 1e12 FLOP in 0.508 s -> busy 0.5 s -> 2e12 FLOP/s
    for _ in range(3):
        est.observe_compute("v100-16-0", 1e12, 0.508, num_microbatches=4)
    est.observe_transfer("v100-16-1", 1e8, 0.1002)  # 1e8 B in 0.1 s after 2 latencies
    new = est.apply(state)
    assert new.speed_flops[0] == pytest.approx(2e12)
    assert new.speed_flops[1] == state.speed_flops[1]
    assert new.nic_bytes_per_s[1] == pytest.approx(1e9)
    assert new.nic_bytes_per_s[0] == state.nic_bytes_per_s[0]
    with pytest.raises(KeyError):
        est.observe_compute("nope", 1.0, 1.0)


def test_planning_side_modules_do_not_import_torch():
    code = (
        "import sys, hetrain.calibration, hetrain.catalog, hetrain.converters;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
