"""The controller's state is part of the checkpoint: a versioned plain-JSON ``state_dict``
(no pickle) that restores a controller taking the same decisions, written into the checkpoint
folder (``controller.json``) with its checksum in the manifest and pruned with it; malformed or
hostile states are rejected with one line and change nothing."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle

import numpy as np
import pytest

from hetrain.cli import main
from hetrain.costmodel import TrainingConfig
from hetrain.profile import ProfileArrays
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.ctlcontroller import PlanController
from hetrain.runtime.ctldecision import even_dp_plan
from hetrain.runtime.worker_main import local_cluster_state

DEVICES = ["w0", "w1", "w2", "w3"]
BATCH = 64


def _controller(plan=None, steps: int = 80) -> PlanController:
    f = np.full(4, 2e6)
    profile = ProfileArrays(
        names=tuple(f"layer{i}" for i in range(4)),
        fwd_flops=f,
        bwd_flops=2 * f,
        activation_bytes=np.full(4, 256.0),
        activation_memory_bytes=np.full(4, 256.0),
        param_bytes=np.full(4, 4e4),
    )
    state = local_cluster_state(DEVICES, [2e10] * 4)
    plan = plan or even_dp_plan(DEVICES, 4, BATCH, 8)
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    return PlanController(state, profile, config, plan, steps)


def _feed(ctl: PlanController, t: int, rng: np.random.Generator) -> None:
    flops = float(ctl.profile.train_flops.sum())
    noise = rng.uniform(0.8, 1.2, size=4)
    compute = {}
    for g in ctl.current.groups:
        for i, d in enumerate(DEVICES):
            if d in g.devices and g.batch > 0:
                slow = 3.0 if (d == "w1" and t >= 10) else 1.0
                compute[d] = flops * g.batch / 2e10 * slow * noise[i]
    ctl.observe(t, int(ctl.current.plan_id), compute, max(compute.values()) + 1e-3)


def _run(ctl: PlanController, steps: range, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for t in steps:
        _feed(ctl, t, rng)
        d = ctl.decide(t + 1)
        if d is not None:
            ctl.current = d.plan
            ctl.plans[int(d.plan.plan_id)] = d.plan
            out.append((t + 1, d.plan.model_dump()))
    return out


@pytest.mark.parametrize("cut", [5, 12, 30])
def test_restored_controller_takes_the_same_decisions(cut):
    a = _controller()
    _run(a, range(cut), seed=1)
    from torch.distributed.checkpoint.stateful import Stateful

    assert isinstance(a, Stateful)  # torch.distributed.checkpoint's protocol
    state = json.loads(json.dumps(a.state_dict()))  # plain JSON, nothing else
    assert state["format"] == "hetrain.controller" and state["version"] == 2
    b = _controller(plan=a.current)
    b.load_state_dict(state)
    assert b.next_plan_id == a.next_plan_id and b.observed_steps == a.observed_steps
    rest = range(cut, 60)
    assert _run(b, rest, seed=2) == _run(a, rest, seed=2)


def _malformed() -> list[tuple[str, dict]]:
    good = _controller()
    _run(good, range(12), seed=1)
    base = good.state_dict()
    cases = []
    for name, change in [
        ("version", lambda s: s.update(version=1)),
        ("format", lambda s: s.update(format="pickle")),
        ("devices", lambda s: s.update(devices=["w0", "w1"])),
        ("samples", lambda s: s["estimates"]["samples"].update(w1="abc")),
        ("speed", lambda s: s["estimates"]["speed_flops"].update(w0=-1.0)),
        ("plans", lambda s: s.update(plans={"0": {"groups": "x"}})),
        ("counter", lambda s: s.update(next_plan_id=None)),
    ]:
        state = copy.deepcopy(base)
        change(state)
        cases.append((name, state))
    return cases


@pytest.mark.parametrize("name,state", _malformed())
def test_malformed_state_is_one_line_and_changes_nothing(name, state):
    ctl = _controller()
    before = json.dumps(ctl.state_dict(), sort_keys=True)
    with pytest.raises(ValueError) as info:
        ctl.load_state_dict(state)
    assert "\n" not in str(info.value) and str(info.value).startswith("controller state:")
    assert json.dumps(ctl.state_dict(), sort_keys=True) == before


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_crafted_pickle_as_controller_state_is_rejected(tmp_path):
    folder = ckpt.checkpoint_path(tmp_path, 5)
    folder.mkdir(parents=True)
    blob = pickle.dumps(_Payload(str(tmp_path / "pwned")))
    (folder / ckpt.CONTROLLER_FILE).write_bytes(blob)
    files = {ckpt.CONTROLLER_FILE: {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}
    manifest = {"format": 1, "step": 5, "controller": ckpt.CONTROLLER_FILE, "files": files}
    (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="expected JSON"):
        ckpt.read_controller_state(tmp_path, 5)
    assert not (tmp_path / "pwned").exists()
    (folder / ckpt.CONTROLLER_FILE).write_bytes(b'{"format": "hetrain.controller"}')
    with pytest.raises(ckpt.CheckpointError, match="corrupted"):  # checksum differs
        ckpt.read_controller_state(tmp_path, 5)


def test_checkpoint_holds_the_controller_state_and_resume_uses_it(tmp_path, capfd):
    ck = tmp_path / "ck"
    common = [
        "train",
        "--example",
        "digits",
        "--workers",
        "2",
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "6",
        "--checkpoint-keep",
        "2",
        "--no-progress",
        "--no-report",
    ]
    assert main([*common, "--steps", "18", "--run-dir", str(tmp_path / "a")]) == 0
    kept = ckpt.list_checkpoints(ck)
    assert [p.name for p in kept] == ["step-000012", "step-000018"]
    for path in kept:
        loaded = ckpt.read_checkpoint(path)  # checksums of every file, controller.json too
        assert loaded.manifest["controller"] == ckpt.CONTROLLER_FILE
        assert ckpt.CONTROLLER_FILE in loaded.manifest["files"]
        state = ckpt.read_controller_state(ck, loaded.step)
        assert state["devices"] == ["w0", "w1"] and state["observed_steps"] >= 1
    assert not list(ck.glob("controller/*.pkl"))  # no pickles anywhere
    assert len(list((ck / ".controller").glob("state-*.json"))) <= 1  # older ones pruned
    before = ckpt.read_controller_state(ck, 18)
    capfd.readouterr()
    b = [*common[:-6], "--checkpoint-every", "3", *common[-4:]]
    assert main([*b, "--steps", "24", "--run-dir", str(tmp_path / "b")]) == 0
    err = capfd.readouterr().err
    assert "resumed from step 18" in err
    assert "controller state not restored" not in err
    # the resumed controller went on from the saved state: steps 18-20 observed on top of it
    after = ckpt.read_controller_state(ck, 21)
    assert after["observed_steps"] == before["observed_steps"] + 3
    assert after["next_plan_id"] >= before["next_plan_id"]
