"""``hetrain simulate`` through the CLI: per-slot time of a fixed plan equals ``hetrain evaluate``,
bad input exits 2 with one line, and the command never imports torch."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

DEVICES = [
    {"id": "a0", "node": "n0", "tflops": 30.0, "memory_gib": 40, "nic_gbps": 100,
     "price_per_hour": 3.0, "power_w": 400},
    {"id": "a1", "node": "n0", "tflops": 30.0, "memory_gib": 40, "nic_gbps": 100,
     "price_per_hour": 3.0, "power_w": 400},
    {"id": "b0", "node": "n1", "tflops": 10.0, "memory_gib": 16, "nic_gbps": 25,
     "price_per_hour": 0.6, "power_w": 250},
    {"id": "b1", "node": "n1", "tflops": 10.0, "memory_gib": 16, "nic_gbps": 25,
     "price_per_hour": 0.6, "power_w": 250},
]  # fmt: skip
PLAN = {
    "groups": [
        {"devices": ["a0", "b0"], "stages": [[0, 5], [5, 8]], "microbatch_size": 4, "batch": 40},
        {"devices": ["b1"], "stages": [[0, 8]], "microbatch_size": 2, "batch": 24},
    ]
}
TRACE = "slot,device,speed_factor,available,price_per_hour,nic_gbps\n2,a0,0.5,,,\n3,b1,,,1.2,\n"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "hetrain", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"devices": DEVICES}))
    layers = [{"fwd_flops": 2e9, "activation_bytes": 4e5, "param_bytes": 2e7} for _ in range(8)]
    (tmp_path / "model.json").write_text(json.dumps({"name": "toy", "layers": layers}))
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    (tmp_path / "trace.csv").write_text(TRACE)
    return tmp_path


def test_fixed_plan_slot_time_equals_hetrain_evaluate(files: Path):
    common = ["--model", "model.json", "--batch", "64"]
    sim = _run("simulate", "--cluster", "cluster.yaml", *common, "--plan", "plan.json",
               "--trace", "trace.csv", "--slots", "4", "--csv-out", "slots.csv", "--json",
               cwd=files)  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    rows = list(csv.DictReader((files / "slots.csv").open()))
    assert len(rows) == 4
    # slot 0-1: the cluster file; slot 2: a0 at half speed; slot 3: b1's price doubled
    slowed = [dict(d, tflops=d["tflops"] * 0.5) if d["id"] == "a0" else d for d in DEVICES]
    priced = [dict(d, price_per_hour=1.2) if d["id"] == "b1" else d for d in slowed]
    for slot, devices in ((0, DEVICES), (2, slowed), (3, priced)):
        (files / f"c{slot}.yaml").write_text(yaml.safe_dump({"devices": devices}))
        ev = _run("evaluate", "--cluster", f"c{slot}.yaml", *common, "--plan", "plan.json",
                  "--json", cwd=files)  # fmt: skip
        assert ev.returncode == 0, ev.stderr
        ref = json.loads(ev.stdout)
        assert float(rows[slot]["iteration_time_s"]) == pytest.approx(
            ref["iteration_time_s"], rel=1e-8
        )
        assert float(rows[slot]["cost_money"]) == pytest.approx(ref["cost"]["money"], rel=1e-8)
        assert float(rows[slot]["cost_energy"]) == pytest.approx(ref["cost"]["energy"], rel=1e-8)
    summary = json.loads(sim.stdout)
    assert summary["plan_changes"] == 0
    assert summary["slots"] == 4
    assert set(summary) >= {"policy", "slots", "mean_iteration_time_s", "mean_lower_bound_s",
                            "mean_cost", "plan_changes"}  # fmt: skip


def test_simulate_json_for_every_policy(files: Path, capsys, monkeypatch):
    from hetrain.cli import main

    monkeypatch.chdir(files)
    for policy in ("lyapunov", "greedy", "dp-even", "dp-proportional", "pipeline", "static-hybrid"):
        args = ["simulate", "--cluster", "cluster.yaml", "--model", "model.json", "--batch", "64"]
        rc = main([*args, "--trace", "trace.csv", "--slots", "6", "--policy", policy, "--json"])
        out = capsys.readouterr()
        assert rc == 0, (policy, out.err)
        summary = json.loads(out.out)
        assert summary["policy"] == policy
        assert summary["mean_iteration_time_s"] >= summary["mean_lower_bound_s"] > 0


@pytest.mark.parametrize(
    ("trace", "expect"),
    [
        ("slot,device,speed_factor\n0,zz,1.0\n", "row 2.device"),
        ("slot,device,speed_factor\n0,a0,-2\n", "row 2.speed_factor"),
        ("slot,device,speed_factor\n5,a0,1\n2,a0,1\n", "row 3.slot"),
    ],
)
def test_bad_trace_exits_2_with_one_line(files: Path, trace: str, expect: str):
    (files / "bad.csv").write_text(trace)
    out = _run("simulate", "--cluster", "cluster.yaml", "--model", "model.json", "--batch", "64",
               "--trace", "bad.csv", "--slots", "5", cwd=files)  # fmt: skip
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.csv" in lines[0] and expect in lines[0]


def test_budget_below_cheapest_plan_states_the_minimum(files: Path):
    out = _run("simulate", "--cluster", "cluster.yaml", "--model", "model.json", "--batch", "64",
               "--slots", "5", "--budget", "money=1e-9", cwd=files)  # fmt: skip
    assert out.returncode == 2
    line = out.stderr.strip()
    assert "\n" not in line and "--budget" in line and "minimum feasible budget" in line
    least = float(line.split("minimum feasible budget ")[1].split()[0])
    assert least > 1e-9
    ok = _run("simulate", "--cluster", "cluster.yaml", "--model", "model.json", "--batch", "64",
              "--slots", "5", "--budget", f"money={least * 1.001}", "--json",
              cwd=files)  # fmt: skip
    assert ok.returncode == 0, ok.stderr


def test_bad_policy_and_v_exit_2(files: Path):
    base = ["simulate", "--cluster", "cluster.yaml", "--model", "model.json", "--batch", "64"]
    for extra, what in (
        (["--policy", "fastest"], "--policy"),
        (["--V", "0"], "--V"),
        (["--decision-delay", "-1"], "--decision-delay"),
    ):
        out = _run(*base, *extra, cwd=files)
        assert out.returncode == 2 and what in out.stderr


def test_simulate_never_imports_torch(files: Path):
    code = (
        "import sys, hetrain.control, hetrain.sim.simulator, hetrain.sim.dynamics, "
        "hetrain.sim.converters, hetrain.commands.simulate\n"
        "from hetrain.cli import main\n"
        "rc = main(['simulate', '--cluster', 'cluster.yaml', '--model', 'model.json', "
        "'--batch', '64', '--slots', '3', '--json'])\n"
        "assert rc == 0, rc\n"
        "print('torch' in sys.modules)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    out = subprocess.run([sys.executable, "-c", code], cwd=files, env=env, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_decision_delay_option_changes_when_a_reaction_runs(files: Path, capsys, monkeypatch):
    """a0 halves its speed at slot 2: with the default delay (1) the controller's reaction
    runs from slot 4, with delay 0 from slot 3, so slot 3 is slower with the delay."""
    from hetrain.cli import main

    monkeypatch.chdir(files)
    times = {}
    for delay in ("0", "1"):
        args = ["simulate", "--cluster", "cluster.yaml", "--model", "model.json", "--batch", "64",
                "--trace", "trace.csv", "--slots", "6", "--policy", "greedy",
                "--csv-out", f"d{delay}.csv", "--decision-delay", delay]  # fmt: skip
        assert main(args) == 0
        capsys.readouterr()
        rows = list(csv.DictReader((files / f"d{delay}.csv").open()))
        times[delay] = [float(r["compute_time_s"]) for r in rows]
    assert times["0"][:3] == times["1"][:3]
    assert times["1"][3] > times["0"][3] * 1.01


def test_search_latency_runs_cheap_decisions_and_hands_searches_in_later(files: Path, monkeypatch):
    """``--search-latency L`` models the runtime's search thread: decisions never search
    (except the forced first one), and each search a decision asked for joins the policy's
    pool L slots later; with L = 0 that is the next decision."""
    from hetrain.cluster import load_cluster
    from hetrain.control.lyapunov import LyapunovController
    from hetrain.costmodel import TrainingConfig
    from hetrain.profile import load_profile
    from hetrain.sim.simulator import simulate
    from hetrain.trace import load_trace

    cluster = load_cluster(files / "cluster.yaml")
    profile = load_profile(files / "model.json").arrays()
    config = TrainingConfig(batch=64)
    trace = "slot,device,speed_factor,available,price_per_hour,nic_gbps\n" + "".join(
        f"{t},a0,{0.3 if t % 16 < 8 else 1.0},,,\n" for t in range(4, 60, 4)
    )
    (files / "moving.csv").write_text(trace)
    timeline = load_trace(files / "moving.csv").timeline(cluster, 60)
    for latency in (0, 3):
        handed, inline = [], []
        original_add, original_search = LyapunovController.add_searched, LyapunovController._search

        def add(self, step, plan, observed, weights, _log=handed, _orig=original_add):
            _log.append((self.clock, step))
            _orig(self, step, plan, observed, weights)

        def search(self, observed, weights, _log=inline, _orig=original_search):
            _log.append(self.clock)
            _orig(self, observed, weights)

        monkeypatch.setattr(LyapunovController, "add_searched", add)
        monkeypatch.setattr(LyapunovController, "_search", search)
        original_decide = LyapunovController.decide

        def decide(self, step, observed, current_plan=None, *, search=True, _orig=original_decide):
            self.clock = step
            return _orig(self, step, observed, current_plan, search=search)

        monkeypatch.setattr(LyapunovController, "decide", decide)
        pol = LyapunovController(profile, config, v=float("inf"), name="greedy")
        simulate(pol, timeline, profile, config, search_latency=latency)
        monkeypatch.undo()
        assert inline == [0]  # the first plan only
        assert len(handed) >= 3, handed
        # (handed in before the decision of slot ``clock + 1``)
        assert all(now + 1 == asked + max(latency, 1) for now, asked in handed), handed
