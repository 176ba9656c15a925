"""The controller's search thread runs below the ranks' priority and poll the store less while idle
(docs/controller.md "Where it runs")."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from hetrain.runtime.adapt import CONTROLLER_NICE, ControllerService, ControllerThread

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@linux_only
def test_search_thread_runs_below_the_controller_thread() -> None:
    from hetrain.runtime.ctlcontroller import _search_executor

    own = _nice(threading.get_native_id())
    controller = ControllerThread().start()
    try:
        tid = controller.thread.native_id
        assert tid is not None
        # the service's thread (the per-step decision) keeps the launcher's priority
        assert _nice(tid) == own
        searched = _search_executor().submit(lambda: _nice(threading.get_native_id())).result()
        search_base = min(19, own + CONTROLLER_NICE)
        assert searched >= search_base  # (a thread created earlier by a niced thread: more)
        assert _nice(threading.get_native_id()) == own
    finally:
        controller.close()


@linux_only
def test_threads_the_controller_starts_inherit_its_priority() -> None:
    from hetrain.runtime.adapt import lower_thread_priority

    seen: dict[str, int] = {}

    def controller_like() -> None:
        lower_thread_priority()
        child = threading.Thread(target=lambda: seen.update(child=_nice(threading.get_native_id())))
        child.start()
        child.join()
        seen["own"] = _nice(threading.get_native_id())

    base = _nice(threading.get_native_id())
    t = threading.Thread(target=controller_like)
    t.start()
    t.join()
    assert seen["own"] == min(19, base + CONTROLLER_NICE)
    assert seen["child"] == seen["own"]
    assert _nice(threading.get_native_id()) == base


def test_idle_sleep_backs_off_and_follows_the_step_time() -> None:
    service = ControllerService(store=None, poll_s=0.005)
    sleeps = []
    for ticks in range(8):
        service._idle_ticks = ticks
        sleeps.append(service.idle_sleep_s())
    # no step yet (start-up): 5 ms doubling up to the cap
    assert sleeps[:4] == pytest.approx([0.005, 0.01, 0.02, 0.04])
    assert sleeps[4:] == pytest.approx([ControllerService.IDLE_POLL_MAX_S] * 4)
    # steps 200 ms apart: a check at least every 5 % of a step (10 ms)
    service._step_gap_s = 0.2
    service._idle_ticks = 10
    assert service.idle_sleep_s() == pytest.approx(0.2 * ControllerService.IDLE_POLL_STEP_FRACTION)
    # steps faster than 100 ms: never below poll_s
    service._step_gap_s = 0.02
    assert service.idle_sleep_s() == pytest.approx(0.005)
    service._idle_ticks = 0
    assert service.idle_sleep_s() == pytest.approx(0.005)


def test_step_gap_is_the_mean_time_between_complete_steps(monkeypatch) -> None:
    service = ControllerService(store=None)
    clock = iter([10.0, 10.3, 10.9])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    service._note_steps(1)
    assert service._step_gap_s is None
    service._note_steps(3)  # three steps in 0.3 s
    assert service._step_gap_s == pytest.approx(0.1)
    service._note_steps(2)  # two in 0.6 s: EWMA 0.8 * 0.1 + 0.2 * 0.3
    assert service._step_gap_s == pytest.approx(0.14)


def test_logged_predictions_are_the_plans_times_with_f_and_cost_two_evaluations(
    monkeypatch,
) -> None:
    """The service's predictions (evaluated after a decision is posted, from a snapshot) are
    bit-equal to the cost model's times with the learned ``F``, and a measured step costs two
    cost-model evaluations for them and the residual of ``F`` (the plan in force's time is
    shared), over a run whose ``F`` and plans change."""
    import dataclasses

    import numpy as np

    import hetrain.runtime.ctlcontroller as cc
    from hetrain.costmodel import TrainingConfig
    from hetrain.profile import ProfileArrays
    from hetrain.runtime.ctldecision import even_dp_plan
    from hetrain.runtime.worker_main import local_cluster_state

    devices = ["w0", "w1", "w2", "w3"]
    f = np.full(4, 2e6)
    profile = ProfileArrays(
        names=tuple(f"layer{i}" for i in range(4)),
        fwd_flops=f,
        bwd_flops=2 * f,
        activation_bytes=np.full(4, 256.0),
        activation_memory_bytes=np.full(4, 256.0),
        param_bytes=np.full(4, 4e4),
    )
    config = TrainingConfig(batch=64, optimizer_state_factor=2.0, sync_overlap=True)
    ctl = cc.PlanController(
        local_cluster_state(devices, [2e10] * 4),
        profile,
        config,
        even_dp_plan(devices, 4, 64, 8),
        40,
        async_search=False,
    )
    calls = []
    real = cc.predict_iteration_time_s
    monkeypatch.setattr(cc, "predict_iteration_time_s", lambda *a: calls.append(1) or real(*a))
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
        even = even_dp_plan(devices, 4, 64, 1)
        assert got["predicted_time_s"] == real(expected_plan, state, profile, with_f)
        assert got["dp_even_time_s"] == real(even, state, profile, with_f)
        assert got["step_overhead_s"] == overhead_s
        overheads.add(round(overhead_s, 6))
        changes += ctl.decide(t + 1) is not None
    assert len(overheads) > 5  # F was learned and moved
    assert ctl.current.plan_id != 0  # plans changed on the way
    # two evaluations per step (three before: the residual evaluated the plan in force on its
    # own); a third only right after a decision changed the plan in force
    assert set(per_step) <= {2, 3}
    assert changes >= 1 and per_step.count(3) <= changes
