"""The speed estimator pools identical devices (issue 19: identical ranks' final estimates
within 10 % of each other), pure logic: noisy measurement streams of a shared machine fed to
:class:`hetrain.control.estimates.SpeedEstimates`."""

from __future__ import annotations

import numpy as np
import pytest

from hetrain.control.estimates import SpeedEstimates

SPEED = 1e10  # FLOP/s at start-up (per unit of the device's factor)
FLOPS = 1e8  # FLOPs of one step's work: 10 ms at start-up


def _contended_times_s(rng, steps: int, factor: float, common: float) -> np.ndarray:
    """A rank's measured compute seconds on shared cores: ``factor`` x its start-up time
    times a slow-down ``common`` to every rank of the run, ±35 % (log-normal) noise per step
    and descheduled episodes (2-5x for 1-4 steps in a row, about one step in nine)."""
    t = factor * common * FLOPS / SPEED * rng.lognormal(0.0, 0.35, steps)
    k = 0
    while k < steps:
        if rng.random() < 0.05:
            n = int(rng.integers(1, 5))
            t[k : k + n] *= rng.uniform(2.0, 5.0)
            k += n
        k += 1
    return t


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("slow", [("w1", 3.0), ("w3", 2.0), ("w0", 5.0)])
def test_identical_devices_estimates_within_ten_percent_and_a_slow_one_keeps_its_own(seed, slow):
    ids = ["w0", "w1", "w2", "w3", "w4"]  # w4 idle since start-up
    slow_id, factor = slow
    speed = {d: SPEED / (factor if d == slow_id else 1.0) for d in ids}
    est = SpeedEstimates(ids, [speed[d] for d in ids], kinds=["cpu"] * len(ids))
    rng = np.random.default_rng(seed)
    common = 2.5  # every rank 2.5x slower than at start-up (contention while training)
    busy = ids[:4]
    times = {d: _contended_times_s(rng, 60, factor if d == slow_id else 1.0, common) for d in busy}
    for step in range(60):
        for d in busy:
            est.observe(d, FLOPS, float(times[d][step]), 1)
    speeds = est.speeds_flops()
    equal = [speeds[d] for d in ids if d != slow_id]
    assert max(equal) <= 1.10 * min(equal), speeds
    # the slow device keeps its own estimate: factor x slower than its peers
    assert speeds[slow_id] == pytest.approx(np.median(equal) / factor, rel=0.15), speeds
    # the idle device (in ``equal``) takes the slow-down common to its kind, not its
    # start-up speed
    assert speeds["w4"] < SPEED / (0.8 * common), speeds


def test_a_device_that_slows_down_mid_run_leaves_the_pool_after_seven_steps():
    ids = ["w0", "w1", "w2", "w3"]
    est = SpeedEstimates(ids, [SPEED] * 4, kinds=["cpu"] * 4)
    rng = np.random.default_rng(0)
    for step in range(60):
        for d in ids:
            factor = 3.0 if (d == "w2" and step >= 40) else 1.0
            est.observe(d, FLOPS, factor * FLOPS / SPEED * rng.uniform(0.9, 1.1), 1)
        if step == 45:
            assert est.slowdowns()["w2"] == pytest.approx(est.slowdowns()["w0"], rel=1e-12)
    r = est.slowdowns()
    assert r["w2"] == pytest.approx(3.0, rel=0.1), r
    assert r["w0"] == r["w1"] == r["w3"] == pytest.approx(1.0, rel=0.1), r


def test_devices_of_other_kinds_are_not_pooled():
    est = SpeedEstimates(["a0", "a1", "b0"], [SPEED] * 3, kinds=["a", "a", "b"])
    for _ in range(13):
        est.observe("a0", FLOPS, 1.0 * FLOPS / SPEED, 1)
        est.observe("a1", FLOPS, 1.05 * FLOPS / SPEED, 1)
        est.observe("b0", FLOPS, 2.0 * FLOPS / SPEED, 1)
    r = est.slowdowns()
    assert r["a0"] == r["a1"] == pytest.approx(1.025, rel=1e-12)
    assert r["b0"] == pytest.approx(2.0, rel=1e-12)
