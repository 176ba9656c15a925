"""Warm-started re-planning (the controller calls best_plan every slot)."""

from __future__ import annotations

import numpy as np
import pytest

from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.errors import NoFeasiblePlanError
from hetrain.planner import best_plan, warm_structure
from hetrain.profile import profile_from_dict

CLUSTER = {
    "links": {"intra_node_gbps": 400, "latency_us": 20},
    "devices": [
        {"id": f"d{i}", "node": f"n{i // 4}", "tflops": [10, 20, 40][i % 3], "memory_gib": 8,
         "nic_gbps": 25}
        for i in range(12)
    ],
}  # fmt: skip
LAYERS = [
    {"name": f"l{i}", "fwd_flops": 2e10, "activation_bytes": 4e5, "param_bytes": 2e8}
    for i in range(12)
]


@pytest.fixture(scope="module")
def setting():
    state = cluster_from_dict(CLUSTER).state()
    profile = profile_from_dict({"layers": LAYERS}).arrays()
    config = TrainingConfig(batch=64)
    return state, profile, config, best_plan(state, profile, config)


def test_warm_keeps_structure_and_stays_valid(setting) -> None:
    state, profile, config, plan = setting
    rng = np.random.default_rng(1)
    noisy = state.with_changes(speed_flops=state.speed_flops * rng.uniform(0.9, 1.1, 12))
    again = best_plan(noisy, profile, config, warm_start=plan, time_budget_s=0.0)
    ev = evaluate_plan(again, noisy, profile, config)
    assert ev.fits and again.global_batch == 64
    # with no time budget the warm re-plan keeps the previous groups (stages kept or re-split)
    assert {g.devices for g in again.groups} <= {g.devices for g in plan.groups}
    # never worse than keeping the old plan as it is (its stages, μ and shares are among
    # the options of the warm structure, and the shares are solved exactly)
    old = evaluate_plan(plan, noisy, profile, config)
    assert ev.iteration_time_s <= old.iteration_time_s * (1 + 1e-12)


def test_warm_after_device_loss(setting) -> None:
    state, profile, config, plan = setting
    used = plan.groups[0].devices[0]
    avail = np.array([d != used for d in state.ids])
    gone = state.with_changes(available=avail)
    groups, bounds = warm_structure(plan, gone)
    assert all(state.ids[d] != used for g in groups for d in g)
    again = best_plan(gone, profile, config, warm_start=plan, time_budget_s=0.0)
    assert used not in again.devices
    ev = evaluate_plan(again, gone, profile, config)
    assert ev.fits and again.global_batch == 64


def test_no_device_available(setting) -> None:
    state, profile, config, _ = setting
    with pytest.raises(NoFeasiblePlanError):
        best_plan(state.with_changes(available=np.zeros(12, bool)), profile, config)
