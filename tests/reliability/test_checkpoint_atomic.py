"""Checkpoints (issue 6): atomic writes (a kill while writing never yields a checkpoint that loads
as valid but wrong; the previous one is loaded), validation on load (corruption and another
model's checkpoint give one clear line)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from hetrain.runtime.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_latest,
    load_tensors,
    model_fingerprint,
    save,
)

FP = "toy-fingerprint"
PLAN = {"groups": [{"devices": ["w0"], "stages": [[0, 8]], "microbatch_size": 4, "batch": 4}]}


def save_checkpoint(root, step, state, *, fingerprint, meta=None, keep=None):
    """The trainer's checkpoint call (:func:`hetrain.runtime.checkpoint.save`) with a manifest
    of ``fingerprint``, a data position and ``meta``."""
    manifest = {"data_position": step * 4, "plan": PLAN, "model_fingerprint": fingerprint}
    return save(root, step, state, {**manifest, **(meta or {})}, keep=keep)


def _state(step: int, numel: int = 1000) -> dict[str, torch.Tensor]:
    """Tensors whose values encode the step, so a wrong or mixed checkpoint is detectable."""
    return {f"layers.{i}.weight": torch.full((numel,), float(step) + i / 100) for i in range(8)} | {
        "optim.0.weight.step": torch.tensor(float(step))
    }


def _assert_is_step(tensors: dict[str, torch.Tensor], step: int) -> None:
    expect = _state(step, 1)
    for k, v in tensors.items():
        assert torch.all(v == expect[k].reshape(-1)[0]), (k, v.reshape(-1)[:3], step)


def test_roundtrip_retention_and_meta(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(
            tmp_path, step, _state(step), fingerprint=FP, meta={"pos": step * 8}, keep=2
        )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
    info = load_latest(tmp_path, fingerprint=FP)
    assert info is not None and info.step == 3 and info.manifest["pos"] == 24
    tensors = load_tensors(info)
    assert set(tensors) == set(_state(3))
    _assert_is_step(tensors, 3)
    # a subset, by predicate, with a dtype template
    like = {"layers.1.weight": torch.zeros(1000, dtype=torch.float64)}
    sub = load_tensors(info, lambda k: k == "layers.1.weight", like=like)
    assert sub["layers.1.weight"].dtype == torch.float64
    assert float(sub["layers.1.weight"][0]) == pytest.approx(3.01)
    assert load_latest(tmp_path / "nothing-here") is None


def test_corrupted_checkpoint_is_a_clear_error(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1), fingerprint=FP)
    newest = save_checkpoint(tmp_path, 2, _state(2), fingerprint=FP)
    data = sorted(newest.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped bit pattern, same size
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch") as info:
        load_latest(tmp_path, fingerprint=FP)
    assert str(info.value).startswith(str(data)) and len(str(info.value).splitlines()) == 1
    # opt-in fallback to the previous valid checkpoint
    prev = load_latest(tmp_path, fingerprint=FP, fallback=True)
    assert prev is not None and prev.step == 1
    _assert_is_step(load_tensors(prev), 1)
    # truncation and a missing manifest
    data.write_bytes(bytes(raw[:10]))
    with pytest.raises(CheckpointError, match="manifest says"):
        load_latest(tmp_path)
    (newest / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="expected valid JSON"):
        load_latest(tmp_path)


def test_checkpoint_of_another_model_is_rejected(tmp_path):
    small = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    wide = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))
    assert model_fingerprint(small) == model_fingerprint(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    )
    assert model_fingerprint(small) != model_fingerprint(wide)
    assert model_fingerprint(small) != model_fingerprint(small, example="other")
    save_checkpoint(tmp_path, 5, small.state_dict(), fingerprint=model_fingerprint(small))
    with pytest.raises(CheckpointError, match="checkpoint of another model"):
        load_latest(tmp_path, fingerprint=model_fingerprint(wide))
    with pytest.raises(CheckpointError, match="another model"):  # never skipped by fallback
        load_latest(tmp_path, fingerprint=model_fingerprint(wide), fallback=True)
    info = load_latest(tmp_path, fingerprint=model_fingerprint(small))
    with pytest.raises(CheckpointError, match="shape"):
        load_tensors(info, like=wide.state_dict())


def _writer(root: str) -> None:
    """Write checkpoints 1, 2, 3, ... forever (killed by the test)."""
    torch.set_num_threads(1)
    step = 1
    while True:
        save_checkpoint(root, step, _state(step, numel=400_000), fingerprint=FP, keep=2)
        step += 1


def _kill_when(root: Path, pid: int, phase: str, limit_s: float = 120.0) -> int | None:
    """SIGKILL ``pid`` as soon as a checkpoint write in progress reaches ``phase``:
    'started' (temp folder exists), 'data' (a data file exists in it), 'metadata' (DCP's
    metadata written, manifest pending). Returns the step being written at the kill."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for tmp in root.glob(".tmp-step-*"):
            try:  # the writer may rename the folder between glob and iterdir
                names = {p.name for p in tmp.iterdir()}
            except FileNotFoundError:
                continue
            hit = {
                "started": True,
                "data": any(n.endswith(".distcp") for n in names),
                "metadata": ".metadata" in names,
            }[phase]
            # skip the first checkpoint: there must be a previous one to fall back to
            if hit and list_checkpoints(root):
                os.kill(pid, signal.SIGKILL)
                return int(tmp.name.rsplit("-", 1)[1])
        time.sleep(0.0005)
    os.kill(pid, signal.SIGKILL)
    return None


@pytest.mark.multiprocess
@pytest.mark.parametrize("phase", ["started", "data", "metadata"])
def test_kill_while_checkpointing_loads_previous(tmp_path, phase):
    proc = mp.get_context("fork").Process(target=_writer, args=(str(tmp_path),), daemon=True)
    proc.start()
    try:
        writing = _kill_when(tmp_path, proc.pid, phase)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    assert proc.exitcode == -signal.SIGKILL
    assert writing is not None, f"never saw a write reach phase {phase!r}"
    info = load_latest(tmp_path, fingerprint=FP)
    assert info is not None
    complete = [int(p.name.split("-")[1]) for p in list_checkpoints(tmp_path)]
    print(f"phase={phase} writing={writing} complete={complete} loaded={info.step}")
    if writing in complete:  # the rename won the race with the kill: the new one is whole
        assert info.step == writing
    else:  # the interrupted write is invisible: the previous checkpoint is the one loaded
        assert info.step == writing - 1
    _assert_is_step(load_tensors(info), info.step)  # valid AND right: values match its step
    # the run resumes: re-writing the interrupted step replaces the stale temp folder
    save_checkpoint(tmp_path, writing, _state(writing, 10), fingerprint=FP)
    again = load_latest(tmp_path, fingerprint=FP)
    assert again.step == writing
    _assert_is_step(load_tensors(again), writing)
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.filterwarnings("ignore:.*single process:UserWarning")
def test_train_checkpoints_are_checksummed(tmp_path):
    """The launcher's checkpoints (``hetrain train``) record sizes and sha256 too: a corrupted
    data file is a one-line error on load, not wrong weights."""
    from hetrain.runtime import checkpoint as ckpt

    plan = {"groups": [{"devices": ["w0"], "stages": [[0, 2]], "microbatch_size": 4, "batch": 4}]}
    manifest = {"data_position": 8, "plan": plan, "model_fingerprint": "abc"}
    path = ckpt.save(tmp_path, 2, _state(2, 100), manifest)
    loaded = ckpt.load_latest(tmp_path)
    assert loaded.step == 2 and ".metadata" in loaded.manifest["files"]
    data = sorted(path.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x55
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch") as info:
        ckpt.load_latest(tmp_path)
    assert str(info.value).startswith(str(data))


@pytest.mark.filterwarnings("ignore:.*single process:UserWarning")
def test_a_staged_controller_state_removed_before_the_copy_leaves_it_out(tmp_path):
    """The controller process clears the states staged before its round starts; a checkpoint
    whose staged state went that way is written without controller state (it failed the run:
    'cannot write: No such file or directory')."""
    from hetrain.runtime import checkpoint as ckpt

    gone = tmp_path / ".controller" / "state-00000003.json"
    manifest = {"data_position": 24, "plan": PLAN, "model_fingerprint": FP}
    path = ckpt.save(tmp_path / "ck", 6, _state(6, 10), manifest, controller_state=gone)
    info = ckpt.load_latest(tmp_path / "ck")
    assert info is not None and info.step == 6 and path.name == "step-000006"
    assert info.manifest["controller"] is None
    assert not (path / ckpt.CONTROLLER_FILE).exists()


def test_a_resumed_round_never_checkpoints_a_state_staged_before_it(tmp_path):
    """At the last step the trainer takes the newest staged controller state of this round
    (above its first step), never one the round before the resume staged."""
    from types import SimpleNamespace

    from hetrain.runtime.adapt import controller_state_path
    from hetrain.runtime.trainer import _staged_controller_state

    job = SimpleNamespace(checkpoint_dir=tmp_path)
    old = controller_state_path(tmp_path, 3)
    old.parent.mkdir(parents=True)
    old.write_text("{}")
    assert _staged_controller_state(job, 6, True, after=4) is None
    assert _staged_controller_state(job, 6, True) == old  # a round from step 0
    mine = controller_state_path(tmp_path, 5)
    mine.write_text("{}")
    assert _staged_controller_state(job, 6, True, after=4) == mine
