"""The re-plan line's reason names only the devices whose speed moved relative to the others
since the plan in force was chosen: a start-up benchmark that measured every rank 2.5x slow
(the README main job's "w0/w2/w3 2.5x faster than at start") names none."""

from __future__ import annotations

import re

import numpy as np
import pytest
from adapt_inputs import KAPPA, SPEED, blocks_profile

from hetrain.costmodel import TrainingConfig
from hetrain.runtime.ctlcontroller import PlanController, relative_moves
from hetrain.runtime.ctldecision import even_dp_plan
from hetrain.runtime.emulation import local_cluster_state

DEVICES = ["w0", "w1", "w2", "w3"]
BATCH = 64


@pytest.mark.parametrize("factor", [0.2, 0.4, 2.5, 9.0])
def test_a_move_common_to_every_device_names_none(factor):
    before = {"w0": 1e10, "w1": 3e9, "w2": 1e10, "w3": 2e10}
    assert relative_moves(before, {d: s * factor for d, s in before.items()}) == ""


@pytest.mark.parametrize("common", [0.4, 1.0, 2.5])
def test_one_device_that_moved_is_the_only_one_named(common):
    before = {"w0": 1e10, "w1": 1e10, "w2": 1e10, "w3": 1e10}
    after = {d: s * common for d, s in before.items()}
    after["w1"] /= 3.0
    assert relative_moves(before, after) == "w1 3.0x slower"
    after["w1"] *= 6.0
    assert relative_moves(before, after) == "w1 2.0x faster"
    # two devices: the one that moved, not both by half of it
    two = {"w0": 1e10, "w1": 1e10}
    assert relative_moves(two, {"w0": 1e10, "w1": 5e9}) == "w1 2.0x slower"
    # a move within 1.5x names none; a device without a reference is left out
    assert relative_moves(before, {**before, "w2": 1.4e10}) == ""
    assert relative_moves({"w0": 1e10}, {"w0": 1e10, "w1": 1e9}) == ""


def _run(steps: int = 60, slow_at=lambda t: t < 30) -> list[str]:
    """The re-plan reasons of a controller whose start-up benchmark measured every rank 2.5x
    slower than it trains (speed and ``κ``) while w1 trains 3x slower than the others at the
    steps ``t`` where ``slow_at(t)`` (default: until step 30, as fast from then on; measured
    ±5 %)."""
    profile = blocks_profile()
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    base = local_cluster_state(DEVICES, [SPEED / 2.5] * 4).with_changes(
        kappa_s=np.full(4, KAPPA * 2.5)
    )
    ctl = PlanController(base, profile, config, even_dp_plan(DEVICES, 8, BATCH, 1), steps)
    rng = np.random.default_rng(0)
    flops = profile.train_flops
    reasons = []
    for t in range(steps):
        compute = {}
        for g in ctl.current.groups:
            if g.batch <= 0:
                continue
            for d, (start, end) in zip(g.devices, g.stages, strict=True):
                slow = 3.0 if d == "w1" and slow_at(t) else 1.0
                work = flops[start:end].sum() * g.batch / SPEED + g.num_microbatches * KAPPA
                compute[d] = slow * float(work) * float(rng.lognormal(0.0, 0.05))
        ctl.observe(t, int(ctl.current.plan_id), compute, max(compute.values()) + 1e-3)
        made = ctl.decide(t + 1)
        if made is not None:
            reasons.append(made.reason)
    return reasons


def test_the_re_plan_line_names_the_rank_that_moved_only():
    reasons = _run()
    named = [re.findall(r"(w\d) ([\d.]+)x (slower|faster)", r) for r in reasons]
    # the first decision: w1 3x slower than when plan 0 (even data parallelism, chosen on
    # the start-up benchmark) was chosen; the start-up bias common to every rank (the old
    # line: "w0 2.5x faster, w2 2.5x faster, w3 2.5x faster than at start") names none
    assert len(reasons) == 2, reasons
    assert [(d, w) for d, _, w in named[0]] == [("w1", "slower")], reasons[0]
    assert 2.7 <= float(named[0][0][1]) <= 3.3, reasons[0]
    assert "than when plan 0 was chosen" in reasons[0], reasons[0]
    # the second, after w1 recovered: against the estimates that chose plan 1, not the
    # start-up's (against which w1 is as fast as ever)
    assert [(d, w) for d, _, w in named[1]] == [("w1", "faster")], reasons[1]
    assert 2.7 <= float(named[1][0][1]) <= 3.3, reasons[1]
    assert "than when plan 1 was chosen" in reasons[1], reasons[1]


def test_a_rank_that_slows_down_for_good_is_re_planned_for_once():
    """w1 3x slower from step 20 on: one re-plan (w1 3x slower), then none. A fixed-cost fit
    with one level per device reads the change of speed, seen at w1's old and then its new
    share, as a fixed cost of 390 ms a micro-batch: w1's estimate went 3.3 -> 74 -> 3.3
    GFLOP/s and two more re-plans ("w1 15.6x faster", "w1 15.8x slower") followed."""
    reasons = _run(slow_at=lambda t: t >= 20)
    assert len(reasons) == 1, reasons
    named = re.findall(r"(w\d) ([\d.]+)x (slower|faster)", reasons[0])
    assert [(d, w) for d, _, w in named] == [("w1", "slower")], reasons[0]
    assert 2.7 <= float(named[0][1]) <= 3.3, reasons[0]
