"""``hetrain train`` on elastic agents (issue 6): one torchrun agent per device running
``python -m hetrain train``; SIGKILL one device mid-run. The survivors restart, ``hetrain
train`` re-plans for the devices that remain, resumes from the latest checkpoint and completes;
the metrics have a ``restart`` line naming the lost device and the new ``plan_id``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hetrain._io import read_jsonl
from hetrain.runtime.elastic import ElasticController

STEPS = 150
EVERY = 10


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hetrain_train_survives_losing_a_device(tmp_path: Path):
    metrics = tmp_path / "m.jsonl"
    args = [
        "train", "--example", "digits", "--steps", str(STEPS), "--checkpoint-dir",
        str(tmp_path / "ck"), "--checkpoint-every", str(EVERY), "--metrics-out", str(metrics),
        "--run-dir", str(tmp_path / "run"), "--no-report", "--hang-timeout", "60",
    ]  # fmt: skip
    with ElasticController(
        args, min_devices=1, max_devices=3, max_restarts=3, log_dir=tmp_path / "logs",
        last_call_s=3,
    ) as ctl:  # fmt: skip
        for d in ["w0", "w1", "w2"]:
            ctl.add_device(d)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            steps = [r for r in read_jsonl(metrics) if r.get("event") == "step"]
            if steps and steps[-1]["step"] >= 2 * EVERY:
                break
            time.sleep(0.05)
        ctl.kill_device("w2")
        codes = ctl.wait(max(deadline - time.monotonic(), 1))
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert codes == {"w0": 0, "w1": 0}, logs
    records = read_jsonl(metrics)
    restarts = [r for r in records if r["event"] == "restart"]
    assert len(restarts) == 1, logs
    restart = restarts[0]
    assert restart["lost_devices"] == ["w2"] and restart["devices"] == ["w0", "w1"]
    earlier = [r["plan_id"] for r in records[: records.index(restart)] if r["event"] == "plan"]
    assert restart["plan_id"] > max(earlier)  # a new plan, for the devices that remain
    new_plan = records[records.index(restart) + 1]
    assert new_plan["event"] == "plan" and new_plan["plan_id"] == restart["plan_id"]
    assert {d for g in new_plan["plan"]["groups"] for d in g["devices"]} <= {"w0", "w1"}
    resumed = restart["step"]
    assert resumed % EVERY == 0 and resumed >= EVERY
    after = [r["step"] for r in records[records.index(restart) :] if r["event"] == "step"]
    assert after == list(range(resumed, STEPS))
    assert records[-1]["event"] == "end"
