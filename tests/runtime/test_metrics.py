"""The metrics file (``hetrain.runtime.metrics``): reading back what a run wrote."""

from __future__ import annotations

import json

from hetrain.cli import main
from hetrain.runtime.metrics import read_metrics


def test_read_metrics_keeps_the_json_object_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"event": "plan", "step": 0}\n[1, 2]\n"text"\n\n{"event": "step", "step": 0}\n{"ev'
    )
    assert read_metrics(path) == [{"event": "plan", "step": 0}, {"event": "step", "step": 0}]


def test_resume_appends_to_a_metrics_file_with_foreign_lines(tmp_path, capsys):
    """A resume on a metrics file holding a JSON line that is not an object failed in rank 0
    (``'list' object has no attribute 'get'``, exit 1)."""
    run = ["train", "--example", "digits", "--workers", "2", "--no-progress", "--no-report"]
    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    args += ["--run-dir", str(tmp_path / "run")]
    assert main([*run, "--steps", "4", *args]) == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write("[1, 2]\n")
    capsys.readouterr()
    code = main([*run, "--steps", "6", *args])
    assert code == 0, capsys.readouterr().err[-2000:]
    steps = [e["step"] for e in read_metrics(metrics) if e["event"] == "step"]
    assert steps == [0, 1, 2, 3, 4, 5]
    assert "[1, 2]" in metrics.read_text()  # the file is appended to, not rewritten
    assert json.loads(metrics.read_text().splitlines()[0])["event"] == "plan"


def test_every_jsonl_reader_is_the_one_reader(tmp_path):
    """The run report, the elastic launcher and the metrics module read JSONL alike: the
    report's summary of a metrics file with a foreign line ``[1, 2]`` failed
    (``'list' object has no attribute 'get'``)."""
    from hetrain._io import read_jsonl
    from hetrain.report import run_report

    path = tmp_path / "metrics.jsonl"
    step = {"event": "step", "step": 0, "plan_id": 0, "iteration_time_s": 0.5, "loss": 2.0}
    path.write_text("[1, 2]\n" + json.dumps(step) + '\n{"ev')
    assert run_report.read_metrics(path) == read_jsonl(path) == [step]
    assert run_report.summarize(run_report.read_metrics(path))["steps"] == 1
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_an_elastic_restart_after_the_last_step_ends_as_success(tmp_path, capsys, monkeypatch):
    """A device that joins as the run ends starts one more elastic round (restart count > 0)
    on a checkpoint already at the last step: that round ends with exit 0 and one line (it
    failed every rank with exit 2, 'nothing left to train', and the agents with exit 1); a
    plain rerun of a finished run stays bad input."""
    run = ["train", "--example", "digits", "--workers", "2", "--no-progress", "--no-report"]
    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    args += ["--run-dir", str(tmp_path / "run"), "--steps", "4"]
    assert main([*run, *args]) == 0
    capsys.readouterr()
    assert main([*run, *args]) == 2
    assert "nothing left to train" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert main([*run, *args]) == 0
    err = capsys.readouterr().err.strip()
    assert err == (
        f"hetrain: the run is complete: the latest checkpoint {tmp_path / 'ckpt' / 'step-000004'}"
        " is at step 4 of 4 (an elastic restart after the last step)"
    )
