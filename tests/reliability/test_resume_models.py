"""Every model resumes from its own checkpoint under another plan and another number of
devices, and trains on exactly as the uninterrupted run did (float64): tied weights (GPT-2's
and BERT's embedding shared with the output head, held by both pipeline stages), dropout keyed
by the step, the sampler's position, the learning-rate schedule and AdamW's state."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hetrain.cli import main
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.metrics import read_metrics

STEPS = 4
EVERY = 2


def _common(example: str) -> list[str]:
    return [
        "train",
        "--example",
        example,
        "--dtype",
        "float64",
        "--batch",
        "8",
        "--steps",
        str(STEPS),
        "--warmup-steps",
        "1",
        "--no-report",
        "--no-progress",
        "--no-demo-slowdown",
    ]


def _losses(path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_metrics(path) if e["event"] == "step"}


@pytest.mark.parametrize("example", ["gpt2", "bert"])
def test_tied_weights_model_resumes_under_another_plan_and_world(tmp_path, example):
    ck = tmp_path / "ck"
    # uninterrupted: 1 device, every layer on it
    code = main(
        [
            *_common(example),
            "--workers",
            "1",
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            str(EVERY),
            "--checkpoint-keep",
            "5",
            "--run-dir",
            str(tmp_path / "a"),
            "--out",
            str(tmp_path / "a.pt"),
        ]
    )
    assert code == 0
    first = [e for e in read_metrics(tmp_path / "a" / "metrics.jsonl") if e["event"] == "plan"]
    num_layers = first[0]["plan"]["groups"][0]["stages"][-1][1]
    assert num_layers >= 3
    # interrupted after step EVERY: drop the later checkpoints, resume on 2 devices as a
    # 2-stage pipeline (the tied embedding / head is held by both stages)
    for path in ckpt.list_checkpoints(ck):
        if ckpt.read_checkpoint(path).step > EVERY:
            shutil.rmtree(path)
    cut = num_layers // 2
    plan = {
        "groups": [
            {
                "devices": ["w1", "w0"],
                "stages": [[0, cut], [cut, num_layers]],
                "microbatch_size": 4,
                "batch": 8,
            }
        ]
    }
    (tmp_path / "pipe.json").write_text(json.dumps(plan))
    code = main(
        [
            *_common(example),
            "--workers",
            "2",
            "--plan",
            str(tmp_path / "pipe.json"),
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            str(EVERY),
            "--run-dir",
            str(tmp_path / "b"),
            "--out",
            str(tmp_path / "b.pt"),
        ]
    )
    assert code == 0
    ref = _losses(tmp_path / "a" / "metrics.jsonl")
    resumed = _losses(tmp_path / "b" / "metrics.jsonl")
    assert sorted(resumed) == list(range(EVERY, STEPS))
    for step, loss in resumed.items():
        assert loss == pytest.approx(ref[step], rel=1e-9, abs=0.0), step
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-9, atol=1e-12)
