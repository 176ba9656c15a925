"""Decisions that hold (docs/controller.md): the gain rule, persistence, the decision delay, the
controller's checkpointable state and a replay of a recorded main-job measurement log."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from gate_inputs import two_layer_profile

from hetrain.calibration import ClusterEstimator
from hetrain.cluster import cluster_from_dict
from hetrain.control import make_policy, plan_of
from hetrain.control.decision import PersistenceEstimator
from hetrain.control.lyapunov import LyapunovController
from hetrain.control.migration import migration_time_s
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.plan import GroupPlan, Plan
from hetrain.profile import profile_from_dict
from hetrain.sim.simulator import simulate
from hetrain.trace import Trace, TraceRow

DATA = Path(__file__).parent / "data"

# two devices on separate nodes behind 1 Gbit/s NICs; 2 layers of 1e10 FLOP forward per sample,
# 62.5 MB of parameters each (moving the model costs 3 s with Adam state, syncing it 1 s) and
# 100 MB activations (a pipeline is hopeless): the best plan is the faster device alone
TWO = cluster_from_dict(
    {
        "links": {"intra_node_gbps": 800, "latency_us": 20},
        "devices": [
            {"id": f"d{i}", "tflops": 0.96, "memory_gib": 16, "nic_gbps": 1.0} for i in range(2)
        ],
    }
)
TWO_PROFILE = two_layer_profile()
TWO_CONFIG = TrainingConfig(batch=8)


def _slowed(slot: int, slow: str, fast: str) -> list[TraceRow]:
    return [
        TraceRow(slot=slot, device=slow, speed_factor=0.5),
        TraceRow(slot=slot, device=fast, speed_factor=1.0),
    ]


def _run(rows: list[TraceRow], slots: int, delay: int = 1):
    timeline = Trace(tuple(rows)).timeline(TWO, slots)
    pol = make_policy("greedy", TWO_PROFILE, TWO_CONFIG, decision_delay_slots=delay)
    res = simulate(pol, timeline, TWO_PROFILE, TWO_CONFIG, keep_plans=True, decision_delay=delay)
    used = [tuple(d for g in p.groups if g.batch > 0 for d in g.devices) for p in res.plans]
    return res, used


def test_alternating_state_where_switching_costs_more_than_it_gains_stays_put():
    # the faster device alternates every slot: following it would gain 0.5 s a slot and cost a
    # 3 s migration each time (and, one slot late, land on the slow device)
    rows = []
    for t in range(60):
        rows += _slowed(t, "d1", "d0") if t % 2 == 0 else _slowed(t, "d0", "d1")
    res, used = _run(rows, 60)
    assert used[0] == ("d0",)
    assert res.plan_changes == 0
    assert set(used) == {("d0",)}
    assert sum(r.migration_time_s for r in res.records) == 0.0


def test_a_change_that_persists_is_followed_within_two_slots():
    rows = _slowed(0, "d1", "d0") + _slowed(20, "d0", "d1")
    res, used = _run(rows, 40)
    assert used[:20] == [("d0",)] * 20
    # measured in slot 20, decided before slot 21, running from slot 22 (decision delay 1)
    assert used[22:] == [("d1",)] * 18
    assert res.plan_changes == 1
    mig = [r.migration_time_s for r in res.records]
    assert mig[22] == pytest.approx(3.0, rel=0.01) and sum(mig) == mig[22]


def test_decision_delay_shifts_when_a_decision_first_runs():
    rows = _slowed(0, "d1", "d0") + _slowed(20, "d0", "d1")
    _, used0 = _run(rows, 30, delay=0)
    _, used2 = _run(rows, 30, delay=2)
    assert used0[20] == ("d0",) and used0[21] == ("d1",)
    assert used2[22] == ("d0",) and used2[23] == ("d1",)


def test_persistence_estimator_learns_run_lengths():
    state = TWO.state()
    both = [0, 1]  # the whole cluster
    est = PersistenceEstimator(threshold=0.1, prior_slots=10.0, prior_weight=1.0)
    for t in range(30):  # both devices halve or restore their speed every third slot
        factor = 0.5 if (t // 3) % 2 else 1.0
        est.update(t, state.with_changes(speed_flops=state.speed_flops * factor))
    assert est.set_changes(both) == pytest.approx(9.0)
    # the prior's one change spread over the two devices: one for the pair
    assert est.mean_run_slots(both) == pytest.approx((30 + 10) / (9 + 1))
    m = est.mean_run_slots(both)
    assert est.benefit_slots(1, both) == pytest.approx(m * (1 - 1 / m) ** 2)
    # 5% noise is not a change
    quiet = PersistenceEstimator()
    rng = np.random.default_rng(0)
    for t in range(50):
        quiet.update(t, state.with_changes(speed_flops=state.speed_flops * rng.uniform(0.96, 1.04)))
    assert quiet.set_changes(both) == 0.0
    assert quiet.mean_run_slots(both) == pytest.approx(50 + 10)


# --------------------------------------------------------------------------------------------
# replay of a recorded main-job log
# --------------------------------------------------------------------------------------------


def _load_log():
    raw = json.loads((DATA / "charlm_run.json").read_text())
    profile = profile_from_dict(raw["profile"]).arrays()
    ids = sorted(raw["startup"]["speed_flops"])
    start = raw["startup"]
    # the runtime's local cluster (worker_main.local_cluster_state): one node per rank,
    # 16 GiB, 20 Gbit/s, 20 µs, start-up speeds and κ measured
    base = cluster_from_dict(
        {
            "links": {"intra_node_gbps": 20.0, "latency_us": 20.0},
            "devices": [
                {
                    "id": d,
                    "tflops": start["speed_flops"][d] / 1e12,
                    "memory_gib": 16.0,
                    "nic_gbps": 20.0,
                    "microbatch_overhead_ms": start["kappa_s"][d] * 1e3,
                }
                for d in ids
            ],
        }
    ).state()
    plans = {int(k): Plan.model_validate(v) for k, v in raw["plans"].items()}
    config = TrainingConfig(
        batch=raw["batch"], optimizer_state_factor=raw["optimizer_state_factor"], sync_overlap=True
    )
    return raw, profile, base, plans, config


REPLAY = (80, 150)
"""Replayed window of the 300-step log (w1 is 3x slower from step 100): the measurements
before it only warm the speed estimates (a full replay takes minutes on a loaded machine)."""


def _replay(raw, profile, base, plans, config, *, restore_at: int | None = None):
    """Feed the log's measurements (speed = FLOPs done / compute time, smoothed like the
    runtime) to a fresh controller; return its decisions for the steps of :data:`REPLAY`."""
    estimator = ClusterEstimator(
        base.ids,
        kappa_s=list(base.kappa_s),
        alpha=0.3,
        threshold=4.0,
        max_consecutive_outliers=3,
    )
    controller = LyapunovController(profile, config)
    flops = profile.train_flops
    decisions = []
    for rec in raw["steps"]:
        ran = plans[rec["plan_id"]]
        for g, share in zip(ran.groups, rec["shares"], strict=True):
            if share <= 0:
                continue
            n_mb = math.ceil(share / g.microbatch_size)
            for d, (a, b) in zip(g.devices, g.stages, strict=True):
                t = rec["compute_time_s"].get(d)
                if t:
                    estimator.observe_compute(d, float(flops[a:b].sum()) * share, t, n_mb)
        speed = base.speed_flops.copy()
        for d, s in estimator.speed_flops().items():
            if s and s > 0:
                speed[base.index()[d]] = s
        observed = base.with_changes(speed_flops=speed)
        step = rec["step"] + 1
        if not REPLAY[0] <= step < REPLAY[1]:
            continue
        if restore_at is not None and step == restore_at:
            blob = json.loads(json.dumps(controller.state_dict()))
            controller = LyapunovController(profile, config)
            controller.load_state_dict(blob)
        decisions.append(controller.decide(step, observed))
        controller.record(step, rec["iteration_time_s"], {"money": 0.0, "energy": 0.0})
    return decisions


@pytest.fixture(scope="module")
def replayed():
    raw, profile, base, plans, config = _load_log()
    return raw, profile, config, _replay(raw, profile, base, plans, config)


def test_replayed_main_job_log_applies_no_change_the_rule_forbids(replayed):
    raw, profile, config, decisions = replayed
    assert len(decisions) == REPLAY[1] - REPLAY[0]
    previous = None
    applied = 0
    for dec in decisions:
        state = dec.estimates.state
        after = evaluate_plan(dec.plan, state, profile, config)
        assert dec.predicted_time_s_after == pytest.approx(after.iteration_time_s, rel=1e-12)
        if previous is not None:
            before = evaluate_plan(previous, state, profile, config)
            # the figures are those of the estimates that chose the decision
            assert dec.predicted_time_s_before == pytest.approx(before.iteration_time_s, rel=1e-12)
            if dec.changed:
                applied += 1
                assert not dec.budget_driven and not dec.forced
                gain = before.iteration_time_s - after.iteration_time_s
                t_mig = migration_time_s(previous, dec.plan, state, profile, 2.0)
                assert dec.migration_time_s == pytest.approx(t_mig)
                assert gain > 0, dec.note
                assert gain * dec.persistence_slots >= t_mig, dec.note
            else:
                assert dec.plan == previous
        previous = dec.plan
    assert applied >= 1  # the slow-down of w1 (3x from step 100) is acted on
    last = decisions[-1].plan
    shares = {d: g.batch for g in last.groups for d in g.devices}
    assert shares.get("w1", 0) < min(shares[d] for d in ("w0", "w2", "w3"))


def test_replaying_twice_and_restoring_mid_run_give_identical_decisions(replayed):
    raw, profile, config, first = replayed
    _, _, base, plans, _ = _load_log()
    second = _replay(raw, profile, base, plans, config, restore_at=115)
    assert [d.to_dict() for d in first] == [d.to_dict() for d in second]


def test_budget_driven_changes_are_flagged_with_the_costs_that_drove_them():
    # two devices: d0 fast and expensive, d1 half as fast and cheap; a money budget between
    from hetrain.control.decision import Decision

    cluster = cluster_from_dict(
        {
            "links": {"intra_node_gbps": 800, "latency_us": 20},
            "devices": [
                {"id": "d0", "tflops": 0.96, "memory_gib": 16, "nic_gbps": 100.0,
                 "price_per_hour": 36.0},
                {"id": "d1", "tflops": 0.48, "memory_gib": 16, "nic_gbps": 100.0,
                 "price_per_hour": 3.6},
            ],
        }
    )  # fmt: skip
    state = cluster.state()
    # without the learned multiplier the queue alone drives the change (dual_learning=False)
    pol = LyapunovController(
        TWO_PROFILE, TWO_CONFIG, v=1.0, budgets={"money": 0.002}, dual_learning=False
    )
    seen: list[Decision] = []
    for t in range(40):
        dec = pol.decide(t, state)
        seen.append(dec)
        ev = evaluate_plan(dec.plan, state, TWO_PROFILE, TWO_CONFIG)
        pol.record(t, ev.iteration_time_s, ev.cost)
    budget = [d for d in seen if d.budget_driven]
    assert budget, [d.reason for d in seen]
    for d in budget:
        assert d.reason == "budget" and d.changed
        assert "money" in d.note and d.estimates.queue_weights["money"] > 0
        assert d.cost_after is not None and d.cost_before is not None
        assert d.objective_after < d.objective_before
    for d in seen:
        if d.changed and not d.forced and not d.budget_driven:
            assert d.predicted_time_s_after < d.predicted_time_s_before


def test_state_dict_is_plain_json_and_round_trips():
    pol = make_policy("lyapunov", TWO_PROFILE, TWO_CONFIG, budgets={"money": 1.0})
    state = TWO.state()
    pol.decide(0, state)
    pol.record(0, 0.5, {"money": 1.5, "energy": 0.0})
    blob = pol.state_dict()
    text = json.dumps(blob, allow_nan=False)
    twin = make_policy("lyapunov", TWO_PROFILE, TWO_CONFIG, budgets={"money": 1.0})
    twin.load_state_dict(json.loads(text))
    assert twin.state_dict() == blob
    assert twin.queues.backlog == pol.queues.backlog
    assert plan_of(twin.decide(1, state)) == plan_of(pol.decide(1, state))
    other = make_policy("lyapunov", TWO_PROFILE, TWO_CONFIG, budgets={"money": 2.0})
    with pytest.raises(ValueError, match="budgets"):
        other.load_state_dict(blob)


def test_decide_takes_the_runtime_s_current_plan():
    pol = LyapunovController(TWO_PROFILE, TWO_CONFIG)
    state = TWO.state().with_changes(speed_flops=np.array([0.96e12, 0.48e12]))
    running = Plan(
        plan_id=7,
        groups=(GroupPlan(devices=("d1",), stages=((0, 2),), microbatch_size=8, batch=8),),
    )
    dec = pol.decide(5, state, running)
    assert dec.predicted_time_s_before == pytest.approx(
        evaluate_plan(running, state, TWO_PROFILE, TWO_CONFIG).iteration_time_s
    )
    # moving to d0 gains 0.5 s a slot for a 3 s migration over ~8 slots of expected persistence
    assert dec.reason == "faster" and dec.plan.plan_id == 8
    assert dec.migration_time_s == pytest.approx(3.0, rel=0.01)


def test_a_persisting_gain_refused_after_a_turbulent_start_is_taken_by_the_age_rule():
    # 30 slots where the faster device swaps every slot teach the persistence estimate that a
    # state lasts ~1 slot (H ≈ 0.3); then d1 stays the faster one. Moving costs 3 s and gains
    # 0.5 s a slot: the geometric horizon alone never pays it back, the age rule (rent or buy)
    # switches once the gain forgone reaches the migration, (a + 1) · 0.5 >= 3: decisions 31-35
    # refuse (a = 0..4), decision 36 (a = 5) switches, the plan runs from slot 37.
    rows = []
    for t in range(30):
        rows += _slowed(t, "d1", "d0") if t % 2 == 0 else _slowed(t, "d0", "d1")
    rows += _slowed(30, "d0", "d1")
    res, used = _run(rows, 50)
    assert set(used[:30]) == {("d0",)}
    assert res.plan_changes == 1
    first = used.index(("d1",))
    assert first == 37, used
    assert used[first:] == [("d1",)] * (50 - first)
