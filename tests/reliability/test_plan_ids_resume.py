"""Plan ids of a resumed round come from the checkpoint folder, not from the metrics file: a
round that resumed, ran under a new plan id and ended before its next checkpoint leaves that id
recorded in the checkpoint folder, so the round after it (resumed from the same checkpoint)
takes a new id even when ``metrics.jsonl`` was deleted or cut short in between."""

from __future__ import annotations

import pytest

from hetrain.cli import main
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.metrics import read_metrics

COMMON = ["train", "--example", "digits", "--workers", "1", "--no-report", "--no-progress"]


def _run(tmp_path, steps: int) -> None:
    code = main(
        [
            *COMMON,
            "--steps",
            str(steps),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--checkpoint-every",
            "2",
            "--metrics-out",
            str(tmp_path / "metrics.jsonl"),
            "--out",
            str(tmp_path / f"model-{steps}.pt"),
        ]
    )
    assert code == 0


def _plan_ids(path) -> list[int]:
    return [int(e["plan_id"]) for e in read_metrics(path) if e.get("event") == "plan"]


@pytest.mark.parametrize("metrics_after", ["deleted", "truncated"])
def test_resumed_round_takes_a_new_plan_id_without_the_metrics(tmp_path, metrics_after):
    metrics = tmp_path / "metrics.jsonl"
    _run(tmp_path, 4)  # checkpoints at steps 2 and 4, plan 0
    first_round = metrics.read_text()
    assert _plan_ids(metrics) == [0]
    # resumes from step 4 under plan 1 and ends at step 5: no checkpoint of that round
    _run(tmp_path, 5)
    assert _plan_ids(metrics) == [0, 1]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "ck")][-1] == "step-000004"
    assert ckpt.load_latest(tmp_path / "ck").plan.plan_id == 0
    if metrics_after == "deleted":
        metrics.unlink()
    else:  # the second round's lines lost (a copy of the file from before it)
        metrics.write_text(first_round)
    # resumes from step 4 again: plan 1 was used after that checkpoint, so the new id is 2
    _run(tmp_path, 6)
    restarts = [e for e in read_metrics(metrics) if e.get("event") == "restart"]
    assert restarts[-1]["step"] == 4 and restarts[-1]["plan_id"] == 2
    assert _plan_ids(metrics)[-1] == 2
    assert ckpt.load_latest(tmp_path / "ck").plan.plan_id == 2


def test_plan_id_record_is_the_last_written_and_a_bad_one_counts_as_none(tmp_path):
    assert ckpt.max_plan_id(tmp_path / "ck", None) == -1  # no folder yet
    ckpt.record_plan_id(tmp_path / "ck", 3)
    ckpt.record_plan_id(tmp_path / "ck", 7)
    assert ckpt.max_plan_id(tmp_path / "ck", None) == 7
    assert not list((tmp_path / "ck").glob("*.part"))
    record = tmp_path / "ck" / ckpt.PLAN_IDS_FILE
    for bad in ("{", "[]", '{"format": 1, "max_plan_id": "7"}', '{"max_plan_id": 7}'):
        record.write_text(bad)
        assert ckpt.max_plan_id(tmp_path / "ck", None) == -1, bad
