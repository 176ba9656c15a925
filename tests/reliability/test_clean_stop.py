"""SIGTERM to ``hetrain train`` and Ctrl-C (SIGINT to its whole process group): the ranks
finish the current step, write the stop checkpoint, the launcher prints one line (stopped at
step N, the checkpoint) and exits 0, with no traceback; the same command then resumes from the
stop checkpoint and reaches the last step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.metrics import read_metrics

STEPS = 30


def _command(tmp: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hetrain",
        "train",
        "--example",
        "digits",
        "--workers",
        "2",
        "--steps",
        str(STEPS),
        "--slowdown",
        "w0=4",
        "--slowdown",
        "w1=4",
        "--checkpoint-dir",
        str(tmp / "ck"),
        "--checkpoint-every",
        "1000",
        "--run-dir",
        str(tmp / "run"),
        "--no-progress",
        "--no-report",
        "--no-demo-slowdown",
    ]


def _steps_logged(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    return [e["step"] for e in read_metrics(metrics) if e.get("event") == "step"]


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "SIGINT to the process group"])
def test_signal_stops_cleanly_and_the_rerun_finishes(tmp_path, how):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        _command(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: killpg reaches it and its ranks only
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not _steps_logged(metrics) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be stopped"
    if how.startswith("SIGTERM"):
        os.kill(proc.pid, signal.SIGTERM)
    else:  # Ctrl-C in a terminal: every process of the foreground group gets SIGINT
        os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "Traceback" not in out
    lines = [ln for ln in err.splitlines() if ln.startswith("hetrain: stopped")]
    assert len(lines) == 1, err
    found = ckpt.list_checkpoints(tmp_path / "ck")
    assert len(found) == 1
    stop = ckpt.read_checkpoint(found[0])
    name = "SIGTERM" if how.startswith("SIGTERM") else "SIGINT"
    assert stop.manifest["stop"] == name
    assert 1 <= stop.step < STEPS
    assert lines[0] == (
        f"hetrain: stopped at step {stop.step} ({name}); checkpoint {found[0]}; the same "
        "command resumes from it"
    )
    assert max(_steps_logged(metrics)) == stop.step - 1  # the stop step was the last trained
    events = [e for e in read_metrics(metrics) if e["event"] == "stop"]
    assert [(e["step"], e["reason"]) for e in events] == [(stop.step, name)]

    rerun = subprocess.run(_command(tmp_path), capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resumed from step {stop.step} of {found[0]}" in rerun.stderr
    logged = _steps_logged(metrics)
    assert logged == list(range(STEPS)), json.dumps(logged)


def test_a_stop_without_a_checkpoint_folder_names_its_step(tmp_path):
    """Ctrl-C to a run without ``--checkpoint-dir``: one line naming the step the ranks stopped
    at (the metrics' ``stop`` event) and that nothing was saved; exit 128 + SIGINT."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = _command(tmp_path)
    i = command.index("--checkpoint-dir")
    del command[i : i + 4]  # --checkpoint-dir D --checkpoint-every N
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not _steps_logged(metrics) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be stopped"
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "Traceback" not in out
    events = [e for e in read_metrics(metrics) if e["event"] == "stop"]
    assert len(events) == 1 and 1 <= events[0]["step"] < STEPS
    lines = [ln for ln in err.splitlines() if ln.startswith("hetrain: stopped")]
    step = events[0]["step"]
    assert lines == [
        f"hetrain: stopped at step {step} (SIGINT); no checkpoint (no --checkpoint-dir)"
    ]


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_during_start_up_gives_one_line(tmp_path, name):
    """A signal while the launcher still builds the model (here a ``--model`` factory that
    waits): one line naming the signal, exit 128 + signal, no traceback."""
    started = tmp_path / "started"
    (tmp_path / "waiting_factory.py").write_text(
        "import time\nfrom pathlib import Path\n\n\ndef make():\n"
        f"    Path({str(started)!r}).write_text('x')\n    time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    command = [sys.executable, "-m", "hetrain", "train", "--model", "waiting_factory:make",
               "--workers", "2", "--steps", "3", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists() and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    signum = getattr(signal, name)
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err and "Traceback" not in out
    assert err.strip().splitlines() == [f"hetrain: interrupted ({name}) outside the training loop"]
