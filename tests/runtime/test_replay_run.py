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
