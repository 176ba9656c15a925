"""Elastic membership (issue 6, "Must show"): SIGKILL one of 4 devices (its torchrun agent and its
rank) mid-run. Training completes on the remaining 3; the loss curve after the restart equals an
uninterrupted 3-device run from the same checkpoint; the JSONL metrics record the failure and
the new plan; no step of the deterministic data order is skipped, and only the steps after the
last checkpoint are redone."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from hetrain.runtime.elastic import ElasticController, read_jsonl

STEPS = 40
EVERY = 5
KILL_AFTER_STEP = 12
VICTIM = "w3"
DEVICES = ["w0", "w1", "w2", "w3"]
RUN_TIMEOUT_S = 400


CLUSTER = """\
links: {intra_node_gbps: 100, latency_us: 50}
devices:
  - {id: w0, tflops: 2.0e-6, memory_gib: 16, nic_gbps: 10, microbatch_overhead_ms: 1.0}
  - {id: w1, tflops: 1.5e-6, memory_gib: 16, nic_gbps: 10, microbatch_overhead_ms: 1.0}
  - {id: w2, tflops: 1.0e-6, memory_gib: 16, nic_gbps: 10, microbatch_overhead_ms: 1.0}
  - {id: w3, tflops: 1.0e-6, memory_gib: 16, nic_gbps: 10, microbatch_overhead_ms: 1.0}
"""


def _args(root: Path) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cluster.yaml").write_text(CLUSTER)
    return ["--cluster", str(root / "cluster.yaml"),
        "--steps", str(STEPS), "--batch", "24", "--checkpoint-dir", str(root / "ckpt"),
        "--checkpoint-every", str(EVERY), "--metrics-out", str(root / "metrics.jsonl"),
        "--min-step-time", "0.1", "--hang-timeout", "60", "--keep", "100", "--seed", "3",
    ]  # fmt: skip


def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") == "step"]


def _logs(root: Path) -> str:
    out = []
    for log in sorted((root / "logs").glob("*.log")):
        out.append(f"== {log.name}\n" + log.read_text(errors="replace")[-3000:])
    return "\n".join(out)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kill_one_of_four_devices_resumes_on_three(tmp_path):
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    with ElasticController(
        _args(run), min_devices=1, max_devices=4, max_restarts=5, log_dir=run / "logs",
        last_call_s=5,
    ) as ctl:  # fmt: skip
        for d in DEVICES:
            ctl.add_device(d)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            done = _steps(read_jsonl(metrics))
            if done and done[-1]["step"] >= KILL_AFTER_STEP:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the run never reached the kill step\n" + _logs(run))
        ctl.kill_device(VICTIM)  # SIGKILL: agent and rank, no warning
        codes = ctl.wait(max(deadline - time.monotonic(), 1))
    assert codes == {"w0": 0, "w1": 0, "w2": 0}, _logs(run)

    records = read_jsonl(metrics)
    start = records[0]
    assert start["event"] == "start" and start["world_size"] == 4, records[0]
    restarts = [r for r in records if r.get("event") == "restart"]
    assert len(restarts) == 1, restarts
    restart = restarts[0]
    # the failure and the new plan are recorded
    assert restart["lost_devices"] == [VICTIM]
    assert sorted(restart["devices"]) == ["w0", "w1", "w2"] and restart["world_size"] == 3
    assert restart["plan_id"] == start["plan_id"] + 1
    plans = [r for r in records if r.get("event") == "plan"]
    new_plan = next(p for p in plans if p["plan_id"] == restart["plan_id"])
    assert sorted(d for g in new_plan["plan"]["groups"] for d in g["devices"]) == [
        "w0", "w1", "w2"
    ]  # fmt: skip
    assert sum(g["batch"] for g in new_plan["plan"]["groups"]) == 24
    # resumed from the last checkpoint before the failure: only steps after it are redone
    resumed = restart["resumed_from_step"]
    assert resumed % EVERY == 0 and resumed >= EVERY
    assert restart["steps_done_before"] > KILL_AFTER_STEP
    assert 0 <= restart["redone_steps"] <= EVERY
    # every step of the data order is trained; after the restart exactly once each, in order
    idx = records.index(restart)
    before = [r["step"] for r in _steps(records[:idx])]
    after = _steps(records[idx:])
    assert before == list(range(len(before)))
    assert [r["step"] for r in after] == list(range(resumed, STEPS))
    assert all(r["world_size"] == 3 and r["plan_id"] == restart["plan_id"] for r in after)
    assert records[-1]["event"] == "end"

    # reference: an uninterrupted 3-device run from the same checkpoint
    ref = tmp_path / "ref"
    (ref / "ckpt").mkdir(parents=True)
    name = f"step-{resumed:09d}"
    shutil.copytree(run / "ckpt" / name, ref / "ckpt" / name)
    with ElasticController(
        _args(ref), min_devices=3, max_devices=3, max_restarts=0, log_dir=ref / "logs",
        last_call_s=1,
    ) as ctl:  # fmt: skip
        for d in ["w0", "w1", "w2"]:
            ctl.add_device(d)
        codes = ctl.wait(RUN_TIMEOUT_S)
    assert codes == {"w0": 0, "w1": 0, "w2": 0}, _logs(ref)
    ref_records = read_jsonl(ref / "metrics.jsonl")
    assert ref_records[0]["event"] == "resume" and ref_records[0]["resumed_from_step"] == resumed
    ref_steps = _steps(ref_records)
    assert [r["step"] for r in ref_steps] == list(range(resumed, STEPS))
    got = np.array([r["loss"] for r in after])
    want = np.array([r["loss"] for r in ref_steps])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
    # and the curve is a real training curve (it went down), not a constant
    assert got[-1] < got[0]

    def brief(plan: dict) -> list:
        return [(g["devices"], g["stages"], g["batch"]) for g in plan["plan"]["groups"]]

    print(f"plan before: {brief(plans[0])}\nplan after: {brief(new_plan)}")
    print(
        f"kill after step {KILL_AFTER_STEP}; resumed from checkpoint {resumed}; "
        f"redone {restart['redone_steps']} steps; max |loss diff| vs reference "
        f"{np.max(np.abs(got - want)):.2e}"
    )
