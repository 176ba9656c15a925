"""``hetrain train --checkpoint-dir D --checkpoint-every N --max-restarts R`` (issue 6): a rank
killed mid-run (SIGKILL) is restarted by the elastic agent, training resumes from the latest
checkpoint and completes; the metrics record the restart and the plan it resumed with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetrain.runtime.elastic import _descendants

STEPS = 40
EVERY = 5


def _events(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


@pytest.mark.multiprocess
def test_train_resumes_after_a_rank_is_killed(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = (
        str(Path(__file__).resolve().parents[2] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    )
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetrain", "train", "--example", "digits", "--workers", "3",
         "--steps", str(STEPS), "--slowdown", "w2=40", "--checkpoint-dir", str(tmp_path / "ck"),
         "--checkpoint-every", str(EVERY), "--max-restarts", "2", "--run-dir",
         str(tmp_path / "run"), "--metrics-out", str(metrics), "--no-report"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            steps = [e for e in _events(metrics) if e["event"] == "step"]
            if steps and steps[-1]["step"] >= 12:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "finished before the kill: " + proc.stderr.read()[-2000:]
        ranks = _descendants(proc.pid)
        assert len(ranks) >= 3, ranks
        os.kill(ranks[-1], signal.SIGKILL)  # one rank dies without warning
        out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    events = _events(metrics)
    restarts = [e for e in events if e["event"] == "restart"]
    # on failure: the restarts, the launcher's stderr and every rank's recorded error
    errors = tmp_path / "run" / "rank_errors.jsonl"
    why = f"{restarts}\n{err[-3000:]}\n" + (
        errors.read_text()[-6000:] if errors.is_file() else "no rank_errors.jsonl"
    )
    assert len(restarts) == 1, why
    resumed = restarts[0]["step"]
    assert resumed % EVERY == 0 and resumed >= 10
    assert isinstance(restarts[0]["plan_id"], int)
    after = [e["step"] for e in events[events.index(restarts[0]) :] if e["event"] == "step"]
    assert after == list(range(resumed, STEPS))
    assert events[-1]["event"] == "end"


def _train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = (
        str(Path(__file__).resolve().parents[2] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    )
    return subprocess.run(
        [sys.executable, "-m", "hetrain", "train", "--example", "digits", "--workers", "2",
         "--steps", "2", "--no-report", "--run-dir", str(cwd / "run"), *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=cwd,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:.*single process:UserWarning")
def test_bad_checkpoint_dir_is_bad_input_before_any_rank_starts(tmp_path):
    """A file as --checkpoint-dir, a checkpoint of another model, or a corrupted one: exit 2 and
    one line naming it (not a rank failing with a traceback)."""
    import torch

    from hetrain.runtime import checkpoint as ckpt

    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = _train(["--checkpoint-dir", str(afile)], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"hetrain: error: --checkpoint-dir: expected a folder, got a file: {afile}"
    ]

    other = tmp_path / "other"
    plan = {"groups": [{"devices": ["w0"], "stages": [[0, 1]], "microbatch_size": 1, "batch": 1}]}
    path = ckpt.save(
        other, 4, {"layers.0.weight": torch.ones(3)},
        {"data_position": 4, "plan": plan, "model_fingerprint": "0123456789abcdef"},
    )  # fmt: skip
    proc = _train(["--checkpoint-dir", str(other)], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"hetrain: error: {path / 'manifest.json'}: model_fingerprint: ")
    assert "checkpoint of another model" in lines[0]

    data = sorted(path.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:-3])
    proc = _train(["--checkpoint-dir", str(other)], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"hetrain: error: {data}: size ") and "corrupted" in lines[0]
