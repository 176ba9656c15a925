"""``fewest_microbatches`` (what ``hetrain plan`` prints): a one-device group runs its share in as
few micro-batches as its memory allows: with one stage nothing overlaps, so splitting only adds
the fixed cost ``κ`` per micro-batch; at ``κ = 0`` (a fixed cost measured as nothing) every
micro-batch size ties in the cost model, and the plan must still not split (a runtime runs
``⌈b/μ⌉`` micro-batches of a plan as written)."""

from __future__ import annotations

import numpy as np
import pytest
from random_inputs import random_profile

from hetrain.catalog import make_mixed_cluster
from hetrain.costmodel import TrainingConfig, evaluate_plan, profile_prefix, stage_memory_bytes
from hetrain.planner import best_plan, fewest_microbatches
from hetrain.profile import profile_from_dict


def _small(profile: dict):
    """The profile with parameters 1000x smaller (a model data parallelism suits)."""
    for layer in profile["layers"]:
        layer["param_bytes"] *= 1e-3
    return profile_from_dict(profile).arrays()


def _single_device_groups_checked(state, profile, config) -> int:
    searched = best_plan(state, profile, config)
    plan = fewest_microbatches(searched, state, profile, config)
    ev = evaluate_plan(plan, state, profile, config)
    assert ev.fits and plan.global_batch == config.batch
    assert plan.iteration_time_s == ev.iteration_time_s
    assert plan.iteration_time_s <= searched.iteration_time_s * (1 + 1e-9)
    pre = profile_prefix(profile)
    index = state.index()
    checked = 0
    for g in plan.groups:
        if g.num_stages != 1 or g.batch <= 0:
            continue
        checked += 1
        if g.microbatch_size == g.batch:
            continue
        # split only where one more sample per micro-batch would not fit the device
        ((lo, hi),) = g.stages
        more = stage_memory_bytes(pre, [lo, hi], g.microbatch_size + 1, 2,
                                  config.optimizer_state_factor, config.schedule)[0]  # fmt: skip
        assert more > state.memory_bytes[index[g.devices[0]]], (g, more)
    return checked


@pytest.mark.parametrize("seed", range(12))
def test_one_device_groups_are_not_split_when_kappa_is_zero(seed: int) -> None:
    rng = np.random.default_rng(700 + seed)
    size = int(rng.integers(3, 13))
    state = make_mixed_cluster(size, seed=seed, speed_jitter=0.2).state()
    kappa = np.where(rng.random(size) < 0.5, 0.0, state.kappa_s)  # some fixed costs measured 0
    state = state.with_changes(kappa_s=kappa)
    # small models: data parallelism (one-device groups) is what such a plan mostly is
    profile = _small(random_profile(rng, 4, 12))
    config = TrainingConfig(batch=int(rng.integers(16, 200)))
    assert _single_device_groups_checked(state, profile, config) >= 1


def test_every_single_device_group_of_a_zero_kappa_cluster_runs_one_micro_batch() -> None:
    """The measured case: four CPU ranks, the fixed cost of one fitted as 0, a small MLP;
    every group runs its share as one micro-batch (it ran w2's 22 samples as 22)."""
    checked = 0
    for seed in range(6):
        state = make_mixed_cluster(4, seed=seed).state()
        state = state.with_changes(kappa_s=np.where(np.arange(4) == seed % 4, 0.0, 3e-3))
        rng = np.random.default_rng(seed)
        profile = _small(random_profile(rng, 8, 8))
        config = TrainingConfig(batch=64)
        plan = fewest_microbatches(best_plan(state, profile, config), state, profile, config)
        for g in plan.groups:
            if g.num_stages == 1 and g.batch > 0:
                checked += 1
                assert g.microbatch_size == g.batch
    assert checked >= 6
