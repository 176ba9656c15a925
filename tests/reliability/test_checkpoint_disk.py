"""A checkpoint folder on a full file system (a small tmpfs mounted here; skipped where
mounting is not allowed): one line naming the checkpoint and ``No space left on device``, the
partial checkpoint removed, every earlier one intact; ``--checkpoint-keep N`` keeps the newest
N complete checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from hetrain.cli import main
from hetrain.runtime import checkpoint as ckpt

COMMON = [
    "train",
    "--example",
    "digits",
    "--no-progress",
    "--no-report",
    "--no-demo-slowdown",
]


@pytest.fixture
def small_fs(tmp_path):
    """A 3 MiB tmpfs (about two checkpoints of the digits example with AdamW's state)."""
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_full_disk_is_one_line_and_keeps_earlier_checkpoints(tmp_path, small_fs, workers):
    ck = small_fs / "ck"
    cmd = [
        sys.executable,
        "-m",
        "hetrain",
        *COMMON,
        "--workers",
        workers,
        "--steps",
        "20",
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "2",
        "--checkpoint-keep",
        "10",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "No space left on device" in lines[0]
    written = ckpt.list_checkpoints(ck)
    assert written, "no checkpoint fitted at all: the tmpfs is too small for this test"
    next_step = ckpt.read_checkpoint(written[-1]).step + 2
    assert f"checkpoint {ck / f'step-{next_step:06d}'}: cannot write" in lines[0]
    for path in written:  # every earlier checkpoint is complete and valid
        ckpt.read_checkpoint(path)
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".tmp-")]
    assert not (tmp_path / "run" / "model.pt").exists()


def test_checkpoint_keep_leaves_the_newest(tmp_path):
    ck = tmp_path / "ck"
    code = main(
        [
            *COMMON,
            "--workers",
            "1",
            "--steps",
            "8",
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            "2",
            "--checkpoint-keep",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0
    assert [p.name for p in ckpt.list_checkpoints(ck)] == ["step-000006", "step-000008"]
    for path in ckpt.list_checkpoints(ck):
        ckpt.read_checkpoint(path)


def test_checkpoint_keep_must_be_positive(tmp_path, capsys):
    code = main([*COMMON, "--workers", "1", "--steps", "2", "--checkpoint-keep", "0"])
    assert code == 2
    assert "--checkpoint-keep" in capsys.readouterr().err


def test_read_only_folder_is_one_line_and_keeps_earlier_checkpoints(tmp_path, small_fs, capfd):
    ck = small_fs / "ck"
    args = [*COMMON, "--workers", "1", "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
    assert main([*args, "--steps", "4", "--run-dir", str(tmp_path / "a")]) == 0
    done = subprocess.run(
        ["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")
    capfd.readouterr()
    # found before any rank starts (it trained steps 4-5 and failed at step 6's checkpoint)
    assert main([*args, "--steps", "8", "--run-dir", str(tmp_path / "b")]) == 2
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("hetrain: ")]
    assert len(err) == 1
    assert "--checkpoint-dir" in err[0] and f"{ck} cannot be written" in err[0], err
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    assert [p.name for p in ckpt.list_checkpoints(ck)] == ["step-000002", "step-000004"]
    for path in ckpt.list_checkpoints(ck):
        ckpt.read_checkpoint(path)
