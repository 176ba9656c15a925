"""Tier 1: the docs/model.md §7 file formats (cluster, trace, plan) load, convert units and reject
bad
input with one line naming file and field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hetrain.cluster import GIB, cluster_from_dict, load_cluster
from hetrain.errors import InputError
from hetrain.plan import load_plan, plan_from_dict
from hetrain.trace import TraceRow, load_trace, write_trace

CLUSTER = {
    "links": {"intra_node_gbps": 800, "latency_us": 20},
    "devices": [
        {"id": "v100-0", "node": "n0", "tflops": 14.0, "memory_gib": 16, "nic_gbps": 25,
         "power_w": 300, "price_per_hour": 3.06, "microbatch_overhead_ms": 2.0},
        {"id": "v100-1", "node": "n0", "tflops": 14.0, "memory_gib": 16, "nic_gbps": 25},
        {"id": "k80", "tflops": 4.0, "memory_gib": 12, "nic_gbps": 10},
    ],
}  # fmt: skip


def test_cluster_state_converts_units_to_si():
    state = cluster_from_dict(CLUSTER).state()
    assert state.ids == ("v100-0", "v100-1", "k80")
    np.testing.assert_allclose(state.speed_flops, [14e12, 14e12, 4e12])
    np.testing.assert_allclose(state.memory_bytes, [16 * GIB, 16 * GIB, 12 * GIB])
    np.testing.assert_allclose(state.nic_bytes_per_s, [25e9 / 8, 25e9 / 8, 10e9 / 8])
    np.testing.assert_allclose(state.price_per_s, [3.06 / 3600, 0, 0])
    np.testing.assert_allclose(state.kappa_s, [2e-3, 0, 0])
    assert state.latency_s == pytest.approx(20e-6)
    # node defaults to the device's own id: k80 is alone on its node
    assert state.node[0] == state.node[1] != state.node[2]
    # bw(d, e): intra-node for v100-0/v100-1, min of NICs otherwise (docs/model.md §2)
    assert state.link_bandwidth(0, 1) == pytest.approx(800e9 / 8)
    assert state.link_bandwidth(0, 2) == pytest.approx(10e9 / 8)


def test_cluster_yaml_and_json_load_the_same(tmp_path):
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CLUSTER))
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    assert load_cluster(tmp_path / "c.yaml") == load_cluster(tmp_path / "c.json")


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (lambda c: c["devices"][1].pop("tflops"), "devices[1].tflops", "missing"),
        (lambda c: c["devices"][2].update(tflops=-1), "devices[2].tflops", "greater than 0"),
        (lambda c: c["devices"][0].update(memory_gb=16), "devices[0].memory_gb", "unknown key"),
        (lambda c: c["devices"][2].update(id="v100-0"), "devices[2].id", "duplicate"),
        (lambda c: c["links"].update(latency_us=float("nan")), "links.latency_us", "finite"),
    ],
)
def test_cluster_bad_field_names_file_and_field(mutate, field, words):
    raw = json.loads(json.dumps(CLUSTER))
    mutate(raw)
    with pytest.raises(InputError) as info:
        cluster_from_dict(raw, "c.yaml")
    message = str(info.value)
    assert message.startswith("c.yaml: ")
    assert field in message
    assert words in message
    assert "\n" not in message


def test_trace_timeline_applies_changes_from_their_slot_on(tmp_path):
    cluster = cluster_from_dict(CLUSTER)
    path = tmp_path / "t.csv"
    path.write_text(
        "slot,device,speed_factor,available,price_per_hour,nic_gbps\n"
        "0,k80,,0,,\n"
        "2,v100-1,0.5,,,\n"
        "3,k80,,1,0.9,5\n"
        "3,v100-1,,,,\n"
    )
    timeline = load_trace(path, cluster).timeline(cluster, 5)
    s0, s2, s4 = timeline.state_at(0), timeline.state_at(2), timeline.state_at(4)
    assert list(s0.available) == [True, True, False]
    np.testing.assert_allclose(s0.speed_flops, [14e12, 14e12, 4e12])
    np.testing.assert_allclose(s2.speed_flops, [14e12, 7e12, 4e12])
    assert list(s2.available) == [True, True, False]
    assert list(s4.available) == [True, True, True]
    np.testing.assert_allclose(s4.speed_flops, [14e12, 7e12, 4e12])  # empty cells: unchanged
    assert s4.price_per_s[2] == pytest.approx(0.9 / 3600)
    assert s4.nic_bytes_per_s[2] == pytest.approx(5e9 / 8)


def test_trace_round_trip_through_write(tmp_path):
    rows = [TraceRow(3, "k80", speed_factor=0.25), TraceRow(1, "v100-0", available=False)]
    write_trace(tmp_path / "t.csv", rows)
    loaded = load_trace(tmp_path / "t.csv")
    assert [r.slot for r in loaded.rows] == [1, 3]
    assert loaded.rows[0].available is False and loaded.rows[1].speed_factor == 0.25


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("1,k80,1,,,\n0,k80,1,,,\n", "row 3.slot"),
        ("0,gpu9,1,,,\n", "row 2.device"),
        ("0,k80,-2,,,\n", "row 2.speed_factor"),
        ("0,k80,,2,,\n", "row 2.available"),
        ("x,k80,,,,\n", "row 2.slot"),
    ],
)
def test_trace_bad_rows(tmp_path, body, field):
    path = tmp_path / "t.csv"
    path.write_text("slot,device,speed_factor,available,price_per_hour,nic_gbps\n" + body)
    with pytest.raises(InputError) as info:
        load_trace(path, cluster_from_dict(CLUSTER))
    assert field in str(info.value) and str(path) in str(info.value)


def test_plan_json_round_trip_and_validation(tmp_path):
    raw = {
        "plan_id": 3,
        "groups": [
            {"devices": ["v100-0", "v100-1"], "stages": [[0, 3], [3, 8]],
             "microbatch_size": 4, "batch": 12},
            {"devices": ["k80"], "stages": [[0, 8]], "microbatch_size": 2, "batch": 0},
        ],
    }  # fmt: skip
    plan = plan_from_dict(raw)
    assert plan.schedule == "1f1b" and plan.global_batch == 12
    assert plan.groups[0].num_microbatches == 3 and plan.groups[1].num_microbatches == 0
    (tmp_path / "p.json").write_text(plan.to_json())
    assert load_plan(tmp_path / "p.json") == plan
    plan.validate_for(cluster_from_dict(CLUSTER).ids, 8, 12, "p.json")
    with pytest.raises(InputError, match="summing to the global batch 16"):
        plan.validate_for(cluster_from_dict(CLUSTER).ids, 8, 16, "p.json")
    with pytest.raises(InputError, match=r"covering layers \[0, 9\)"):
        plan.validate_for(cluster_from_dict(CLUSTER).ids, 9, 12, "p.json")
    with pytest.raises(InputError, match="groups\\[0\\].devices\\[1\\]"):
        plan.validate_for(["v100-0", "k80"], 8, 12, "p.json")


def test_plan_rejects_a_device_in_two_groups():
    raw = {
        "groups": [
            {"devices": ["a"], "stages": [[0, 2]], "microbatch_size": 1, "batch": 1},
            {"devices": ["a"], "stages": [[0, 2]], "microbatch_size": 1, "batch": 1},
        ]
    }
    with pytest.raises(InputError, match="also in groups\\[0\\]"):
        plan_from_dict(raw, "p.json")
