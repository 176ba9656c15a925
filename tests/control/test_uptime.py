"""The payback rule's device-uptime cap (docs/controller.md "Persistence"): up-runs learned per
device kind from the observed availability bound how long a switch onto some devices can pay
back its migration."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gate_inputs import two_layer_profile

from hetrain.cluster import cluster_from_dict
from hetrain.control import make_policy
from hetrain.control.decision import UptimeEstimator
from hetrain.costmodel import TrainingConfig
from hetrain.plan import GroupPlan, Plan
from hetrain.trace import Trace, TraceRow

# one stable slow device and two fast ones (2x) that take turns: each is up 3 slots, then down
# 3 (one of them is always up). Moving the 2-layer model costs 3 s (1 Gbit/s NICs), a fast
# device gains 0.25 s a slot
CLUSTER = cluster_from_dict(
    {
        "links": {"intra_node_gbps": 800, "latency_us": 20},
        "devices": [
            {"id": "slow-0", "node": "n0", "tflops": 0.96, "memory_gib": 16, "nic_gbps": 1.0},
            {"id": "fast-0", "node": "n1", "tflops": 1.92, "memory_gib": 16, "nic_gbps": 1.0},
            {"id": "fast-1", "node": "n2", "tflops": 1.92, "memory_gib": 16, "nic_gbps": 1.0},
        ],
    }
)
PROFILE = two_layer_profile()
CONFIG = TrainingConfig(batch=8)


def _taking_turns(slots: int, run: int = 3) -> list[TraceRow]:
    rows = []
    for t in range(0, slots, run):
        up = (t // run) % 2
        rows += [TraceRow(t, f"fast-{up}", available=True),
                 TraceRow(t, f"fast-{1 - up}", available=False)]  # fmt: skip
    return rows


def test_uptime_estimator_learns_up_runs_per_kind():
    state = CLUSTER.state()
    est = UptimeEstimator(prior_slots=10.0, prior_weight=1.0)
    rows = _taking_turns(30)
    timeline = Trace(tuple(rows)).timeline(CLUSTER, 30)
    for t in range(30):
        est.update(t, timeline.state_at(t))
        est.update(t, timeline.state_at(t))  # counted once
    # "fast": one device up per slot (30 device-slots), a device leaves every 3 slots from
    # slot 3 on (9 ends); "slow": 30 up-slots, never down
    assert est.up_slots == {"slow": 30.0, "fast": 30.0}
    assert est.downs == {"fast": 9.0}
    m = (30 + 10) / (9 + 1)
    assert est.mean_up_slots("fast") == pytest.approx(m)
    assert est.mean_up_slots("slow") == pytest.approx(40.0)
    p = 1 - 1 / m
    assert est.set_benefit_slots(state, [1], 1) == pytest.approx(p**2 / (1 - p))
    both = p * p
    assert est.set_benefit_slots(state, [1, 2], 0) == pytest.approx(both / (1 - both))
    assert est.set_benefit_slots(state, [], 1) == math.inf
    restored = UptimeEstimator()
    restored.load_state_dict(est.state_dict())
    assert restored.set_benefit_slots(state, [0, 1], 1) == est.set_benefit_slots(state, [0, 1], 1)


# a stable slow device and a 4x faster one of another kind: moving the model onto the fast
# device costs 3 s (1 Gbit/s NICs), running there gains 0.375 s a slot
PAIR = cluster_from_dict(
    {
        "links": {"intra_node_gbps": 800, "latency_us": 20},
        "devices": [
            {"id": "slow-0", "node": "n0", "tflops": 0.96, "memory_gib": 16, "nic_gbps": 1.0},
            {"id": "fast-0", "node": "n1", "tflops": 3.84, "memory_gib": 16, "nic_gbps": 1.0},
        ],
    }
)
ON_SLOW = Plan(
    groups=(GroupPlan(devices=("slow-0",), stages=((0, 2),), microbatch_size=1, batch=8),)
)


def _decide(flaps: bool, **options):
    """Greedy's decision at step 60 on slot-0's plan (the slow device), both devices up, after
    60 steps of availability history in which the fast device was up 2 slots and down 2
    (``flaps``) or always up; the state persistence seen by then is one slot (prior only)."""
    ctl = make_policy("greedy", PROFILE, CONFIG, **options)
    state = PAIR.state()
    if ctl.uptime is not None:
        for t in range(60):
            up = not flaps or (t // 2) % 2 == 0
            ctl.uptime.update(t, state.with_changes(available=np.array([True, up])))
    decision = ctl.decide(60, state, ON_SLOW)
    used = {d for g in decision.plan.groups if g.batch > 0 for d in g.devices}
    return decision, used


def test_switches_onto_devices_that_leave_soon_are_refused():
    # the state has held (persistence prior: H = 11 (10/11)^2 = 9.1 slots, 3.4 s of gain >= 3 s)
    # but the fast kind's learned up-run is m = (30 + 50) / (15 + 1) = 5 slots: it stays up
    # 0.8^2 / 0.2 = 3.2 more slots once the decision runs, 1.2 s of gain < 3 s
    refused, used = _decide(flaps=True)
    assert refused.reason == "keep" and used == {"slow-0"}
    taken, used = _decide(flaps=True, uptime_prior_slots=None)
    assert taken.reason == "faster" and "fast-0" in used
    assert taken.migration_time_s == pytest.approx(3.0, rel=0.01)
    # a fast device that never left: the same switch is taken with the cap
    stable, used = _decide(flaps=False)
    assert stable.reason == "faster" and "fast-0" in used
