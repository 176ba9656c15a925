"""Seeded dynamics generators, converters from the real traces in ../shared/data, and the
simulation plots."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hetrain.cluster import cluster_from_dict
from hetrain.errors import InputError
from hetrain.sim import converters
from hetrain.sim.dynamics import generate_trace, preemption_rows, straggler_rows
from hetrain.trace import Trace, load_trace, write_trace

DATA = Path(os.environ.get("HETRAIN_SHARED_DATA", "/work/shared/data"))
IDS = [f"d{i}" for i in range(12)]
CLUSTER = cluster_from_dict(
    {
        "devices": [
            {"id": d, "tflops": 10, "memory_gib": 16, "nic_gbps": 25, "price_per_hour": 1.0}
            for d in IDS
        ]
    }  # fmt: skip
)


def need(path: str) -> Path:
    p = DATA / path
    if not p.exists():
        pytest.skip(f"shared data {p} is absent")
    return p


def test_generators_are_seeded_and_round_trip_through_a_trace_file(tmp_path):
    kw = {"drift": {"sigma": 0.02}, "stragglers": {"rate": 0.02}, "preemption": {"rate": 0.01},
          "prices": {"base_price_per_hour": [1.0] * len(IDS)}}  # fmt: skip
    a = generate_trace(IDS, 300, 7, **kw)
    assert a == generate_trace(IDS, 300, 7, **kw)
    assert a != generate_trace(IDS, 300, 8, **kw)
    write_trace(tmp_path / "t.csv", a)
    loaded = load_trace(tmp_path / "t.csv", CLUSTER)
    dense = loaded.timeline(CLUSTER, 300)
    direct = Trace(tuple(a)).timeline(CLUSTER, 300)
    np.testing.assert_allclose(dense.speed_factor, direct.speed_factor, rtol=1e-5)
    np.testing.assert_array_equal(dense.available, direct.available)
    assert np.all(dense.speed_factor > 0) and np.all(dense.price_per_s > 0)


def test_preemption_keeps_the_minimum_up_and_devices_return():
    rng = np.random.default_rng(0)
    rows = preemption_rows(IDS, 400, rng, rate=0.2, mean_downtime_slots=5, min_available=4)
    tl = Trace(tuple(rows)).timeline(CLUSTER, 400)
    up = tl.available.sum(axis=1)
    assert up.min() >= 4
    assert up.max() == len(IDS)  # returns happen
    assert (np.diff(tl.available.astype(int), axis=0) == 1).any()


def test_straggler_spikes_slow_down_then_recover():
    rows = straggler_rows(IDS, 500, np.random.default_rng(1), rate=0.02, slowdown=0.25)
    tl = Trace(tuple(rows)).timeline(CLUSTER, 500)
    assert set(np.unique(tl.speed_factor)) == {0.25, 1.0}
    assert 0.05 < (tl.speed_factor < 1).mean() < 0.6


def test_alibaba_straggler_trace_gives_median_speed_one_and_real_stragglers():
    rows = converters.straggler_rows_from_alibaba(
        need("alibaba-stragglers/gpu-v2020__job_1_norm.csv"), IDS[:10], 300
    )
    tl = Trace(tuple(rows)).timeline(CLUSTER, 300)
    f = tl.speed_factor[:, :10]
    assert np.median(f) == pytest.approx(1.0, rel=0.05)
    # job 1: worker 6 has a straggler spike (mini-batch time 1000 vs a median of ~450)
    assert f[:, 6].min() < 0.5 < f[:, [0, 1, 2, 3, 4, 5, 7, 8, 9]].min()
    # and workers differ persistently: 0-2 are ~10% slower than 7-9
    assert f[:, :3].mean() < 0.95 * f[:, 7:].mean()


def test_bamboo_events_make_devices_leave_and_join(tmp_path):
    rows = converters.bamboo_event_rows(need("bamboo/p3-trace.csv"), IDS, 300, slot_seconds=120)
    tl = Trace(tuple(rows)).timeline(CLUSTER, 300)
    up = tl.available.sum(axis=1)
    assert up[0] > 0 and up.min() < up.max() <= len(IDS)
    (tmp_path / "bad.csv").write_text("0,add,node1\n10,explode,node1\n")
    with pytest.raises(InputError, match="line 2"):
        converters.bamboo_event_rows(tmp_path / "bad.csv", IDS, 5)


def test_spot_prices_follow_the_aws_history():
    path = need("spot-prices-aws/us-east-1/p3.2xlarge.json")
    rows = converters.spot_price_rows(path, IDS[:2], 200, slot_seconds=3600, gpus_per_instance=1)
    tl = Trace(tuple(rows)).timeline(CLUSTER, 200)
    prices = tl.price_per_s[:, 0] * 3600
    # p3.2xlarge spot in us-east-1 ranged about 0.9 - 1.1 USD/hour in 2019-20
    assert 0.8 < prices.min() <= prices.max() < 1.2
    assert len(np.unique(prices)) > 5


def test_spot_logs_and_instance_counts_are_availability():
    rows = converters.spot_log_rows(
        need("spot-availability/availability/persistent_2020-03-04.out"), IDS, 300,
        slot_seconds=300,
    )  # fmt: skip
    up = Trace(tuple(rows)).timeline(CLUSTER, 300).available.sum(axis=1)
    assert up.max() > 0 and (np.diff(up) < 0).any()  # instances run and get preempted
    rows = converters.instance_count_rows(need("bamboo/v100x1-east1c.txt"), IDS, 200)
    up = Trace(tuple(rows)).timeline(CLUSTER, 200).available.sum(axis=1)
    assert up.max() == len(IDS) or up.max() >= 0.8 * len(IDS)


def test_plots_are_written(tmp_path):
    from hetrain.control import make_policy
    from hetrain.costmodel import TrainingConfig
    from hetrain.profile import profile_from_dict
    from hetrain.report.sim_plots import plot_policies, plot_v_sweep
    from hetrain.sim.simulator import simulate

    profile = profile_from_dict(
        {"layers": [{"fwd_flops": 1e9, "activation_bytes": 1e5, "param_bytes": 1e6}] * 4}
    ).arrays()
    config = TrainingConfig(batch=16)
    tl = Trace(tuple(generate_trace(IDS, 20, 0, drift={}))).timeline(CLUSTER, 20)
    budget = {"money": 1e-6}
    runs = {v: simulate(make_policy("lyapunov", profile, config, v=v, budgets=budget),
                        tl, profile, config, budgets=budget) for v in (1.0, 10.0)}  # fmt: skip
    a = plot_policies(list(runs.values()), tmp_path / "p.png", title="t")
    b = plot_v_sweep(runs, tmp_path / "v.png")
    assert a.stat().st_size > 10_000 and b.stat().st_size > 5_000


def test_link_degradation_episodes_cut_the_nic_then_recover():
    from hetrain.sim.dynamics import link_rows

    rows = link_rows(IDS, [25.0] * len(IDS), 600, np.random.default_rng(2), rate=0.01,
                     factor=0.1, mean_duration_slots=20.0)  # fmt: skip
    assert [r.slot for r in rows] == sorted(r.slot for r in rows)
    tl = Trace(tuple(rows)).timeline(CLUSTER, 600)
    gbps = tl.nic_bytes_per_s / tl.nic_bytes_per_s.max()
    assert set(np.round(np.unique(gbps), 9)) == {0.1, 1.0}
    degraded = (gbps < 1).mean()
    # stationary share of an on/off chain with rates 0.01 and 1/20: 0.01 / (0.01 + 0.05)
    assert 0.08 < degraded < 0.28, degraded
    with pytest.raises(ValueError, match="factor"):
        link_rows(IDS, [25.0] * len(IDS), 10, np.random.default_rng(0), factor=0.0)


def test_policy_bench_family_is_forty_seeded_scenarios_on_real_traces():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from family import family_specs

    specs = family_specs(40)
    assert family_specs(40) == specs  # seeded
    assert len({s["name"] for s in specs}) == 40
    sizes = [sum(s["cluster"]["kinds"].values()) for s in specs]
    assert min(sizes) >= 8 and max(sizes) <= 64 and len(set(sizes)) >= 5
    assert len({s["model"] for s in specs}) >= 4 and len({s["batch"] for s in specs}) >= 4
    root = Path(__file__).resolve().parents[2]
    for s in specs:
        assert (root / s["model"]).is_file()
        dyn = s["dynamics"]
        assert dyn["stragglers"] and dyn["bamboo_events"]
        for entry in dyn["stragglers"] + dyn["bamboo_events"] + dyn["spot_prices"]:
            need(entry["file"])
