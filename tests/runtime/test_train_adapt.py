"""Online adaptation: a rank slowed down mid-training (trace) triggers a re-plan that moves
work away from it; the trained weights load into the original module (``hetrain.train``)."""

from __future__ import annotations

import json
import statistics

import torch
from torch import nn
from torch.nn import functional as F

import hetrain
from hetrain.runtime.metrics import read_metrics

SLOW_STEP = 10
STEPS = 50
BATCH = 384
EVEN = {
    "groups": [
        {"devices": [d], "stages": [[0, 4]], "microbatch_size": 128, "batch": 128}
        for d in ("w0", "w1", "w2")
    ]
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(64, 384), nn.Tanh()),
        nn.Sequential(nn.Linear(384, 384), nn.Tanh()),
        nn.Sequential(nn.Linear(384, 384), nn.Tanh()),
        nn.Linear(384, 4),
    )


def test_slowdown_mid_training_triggers_replan(tmp_path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 64, generator=g)
    y = (x[:, :4].argmax(dim=1)).long()
    trace = tmp_path / "trace.csv"
    # from step SLOW_STEP on, w1 computes 5x slower (docs/model.md §7 trace, one slot = one step)
    trace.write_text(f"slot,device,speed_factor\n{SLOW_STEP},w1,0.2\n")
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = hetrain.train(
        model=model,
        dataset=(x, y),
        val_dataset=(x[:256], y[:256]),
        loss_fn=F.cross_entropy,
        workers=3,
        steps=STEPS,
        batch=BATCH,
        lr=3e-3,
        trace=trace,
        # start from even data parallelism and adapt from there (the first plan would otherwise
        # come from start-up measurements, which are noisy on a shared machine)
        plan=EVEN,
        adaptive=True,
        run_dir=tmp_path / "run",
    )
    events = read_metrics(result["metrics_path"])
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(STEPS))
    assert all(e["global_batch"] == BATCH and sum(e["shares"]) == BATCH for e in steps)
    # plan ids only grow
    ids = [e["plan_id"] for e in steps]
    assert ids == sorted(ids)
    # emulation in force: w1's factor is 5 from the slow step on
    assert steps[SLOW_STEP - 1]["slowdown"]["w1"] == 1.0
    assert steps[SLOW_STEP]["slowdown"]["w1"] == 5.0
    # a re-plan within a few iterations of the slowdown that takes work away from w1
    share_w1 = {e["step"]: _work_share(_plan_at(events, e["step"]), "w1") for e in steps}
    replans = [r for r in events if r["event"] == "replan" and r["step"] > SLOW_STEP]
    assert replans, "no re-plan after the slowdown"
    # within a few iterations a plan that gives w1 clearly less work (the controller runs in a
    # background thread, so its first answer may still be based on pre-slowdown measurements)
    base = share_w1[SLOW_STEP]
    moved = [r for r in replans if share_w1[r["step"]] < 0.9 * base]
    assert moved and moved[0]["step"] <= SLOW_STEP + 20, [
        (r["step"], share_w1[r["step"]]) for r in replans
    ]
    first = moved[0]
    assert share_w1[STEPS - 1] < 0.9 * base
    # iteration time before/after (logged, not asserted: tests never assert on timing)
    slow = [e["iteration_time_s"] for e in steps[SLOW_STEP : first["step"]]]
    after = [e["iteration_time_s"] for e in steps[first["step"] :]]
    print(
        json.dumps(
            {
                "replan_step": first["step"],
                "median_slow_s": statistics.median(slow),
                "median_after_s": statistics.median(after),
            }
        )
    )
    # the exported state_dict was loaded into the original module and changed it
    assert result["model_path"] and set(model.state_dict()) == set(before)
    assert any(not torch.equal(model.state_dict()[k], before[k]) for k in before)
    assert result["metrics"]["val_loss"] < 1.386  # better than chance (ln 4)


def _work_share(plan, device):
    """Samples x layers of ``device`` over the total (layers of this MLP are similar)."""
    total = mine = 0
    for g in plan["groups"]:
        for d, (start, end) in zip(g["devices"], g["stages"], strict=True):
            total += g["batch"] * (end - start)
            if d == device:
                mine += g["batch"] * (end - start)
    return mine / total


def _plan_at(events, step):
    plans = [e for e in events if e["event"] == "plan" and e["step"] <= step]
    return plans[-1]["plan"]
