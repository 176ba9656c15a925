"""``hetrain simulate --replay`` of a resumed run whose later rounds cannot be replayed, on
constructed logs (no torch): one line saying at which step the run was resumed, exit 2 (bad
input); a log of one round replays as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetrain.cli import main
from hetrain.costmodel import TrainingConfig
from hetrain.profile import ProfileArrays
from hetrain.runtime.ctldecision import even_dp_plan
from hetrain.runtime.ctlwire import encode_init
from hetrain.runtime.emulation import local_cluster_state
from hetrain.sim.replay import replay_run

DEVICES = ["w0", "w1"]


def _run_dir(tmp_path: Path, rounds: list[tuple[str | None, int, list[int]]]) -> Path:
    """A run folder whose ``controller_init.json`` starts round ``"a"`` at step 0 (2 equal
    ranks, 8 blocks, batch 16) and whose ``controller.jsonl`` holds, per ``(round, plan_id,
    steps)``, rows of equal measured compute (``round`` None: rows without it, as an older
    version wrote them)."""
    f = np.full(8, 1e7)
    profile = ProfileArrays(
        names=tuple(f"b{i}" for i in range(8)),
        fwd_flops=f,
        bwd_flops=2 * f,
        activation_bytes=np.full(8, 256.0),
        activation_memory_bytes=np.full(8, 256.0),
        param_bytes=np.full(8, 4e4),
    )
    init = {"round": "a", "world_size": 2, "base_state": local_cluster_state(DEVICES, [1e10] * 2),
            "profile": profile, "config": TrainingConfig(batch=16, optimizer_state_factor=2.0),
            "plan": even_dp_plan(DEVICES, 8, 16, 1).model_copy(update={"plan_id": 0}),
            "steps": 40, "start_step": 0, "optimizer_state_factor": 2.0,
            "checkpoint_dir": None, "checkpoint_every": 0, "log_path": None}  # fmt: skip
    run = tmp_path / "run"
    run.mkdir()
    (run / "controller_init.json").write_bytes(encode_init(init))
    rows = []
    for round_id, plan_id, steps in rounds:
        for k in steps:
            row = {"step": k, "plan_id": plan_id, "compute_time_s": dict.fromkeys(DEVICES, 0.01),
                   "decided": True, "measured_time_s": 0.012}  # fmt: skip
            if round_id is not None:
                row["round"] = round_id
            rows.append(json.dumps(row))
    (run / "controller.jsonl").write_text("\n".join(rows) + "\n")
    return run


@pytest.mark.parametrize(
    ("rounds", "step", "why"),
    [
        # an older version's log: the resumed round's new plan id, then steps that go back
        ([(None, 0, range(12)), (None, 3, range(12, 20))], 12, "an older version's"),
        ([(None, 0, range(12)), (None, 3, range(9, 20))], 9, "an older version's"),
        # rows of a second round whose start is not kept
        ([("a", 0, range(12)), ("b", 3, range(12, 20))], 12, "controller_init-b.json"),
    ],
)
def test_a_resumed_round_without_its_start_is_one_line_exit_2(tmp_path, capsys, rounds, step, why):
    run = _run_dir(tmp_path, rounds)
    assert main(["simulate", "--replay", str(run)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    assert (
        f"the run was resumed at step {step}; rounds after the first are not replayable" in lines[0]
    )
    assert why in lines[0], lines[0]
    assert "decisions replayed" not in captured.out  # no mismatch report


@pytest.mark.parametrize("round_id", [None, "a"])
def test_a_log_of_one_round_replays(tmp_path, capsys, round_id):
    run = _run_dir(tmp_path, [(round_id, 0, range(20))])
    assert replay_run(run) == []  # equal ranks on equal shares: no decision
    assert main(["simulate", "--replay", str(run)]) == 0
    assert "0 decisions replayed; the same as the run's" in capsys.readouterr().out
