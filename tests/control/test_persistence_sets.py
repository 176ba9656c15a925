"""Persistence of the devices a plan change involves (docs/controller.md, "Persistence"):
per-device change counts, the set estimate, and a controller whose payback horizon is not cut
short by churn on devices outside the two plans."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from gate_inputs import two_layer_profile
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import cluster_from_dict
from hetrain.control import make_policy, plan_of
from hetrain.control.decision import PersistenceEstimator
from hetrain.costmodel import TrainingConfig
from hetrain.sim.simulator import simulate
from hetrain.trace import Trace, TraceRow


def _cluster(devices: int, spot: int = 0):
    """``devices`` fast devices ``d*`` and ``spot`` slow spot devices ``s*`` (their own kind),
    each on its own node behind a 1 Gbit/s NIC."""
    rows = [
        {"id": f"d{i}", "kind": "fast", "tflops": 0.96, "memory_gib": 16, "nic_gbps": 1.0}
        for i in range(devices)
    ]
    rows += [
        {"id": f"s{i}", "kind": "spot", "tflops": 0.02, "memory_gib": 16, "nic_gbps": 1.0}
        for i in range(spot)
    ]
    return cluster_from_dict({"links": {"intra_node_gbps": 800, "latency_us": 20}, "devices": rows})


@settings(max_examples=40, deadline=None)
@given(
    devices=st.integers(2, 24),
    steps=st.integers(2, 60),
    seed=st.integers(0, 2**31 - 1),
    prior_slots=st.floats(1.0, 50.0),
    prior_weight=st.floats(0.0, 3.0),
)
def test_set_estimate_counts_its_members_events_by_their_share(
    devices, steps, seed, prior_slots, prior_weight
):
    # every step each device may come or go, halve or restore its speed, or stay (a 3% wobble
    # is never an event); the test keeps each device's events against its own value at the
    # start of its run: a step where a member came or went is one change of the set, a step
    # with speed moves |dx| of members min(1, sum |dx| / (0.1 * the set's speed)) of one
    rng = np.random.default_rng(seed)
    base = _cluster(devices).state()
    speed0 = base.speed_flops.copy()
    est = PersistenceEstimator(threshold=0.1, prior_slots=prior_slots, prior_weight=prior_weight)
    up = np.ones(devices, dtype=bool)
    factor = np.ones(devices)  # 1 or 0.5
    ref_up, ref_factor, ref_value = up.copy(), factor.copy(), factor.copy()
    events: list[list[tuple[int, str, float]]] = [[] for _ in range(devices)]
    for t in range(steps):
        wobble = np.ones(devices)
        if t > 0:
            up = np.where(rng.random(devices) < 0.15, ~up, up)
            slow = rng.random(devices) < 0.15
            factor = np.where(slow, np.where(factor == 1.0, 0.5, 1.0), factor)
            wobble = rng.uniform(0.985, 1.015, devices)
            for d in range(devices):
                if up[d] != ref_up[d]:
                    events[d].append((t, "came or went", 0.0))
                elif up[d] and factor[d] != ref_factor[d]:
                    dx = abs(factor[d] * wobble[d] - ref_value[d]) * speed0[d]
                    events[d].append((t, "speed", dx))
                else:
                    continue
                ref_up[d], ref_factor[d], ref_value[d] = up[d], factor[d], factor[d] * wobble[d]
        est.update(t, base.with_changes(available=up.copy(), speed_flops=speed0 * factor * wobble))
    subset = sorted(rng.choice(devices, size=int(rng.integers(1, devices + 1)), replace=False))
    speed_of_set = 0.1 * float(np.sum(ref_value[subset] * speed0[subset]))
    per_step: dict[int, float] = {}
    for d in subset:
        for step, what, dx in events[d]:
            per_step[step] = per_step.get(step, 0.0) + (
                1.0 if what == "came or went" else dx / speed_of_set
            )
    changes = sum(min(x, 1.0) for x in per_step.values())
    rate = changes + prior_weight * len(subset) / devices
    expected = (steps + prior_weight * prior_slots) / rate if rate > 0 else math.inf
    assert est.set_changes(subset) == pytest.approx(changes)
    assert est.mean_run_slots(subset) == pytest.approx(max(expected, 1.0))
    assert est.mean_run_slots([]) == math.inf
    m = est.mean_run_slots(subset)
    assert est.benefit_slots(1, subset) == pytest.approx(m * (1 - 1 / m) ** 2)
    restored = PersistenceEstimator()
    restored.load_state_dict(json.loads(json.dumps(est.state_dict())))
    assert restored.mean_run_slots(subset) == pytest.approx(m)


def test_churn_outside_a_set_leaves_its_persistence_alone():
    base = _cluster(4, spot=12).state()
    rng = np.random.default_rng(7)
    est = PersistenceEstimator()
    for t in range(200):
        up = np.ones(16, dtype=bool)
        up[4:] = rng.random(12) < 0.5  # the spot devices come and go every other step
        est.update(t, base.with_changes(available=up))
    assert est.mean_run_slots(range(16)) < 1.5  # the cluster as a whole never holds a state
    # the four stable devices: 200 steps and only their share of the prior's one change
    assert est.mean_run_slots([0, 1, 2, 3]) == pytest.approx((200 + 10) / (4 / 16))


# PersistenceEstimator.state_dict() as written before the cluster-wide count was removed (it
# carried "slots", "changes" and "reference"), after six steps on three 1 TFLOP/s devices: d0
# halves its speed at step 2, d1 leaves at 3 and returns at 5, d2 drops to 0.8 at 4
OLD_FORMAT = {
    "threshold": 0.1, "prior_slots": 10.0, "prior_weight": 1.0, "slots": 6, "changes": 4,
    "last_step": 5,
    "reference": {
        "available": [True, True, True], "speed": [5e11, 1e12, 8e11], "nic": [1.25e8] * 3
    },
    "window_slots": 1000, "device_slots": 6, "device_count": 3,
    "device_events": [
        [3, 0, "speed", 5e11], [4, 1, "available", 0.0], [5, 2, "speed", 2e11],
        [6, 1, "available", 0.0],
    ],
    "device_reference": {
        "available": [True, True, True], "speed": [5e11, 1e12, 8e11], "nic": [1.25e8] * 3
    },
}  # fmt: skip


def test_an_older_state_with_the_cluster_wide_count_still_loads():
    est = PersistenceEstimator(threshold=0.3, prior_slots=2.0)
    est.load_state_dict(json.loads(json.dumps(OLD_FORMAT)))
    # the set figures the code that wrote it gave, to the last bit
    assert est.set_changes([0, 1, 2]) == 3.869565217391304  # min(1, 5/2.3) + 1 + 2/2.3 + 1
    assert est.mean_run_slots([0, 1, 2]) == 3.2857142857142856
    assert est.mean_run_slots([1]) == 6.857142857142857
    assert est.mean_run_slots([0, 2]) == 6.0
    assert est.benefit_slots(1, [0, 2]) == 4.166666666666667
    blob = est.state_dict()
    gone = ("slots", "changes", "reference")
    assert not set(gone) & set(blob)
    assert blob == {k: v for k, v in OLD_FORMAT.items() if k not in gone}
    # the count goes on from where it was: step 5 again is ignored, step 6 adds one slot
    state = _cluster(3).state().with_changes(speed_flops=np.array([5e11, 1e12, 8e11]))
    est.update(5, state)
    assert est.mean_run_slots([0]) == (6 + 10) / (1 + 1 / 3)
    est.update(6, state)
    assert est.mean_run_slots([0]) == (7 + 10) / (1 + 1 / 3)


def test_a_controller_state_with_the_old_persistence_fields_gives_the_same_decisions():
    cluster = _cluster(3)
    config = TrainingConfig(batch=8)
    speeds = np.array([[1.0, 1.0, 1.0], [1.0, 0.5, 1.0], [0.4, 0.5, 1.0], [0.4, 0.5, 0.9]])
    pol = make_policy("greedy", TWO_LAYERS, config)
    base = cluster.state()
    for t in range(2):
        pol.decide(t, base.with_changes(speed_flops=base.speed_flops * speeds[t]))
    blob = pol.state_dict()
    old = json.loads(json.dumps(blob))
    old["persistence"].update(slots=2, changes=1, reference=old["persistence"]["device_reference"])
    twin = make_policy("greedy", TWO_LAYERS, config)
    twin.load_state_dict(old)
    assert twin.state_dict() == blob
    for t in range(2, 4):
        state = base.with_changes(speed_flops=base.speed_flops * speeds[t])
        a, b = pol.decide(t, state), twin.decide(t, state)
        assert plan_of(a) == plan_of(b) and a.persistence_slots == b.persistence_slots


TWO_LAYERS = two_layer_profile()


@pytest.mark.parametrize("seed", range(8))
def test_a_persistent_straggler_is_left_despite_spot_churn_elsewhere(seed):
    # two fast devices (one runs the model: 0.5 s a step; moving it costs 3 s over 1 Gbit/s)
    # and slow spot devices that no plan uses, flapping at a seeded rate; the running device
    # halves its speed at slot 20 for good: the other one gains 0.5 s a slot and pays the move
    # back in 6. The controller must follow at once (measured in 20, decided before 21, runs
    # from 22 with the decision delay), not wait until a refused gain has aged
    rng = np.random.default_rng(seed)
    spot = int(rng.integers(4, 13))
    cluster = _cluster(2, spot=spot)
    slots = 40
    rate = float(rng.uniform(0.3, 0.7))
    rows = []
    for t in range(1, slots):
        for i in range(spot):
            if rng.random() < rate:
                rows.append(TraceRow(slot=t, device=f"s{i}", available=bool(rng.random() < 0.5)))
    rows.append(TraceRow(slot=20, device="d0", speed_factor=0.5))
    rows.sort(key=lambda r: r.slot)
    timeline = Trace(tuple(rows)).timeline(cluster, slots)
    config = TrainingConfig(batch=8)
    pol = make_policy("greedy", TWO_LAYERS, config)
    res = simulate(pol, timeline, TWO_LAYERS, config, keep_plans=True, decision_delay=1)
    used = [tuple(d for g in p.groups if g.batch > 0 for d in g.devices) for p in res.plans]
    assert used[:20] == [("d0",)] * 20
    assert used[22:] == [("d1",)] * (slots - 22)
