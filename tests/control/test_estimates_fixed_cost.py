"""The speed estimator fits each kind's fixed cost per micro-batch beside each device's
slow-down from the shares seen while training (issue 19: estimates converge to the measured
speeds), pure logic: seeded noisy measurement streams of devices whose step costs ``f (a + b
s)`` for a share of ``s`` samples, fed to :class:`hetrain.control.estimates.SpeedEstimates`
with a start-up calibration that put most of ``a`` into the per-sample term. The estimates,
applied to the start-up state (:meth:`SpeedEstimates.apply`), must predict the slow
device's time at the even share, which it did not run since it slowed down, within 10 %, the
fast ones' at 1 sample within 15 %, and the even data parallelism / best shares ratio within
10 % of the true one."""

from __future__ import annotations

import numpy as np
import pytest

from hetrain.cluster import ClusterState
from hetrain.control.estimates import SpeedEstimates

IDS = ["w0", "w1", "w2", "w3"]
BATCH = 64  # samples per step: 16 each under even data parallelism
FIXED_S = 0.06  # a: true fixed seconds per step (one micro-batch) at factor 1
PER_SAMPLE_S = 0.004  # b: true seconds per sample at factor 1
FLOPS_PER_SAMPLE = 1e8
# start-up calibration: 20 % of a as κ, the rest put into the per-sample term (it matches the
# true time at 16 samples only)
KAPPA0_S = 0.2 * FIXED_S
PER_SAMPLE0_S = PER_SAMPLE_S + 0.8 * FIXED_S / 16


def _startup_state() -> ClusterState:
    n = len(IDS)
    return ClusterState(
        ids=tuple(IDS),
        node=np.zeros(n, dtype=np.int64),
        speed_flops=np.full(n, FLOPS_PER_SAMPLE / PER_SAMPLE0_S),
        memory_bytes=np.full(n, 1e10),
        nic_bytes_per_s=np.full(n, 1e9),
        power_w=np.full(n, 100.0),
        price_per_s=np.zeros(n),
        kappa_s=np.full(n, KAPPA0_S),
        available=np.ones(n, dtype=bool),
        intra_node_bytes_per_s=1e10,
        latency_s=0.0,
        kinds=("cpu",) * n,
    )


def _predicted_s(state: ClusterState, i: int, share: float) -> float:
    """The estimates' time of device ``i`` for ``share`` samples in one micro-batch (the FLOP
    model of docs/model.md §3)."""
    return float(share * FLOPS_PER_SAMPLE / state.speed_flops[i] + state.kappa_s[i])


def _even_over_balanced(fixed_s: np.ndarray, per_sample_s: np.ndarray) -> float:
    """Even data parallelism's step time over that of the best (continuous) shares, devices
    taking ``fixed_s[d] + per_sample_s[d] · s`` for ``s`` samples; a device whose fixed cost
    exceeds the balanced time gets no work."""
    even = float(np.max(fixed_s + per_sample_s * BATCH / len(fixed_s)))
    active = np.ones(len(fixed_s), dtype=bool)
    while True:
        tau = (BATCH + np.sum(fixed_s[active] / per_sample_s[active])) / np.sum(
            1.0 / per_sample_s[active]
        )
        drop = active & (fixed_s >= tau)
        if not drop.any():
            return even / float(tau)
        active &= ~drop


def _stream(seed: int, factor: float):
    """Per step, ``({device: share}, {device: measured s})``: w-slow (seeded) is ``factor``
    x slower from step 20 on; from step 27 its share moves among 1-8 samples and the others
    share the rest unevenly (9-32 each), redrawn every 5 steps; every rank also runs a
    common contention factor; ±5 % log-normal noise per step and descheduled episodes (2-5x
    for 1-4 steps in a row, about one step in fourteen)."""
    rng = np.random.default_rng(seed)
    slow = IDS[int(rng.integers(len(IDS)))]
    common = float(rng.uniform(1.0, 2.0))
    shares = {d: BATCH // len(IDS) for d in IDS}
    bad = {d: 0 for d in IDS}  # steps of a descheduled episode left, per device
    bad_factor = {d: 1.0 for d in IDS}
    for step in range(90):
        if step >= 27 and (step - 27) % 5 == 0:
            mine = int(rng.choice([1, 2, 3, 4, 6, 8]))
            w = rng.uniform(0.6, 1.4, len(IDS) - 1)
            rest = np.floor((BATCH - mine) * w / w.sum()).astype(int)
            rest[0] += BATCH - mine - int(rest.sum())
            others = iter(rest.tolist())
            shares = {d: (mine if d == slow else next(others)) for d in IDS}
        times = {}
        for d in IDS:
            f = common * (factor if (d == slow and step >= 20) else 1.0)
            t = f * (FIXED_S + PER_SAMPLE_S * shares[d]) * rng.lognormal(0.0, 0.05)
            if bad[d] > 0:
                t *= bad_factor[d]
                bad[d] -= 1
            elif rng.random() < 0.03:
                bad[d] = int(rng.integers(0, 4))
                bad_factor[d] = float(rng.uniform(2.0, 5.0))
                t *= bad_factor[d]
            times[d] = t
        yield step, slow, common, dict(shares), times


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("factor", [2.0, 3.0, 4.0, 5.0])
def test_fitted_estimates_predict_unseen_shares_and_the_even_dp_ratio(seed, factor):
    state0 = _startup_state()
    est = SpeedEstimates(
        IDS,
        list(state0.speed_flops),
        list(state0.kappa_s),
        kinds=list(state0.kinds),
    )
    seen: dict[str, set[int]] = {d: set() for d in IDS}
    slow, common = "", 1.0
    for step, slow, common, shares, times in _stream(seed, factor):  # noqa: B007
        for d in IDS:
            est.observe(d, shares[d] * FLOPS_PER_SAMPLE, times[d], 1)
            if step >= 20:  # since the slow-down
                seen[d].add(shares[d])
        est.close_step()
    state = est.apply(state0)
    true_fixed = np.array([common * (factor if d == slow else 1.0) * FIXED_S for d in IDS])
    true_per = np.array([common * (factor if d == slow else 1.0) * PER_SAMPLE_S for d in IDS])
    i_slow = IDS.index(slow)
    fast = [i for i in range(len(IDS)) if i != i_slow]
    # shares not run since the slow-down: 16 by the slow device (1-8 from step 27 on; 16
    # only for the 7 steps before), 1 by the others (9 or more)
    assert max(seen[slow] - {16}) <= 8 and all(min(seen[IDS[i]]) >= 9 for i in fast)
    true = true_fixed[i_slow] + true_per[i_slow] * 16
    assert _predicted_s(state, i_slow, 16) == pytest.approx(true, rel=0.10)
    # the fast ones at 1 sample, 9x below their least share: mostly fixed cost (15 %: 11.7 %
    # at most measured over these streams; the one ratio missed by 50-60 %)
    for i in fast:
        true = true_fixed[i] + true_per[i]
        assert _predicted_s(state, i, 1) == pytest.approx(true, rel=0.15), IDS[i]
    fitted_fixed = np.array([_predicted_s(state, i, 0) for i in range(len(IDS))])
    fitted_per = np.array([_predicted_s(state, i, 1) for i in range(len(IDS))]) - fitted_fixed
    implied = _even_over_balanced(fitted_fixed, fitted_per)
    assert implied == pytest.approx(_even_over_balanced(true_fixed, true_per), rel=0.10)
    # identical ranks: identical estimates (pooled)
    speeds = [float(state.speed_flops[i]) for i in fast]
    assert max(speeds) <= 1.10 * min(speeds)
