"""The controller in its own process (issue 10): decisions that hold, replayed logs, the store
protocol, checkpointed controller state, and the main job's story."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import pytest

from hetrain.cli import main
from hetrain.costmodel import TrainingConfig
from hetrain.profile import ProfileArrays
from hetrain.runtime.adapt import ControllerThread, controller_state_path
from hetrain.runtime.ctlcontroller import PlanController
from hetrain.runtime.ctldecision import (
    Decision,
    even_dp_plan,
    policy_options,
    predict_iteration_time_s,
)
from hetrain.runtime.ctlstore import ControllerLink
from hetrain.runtime.metrics import read_metrics
from hetrain.runtime.worker_main import local_cluster_state
from hetrain.sim.replay import recorded_decisions, replay_run

DEVICES = ["w0", "w1", "w2", "w3"]
BATCH = 64


def _profile() -> ProfileArrays:
    f = np.full(4, 2e6)
    return ProfileArrays(
        names=tuple(f"layer{i}" for i in range(4)),
        fwd_flops=f,
        bwd_flops=2 * f,
        activation_bytes=np.full(4, 256.0),
        activation_memory_bytes=np.full(4, 256.0),
        param_bytes=np.full(4, 4e4),
    )


def _controller(steps: int = 120) -> PlanController:
    state = local_cluster_state(DEVICES, [2e10] * 4)
    plan = even_dp_plan(DEVICES, 4, BATCH, 8)
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    return PlanController(state, _profile(), config, plan, steps)


def _recorded_log(steps: int = 120, slow_step: int = 40, seed: int = 3) -> list[dict]:
    """A main-job-like measurement log: four identical ranks with ±30 % noise (shared CPUs),
    w1 3x slower from ``slow_step``; compute seconds = work / speed under the plan in force is
    filled in by :func:`_replay`."""
    rng = np.random.default_rng(seed)
    return [
        {
            "noise": rng.uniform(0.7, 1.3, size=4).tolist(),
            "factor": [1.0, 3.0 if t >= slow_step else 1.0, 1.0, 1.0],
        }
        for t in range(steps)
    ]


def _replay(log: list[dict]) -> tuple[PlanController, list]:
    ctl = _controller(len(log))
    flops = float(ctl.profile.train_flops.sum())
    decisions = []
    for t, row in enumerate(log):
        plan = ctl.current
        compute = {}
        for g in plan.groups:
            for i, d in enumerate(DEVICES):
                if d in g.devices and g.batch > 0:
                    compute[d] = flops * g.batch / 2e10 * row["factor"][i] * row["noise"][i]
        ctl.observe(t, int(plan.plan_id), compute)
        d = ctl.decide(t + 1)
        if d is not None:
            decisions.append(d)
    return ctl, decisions


def test_replayed_log_applies_only_changes_that_hold_and_is_deterministic():
    log = _recorded_log()
    ctl, decisions = _replay(log)
    assert decisions, "the 3x slow-down of w1 must move work"
    for d in decisions:
        # figures on the estimates that chose the plan, recomputed from the record
        ids = ctl.base_state.ids
        state = ctl.base_state.with_changes(
            speed_flops=np.array([d.speeds_flops[x] for x in ids]),
            kappa_s=np.array([d.kappa_s[x] for x in ids]),
            measured_extra_s=np.array([d.measured_extra_s[x] for x in ids]),
        )
        before = ctl.plans[int(d.plan.plan_id) - 1]
        t_cur = predict_iteration_time_s(before, state, ctl.profile, ctl.config)
        t_new = predict_iteration_time_s(d.plan, state, ctl.profile, ctl.config)
        assert t_cur == pytest.approx(d.current_time_s) and t_new == pytest.approx(
            d.predicted_time_s
        )
        # no change predicted slower, none whose gain over the persistence misses migration
        margin = ctl.policy.switch_margin if d.structure_changed else ctl.policy.rebalance_margin
        assert d.predicted_time_s < (1 - margin) * d.current_time_s
        assert (d.current_time_s - d.predicted_time_s) * d.horizon_steps >= d.migration_time_s
    # after the slow-down w1 gets at most half the mean share of the used ranks
    last = decisions[-1].shares_after
    used = [b for b in last.values() if b > 0]
    assert last["w1"] <= 0.5 * np.mean(used)
    _, again = _replay(log)
    assert [(d.decided_after_step, d.plan.model_dump()) for d in again] == [
        (d.decided_after_step, d.plan.model_dump()) for d in decisions
    ]


def _service_round(thread, tmp_path, **init) -> tuple:
    """A 60-step round of the 4 devices started on ``thread``'s service: rank 0's link, the
    links of ranks 1-3 (every rank writes its own record), and the controller the round's
    start was taken from; ``init``: the round's checkpoint fields."""
    link = ControllerLink(thread.endpoint, timeout_s=10)
    others = [
        ControllerLink(thread.endpoint, timeout_s=10, rank=r, round_id=link.round_id)
        for r in range(1, len(DEVICES))
    ]
    ctl = _controller(60)
    link.start_round(
        {
            "world_size": len(DEVICES),
            "base_state": ctl.base_state,
            "profile": ctl.profile,
            "config": ctl.config,
            "plan": ctl.current,
            "steps": 60,
            "start_step": 0,
            "optimizer_state_factor": 2.0,
            "log_path": str(tmp_path / "controller.jsonl"),
            **init,
        }
    )
    return link, others, ctl


def test_service_answers_through_the_store_and_saves_its_state(tmp_path):
    thread = ControllerThread().start()
    try:
        link, others, ctl = _service_round(
            thread, tmp_path, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10
        )
        flops = float(ctl.profile.train_flops.sum())
        decision = None
        for t in range(40):
            slow = 4.0 if t >= 5 else 1.0
            compute = {d: flops * 16 / 2e10 * (slow if d == "w1" else 1.0) for d in DEVICES}
            plan_id = 0 if decision is None else int(decision.plan.plan_id)
            for rank, each in enumerate([link, *others]):
                d = DEVICES[rank]
                each.post(t, {"device": d, "plan_id": plan_id, "compute_time_s": compute[d],
                              "iteration_time_s": max(compute.values()),
                              "send_recv_time_s": 0.0, "sync_time_s": 0.0})  # fmt: skip
            time.sleep(0.01)  # the rank never waits; this only gives the thread time
            decision = link.poll(plan_id) or decision
        deadline = time.time() + 30  # searches take a while on a loaded machine
        while decision is None and time.time() < deadline:
            time.sleep(0.05)
            decision = link.poll(0)
        assert decision is not None and decision.shares_after["w1"] < 16
        # the first decision is plan 1; this log's times do not follow the shares (every rank
        # reports 16 samples' compute), so w1 looks slower still under its smaller share and a
        # second change may follow
        assert decision.plan.plan_id >= 1
        deadline = time.time() + 10
        while not controller_state_path(tmp_path / "ckpt", 40).is_file():
            assert time.time() < deadline
            time.sleep(0.05)
        state = json.loads(controller_state_path(tmp_path / "ckpt", 40).read_text())
        saved = _controller(60)  # a fresh controller restored from the plain-JSON state
        saved.load_state_dict(state)
        # the state at the checkpoint boundary: 40 steps observed, w1's slow-down estimated:
        # its predicted compute for 16 samples in 2 micro-batches over 2x w0's (these times
        # do not follow the shares, which the fit reads as fixed cost, not per-sample speed)
        est = saved.estimates
        slow, fixed = est.slowdowns(), est.fixed_overheads_s()
        work_s = float(saved.profile.train_flops.sum()) * 16 / 2e10
        w1_s, w0_s = (slow[d] * (work_s + 2 * fixed[d]) for d in ("w1", "w0"))
        assert saved.observed_steps == 40 and w1_s > 2.0 * w0_s
        assert saved.plans[0].plan_id == 0
        rows = [json.loads(x) for x in (tmp_path / "controller.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows[:5]] == [0, 1, 2, 3, 4]
        link.close()
        for each in others:
            each.close()
    finally:
        thread.close()
    assert thread.error is None


def test_no_step_is_decided_while_a_posted_decision_is_not_yet_applied(tmp_path):
    """The ranks keep reporting plan 0 after the controller posted a decision (rank 0 has not
    applied it yet): the controller decides on no later step, so that a second decision can
    neither overwrite the first in the store nor be made against a plan that never ran."""
    thread = ControllerThread().start()
    try:
        link, others, ctl = _service_round(
            thread, tmp_path, checkpoint_dir=None, checkpoint_every=0
        )
        flops = float(ctl.profile.train_flops.sum())
        steps = 40
        for t in range(steps):
            slow = 4.0 if t >= 5 else 1.0
            compute = {d: flops * 16 / 2e10 * (slow if d == "w1" else 1.0) for d in DEVICES}
            for rank, each in enumerate([link, *others]):
                d = DEVICES[rank]
                each.post(t, {"device": d, "plan_id": 0, "compute_time_s": compute[d],
                              "iteration_time_s": max(compute.values()),
                              "send_recv_time_s": 0.0, "sync_time_s": 0.0})  # fmt: skip
            time.sleep(0.05)  # the thread keeps up: one step per tick, each one decidable
        log = tmp_path / "controller.jsonl"
        deadline = time.time() + 60  # searches take a while on a loaded machine
        rows: list = []
        while len(rows) < steps:
            assert time.time() < deadline, (len(rows), [r["step"] for r in rows][-3:], thread.error)
            time.sleep(0.05)
            rows = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
        made = [r["step"] for r in rows if "decision" in r]
        assert len(made) == 1, made  # w1 4x slower from step 5: one change of plan
        assert [r["step"] for r in rows if r["decided"] and r["step"] > made[0]] == []
        decision = link.poll(0)
        assert decision is not None and decision.shares_before == {d: 16 for d in DEVICES}
        link.close()
        for each in others:
            each.close()
    finally:
        thread.close()
    assert thread.error is None


def _main_job_late_shares(run_dir, out: str) -> list:
    """Run-level checks of the main job's metrics (asserted), and the steps from 90 on where
    w1's share exceeds half the mean used share (returned)."""
    events = read_metrics(run_dir / "metrics.jsonl")
    plans = {e["plan_id"]: e["plan"] for e in events if e["event"] == "plan"}
    steps = [e for e in events if e["event"] == "step"]
    replans = [e for e in events if e["event"] == "replan"]
    adopted = {r["plan_id"]: r for r in replans}
    late = []
    for e in steps:
        shares = {d: 0 for d in ("w0", "w1", "w2", "w3")}
        shares.update({d: g["batch"] for g in plans[e["plan_id"]]["groups"] for d in g["devices"]})
        if e["step"] < 50:
            used = [b for b in shares.values() if b > 0]
            if not (max(used) <= 1.3 * min(used) and len(used) == 4):
                # issue 10's exception: identical ranks get shares within 30 % of each other
                # unless the controller's logged figures show the uneven plan faster. 4 busy
                # ranks on 2 cores do slow one rank down for several steps (a quiet CI run
                # idled w2 at step 6 on such figures), so such a plan must have been chosen
                # by a re-plan that logged the controller's gate: predicted faster by its
                # margin (shares only: rebalance_margin; new structure: switch_margin)
                r = adopted.get(e["plan_id"])
                assert r is not None, (e["step"], shares)
                margin = policy_options()["rebalance_margin"]
                assert r["predicted_time_s"] < (1 - margin) * r["current_time_s"], (
                    e["step"], shares, r,
                )  # fmt: skip
        if e["step"] >= 90:
            used = [b for b in shares.values() if b > 0]
            if shares["w1"] > 0.5 * np.mean(used):
                late.append((e["step"], shares))
    # every re-plan: one console line and a record with its figures
    lines = [x for x in out.splitlines() if "re-plan at step" in x]
    assert len(lines) == len(replans) >= 1
    for r in replans:
        assert r["predicted_time_s"] < r["current_time_s"]
        # each re-plan was decided against the plan that ran (one decision in flight): its
        # shares before are those of the plan it replaced, its shares after its own plan's
        for key, plan_id in (("shares_before", r["old_plan_id"]), ("shares_after", r["plan_id"])):
            ran = {d: 0 for d in r[key]}
            ran.update({d: g["batch"] for g in plans[plan_id]["groups"] for d in g["devices"]})
            assert r[key] == ran, (key, r)
        assert (
            set(r["shares_before"])
            == set(r["shares_after"])
            == set(plans[0]["groups"][0]["devices"]) | {"w1", "w2", "w3"}
        )
    assert "even data parallelism on the same measured speeds" in out
    # a device the final plan leaves idle holds nothing and is sent nothing per step
    timeline = [e for e in events if e["event"] == "timeline"][-1]
    named = {d for g in timeline["plan"]["groups"] for d in g["devices"]}
    for device, rank in zip(["w0", "w1", "w2", "w3"], timeline["ranks"], strict=True):
        if device not in named:
            assert rank["stage"] is None and rank["sync_bytes"] == 0, rank
            assert rank["bytes_received"] == 0 and rank["compute_time_s"] == 0.0
    return late


def test_main_job_moves_work_off_the_slow_rank(tmp_path, capfd):
    """``hetrain train --example digits --workers 4 --steps 150`` (w1 3x slower from step 50):
    equal shares for identical ranks before (unless a re-plan logged the controller's gate
    for an uneven plan), w1 at most half the mean used share from step 90 on.

    Step 90 leaves 40 steps after the slow-down: the pooled estimate lets w1 out of its
    kind's pool after about 7 slow steps (docs/controller.md, "Pooled per hardware kind"), and on
    this 2-core machine (4 ranks, about 2 ms of compute in a 15-30 ms step) a re-balance
    decided on noise just before the slow-down has delayed the move by up to 24 steps in
    quiet runs (w1 still at 9-13 of 64 at step 70, re-balanced at 71-74)."""
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "--example",
            "digits",
            "--workers",
            "4",
            "--steps",
            "150",
            "--no-progress",
            "--run-dir",
            str(run_dir),
        ]
    )
    assert code == 0
    err = capfd.readouterr()
    late = _main_job_late_shares(run_dir, err.out + err.err)
    assert not late, late[:3]
    # the end line's decision delay: per plan change, its first step minus the last step its
    # decision saw, minus 1 (the unit of hetrain simulate --decision-delay), median
    replans = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] == "replan"]
    assert replans
    delays = [r["step"] - r["decided_after_step"] - 1 for r in replans]
    assert min(delays) >= 1  # a decision is carried by a later step's report row
    median = statistics.median(delays)
    end = [x for x in err.out.splitlines() if x.startswith("trained ")]
    assert len(end) == 1 and f"(decision delay {median:g} step" in end[0], end


def test_first_decision_keeps_the_slow_device_busy_with_balanced_shares():
    """Issue 10, bench/runtime_vs_ddp.py's slow case: one of four identical devices 3x slower
    from the start, per-micro-batch costs κ as start-up calibration measures them under the
    emulation (the slow device's 3x larger, as its speed is 3x lower). The policy's structure
    search moves whole micro-batches and answered 16/0/32/16 (one fast device given two
    shares, the slow one idle); re-balanced shares of the four groups (about 3:3:3:1) are
    predicted faster on the same estimates and are what the controller applies."""
    kappa = {"w0": 0.02, "w1": 0.06, "w2": 0.02, "w3": 0.02}
    flops = float(_profile().train_flops.sum())
    per_sample_s = 0.01
    speed = {d: flops / per_sample_s / (3.0 if d == "w1" else 1.0) for d in DEVICES}
    state = local_cluster_state(DEVICES, [speed[d] for d in DEVICES])
    state = state.with_changes(kappa_s=np.array([kappa[d] for d in state.ids]))
    plan = even_dp_plan(DEVICES, 4, BATCH, 8)
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    ctl = PlanController(state, _profile(), config, plan, 60, async_search=True)
    first = None
    for t in range(30):
        compute = {}
        for g in ctl.current.groups:
            for d in g.devices:
                if g.batch > 0:
                    compute[d] = flops * g.batch / speed[d] + g.num_microbatches * kappa[d]
        ctl.observe(t, int(ctl.current.plan_id), compute)
        decision = ctl.decide(t + 1)
        ctl.wait_for_search()  # the search done before the next step (deterministic)
        if decision is not None and first is None:
            first = decision
    assert first is not None
    shares = first.shares_after
    fast = [shares[d] for d in ("w0", "w2", "w3")]
    assert shares["w1"] > 0, shares
    assert max(fast) <= 1.3 * min(fast), shares
    assert shares["w1"] <= 0.5 * np.mean(fast), shares


def test_controller_learns_the_fixed_step_time_for_its_predictions_not_its_decisions():
    ctl = _controller(60)
    flops = float(ctl.profile.train_flops.sum())
    bare = predict_iteration_time_s(ctl.current, ctl.base_state, ctl.profile, ctl.config)
    rng = np.random.default_rng(8)
    for t in range(20):
        compute = {d: flops * 16 / 2e10 for d in DEVICES}  # the base speeds, 16 samples each
        measured = bare + 0.015 + rng.normal(0, 0.0005)  # 15 ms the model does not see
        if t == 9:
            measured += 0.5  # one stalled step
        ctl.observe(t, int(ctl.current.plan_id), compute, measured)
    pred = ctl.predictions()
    assert pred["step_overhead_s"] == pytest.approx(0.015, abs=0.001)
    on_estimates = predict_iteration_time_s(
        ctl.current, ctl.observed_state(), ctl.profile, ctl.config
    )
    assert pred["predicted_time_s"] == pytest.approx(on_estimates + pred["step_overhead_s"])
    assert pred["predicted_time_s"] == pytest.approx(bare + 0.015, rel=0.02)
    # dp-even here is the plan in force (one micro-batch each): the same F
    assert pred["dp_even_time_s"] - pred["predicted_time_s"] == pytest.approx(
        predict_iteration_time_s(
            even_dp_plan(DEVICES, 4, BATCH, 1), ctl.observed_state(), ctl.profile, ctl.config
        )
        - on_estimates,
        abs=1e-9,
    )
    assert ctl.config.step_overhead_s == 0.0  # decisions compare plans without it
    # the learned F travels in the controller's JSON state: a restored controller predicts alike
    restored = PlanController(ctl.base_state, ctl.profile, ctl.config, ctl.current, ctl.steps)
    restored.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert restored.step_overhead_s() == pytest.approx(ctl.step_overhead_s())
    assert restored.predictions()["predicted_time_s"] == pytest.approx(pred["predicted_time_s"])


def test_a_decision_of_an_ended_round_never_reaches_the_next_round(tmp_path):
    """A round whose rank 0 died (a restart) may still have a search running in the controller;
    its decision, written after the next round's start, is ignored by the new round's rank 0
    (it named plan ids and estimates of the old round); the new round's own decision is read."""
    from hetrain.runtime.ctlstore import PREFIX, _store, publish
    from hetrain.runtime.ctlwire import encode_decision

    store = _store("127.0.0.1", 0, master=True)
    endpoint = f"127.0.0.1:{store.port}"
    ctl = _controller(60)
    init = {"world_size": 4, "base_state": ctl.base_state, "profile": ctl.profile,
            "config": ctl.config, "plan": ctl.current, "steps": 60, "start_step": 0,
            "optimizer_state_factor": 2.0, "checkpoint_dir": None, "checkpoint_every": 0,
            "log_path": None}  # fmt: skip
    old, new = ControllerLink(endpoint, timeout_s=10), None
    try:
        old.start_round(init)
        deadline = time.time() + 10
        while old._round_id is None:
            assert time.time() < deadline
            time.sleep(0.01)
        new = ControllerLink(endpoint, timeout_s=10)
        new.start_round(init)
        while new._round_id is None or store.get(PREFIX + "init_id") != new._round_id:
            assert time.time() < deadline
            time.sleep(0.01)
        plan = even_dp_plan(DEVICES, 4, BATCH, 8).model_copy(update={"plan_id": 7})
        decision = Decision(plan, "rebalance", 3, 0.2, 0.1, 0.01, 10.0, False)
        publish(store, "plan", encode_decision(old.round_id, decision))  # late, old round
        time.sleep(3 * ControllerLink.REFRESH_S)
        assert new.poll(0) is None
        publish(store, "plan", encode_decision(new.round_id, decision))  # this round's
        while new.poll(0) is None:
            assert time.time() < deadline
            time.sleep(0.05)
        assert new.poll(0).plan.plan_id == decision.plan.plan_id
    finally:
        old.close(wait_s=1)
        if new is not None:
            new.close(wait_s=1)


def test_logged_predictions_are_the_plans_times_with_f_and_cost_two_evaluations(
    monkeypatch,
) -> None:
    """The service's predictions (evaluated after a decision is posted, from a snapshot) are
    bit-equal to the cost model's times with the learned ``F``, and a measured step costs at
    most two cost-model evaluations for them and the residual of ``F`` (the plan in force's time
    is shared, also with the policy's memo), over a run whose ``F`` and plans change."""
    import dataclasses

    import hetrain.runtime.ctlcontroller as cc

    devices = DEVICES
    profile = _profile()
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    ctl = PlanController(
        local_cluster_state(devices, [2e10] * 4),
        profile,
        config,
        even_dp_plan(devices, 4, BATCH, 8),
        40,
        async_search=False,
    )
    import hetrain.control.lyapunov as ly

    calls = []
    real = cc.predict_iteration_time_s
    monkeypatch.setattr(cc, "predict_iteration_time_s", lambda *a: calls.append(1) or real(*a))
    # the policy's memo evaluates through the cost model directly: count those calls too
    real_evaluate = ly.evaluate_plan
    monkeypatch.setattr(ly, "evaluate_plan", lambda *a: calls.append(1) or real_evaluate(*a))
    rng = np.random.default_rng(5)
    flops = float(profile.train_flops.sum())
    overheads, per_step, changes = set(), [], 0
    for t in range(40):
        plan = ctl.current
        factor = [1.0, 3.0 if t >= 20 else 1.0, 1.0, 1.0]
        compute = {
            d: flops * g.batch / 2e10 * factor[i] * rng.uniform(0.8, 1.2)
            for g in plan.groups
            if g.batch > 0
            for i, d in enumerate(devices)
            if d in g.devices
        }
        measured = max(compute.values()) + 0.004  # a fixed 4 ms the model does not know
        calls.clear()
        ctl.observe(t, int(plan.plan_id), compute, measured)
        snapshot = ctl.prediction_inputs()
        got = ctl.predictions_of(snapshot)
        per_step.append(len(calls))
        expected_plan, state, overhead_s = snapshot
        with_f = dataclasses.replace(config, step_overhead_s=overhead_s)
        even = even_dp_plan(devices, 4, BATCH, 1)
        assert got["predicted_time_s"] == real(expected_plan, state, profile, with_f)
        assert got["dp_even_time_s"] == real(even, state, profile, with_f)
        assert got["step_overhead_s"] == overhead_s
        overheads.add(round(overhead_s, 6))
        changes += ctl.decide(t + 1) is not None
    assert len(overheads) > 5  # F was learned and moved
    assert ctl.current.plan_id != 0  # plans changed on the way
    # at most two cost-model evaluations per step, the policy's memo included (dp-even's and
    # the plan in force's on the new estimates; the residual and a decision on the same
    # estimates reuse them)
    assert set(per_step) <= {1, 2}
    assert changes >= 1


def test_plan_ids_grow_by_one_after_a_start_up_decision(tmp_path, capfd):
    """An adaptive run whose start-up decision is not even data parallelism (w2 3x slower
    from the start) and that re-plans later (w1 3x slower from step 10): the plans are
    numbered 0, 1, 2, ... in the metrics, the console's re-plan lines and report.txt, and a
    replay of the run gives the same decisions under the same ids."""
    trace = tmp_path / "trace.csv"
    trace.write_text("slot,device,speed_factor\n10,w1,0.3333333\n")
    run_dir = tmp_path / "run"
    argv = ["train", "--example", "digits", "--workers", "3", "--steps", "40",
            "--slowdown", "w2=3", "--trace", str(trace), "--no-progress",
            "--run-dir", str(run_dir)]  # fmt: skip
    assert main(argv) == 0
    out = capfd.readouterr().err
    events = read_metrics(run_dir / "metrics.jsonl")
    first = next(e for e in events if e["event"] == "plan")
    assert first["plan_id"] == 0
    shares = [g["batch"] for g in first["plan"]["groups"]]
    assert max(shares) - min(shares) > 1, shares  # the start-up decision: not even shares
    replans = [e for e in events if e["event"] == "replan"]
    assert replans
    ids = [e["plan_id"] for e in events if e["event"] == "plan"]
    assert ids == list(range(len(replans) + 1)), ids
    assert [(r["old_plan_id"], r["plan_id"]) for r in replans] == [(k, k + 1) for k in ids[:-1]]
    assert sorted({e["plan_id"] for e in events if e["event"] == "step"}) == ids
    lines = [x for x in out.splitlines() if "re-plan at step" in x]
    assert [int(x.split("(plan ")[1].split(")")[0]) for x in lines] == ids[1:], lines
    report = (run_dir / "report.txt").read_text()
    per_plan = next(x for x in report.splitlines() if x.startswith("median iteration time"))
    assert [int(p.split(":")[0]) for p in per_plan.split("plan ")[1:]] == ids, per_plan
    # a replay of the run takes the same decisions under the same ids
    recorded = recorded_decisions(run_dir)
    assert [r["plan_id"] for r in recorded] == ids[1:], recorded
    assert replay_run(run_dir) == recorded
