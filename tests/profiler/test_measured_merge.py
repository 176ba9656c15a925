"""``hetrain profile --measure`` writes the measured per-layer times under a device kind, and
``hetrain profile merge`` joins the profiles of several machines (docs/profiling.md,
docs/model.md §3/§7)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hetrain.cli import main
from hetrain.cluster import cluster_from_dict, load_cluster
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.plan import plan_from_dict
from hetrain.profile import load_profile

MEASURE = ["--example", "digits", "--measure", "--microbatch-sizes", "1,64", "--repeats", "1",
           "--warmup", "0", "--no-link", "--workers", "2"]  # fmt: skip


def test_a_merged_profile_of_two_measure_runs_plans_with_both_kinds(tmp_path, capsys):
    paths = {}
    for kind in ("box-a", "box-b"):
        paths[kind] = tmp_path / f"{kind}.json"
        code = main(["profile", *MEASURE, "--out", str(paths[kind]), "--kind", kind])
        assert code == 0, capsys.readouterr().err
    one = load_profile(paths["box-a"])
    (table,) = one.measured_times.values()
    assert list(one.measured_times) == ["box-a"] and table.microbatch_sizes == [1, 64]
    assert np.array(table.fwd_s).shape == (2, one.num_layers)
    details = json.loads((tmp_path / "box-a.measure.json").read_text())
    assert table.fwd_s == details["fwd_s"] and table.bwd_s == details["bwd_s"]
    # the cluster file of the run names the kind, so plans from the two files use the times
    assert {d.kind for d in load_cluster(tmp_path / "box-a.cluster.yaml").devices} == {"box-a"}

    merged_path = tmp_path / "merged.json"
    code = main(["profile", "merge", str(paths["box-a"]), str(paths["box-b"]),
                 "--out", str(merged_path)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    merged = load_profile(merged_path)
    assert sorted(merged.measured_times) == ["box-a", "box-b"]
    assert merged.layers == one.layers
    b = load_profile(paths["box-b"]).measured_times["box-b"]
    assert merged.measured_times["box-b"] == b

    # a two-stage pipeline over one device of each kind takes the measured times of each
    cluster = {
        "devices": [
            {"id": "box-a-0", "tflops": 1, "memory_gib": 4, "nic_gbps": 1e3},
            {"id": "box-b-0", "tflops": 1, "memory_gib": 4, "nic_gbps": 1e3},
        ]
    }
    state = cluster_from_dict(cluster).state()
    arrays = merged.arrays()
    plan = plan_from_dict({"groups": [{"devices": ["box-a-0", "box-b-0"],
                                       "stages": [[0, 3], [3, 6]], "microbatch_size": 64,
                                       "batch": 64}]})  # fmt: skip
    ev = evaluate_plan(plan, state, arrays, TrainingConfig(batch=64))
    a = merged.measured_times["box-a"]
    want_a = sum(a.fwd_s[1][:3]) + sum(a.bwd_s[1][:3])
    want_b = sum(b.fwd_s[1][3:]) + sum(b.bwd_s[1][3:])
    assert ev.stage_compute_s[0] == pytest.approx((want_a, want_b), rel=1e-12)


def test_merging_profiles_of_different_models_or_one_kind_twice_exits_2(tmp_path, capsys):
    layer = {"fwd_flops": 1e9, "activation_bytes": 1e6}
    table = {"microbatch_sizes": [1], "fwd_s": [[0.1, 0.1]], "bwd_s": [[0.2, 0.2]]}
    files = {
        "a.json": {"layers": [layer, layer], "measured_times": {"K": table}},
        "b.json": {"layers": [layer, {**layer, "fwd_flops": 2e9}],
                   "measured_times": {"L": table}},
        "c.json": {"layers": [layer, layer], "measured_times": {"k": table}},
    }  # fmt: skip
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    out = str(tmp_path / "m.json")
    for other, words in (
        ("b.json", "layers[1].fwd_flops: expected 1000000000.0"),
        ("c.json", "measured_times.k: expected each device kind in one"),
    ):
        code = main(["profile", "merge", str(tmp_path / "a.json"), str(tmp_path / other),
                     "--out", out])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and other in err[0] and words in err[0]
    assert main(["merge-profiles", str(tmp_path / "a.json"), "--out", out]) == 2
    assert "at least two profiles" in capsys.readouterr().err
