"""``hetrain simulate --replay``: a recorded ``hetrain train`` run's measurements replayed
through the controller give the run's decisions at the same steps (issue 19)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hetrain.cli import main
from hetrain.sim.replay import recorded_decisions, replay_run


def test_replay_of_a_recorded_train_run_gives_its_decisions(tmp_path, capsys):
    # 2 ranks, w1 3x slower from step 12 (the example's demo slow-down at steps // 3)
    run_dir = tmp_path / "run"
    code = main(["train", "--example", "digits", "--workers", "2", "--steps", "36",
                 "--no-progress", "--no-report", "--run-dir", str(run_dir)])  # fmt: skip
    assert code == 0
    capsys.readouterr()
    recorded = recorded_decisions(run_dir)
    assert recorded, "the slow-down must move work"
    assert replay_run(run_dir) == recorded
    # the same through the CLI
    assert main(["simulate", "--replay", str(run_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decisions"] == recorded and out["matches_recorded"] is True
    # the controller's measured answer time per decided step, against the measured step
    latency = out["decision_latency"]
    assert 0 < latency["median_decide_time_s"] <= latency["p95_decide_time_s"]
    assert (
        latency["fraction_of_step"] == latency["p95_decide_time_s"] / latency["median_step_time_s"]
    )
    # the replay is the controller alone: no torch
    code = (
        "import sys; from hetrain.sim.replay import replay_run; "
        f"replay_run({str(run_dir)!r}); print('torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_replay_of_a_resumed_run_replays_each_round_from_its_own_start(tmp_path, capsys):
    # round 1: steps 0-23 with checkpoints, equal ranks; round 2: the run resumed to step 48
    # with w1 3x slower (the controller moves work off it), its rows appended to the same
    # controller.jsonl
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    for steps, slow in ((24, []), (48, ["--slowdown", "w1=3"])):
        code = main(["train", "--example", "digits", "--workers", "2", "--steps", str(steps),
                     "--checkpoint-dir", str(ckpt), "--checkpoint-every", "8",
                     "--no-demo-slowdown", *slow, "--no-progress", "--no-report",
                     "--run-dir", str(run_dir)])  # fmt: skip
        assert code == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in (run_dir / "controller.jsonl").read_text().splitlines()]
    # each round's rows tagged with its round (a round's last step may go unlogged: the
    # controller stops when rank 0 is done)
    first = [r for r in rows if r["step"] < 24]
    second = [r for r in rows if r["step"] >= 24]
    assert rows == first + second and len(first) >= 20 and len(second) >= 20
    assert {r["round"] for r in first} == {
        json.loads((run_dir / "controller_init.json").read_text())["round"]
    }
    (resumed_round,) = {r["round"] for r in second}
    assert second[0]["step"] == 24 and resumed_round != first[0]["round"]
    started = run_dir / f"controller_init-{resumed_round}.json"
    kept = json.loads(started.read_text())
    # the restored state: the newest the controller staged by step 24 (one per 8 steps)
    assert kept["start_step"] == 24 and kept["controller_state"]["observed_steps"] in (16, 24)
    recorded = recorded_decisions(run_dir)
    assert any(d["step"] >= 24 for d in recorded), recorded  # the resumed round decided too
    assert replay_run(run_dir) == recorded
    assert main(["simulate", "--replay", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["matches_recorded"] is True
    # without the resumed round's start: one line, exit 2 (bad input)
    started.unlink()
    assert main(["simulate", "--replay", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "the run was resumed at step 24; rounds after the first are not replayable" in err[0]
    assert started.name in err[0]
