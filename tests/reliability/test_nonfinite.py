"""A NaN in the data: by default the run stops at the step whose global batch holds it, with
one line naming the step and the rank and stage where it first showed, exit 1, the last good
checkpoint kept and no model exported; ``--on-nonfinite skip`` skips that update on every
rank, trains on and counts the skipped updates (metrics, summary)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import torch

from hetrain.cli import main
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.data import GlobalBatchSampler
from hetrain.runtime.metrics import read_metrics

SAMPLES, BATCH, STEPS, SEED = 128, 16, 12, 0
FACTORY = """
import torch
from torch import nn

NAN_SAMPLE = {k}


def make():
    g = torch.Generator().manual_seed(1)
    x = torch.randn({n}, 4, generator=g)
    y = (x[:, 0] > 0).long()
    x[NAN_SAMPLE, 1] = float("nan")
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    return {{"model": model, "dataset": (x, y), "loss_fn": nn.functional.cross_entropy}}
"""
PLAN = {  # a 2-stage pipeline: stage 0 on w1 (rank 1), stage 1 on w0
    "groups": [
        {"devices": ["w1", "w0"], "stages": [[0, 2], [2, 5]], "microbatch_size": 8, "batch": 16}
    ]
}


def _nan_sample() -> tuple[int, list[int]]:
    """A sample first drawn at step 5 (after the checkpoint of step 4) and the steps < STEPS
    that draw it, from the sampler itself."""
    sampler = GlobalBatchSampler(SAMPLES, BATCH, SEED)
    batches = [set(sampler.indices(t).tolist()) for t in range(STEPS)]
    k = next(i for i in sorted(batches[5]) if all(i not in b for b in batches[:5]))
    return k, [t for t, b in enumerate(batches) if k in b]


def _run(tmp_path, monkeypatch, name: str, extra: list[str]) -> int:
    k, _ = _nan_sample()
    module = f"nanfactory_{name}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(FACTORY.format(k=k, n=SAMPLES)))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    return main(
        [
            "train",
            "--model",
            f"{module}:make",
            "--workers",
            "2",
            "--plan",
            str(tmp_path / "plan.json"),
            "--steps",
            str(STEPS),
            "--batch",
            str(BATCH),
            "--seed",
            str(SEED),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--checkpoint-every",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            "--no-progress",
            "--no-report",
            *extra,
        ]
    )


def test_nan_in_the_data_stops_at_its_step(tmp_path, monkeypatch, capsys):
    _, steps = _nan_sample()
    assert steps[0] == 5
    code = _run(tmp_path, monkeypatch, "stop", [])
    err = capsys.readouterr().err
    assert code == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("hetrain: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert "non-finite loss nan and gradient norm nan at step 5 " in lines[0]
    assert "(first on rank 1 (w1), group 0 stage 0)" in lines[0]
    assert f"last good checkpoint {tmp_path / 'ck' / 'step-000004'}" in lines[0]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "ck")] == [
        "step-000002",
        "step-000004",
    ]
    assert not (tmp_path / "run" / "model.pt").exists()
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(6))
    assert [e["step"] for e in events if e["event"] == "nonfinite"] == [5]


def test_skip_trains_on_and_counts(tmp_path, monkeypatch, capsys):
    _, steps = _nan_sample()
    code = _run(tmp_path, monkeypatch, "skip", ["--on-nonfinite", "skip"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"updates skipped (non-finite loss or gradient norm): {len(steps)}" in out
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    logged = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in logged] == list(range(STEPS))
    assert [e["step"] for e in logged if e.get("skipped")] == steps
    finite = [e["loss"] for e in logged if e["step"] not in steps]
    assert all(isinstance(v, float) and np.isfinite(v) for v in finite)
    assert [e["skipped_steps"] for e in events if e["event"] == "end"] == [len(steps)]
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state.values())
