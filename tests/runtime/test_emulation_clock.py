"""``Emulation.compute_clock``: the slow-down measured in wall time (default) or in the op's
thread CPU time (an op lasts ``max(wall, factor x cpu)``)."""

from __future__ import annotations

import pytest

from hetrain.runtime.emulation import Emulation, slow_down


def test_thread_cpu_clock_sleeps_factor_times_cpu_minus_wall():
    wall = Emulation(slowdown={"a": 4.0})
    cpu = Emulation(slowdown={"a": 4.0}, compute_clock="thread_cpu")
    # an op of 200 ms wall, of which 100 ms on this thread's CPU (it waited for a core):
    # sleep 3 x 200 ms (wall rule) or 4 x 100 - 200 ms (CPU rule); time.sleep never returns
    # early, so only upper bounds need slack for a loaded machine
    assert 0.6 <= slow_down(wall, "a", 0.2, cpu_s=0.1) < 1.0
    assert 0.2 <= slow_down(cpu, "a", 0.2, cpu_s=0.1) < 0.6
    # wall already above factor x cpu: no sleep; no CPU time given: the wall rule
    assert slow_down(cpu, "a", 0.5, cpu_s=0.1) == 0.0
    assert 0.3 <= slow_down(cpu, "a", 0.1) < 0.7
    with pytest.raises(ValueError, match="compute_clock"):
        Emulation(compute_clock="cpu")
