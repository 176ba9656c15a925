"""The runtime's controller reaches the plan its planner gives (issue 19), pure logic: a
synthetic measurement stream of the issue's case (8 equal MLP blocks, 4 ranks, B = 64, w1 3x
slower at all of its work, ±15 % noise per measurement) fed to
:class:`~hetrain.runtime.ctlcontroller.PlanController` step by step, its decisions applied
at once."""

from __future__ import annotations

import numpy as np
import pytest
from adapt_inputs import KAPPA, SPEED, blocks_profile

from hetrain.costmodel import TrainingConfig
from hetrain.planner import best_plan
from hetrain.runtime.ctlcontroller import PlanController
from hetrain.runtime.ctldecision import even_dp_plan, predict_iteration_time_s
from hetrain.runtime.worker_main import local_cluster_state

DEVICES = ["w0", "w1", "w2", "w3"]
BATCH = 64


def _true_state(slow: float):
    """The devices as they are: w1 ``slow`` x slower at its compute and its fixed costs."""
    state = local_cluster_state(DEVICES, [SPEED / (slow if d == "w1" else 1.0) for d in DEVICES])
    return state.with_changes(
        kappa_s=np.array([KAPPA * (slow if d == "w1" else 1.0) for d in DEVICES])
    )


def _run(steps: int, slow_from: int, seed: int, async_search: bool = False):
    profile = blocks_profile()
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    base = _true_state(1.0)  # start-up calibration: four identical ranks
    plan = even_dp_plan(DEVICES, 8, BATCH, 1)
    ctl = PlanController(base, profile, config, plan, steps, async_search=async_search)
    rng = np.random.default_rng(seed)
    flops = float(profile.train_flops.sum())
    history = []
    for t in range(steps):
        factor = {d: 3.0 if (d == "w1" and t >= slow_from) else 1.0 for d in DEVICES}
        compute = {}
        for g in ctl.current.groups:
            for d in g.devices:
                work_s = flops * g.batch / SPEED + g.num_microbatches * KAPPA
                compute[d] = factor[d] * work_s * rng.uniform(0.85, 1.15)
        ctl.observe(t, int(ctl.current.plan_id), compute, max(compute.values()) + 1e-3)
        ctl.decide(t + 1)
        if async_search:
            ctl.wait_for_search()  # deterministic: the search is done before the next step
        history.append(ctl.current)
    return ctl, history


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_runtime_reaches_the_planners_plan_for_one_slow_rank_of_four(seed):
    ctl, history = _run(steps=120, slow_from=20, seed=seed)
    truth = _true_state(3.0)
    profile, config = ctl.profile, ctl.config
    best = best_plan(truth, profile, config)
    t_best = predict_iteration_time_s(best, truth, profile, config)
    shares = {d: 0 for d in DEVICES}
    shares.update({d: g.batch for g in ctl.current.groups for d in g.devices})
    # the planner's plan here: 20/4/20/20 (or 19-20 on the fast ranks and 4-5 on w1); the
    # runtime stopped at w1 = 6-8 behind a 25 % noise guard (issue 19)
    assert 3 <= shares["w1"] <= 5, shares
    t_final = predict_iteration_time_s(ctl.current, truth, profile, config)
    assert t_final <= 1.05 * t_best, (shares, t_final, t_best)
    # the estimates converge: identical ranks within 10 % of each other, w1 at 3x
    speeds = ctl.estimates.speeds_flops()
    fast = [speeds[d] for d in ("w0", "w2", "w3")]
    assert max(fast) <= 1.10 * min(fast), speeds
    assert speeds["w1"] == pytest.approx(np.mean(fast) / 3.0, rel=0.1), speeds
    # before the slow-down the shares stay even (no change chased noise)
    assert all(
        max(g.batch for g in p.groups) - min(g.batch for g in p.groups) <= 4 for p in history[:20]
    )


def test_runtime_with_its_search_thread_reaches_the_same_plan():
    ctl, _ = _run(steps=80, slow_from=10, seed=4, async_search=True)
    shares = {d: 0 for d in DEVICES}
    shares.update({d: g.batch for g in ctl.current.groups for d in g.devices})
    assert 3 <= shares["w1"] <= 5, shares


def test_logged_lower_bound_is_below_every_logged_prediction():
    ctl, _ = _run(steps=40, slow_from=10, seed=5)
    p = ctl.predictions()
    assert 0 < p["lower_bound_s"] <= p["predicted_time_s"], p
    assert p["lower_bound_s"] <= p["dp_even_time_s"], p
