"""A resumed round's controller (its state restored from the checkpoint) over a start-up
calibration that disagrees with the restored estimates, pure logic: the first round's
calibration is accurate (per-layer times, the runtime's
:func:`~hetrain.runtime.calibrate.with_layer_times`), the resumed round's was taken on a loaded
machine (each rank's layer times and fitted speed 2-10x off, seeded draws), and both
controllers are fed the same steady measurement stream. The restored estimates stand over the
one-off start-up benchmark: the resumed controller makes the uninterrupted one's decisions,
and a device that really changed is followed once measured steps show it."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from adapt_inputs import KAPPA, PER_SAMPLE_S, SPEED, blocks_profile

from hetrain.control.estimates import startup_stage_time_s
from hetrain.costmodel import TrainingConfig
from hetrain.runtime.calibrate import RankLayerTimes, with_layer_times
from hetrain.runtime.ctlcontroller import PlanController
from hetrain.runtime.ctldecision import even_dp_plan
from hetrain.runtime.emulation import local_cluster_state

DEVICES = ["w0", "w1", "w2", "w3"]
BATCH = 64
SIZES = np.array([1.0, 4.0, 16.0, 64.0])
FACTOR = {"w0": 1.0, "w1": 3.0, "w2": 1.0, "w3": 1.0}  # w1 emulated 3x slower


def _calibration(own_kinds: bool, load: dict[str, float]):
    """The start-up state and profile of a round whose calibration ran each rank ``load[d]``
    times slower than it trains (1: accurate): layer times, fitted speed and ``κ`` alike."""
    profile = blocks_profile()
    per_layer = PER_SAMPLE_S / 8
    times = []
    for d in DEVICES:
        f = FACTOR[d] * load[d]
        fwd = np.outer(SIZES, np.full(8, per_layer / 3)) + 1e-4
        times.append(RankLayerTimes(SIZES, f * fwd, 2 * f * fwd, "cpu:test", FACTOR[d]))
    speed = [SPEED / (FACTOR[d] * load[d]) for d in DEVICES]
    base = local_cluster_state(DEVICES, speed).with_changes(
        kappa_s=np.array([KAPPA * FACTOR[d] * load[d] for d in DEVICES])
    )
    return with_layer_times(base, profile, DEVICES, times, own_kinds=own_kinds)


def _noise(seed: int, step: int) -> dict[str, float]:
    """The step's noise per device (the same for both controllers): ±10 % log-normal, one
    step in ten stalled 2-4x (a shared machine)."""
    rng = np.random.default_rng([seed, step])
    out = {}
    for d in DEVICES:
        stall = rng.uniform(2.0, 4.0) if rng.random() < 0.1 else 1.0
        out[d] = float(rng.lognormal(0.0, 0.1)) * stall
    return out


def _feed(ctl: PlanController, truth, seed: int, steps: range, slower=None) -> list[dict]:
    """Feed ``ctl`` the measured compute of ``steps`` under the plan it runs (its decision on
    step ``t`` runs from step ``t + 1``): each stage's time on the accurate calibration
    ``truth`` (``(state, profile)``), times the step's noise and ``slower[d]``; returns the
    decisions' shares."""
    state, profile = truth
    slower = slower or {}
    shares = []
    for t in steps:
        noise = _noise(seed, t)
        compute = {}
        for g in ctl.current.groups:
            if g.batch <= 0:
                continue
            for d, (start, end) in zip(g.devices, g.stages, strict=True):
                true_s = startup_stage_time_s(
                    state, profile, d, start, end, g.batch, g.microbatch_size
                )
                compute[d] = true_s * noise[d] * slower.get(d, 1.0)
        ctl.observe(t, int(ctl.current.plan_id), compute, max(compute.values()) + 1e-3)
        made = ctl.decide(t + 1)
        if made is not None:
            shares.append(made.shares_after)
    return shares


def _rounds(seed: int, own_kinds: bool, slower=None):
    """Round 1 runs 40 steps and checkpoints its controller; then an uninterrupted controller
    and the resumed round's (its calibration loaded 2-10x per rank) run 60 more steps each on
    the same measurements. Returns both controllers and their decisions' shares."""
    steps = 100
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    truth = _calibration(own_kinds, dict.fromkeys(DEVICES, 1.0))
    even = even_dp_plan(DEVICES, 8, BATCH, 1)
    ctl = PlanController(*truth, config, even, steps)
    _feed(ctl, truth, seed, range(40))
    saved = json.loads(json.dumps(ctl.state_dict()))
    rng = np.random.default_rng(seed)
    load = {d: float(np.exp(rng.uniform(np.log(2.0), np.log(10.0)))) for d in DEVICES}
    loaded = _calibration(own_kinds, load)
    plan = ctl.current.model_copy(update={"plan_id": ctl.next_plan_id})  # a new round's id
    resumed = PlanController(*loaded, config, plan, steps)
    resumed.load_state_dict(saved)
    ctl.current = ctl.plans[int(plan.plan_id)] = plan  # the same plan, the same id
    ctl._policy_plan = plan
    ctl.next_plan_id = int(plan.plan_id) + 1
    uninterrupted = _feed(ctl, truth, seed + 1, range(40, steps), slower)
    after_resume = _feed(resumed, truth, seed + 1, range(40, steps), slower)
    return ctl, resumed, uninterrupted, after_resume, load


@pytest.mark.parametrize("own_kinds", [True, False])
def test_a_loaded_start_up_benchmark_does_not_move_the_restored_estimates(own_kinds):
    changes = []
    for seed in range(6):
        ctl, resumed, uninterrupted, after_resume, load = _rounds(seed, own_kinds)
        # the resumed round decides as the uninterrupted controller does, on its estimates
        assert after_resume == uninterrupted, (seed, load, after_resume, uninterrupted)
        mine, theirs = resumed.estimates.speeds_flops(), ctl.estimates.speeds_flops()
        for d in DEVICES:
            assert mine[d] == pytest.approx(theirs[d], rel=1e-9), (seed, d, load)
        changes.append(len(after_resume))
        # the check of the start-up benchmark against the restored estimates names every
        # rank measured more than 1.5x slower than its restored estimate
        named = re.findall(r"(w\d) [\d.]+x slower", resumed.startup_check or "")
        assert named == DEVICES, (seed, load, resumed.startup_check)
    assert max(changes) <= 2, changes


def test_a_device_that_changed_is_followed_from_measured_steps():
    # after the resume w2 is really 4x slower: the resumed controller (loaded benchmark)
    # moves work off it as the uninterrupted one does, within the same steps
    for seed in range(3):
        ctl, resumed, uninterrupted, after_resume, _ = _rounds(seed, True, slower={"w2": 4.0})
        assert after_resume == uninterrupted
        assert after_resume and after_resume[-1]["w2"] < BATCH // 4 // 2, after_resume


def test_a_device_of_another_kind_starts_from_this_rounds_calibration():
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    truth = _calibration(False, dict.fromkeys(DEVICES, 1.0))
    ctl = PlanController(*truth, config, even_dp_plan(DEVICES, 8, BATCH, 1), 100)
    _feed(ctl, truth, 0, range(20))
    saved = json.loads(json.dumps(ctl.state_dict()))
    saved["startup"]["base_state"]["kinds"][3] = "gpu:other"  # w3 was another device
    loaded = _calibration(False, dict.fromkeys(DEVICES, 4.0))
    resumed = PlanController(*loaded, config, ctl.current, 100)
    resumed.load_state_dict(saved)
    assert list(resumed.base_state.speed_flops) == [
        *truth[0].speed_flops[:3],
        loaded[0].speed_flops[3],
    ]
    assert resumed.estimates._samples["w3"] == []
    assert len(resumed.estimates._samples["w0"]) == 20
    named = re.findall(r"(w\d) ([\d.]+)x slower", resumed.startup_check)
    assert [d for d, _ in named] == ["w0", "w1", "w2"], resumed.startup_check  # not w3
    assert all(3.4 <= float(x) <= 4.6 for _, x in named), named  # 4x, ±noise of r̂
    # a state without its start-up calibration keeps this round's for every device
    del saved["startup"]
    legacy = PlanController(*loaded, config, ctl.current, 100)
    legacy.load_state_dict(saved)
    assert legacy.base_state is loaded[0] and legacy.startup_check is None
