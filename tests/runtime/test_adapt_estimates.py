"""The runtime controller's slow-down estimates (pure logic, no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from hetrain.control.estimates import SpeedEstimates
from hetrain.runtime.worker_main import local_cluster_state

SPEED = 1e10  # FLOP/s at start-up
KAPPA = 2e-3  # s per micro-batch
LAMBDA = 0.5e-3  # s per micro-batch and layer unit
UNITS = 6.0  # layer units of the stage
FLOPS_PER_SAMPLE = 1e7  # 1 ms per sample at start-up


def _slowed_time_s(batch: int, microbatches: int, factor: float) -> float:
    """A device ``factor`` x slower at all of its work (compute and fixed costs alike, as a
    throttled or emulated device is)."""
    return factor * (batch * FLOPS_PER_SAMPLE / SPEED + microbatches * (KAPPA + LAMBDA * UNITS))


def _estimates() -> SpeedEstimates:
    return SpeedEstimates(["w0", "w1"], [SPEED, SPEED], [KAPPA, KAPPA], 13, [LAMBDA, LAMBDA])


@pytest.mark.parametrize("batch", [16, 8, 2, 1])
def test_a_slowed_device_is_estimated_at_its_slow_down_whatever_its_share(batch):
    # 3x slower; at one sample a micro-batch the step is 6 parts of 7 fixed cost. The old
    # estimator took the speed as flops / (time - start-up fixed cost): at one sample 1e7 FLOP
    # / (18 - 5) ms, 13x slower; at 16 samples 16e7 / (63 - 5) ms, 3.6x slower: the less w1
    # got, the slower it looked (the main job's runaway to "31.7x slower")
    est = _estimates()
    for _ in range(13):
        est.observe("w1", batch * FLOPS_PER_SAMPLE, _slowed_time_s(batch, 1, 3.0), 1, UNITS)
        est.observe("w0", batch * FLOPS_PER_SAMPLE, _slowed_time_s(batch, 1, 1.0), 1, UNITS)
    assert est.slowdowns()["w1"] == pytest.approx(3.0, rel=1e-12)
    assert est.slowdowns()["w0"] == pytest.approx(1.0, rel=1e-12)
    assert est.speeds_flops()["w1"] == pytest.approx(SPEED / 3.0, rel=1e-12)
    state = local_cluster_state(["w0", "w1"], [SPEED, SPEED]).with_changes(
        kappa_s=np.array([KAPPA, KAPPA]), layer_overhead_s=np.array([LAMBDA, LAMBDA])
    )
    slowed = est.apply(state)
    np.testing.assert_allclose(slowed.speed_flops, [SPEED, SPEED / 3.0], rtol=1e-12)
    np.testing.assert_allclose(slowed.kappa_s, [KAPPA, 3.0 * KAPPA], rtol=1e-12)
    np.testing.assert_allclose(slowed.layer_overhead_s, [LAMBDA, 3.0 * LAMBDA], rtol=1e-12)
    # the model's time for the same work on the applied state is the measured time
    model_s = batch * FLOPS_PER_SAMPLE / slowed.speed_flops[1] + (
        slowed.kappa_s[1] + UNITS * slowed.layer_overhead_s[1]
    )
    assert model_s == pytest.approx(_slowed_time_s(batch, 1, 3.0), rel=1e-12)


def test_estimates_ignore_stalled_steps_and_follow_a_lasting_change_after_seven():
    est = _estimates()
    for step in range(13):
        factor = 10.0 if step % 2 == 0 and step < 12 else 1.0  # 6 stalled steps of 13
        est.observe("w0", 16 * FLOPS_PER_SAMPLE, _slowed_time_s(16, 2, factor), 2, UNITS)
    assert est.slowdowns()["w0"] == pytest.approx(1.0, rel=1e-12)
    est = _estimates()
    for _ in range(13):
        est.observe("w0", 16 * FLOPS_PER_SAMPLE, _slowed_time_s(16, 2, 1.0), 2, UNITS)
    for k in range(7):
        assert est.slowdowns()["w0"] == pytest.approx(1.0, rel=1e-12), k
        est.observe("w0", 16 * FLOPS_PER_SAMPLE, _slowed_time_s(16, 2, 3.0), 2, UNITS)
    assert est.slowdowns()["w0"] == pytest.approx(3.0, rel=1e-12)


def test_devices_without_measurements_keep_their_start_up_figures():
    est = _estimates()
    est.observe("w0", 0.0, 1.0, 1, UNITS)  # no work: ignored
    est.observe("w0", 1e7, float("nan"), 1, UNITS)  # no time: ignored
    assert est.slowdowns() == {}
    state = local_cluster_state(["w0", "w1"], [SPEED, SPEED])
    assert est.apply(state).speed_flops.tolist() == state.speed_flops.tolist()
