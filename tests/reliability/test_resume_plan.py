"""A resumed round goes on with the checkpoint's plan when it runs on the devices that wrote the
checkpoint, also when that plan leaves one of them idle (the controller had moved all work off a
straggler); it started from even data parallelism again, re-learning what the run had learnt."""

from __future__ import annotations

import json

from hetrain.cli import main
from hetrain.plan import plan_from_dict
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.metrics import read_metrics

DEVICES = ["w0", "w1", "w2"]
TWO_OF_THREE = {
    "plan_id": 4,
    "schedule": "1f1b",
    "groups": [
        {"devices": ["w0"], "stages": [[0, 4]], "microbatch_size": 8, "batch": 40},
        {"devices": ["w1"], "stages": [[0, 4]], "microbatch_size": 8, "batch": 24},
    ],
}


def _checkpoint(plan: dict, devices: list[str] | None) -> ckpt.Checkpoint:
    manifest = {"plan": plan} | ({"devices": devices} if devices is not None else {})
    return ckpt.Checkpoint(
        path=ckpt.checkpoint_path("ck", 6),
        step=6,
        data_position=384,
        plan=plan_from_dict(plan, "manifest"),
        model_fingerprint="f",
        manifest=manifest,
    )


def test_plan_to_resume_keeps_a_plan_that_leaves_a_device_of_the_round_idle():
    loaded = _checkpoint(TWO_OF_THREE, DEVICES)
    resumed = loaded.plan_to_resume(["w2", "w0", "w1"], 64)
    assert resumed.groups[:2] == loaded.plan.groups and resumed.plan_id == 4
    assert [(g.devices, g.batch, g.stages) for g in resumed.groups[2:]] == [(("w2",), 0, ((0, 4),))]
    assert loaded.plan_to_resume(DEVICES, 48) is None  # another global batch
    assert loaded.plan_to_resume(["w0", "w1"], 64) is None  # w2 left
    assert loaded.plan_to_resume([*DEVICES, "w3"], 64) is None  # w3 joined
    # without the round's devices in the manifest, the plan's own devices are the round's
    legacy = _checkpoint(TWO_OF_THREE, None)
    assert legacy.plan_to_resume(["w0", "w1"], 64) == legacy.plan
    assert legacy.plan_to_resume(DEVICES, 64) is None


def test_resumed_adaptive_run_goes_on_with_the_checkpoint_plan(tmp_path, capfd):
    """Three ranks, adaptive: the checkpoint of step 6 is given a plan with w2 idle (as the
    controller writes it when it drops a straggler); the same command resumed runs that plan
    from step 6 (a new plan id), not even shares on all three."""
    ck = tmp_path / "ck"
    common = ["train", "--example", "digits", "--workers", "3", "--batch", "64",
              "--checkpoint-dir", str(ck), "--checkpoint-every", "6", "--no-demo-slowdown",
              "--no-progress",
              "--no-report", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main([*common, "--steps", "6"]) == 0
    manifest_path = ckpt.checkpoint_path(ck, 6) / ckpt.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    assert manifest["devices"] == DEVICES
    layers = manifest["plan"]["groups"][0]["stages"][-1][1]
    manifest["plan"] = json.loads(json.dumps(TWO_OF_THREE).replace("[0, 4]", f"[0, {layers}]"))
    manifest_path.write_text(json.dumps(manifest))
    capfd.readouterr()
    assert main([*common, "--steps", "8"]) == 0
    assert "resumed from step 6" in capfd.readouterr().err
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    restart = next(e for e in events if e.get("event") == "restart")
    first = next(e for e in events if e.get("event") == "plan" and e["step"] == 6)
    assert restart["plan_id"] == first["plan_id"] == 5
    groups = [(g["devices"], g["batch"]) for g in first["plan"]["groups"]]
    assert groups == [(["w0"], 40), (["w1"], 24), (["w2"], 0)]
    steps = [e for e in events if e.get("event") == "step" and e["step"] == 6]
    assert steps and steps[0]["compute_time_s"]["w2"] == 0.0
