"""The references of ``hetrain.sim.references``: the stale-information reference pays the
migration of its plan changes as the simulator charges a policy, and the search cache and the
stale-only mode change no figure."""

from __future__ import annotations

import numpy as np
import pytest

import hetrain.planner
from hetrain.cluster import cluster_from_dict, state_digest
from hetrain.costmodel import TrainingConfig
from hetrain.profile import profile_from_dict
from hetrain.sim.dynamics import generate_trace
from hetrain.sim.references import compute_references, slot_states
from hetrain.sim.simulator import simulate
from hetrain.trace import Trace, TraceRow

FAST = {"tflops": 30.0, "memory_gib": 40, "nic_gbps": 10, "price_per_hour": 3.0, "power_w": 400}
SLOW = {"tflops": 10.0, "memory_gib": 16, "nic_gbps": 10, "price_per_hour": 0.6, "power_w": 250}
CLUSTER = cluster_from_dict(
    {
        "links": {"intra_node_gbps": 800, "latency_us": 20},
        "devices": [{"id": f"a{i}", "node": f"n{i}", **FAST} for i in range(2)]
        + [{"id": f"b{i}", "node": "n9", **SLOW} for i in range(2)],
    }
)
PROFILE = profile_from_dict(
    {
        "name": "toy",
        "layers": [
            {"fwd_flops": 2e9, "activation_bytes": 4e5, "param_bytes": 5e7} for _ in range(6)
        ],
    }
).arrays()
CONFIG = TrainingConfig(batch=32)


def _timeline(slots: int, seed: int):
    rows = generate_trace(
        CLUSTER.ids,
        slots,
        seed,
        drift={"sigma": 0.02},
        preemption={"rate": 0.08, "mean_downtime_slots": 3, "min_available": 1},
        prices={"base_price_per_hour": [d.price_per_hour for d in CLUSTER.devices]},
    )
    return Trace(tuple(rows)).timeline(CLUSTER, slots)


class _Replay:
    """A policy that runs given plans, one per slot."""

    name = "replay"

    def __init__(self, plans):
        self.plans = plans

    def decide(self, slot, observed):
        return self.plans[slot]

    def observe(self, slot, plan, evaluation):
        pass


def test_stale_references_pay_the_simulators_migration_for_their_plan_changes():
    # a0 leaves for slots 6-9: a re-planner must re-plan twice, and moving layers back onto
    # a0 (idle, holding nothing) costs a migration the old reference did not charge
    slots = 16
    rows = [TraceRow(6, "a0", available=False), TraceRow(10, "a0", available=True)]
    timeline = Trace(tuple(rows)).timeline(CLUSTER, slots)
    refs = compute_references(timeline, PROFILE, CONFIG, slots=slots, search_every=4)
    stale, myopic, free = refs["stale"], refs["stale-myopic"], refs["stale-no-migration"]
    assert myopic.plan_changes >= 2
    assert myopic.per_slot_migration_s[10] > 0.0
    for ref in (stale, myopic):
        mig = ref.per_slot_migration_s
        assert ref.mean_migration_time_s == pytest.approx(float(np.mean(mig)))
        # the same plans run through the simulator (no delay, no noise) give the same
        # figures: the references are charged exactly as a policy is
        res = simulate(_Replay(ref.per_slot_plan), timeline, PROFILE, CONFIG, decision_delay=0)
        sim_mig = np.array([r.migration_time_s for r in res.records])
        np.testing.assert_allclose(sim_mig, mig, rtol=1e-9, atol=1e-12)
        summary = res.summary()
        assert summary["mean_iteration_time_s"] == pytest.approx(ref.mean_iteration_time_s)
        assert summary["mean_cost"]["money"] == pytest.approx(ref.mean_cost["money"])
        assert summary["mean_cost"]["energy"] == pytest.approx(ref.mean_cost["energy"])
    # without noise the stale states are the true ones (availability is known for the slot):
    # the planned sequence is the best one with migration, between the free and the myopic
    assert free.mean_iteration_time_s <= stale.mean_iteration_time_s + 1e-12
    assert stale.mean_iteration_time_s <= myopic.mean_iteration_time_s + 1e-12
    assert stale.mean_iteration_time_s < myopic.mean_iteration_time_s
    # without the hysteresis the myopic plans are the migration-free reference's plus migrations
    eager = compute_references(
        timeline, PROFILE, CONFIG, slots=slots, search_every=4, switch_margin=0.0
    )["stale-myopic"]
    assert eager.mean_migration_time_s > 0
    assert eager.mean_iteration_time_s == pytest.approx(
        free.mean_iteration_time_s + eager.mean_migration_time_s
    )
    # the migration-free figure is what charge_migration=False gives
    old = compute_references(
        timeline, PROFILE, CONFIG, slots=slots, search_every=4, charge_migration=False
    )["stale"]
    assert old.mean_iteration_time_s == pytest.approx(free.mean_iteration_time_s)
    assert old.mean_migration_time_s == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_cache_and_stale_only_mode_change_no_figure(seed, monkeypatch):
    slots, kw = 14, {"search_every": 4, "eta_grid": (1.0,), "measurement_noise": 0.02,
                     "time_noise": 0.02, "seed": seed}  # fmt: skip
    timeline = _timeline(slots, seed)
    free = compute_references(timeline, PROFILE, CONFIG, slots=slots, hindsight=False, **kw)
    money = 0.8 * free["stale"].mean_cost["money"]
    energy = 0.9 * free["stale"].mean_cost["energy"]
    settings = ({"money": money}, {"money": money, "energy": energy})
    calls = {"n": 0}
    real = hetrain.planner.best_plan

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(hetrain.planner, "best_plan", counted)
    plain = [
        compute_references(timeline, PROFILE, CONFIG, slots=slots, budgets=b, **kw)
        for b in settings
    ]
    plain_calls, calls["n"] = calls["n"], 0
    cache: dict = {}
    fast = [
        compute_references(
            timeline,
            PROFILE,
            CONFIG,
            slots=slots,
            budgets=b,
            hindsight=False,
            search_cache=cache,
            **kw,
        )  # fmt: skip
        for b in settings
    ]
    assert 0 < calls["n"] < plain_calls
    for p, f in zip(plain, fast, strict=True):
        assert "hindsight" in p and "hindsight" not in f
        for name in ("stale", "stale-unbudgeted", "stale-no-migration", "stale-myopic"):
            assert f[name].mean_iteration_time_s == p[name].mean_iteration_time_s
            assert f[name].mean_cost == p[name].mean_cost
            assert f[name].eta == p[name].eta
        assert [x.structure() for x in f["stale"].per_slot_plan] == [
            x.structure() for x in p["stale"].per_slot_plan
        ]
        np.testing.assert_array_equal(
            f["stale"].per_slot_migration_s, p["stale"].per_slot_migration_s
        )


def test_state_digest_separates_the_slot_states_of_a_timeline():
    timeline = _timeline(6, 0)
    actual, observed, _ = slot_states(timeline, 6, measurement_noise=0.02, seed=0)
    true_keys = {state_digest(s) for s in actual}
    seen_keys = {state_digest(s) for s in observed[1:]}  # noisy measurements of slots 0-4
    assert len(true_keys) == 6 and len(seen_keys) == 5
    assert not true_keys & seen_keys
    assert state_digest(actual[3]) == state_digest(timeline.state_at(3))
    flipped = actual[3].with_changes(available=~np.asarray(actual[3].available))
    assert state_digest(flipped) != state_digest(actual[3])
