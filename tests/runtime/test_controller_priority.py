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


def test_idle_sleep_waits_for_most_of_a_step_after_one_completes() -> None:
    """Steps 80 ms apart, the last complete at t = 10 s: a pass that finds nothing at 10.01 s
    sleeps until 10.04 s (half a step), and from then on at most 4 ms (5 % of a step)
    between two checks; a step later than expected is checked for at that pace."""
    service = ControllerService(store=None, poll_s=0.002)
    service._step_gap_s, service._last_seen = 0.08, 10.0
    service._idle_ticks = 0
    assert service.idle_sleep_s(now=10.01) == pytest.approx(0.03)
    service._idle_ticks = 5
    assert service.idle_sleep_s(now=10.041) == pytest.approx(0.004)
    assert service.idle_sleep_s(now=10.5) == pytest.approx(0.004)


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
