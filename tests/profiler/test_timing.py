"""Stage timing and the fit of speed, κ and λ (docs/model.md (v3)) on constructed and real times."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetrain.models.registry import EXAMPLES
from hetrain.profiler import LayerTimes, StageTimes, fit_stages, profile_chain, time_stages
from hetrain.profiler.timing import default_stage_lengths


def test_fit_stages_recovers_known_speed_kappa_and_lambda_from_constructed_times():
    ex = EXAMPLES["charlm"]
    prof = profile_chain(ex.build(), ex.make_input(2))
    arrays = prof.arrays()
    flops = np.concatenate(([0.0], np.cumsum(arrays.train_flops)))
    speed, kappa, lam = 4e10, 3e-4, 6e-4
    mus = (1, 4, 16)
    stages = ((0, 2), (2, 4), (4, 6), (0, 3), (3, 6), (0, 6))

    def t(mu, a, b):
        # λ per layer unit: the stage's Σ ν_l (the profile's operator-count weights)
        return mu * (flops[b] - flops[a]) / speed + kappa + lam * arrays.layer_units(a, b)

    train = np.array([[t(m, a, b) for a, b in stages] for m in mus])
    layers = np.array([[t(m, a, a + 1) for a in range(6)] for m in mus])
    fit = fit_stages(
        prof,
        StageTimes(mus, stages, train, threads=1),
        LayerTimes(mus, layers / 3, 2 * layers / 3, threads=1),
    )
    assert fit.speed_flops == pytest.approx(speed, rel=1e-9)
    assert fit.kappa_s == pytest.approx(kappa, rel=1e-6)
    assert fit.layer_overhead_s == pytest.approx(lam, rel=1e-6)
    assert fit.num_points == 3 * (6 + 6)
    # stages of one size in layer units cannot tell λ from κ
    with pytest.raises(ValueError, match="different lengths"):
        fit_stages(prof, StageTimes(mus, stages[1:2], train[:, 1:2], threads=1))


def test_time_stages_tiles_the_chain_per_length_and_restores_threads():
    assert default_stage_lengths(6) == (1, 2, 3, 6)
    assert default_stage_lengths(1) == (1,)
    ex = EXAMPLES["digits"]
    model = ex.build()
    before = torch.get_num_threads()
    times = time_stages(model, lambda n: ex.make_input(n), (1, 4), (2, 4), warmup=0, repeats=1)
    assert times.stages == ((0, 2), (2, 4), (4, 6), (0, 4), (4, 6))
    assert times.train_s.shape == (2, 5) and np.all(times.train_s > 0)
    assert torch.get_num_threads() == before
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="lengths"):
        time_stages(model, lambda n: ex.make_input(n), (1,), (7,))
