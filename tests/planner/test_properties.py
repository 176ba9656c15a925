"""Invariants of the pruned search on random medium clusters (5-24 devices, too many for the
exhaustive search): the plan fits, its shares sum to B, it uses only available devices, its
figures are the cost model's, and it is never worse than any feasible docs/model.md §6 baseline."""

from __future__ import annotations

import numpy as np
import pytest
from random_inputs import random_profile

from hetrain.catalog import make_mixed_cluster
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.planner import baselines, best_plan
from hetrain.profile import profile_from_dict


@pytest.mark.parametrize("seed", range(8))
def test_pruned_search_invariants(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    size = int(rng.integers(5, 25))
    state = make_mixed_cluster(size, seed=seed, speed_jitter=0.1).state()
    if seed % 2:
        gone = rng.random(size) < 0.2
        gone[0] = False
        state = state.with_changes(available=~gone)
    profile = profile_from_dict(random_profile(rng, 6, 29)).arrays()
    config = TrainingConfig(batch=int(rng.integers(8, 300)), schedule=["1f1b", "gpipe"][seed % 2])
    queues = {"money": float(rng.choice([0.0, 100.0, 1000.0]))}
    plan = best_plan(state, profile, config, queues=queues)
    ev = evaluate_plan(plan, state, profile, config)
    assert ev.fits
    assert plan.global_batch == config.batch
    index = state.index()
    assert all(state.available[index[d]] for d in plan.devices)
    assert plan.iteration_time_s == ev.iteration_time_s and plan.cost == ev.cost
    ours = ev.objective(1.0, queues)
    for make in (baselines.dp_even_plan, baselines.dp_proportional_plan,
                 baselines.pipeline_plan, baselines.static_hybrid_plan):  # fmt: skip
        other = make(state, profile, config)
        if other is None:
            continue
        other_ev = evaluate_plan(other, state, profile, config)
        if other_ev.fits:
            assert ours <= other_ev.objective(1.0, queues) * (1 + 1e-9), make.__name__
