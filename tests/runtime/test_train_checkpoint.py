"""Checkpoint with torch.distributed.checkpoint and resume under a different plan and world
size: the resumed run ends with the same weights as an uninterrupted one (float64)."""

from __future__ import annotations

import json

import torch

from hetrain.cli import main
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.metrics import read_metrics

COMMON = [
    "train",
    "--example",
    "digits",
    "--dtype",
    "float64",
    "--optimizer",
    "adamw",
    "--lr",
    "0.01",
    "--lr-schedule",
    "constant",
    "--warmup-steps",
    "0",
    "--no-report",
    "--no-progress",
]
DP2 = {
    "groups": [
        {"devices": ["w0"], "stages": [[0, 6]], "microbatch_size": 10, "batch": 10},
        {"devices": ["w1"], "stages": [[0, 6]], "microbatch_size": 7, "batch": 14},
    ]
}
HYBRID3 = {
    "groups": [
        {"devices": ["w2", "w0"], "stages": [[0, 2], [2, 6]], "microbatch_size": 4, "batch": 16},
        {"devices": ["w1"], "stages": [[0, 6]], "microbatch_size": 8, "batch": 8},
    ]
}


def test_resume_under_another_plan_and_world_size(tmp_path):
    (tmp_path / "dp2.json").write_text(json.dumps(DP2))
    (tmp_path / "hybrid3.json").write_text(json.dumps(HYBRID3))
    ck = tmp_path / "ck"
    code = main(
        [
            *COMMON,
            "--workers",
            "2",
            "--plan",
            str(tmp_path / "dp2.json"),
            "--steps",
            "4",
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            "2",
            "--run-dir",
            str(tmp_path / "a"),
        ]
    )
    assert code == 0
    assert [p.name for p in ckpt.list_checkpoints(ck)] == ["step-000002", "step-000004"]
    latest = ckpt.load_latest(ck)
    assert latest.step == 4 and latest.data_position == 4 * 24
    assert latest.plan.devices == ["w0", "w1"]
    assert not list(ck.glob(".tmp-*"))

    code = main(
        [
            *COMMON,
            "--workers",
            "3",
            "--plan",
            str(tmp_path / "hybrid3.json"),
            "--steps",
            "6",
            "--checkpoint-dir",
            str(ck),
            "--run-dir",
            str(tmp_path / "b"),
            "--out",
            str(tmp_path / "resumed.pt"),
        ]
    )
    assert code == 0
    events = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [e["event"] for e in events][:2] == ["restart", "plan"]
    assert events[0]["step"] == 4
    assert [e["step"] for e in events if e["event"] == "step"] == [4, 5]

    code = main(
        [
            *COMMON,
            "--workers",
            "1",
            "--batch",
            "24",
            "--steps",
            "6",
            "--run-dir",
            str(tmp_path / "ref"),
            "--out",
            str(tmp_path / "ref.pt"),
        ]
    )
    assert code == 0
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert set(resumed) == set(ref)
    for key in ref:
        torch.testing.assert_close(resumed[key], ref[key], rtol=1e-9, atol=1e-12)
    ref_steps = [
        e for e in read_metrics(tmp_path / "ref" / "metrics.jsonl") if e["event"] == "step"
    ]
    resumed_steps = [e for e in events if e["event"] == "step"]
    for a, b in zip(resumed_steps, ref_steps[4:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * abs(b["loss"])


def test_manifest_is_validated(tmp_path):
    bad = tmp_path / "step-000003"
    bad.mkdir()
    (bad / "manifest.json").write_text(json.dumps({"format": 1, "step": -1}))
    try:
        ckpt.load_latest(tmp_path)
    except ValueError as exc:  # InputError
        assert "step" in str(exc)
    else:
        raise AssertionError("a bad manifest was accepted")
