"""Figures printed with their units and counts with the right plural: money per iteration in
USD/iteration, energy in J/iteration, "1 rank" / "4 ranks"."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from hetrain._text import money_per_iteration, plural
from hetrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = str(ROOT / "examples" / "clusters" / "priced8.yaml")
MODEL = str(ROOT / "examples" / "profiles" / "resnet50.json")


def test_plural() -> None:
    assert plural(1, "rank") == "1 rank"
    assert plural(0, "rank") == "0 ranks"
    assert plural(4, "step") == "4 steps"
    assert plural(2, "bus", "buses") == "2 buses"
    assert money_per_iteration(0.000124) == "0.000124 USD/iteration"


def test_train_summary_says_1_rank_and_1_step(capsys) -> None:
    from hetrain.commands.train import _print_summary

    summary = {"steps": 1, "final_loss": 0.5, "replans": 0, "quality": "ok", "wall_time_s": 1}
    job = SimpleNamespace(devices=["w0"], metrics_out="m.jsonl", run_dir=None)
    _print_summary(summary, job, report=False, json_out=False)
    out = capsys.readouterr().out
    assert "trained 1 step on 1 rank in" in out
    job = SimpleNamespace(devices=["w0", "w1"], metrics_out="m.jsonl", run_dir=None)
    _print_summary({**summary, "steps": 3}, job, report=False, json_out=False)
    assert "trained 3 steps on 2 ranks in" in capsys.readouterr().out


def _money_figures(text: str) -> list[str]:
    return re.findall(r"money \S+(?: \S+)?", text)


def test_plan_and_evaluate_print_money_with_its_unit(tmp_path, capsys) -> None:
    args = ["--cluster", CLUSTER, "--model", MODEL, "--batch", "64"]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    figures = _money_figures(out)
    assert figures and all(f.endswith("USD/iteration,") for f in figures), figures
    assert "J/iteration" in out
    assert main(["plan", *args, "--json"]) == 0
    (tmp_path / "p.json").write_text(capsys.readouterr().out)
    assert main(["evaluate", *args, "--plan", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"money [0-9.e-]+ USD/iteration, energy [0-9.e+]+ J/iteration", out), out


def test_simulate_prints_money_budget_and_slots_with_units(capsys) -> None:
    args = ["--cluster", CLUSTER, "--model", MODEL, "--batch", "64", "--policy", "greedy"]
    assert main(["simulate", *args, "--slots", "1", "--budget", "money=0.0001"]) == 0
    out = capsys.readouterr().out
    assert "policy greedy, 1 slot, batch B = 64" in out
    assert re.search(r"mean cost per iteration: money \S+ USD/iteration, energy \S+ J/iter", out)
    assert re.search(r"budget money 0.0001 USD/iteration: mean \S+ USD/iteration", out), out


def test_profile_says_layers_in_the_plural(tmp_path, capsys) -> None:
    assert main(["profile", "--example", "digits", "--out", str(tmp_path / "d.json")]) == 0
    assert re.search(r"wrote \S+: digits: 6 layers, ", capsys.readouterr().out)


def test_train_console_shows_every_replan(tmp_path, monkeypatch, capfd) -> None:
    """The README's promise: the progress output shows every re-plan (one line each, the same
    plans as the ``replan`` events of the metrics). w1 becomes 10x slower at step 8 of 40 (a
    trace), which makes the controller re-plan even on a loaded machine."""
    import json

    monkeypatch.chdir(tmp_path)
    trace = tmp_path / "slow.csv"
    trace.write_text("slot,device,speed_factor\n8,w1,0.1\n")
    argv = ["train", "--example", "digits", "--workers", "2", "--steps", "40", "--no-report",
            "--trace", str(trace)]  # fmt: skip
    assert main(argv) == 0
    out = capfd.readouterr().out  # rank 0 is a child process
    events = [json.loads(x) for x in (tmp_path / "runs/digits/metrics.jsonl").open()]
    replans = [e for e in events if e["event"] == "replan"]
    assert replans, "a 10x slow-down of w1 should make the controller re-plan"
    lines = re.findall(r"re-plan at step (\d+) \(plan (\d+)\): ", out)
    assert [tuple(map(int, x)) for x in lines] == [(e["step"], e["plan_id"]) for e in replans]


def test_error_counts_use_the_singular_for_one(tmp_path, capsys) -> None:
    cluster = tmp_path / "one.yaml"
    cluster.write_text("devices: [{id: a, tflops: 1, memory_gib: 4, nic_gbps: 10}]\n")
    argv = ["train", "--example", "digits", "--cluster", str(cluster), "--workers", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "expected 1 rank, one per device of the cluster file, got 2" in err
