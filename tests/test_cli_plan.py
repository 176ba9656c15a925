"""``hetrain plan`` and ``hetrain evaluate`` through the command line (docs/model.md §7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetrain.cli import main

CLUSTER = {
    "links": {"intra_node_gbps": 800, "latency_us": 10},
    "devices": [
        {"id": "a", "node": "n0", "tflops": 1, "memory_gib": 1, "nic_gbps": 8,
         "power_w": 100, "price_per_hour": 3.6, "microbatch_overhead_ms": 1.0},
        {"id": "b", "node": "n1", "tflops": 2, "memory_gib": 2, "nic_gbps": 8,
         "power_w": 200, "price_per_hour": 7.2},
        {"id": "c", "node": "n0", "tflops": 1, "memory_gib": 2, "nic_gbps": 8,
         "power_w": 100, "price_per_hour": 3.6},
    ],
}  # fmt: skip
PROFILE = {
    "name": "toy",
    "layers": [
        {"name": f"l{i}", "fwd_flops": 1e9 * (1 + i), "activation_bytes": 1e6,
         "activation_memory_bytes": 2e6, "param_bytes": 1e8}
        for i in range(5)
    ],
}  # fmt: skip


def _write(tmp_path: Path, name: str, obj: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


@pytest.fixture()
def files(tmp_path: Path) -> tuple[str, str]:
    return _write(tmp_path, "cluster.json", CLUSTER), _write(tmp_path, "model.json", PROFILE)


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_evaluate_reproduces_plan_time_through_cli(files, tmp_path: Path) -> None:
    cluster, model = files
    env = {**os.environ}
    cmd = [sys.executable, "-m", "hetrain"]
    common = ["--cluster", cluster, "--model", model, "--batch", "12"]
    done = subprocess.run([*cmd, "plan", *common, "--json"], capture_output=True, text=True,
                          env=env, check=True)  # fmt: skip
    plan = json.loads(done.stdout)
    assert sum(g["batch"] for g in plan["groups"]) == 12
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(done.stdout)
    done = subprocess.run([*cmd, "evaluate", *common, "--plan", str(plan_path), "--json"],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["iteration_time_s"] == plan["iteration_time_s"]  # exactly
    assert figures["lower_bound_s"] == plan["lower_bound_s"]
    assert figures["cost"] == plan["cost"]
    assert figures["fits"] is True
    assert set(figures["devices"]) == {d for g in plan["groups"] for d in g["devices"]}


def test_plan_table_and_queue(files, capsys) -> None:
    cluster, model = files
    code, out, _ = _run(["plan", "--cluster", cluster, "--model", model, "--batch", "12"], capsys)
    assert code == 0
    assert "T / T_LB" in out and "l0" in out and "iteration time" in out
    # a large money queue makes the planner use fewer / cheaper devices
    code, out, _ = _run(["plan", "--cluster", cluster, "--model", model, "--batch", "12",
                         "--json"], capsys)  # fmt: skip
    free = json.loads(out)
    code, out, _ = _run(["plan", "--cluster", cluster, "--model", model, "--batch", "12",
                         "--queue", "money=1e6", "--json"], capsys)  # fmt: skip
    costly = json.loads(out)
    assert costly["cost"]["money"] < free["cost"]["money"]
    assert costly["iteration_time_s"] >= free["iteration_time_s"]


def _plan_file(tmp_path: Path, groups: list[dict]) -> str:
    return _write(tmp_path, "p.json", {"groups": groups})


def test_evaluate_out_of_memory_exit_1(files, tmp_path: Path, capsys) -> None:
    cluster, model = files
    # the whole model on a (1 GiB): 5e8 * 4 = 2e9 B of parameters and Adam state
    plan = _plan_file(tmp_path, [{"devices": ["a"], "stages": [[0, 5]], "microbatch_size": 2,
                                  "batch": 4}])  # fmt: skip
    code, out, err = _run(["evaluate", "--cluster", cluster, "--model", model, "--batch", "4",
                           "--plan", plan, "--json"], capsys)  # fmt: skip
    assert code == 1
    assert json.loads(out)["fits"] is False
    assert "out of memory: device a" in err


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([{"devices": ["zz"], "stages": [[0, 5]], "microbatch_size": 1, "batch": 4}],
         "groups[0].devices[0]: expected a device id of the cluster, got 'zz'"),
        ([{"devices": ["b"], "stages": [[0, 4]], "microbatch_size": 1, "batch": 4}],
         "groups[0].stages: expected stages covering layers [0, 5)"),
        ([{"devices": ["b"], "stages": [[0, 5]], "microbatch_size": 1, "batch": 3}],
         "expected shares summing to the global batch 4, got 3"),
    ],
)  # fmt: skip
def test_evaluate_invalid_plan_exit_2(files, tmp_path, capsys, groups, message) -> None:
    cluster, model = files
    plan = _plan_file(tmp_path, groups)
    code, _, err = _run(["evaluate", "--cluster", cluster, "--model", model, "--batch", "4",
                         "--plan", plan], capsys)  # fmt: skip
    assert code == 2
    assert message in err and err.count("\n") == 1


def _bad_cluster(change) -> dict:
    cluster = json.loads(json.dumps(CLUSTER))
    change(cluster)
    return cluster


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        (_bad_cluster(lambda c: c["devices"][0].pop("tflops")),
         "cluster.json: devices[0].tflops: missing required field"),
        (_bad_cluster(lambda c: c["devices"][1].update(tflops=-3)),
         "cluster.json: devices[1].tflops: expected"),
        (_bad_cluster(lambda c: c["devices"][2].update(memory_gb=2)),
         "cluster.json: devices[2].memory_gb: unknown key"),
        (_bad_cluster(lambda c: c["devices"][2].update(id="a")),
         "duplicate device id 'a'"),
    ],
)  # fmt: skip
def test_plan_bad_cluster_exit_2(tmp_path, capsys, cluster, message) -> None:
    cpath = _write(tmp_path, "cluster.json", cluster)
    mpath = _write(tmp_path, "model.json", PROFILE)
    code, out, err = _run(["plan", "--cluster", cpath, "--model", mpath, "--batch", "4"], capsys)
    assert code == 2
    assert message in err and err.startswith("hetrain: error: ") and err.count("\n") == 1
    assert "Traceback" not in err and out == ""
    if "tflops: expected" in message:
        assert "-3" in err


def test_model_too_large_for_every_arrangement_exit_2(tmp_path, capsys) -> None:
    big = json.loads(json.dumps(PROFILE))
    for layer in big["layers"]:
        layer["param_bytes"] = 2e9  # 8e9 B with grads and Adam state: more than any device
    cpath = _write(tmp_path, "cluster.json", CLUSTER)
    mpath = _write(tmp_path, "big.json", big)
    code, _, err = _run(["plan", "--cluster", cpath, "--model", mpath, "--batch", "4"], capsys)
    assert code == 2
    # layer 0 alone (8e9 B + 2 MB of activations) is larger than the largest device (2 GiB)
    assert f"{mpath}: layers[0]: expected a model that fits some arrangement" in err
    assert "layer 0 ('l0') alone needs 8.002e+09 bytes" in err
    # every layer fits a 2 GiB device (1.2e9 B with Adam), but only one per device: the
    # model does not fit, and no single layer is to blame
    for layer in big["layers"]:
        layer["param_bytes"] = 3e8
    mpath = _write(tmp_path, "big.json", big)
    code, _, err = _run(["plan", "--cluster", cpath, "--model", mpath, "--batch", "4"], capsys)
    assert code == 2
    assert f"{mpath}: layers: expected a model that fits some arrangement" in err
    assert "alone needs" not in err


def test_batch_zero_exit_2(files, capsys) -> None:
    cluster, model = files
    for cmd in (["plan"], ["evaluate", "--plan", cluster]):
        code, _, err = _run([*cmd, "--cluster", cluster, "--model", model, "--batch", "0"],
                            capsys)  # fmt: skip
        assert code == 2
        assert "--batch: expected an integer >= 1, got 0" in err


def test_plan_naming_unavailable_device_is_input_error() -> None:
    from hetrain.cluster import cluster_from_dict
    from hetrain.commands.plan import check_plan_devices
    from hetrain.errors import InputError
    from hetrain.plan import plan_from_dict

    state = cluster_from_dict(CLUSTER).state()
    state = state.with_changes(available=state.available & [True, False, True])
    plan = plan_from_dict(
        {
            "groups": [
                {
                    "devices": ["a", "b"],
                    "stages": [[0, 2], [2, 5]],
                    "microbatch_size": 1,
                    "batch": 4,
                }
            ]
        }  # fmt: skip
    )
    with pytest.raises(InputError, match=r"p.json: groups\[0\].devices\[1\]: expected an avail"):
        check_plan_devices(plan, state, "p.json")


def test_plan_json_runs_each_one_device_share_as_one_micro_batch(tmp_path, capsys) -> None:
    """Four CPU-like devices whose fixed costs were measured as 0 for some (every micro-batch
    size ties for them in the cost model) and a small model: ``hetrain plan --json`` gives every
    one-device group its whole share as one micro-batch (it gave a rank 22 micro-batches of one
    sample, which ``hetrain train --plan`` ran as written, 1.5-2.5x slower)."""
    tflops, kappa_ms = [0.0106, 0.0035, 0.0106, 0.0106], [2.77, 8.96, 0.0, 3.42]
    devices = [
        {"id": f"w{i}", "node": "n0", "tflops": tflops[i], "memory_gib": 16, "nic_gbps": 20,
         "microbatch_overhead_ms": kappa_ms[i]}
        for i in range(4)
    ]  # fmt: skip
    cluster = _write(tmp_path, "c.json", {"links": {"intra_node_gbps": 20, "latency_us": 20},
                                          "devices": devices})  # fmt: skip
    small = {"name": "mlp", "layers": [{"name": f"b{i}", "fwd_flops": 1.05e6,
             "activation_bytes": 2048.0, "activation_memory_bytes": 4096.0,
             "param_bytes": 1.05e6} for i in range(8)]}  # fmt: skip
    model = _write(tmp_path, "m.json", small)
    for batch in (64, 37, 200):
        code, out, _ = _run(["plan", "--cluster", cluster, "--model", model, "--batch",
                             str(batch), "--json"], capsys)  # fmt: skip
        assert code == 0
        plan = json.loads(out)
        single = [g for g in plan["groups"] if len(g["devices"]) == 1 and g["batch"] > 0]
        assert single, plan
        assert all(g["microbatch_size"] == g["batch"] for g in single), plan
