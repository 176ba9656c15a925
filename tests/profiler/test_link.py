"""Ping-pong between two forked gloo ranks (FileStore rendezvous, timeout)."""

from __future__ import annotations

import pytest

from hetrain.profiler import measure_p2p


@pytest.mark.multiprocess
def test_measure_p2p_between_two_local_ranks():
    fit = measure_p2p((4, 1 << 16, 1 << 20), repeats=3, warmup=1, timeout_s=60)
    assert fit.sizes_bytes == (4, 65536, 1048576)
    assert len(fit.one_way_s) == 3 and all(t > 0 for t in fit.one_way_s)
    # local gloo: far above 1 MB/s and latency below 0.1 s even on a loaded 2-core machine
    assert fit.bandwidth_bytes_per_s > 1e6, fit
    assert 0 <= fit.latency_s < 0.1, fit
    # the fit's predictions are consistent with what it reports
    assert fit.one_way_s[-1] > fit.one_way_s[0]
