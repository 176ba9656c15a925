"""Issue 11, runtime failures that must become clear answers (cases 1-4); each test failed on
the code before the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import hetrain
from hetrain.cli import main
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.data import GlobalBatchSampler
from hetrain.runtime.examples import example_task
from hetrain.runtime.launch import RANK_ERRORS_FILE, LaunchError
from hetrain.runtime.metrics import read_metrics


def _train(tmp_path, *args: str) -> int:
    return main(
        [
            "train",
            "--example",
            "digits",
            "--workers",
            "2",
            "--no-progress",
            "--no-report",
            "--run-dir",
            str(tmp_path / "run"),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            *args,
        ]
    )


def test_resume_with_another_global_batch_keeps_the_data_position(tmp_path, capfd):
    """Case 1: B=64 for 4 steps, then B=32 up to step 8: the second run continues at sample
    position 256 of the stream (no sample skipped or repeated) under a plan for B=32."""
    assert _train(tmp_path, "--batch", "64", "--steps", "4", "--checkpoint-every", "4") == 0
    assert _train(tmp_path, "--batch", "32", "--steps", "8", "--checkpoint-every", "4") == 0
    out = capfd.readouterr()
    assert "global batch 64 -> 32" in out.err
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    restart = [e for e in events if e["event"] == "restart"][-1]
    assert (restart["step"], restart["checkpoint_batch"], restart["batch"]) == (4, 64, 32)
    assert restart["data_position"] == 4 * 64
    steps = [e for e in events if e["event"] == "step" and e["step"] >= 4]
    assert [e["step"] for e in steps] == [4, 5, 6, 7]
    assert all(e["global_batch"] == 32 for e in steps)
    last = ckpt.load_latest(tmp_path / "ck")
    assert last.step == 8 and last.data_position == 4 * 64 + 4 * 32
    # the samples of steps 4..7 at B=32 are stream positions 256..383: what B=64 would have
    # read at its steps 4 and 5
    n = len(example_task("digits").train)
    resumed = GlobalBatchSampler(n, 32, 0, offset=4 * 64 - 4 * 32)
    original = GlobalBatchSampler(n, 64, 0)
    got = np.concatenate([resumed.indices(t) for t in range(4, 8)])
    want = np.concatenate([original.indices(4), original.indices(5)])
    assert np.array_equal(got, want)


def _wrong_width_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(12, 4))


def _wrong_width_failure(tmp_path, workers: int, plan: dict | None = None):
    """Train the wrong-width model; the failure's one line and the recorded rank errors."""
    x = torch.randn(64, 8)
    y = torch.randint(0, 4, (64,))
    with pytest.raises(LaunchError) as info:
        hetrain.train(
            model=_wrong_width_model(),
            dataset=(x, y),
            loss_fn=F.cross_entropy,
            workers=workers,
            steps=2,
            batch=8,
            plan=plan,
            run_dir=tmp_path / "run",
        )
    line = str(info.value)
    assert "\n" not in line
    rows = [json.loads(r) for r in (tmp_path / "run" / RANK_ERRORS_FILE).read_text().splitlines()]
    return line, rows


def test_the_first_failing_rank_is_the_one_line(tmp_path):
    """Case 2: layer 3 expects 12 inputs, gets 16; it runs on rank 1 (second stage)."""
    plan = {
        "groups": [
            {"devices": ["w0", "w1"], "stages": [[0, 2], [2, 4]], "microbatch_size": 4, "batch": 8}
        ]
    }
    line, rows = _wrong_width_failure(tmp_path, 2, plan)
    assert line.startswith("rank 1 (w1), layer 3 (Linear): RuntimeError: mat1 and mat2"), line
    mine = [r for r in rows if r["rank"] == 1]
    assert mine and "Traceback (most recent call last)" in mine[0]["traceback"]


def test_a_single_rank_failure_is_one_line_too(tmp_path):
    """``--workers 1`` runs in the launching process; its failure was the rank's whole
    traceback on the console (exit 1) and no ``rank_errors.jsonl`` (new-user pass)."""
    line, rows = _wrong_width_failure(tmp_path, 1)
    assert line.startswith("rank 0 (w0), layer 3 (Linear): RuntimeError: mat1 and mat2"), line
    assert len(rows) == 1 and "Traceback (most recent call last)" in rows[0]["traceback"]


def test_profile_of_a_model_that_fails_its_forward_is_one_line(tmp_path, capsys, monkeypatch):
    """``hetrain profile --model`` on a model whose layers do not fit together was an 84-line
    traceback, exit 1 (new-user pass); ``train`` already said it in one line."""
    (tmp_path / "qa_bad_width.py").write_text(
        "import torch\n\n\ndef make():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), "
        "torch.nn.Linear(7, 2))\n"
        "    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))\n"
        '    return {"model": model, "dataset": (x, y), '
        '"loss_fn": torch.nn.functional.cross_entropy}\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["profile", "--model", "qa_bad_width:make"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith(
        "hetrain: error: --model: qa_bad_width:make: running the model failed: RuntimeError: "
        "mat1 and mat2 shapes cannot be multiplied"
    ), err
    assert len(err.splitlines()) == 1


def test_data_set_smaller_than_the_batch_wraps(tmp_path):
    """Case 3: 10 samples, global batch 16, 2 ranks: start-up calibration and training read
    through the sampler, which wraps (every sample once per epoch)."""
    torch.manual_seed(0)
    x = torch.randn(10, 8)
    y = torch.randint(0, 4, (10,))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    result = hetrain.train(
        model=model,
        dataset=(x, y),
        loss_fn=F.cross_entropy,
        workers=2,
        steps=3,
        batch=16,
        run_dir=tmp_path / "run",
    )
    events = read_metrics(result["metrics_path"])
    assert [e["global_batch"] for e in events if e["event"] == "step"] == [16, 16, 16]


def test_resumed_run_says_what_it_resumed(tmp_path, capfd):
    """Case 4: the console and the metrics say what was resumed, from which step, on which
    devices, and how many steps this run trained."""
    assert _train(tmp_path, "--steps", "4", "--checkpoint-every", "2") == 0
    capfd.readouterr()
    assert _train(tmp_path, "--steps", "6", "--checkpoint-every", "2") == 0
    out = capfd.readouterr()
    assert "trained 2 steps (steps 4-5, resumed from step 4)" in out.out
    assert "resumed from step 4 of" in out.err and "on 2 devices (w0, w1)" in out.err
    restart = [
        e for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "restart"
    ]
    assert restart[-1]["step"] == 4 and restart[-1]["devices"] == ["w0", "w1"]


class _FailOnce:
    """A loss that raises once (the first call in any rank), as a transient fault would."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __call__(self, out, target):
        if not self.marker.exists():
            self.marker.touch()
            raise RuntimeError("injected transient fault")
        return F.cross_entropy(out, target)


def test_restart_before_the_first_checkpoint_is_recorded(tmp_path):
    """Case 4: a restart (``--max-restarts``) before any checkpoint writes a ``restart`` event
    (from step 0, no checkpoint path)."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = torch.randint(0, 4, (64,))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    result = hetrain.train(
        model=model,
        dataset=(x, y),
        loss_fn=_FailOnce(tmp_path / "failed-once"),
        workers=2,
        steps=3,
        batch=16,
        run_dir=tmp_path / "run",
        max_restarts=1,
    )
    events = read_metrics(result["metrics_path"])
    restarts = [e for e in events if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["step"] == 0 and restarts[0]["path"] is None
    assert restarts[0]["restart_count"] == 1
    assert [e["step"] for e in events if e["event"] == "step"][-3:] == [0, 1, 2]


def test_resume_with_a_larger_global_batch_keeps_the_data_position(tmp_path, capfd):
    """Case 1, the other direction (found by a new-user trial): B=32 for 4 steps, then B=64 up
    to step 8. The stream offset is negative (128 - 4*64); start-up calibration read step 0's
    batch and crashed in numpy (``expected non-negative integer``); it now reads the first
    step it trains."""
    assert _train(tmp_path, "--batch", "32", "--steps", "4", "--checkpoint-every", "4") == 0
    assert _train(tmp_path, "--batch", "64", "--steps", "8", "--checkpoint-every", "4") == 0
    assert "global batch 32 -> 64" in capfd.readouterr().err
    last = ckpt.load_latest(tmp_path / "ck")
    assert last.step == 8 and last.data_position == 4 * 32 + 4 * 64
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [e["global_batch"] for e in events if e["event"] == "step" and e["step"] >= 4] == [
        64
    ] * 4


def test_resume_with_nothing_left_to_train_is_bad_input(tmp_path, capfd):
    """A checkpoint at step 4 and ``--steps 3``: exit 2 naming both, before any rank starts
    (it printed ``trained -1 step ... final loss nan`` and exited 0)."""
    assert _train(tmp_path, "--batch", "32", "--steps", "4", "--checkpoint-every", "4") == 0
    capfd.readouterr()
    assert _train(tmp_path, "--batch", "32", "--steps", "3") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps" in err[0] and "4 steps" in err[0] and "got 3" in err[0]


def _a_file(folder):
    path = folder / "afile"
    path.write_text("x")
    return path


@pytest.mark.parametrize(
    ("option", "make"),
    [
        ("--run-dir", lambda p: _a_file(p)),
        ("--metrics-out", lambda p: p),
        ("--out", lambda p: p),
        ("--checkpoint-dir", lambda p: _a_file(p) / "sub"),
    ],
)
def test_unwritable_outputs_are_bad_input_before_training(tmp_path, capfd, option, make):
    """A run folder that is a file, a metrics or model file that is a folder, a checkpoint
    folder under a file: exit 2 and one line before any rank starts (they were a traceback,
    or a rank's error after training)."""
    path = make(tmp_path)
    argv = ["train", "--example", "digits", "--workers", "2", "--steps", "2", "--no-progress"]
    if option != "--run-dir":
        argv += ["--run-dir", str(tmp_path / "run")]
    assert main([*argv, option, str(path)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0], err


def test_negative_max_restarts_and_mismatched_data_are_bad_input(tmp_path, capfd):
    """``--max-restarts -1`` was a ZeroDivisionError traceback; inputs and targets of different
    lengths were a ValueError traceback through ``--model``."""
    argv = ["train", "--example", "digits", "--workers", "2", "--steps", "2"]
    assert main([*argv, "--run-dir", str(tmp_path / "r"), "--max-restarts", "-1"]) == 2
    assert "--max-restarts" in capfd.readouterr().err
    with pytest.raises(hetrain.errors.InputError, match="same length, got 100 vs 50"):
        hetrain.train(
            model=nn.Sequential(nn.Linear(8, 2)),
            dataset=(torch.randn(100, 8), torch.randint(0, 2, (50,))),
            loss_fn=F.cross_entropy,
            workers=2,
            steps=2,
            batch=8,
            run_dir=tmp_path / "run",
        )


def test_schedule_option_is_the_schedule_of_a_given_plan(tmp_path):
    """``--schedule gpipe`` with a ``--plan`` file that names no schedule (its default is
    1f1b): the plan that runs, as the plan event records it, is GPipe's."""
    plan = {"groups": [{"devices": ["w0", "w1"], "stages": [[0, 3], [3, 6]],
                        "microbatch_size": 4, "batch": 32}]}  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert _train(tmp_path, "--plan", str(path), "--schedule", "gpipe", "--steps", "2") == 0
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    plans = [e["plan"] for e in events if e["event"] == "plan"]
    assert plans and all(p["schedule"] == "gpipe" for p in plans)
