"""``StopRequest`` (SIGTERM as a spot warning or an elastic restart for a join): the grace timer
bounds the wait for the ranks to agree on a stop step, and never cuts the stop checkpoint short
once they agreed (a 5 s timer did on a loaded CI machine: the join's next round redid 4 steps)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from hetrain.runtime import stop as worker_stop


@pytest.fixture
def exits(monkeypatch):
    """``os._exit`` replaced by a recorder; the SIGTERM handler restored afterwards."""
    calls: list[int] = []
    monkeypatch.setattr(os, "_exit", calls.append)
    monkeypatch.setattr(worker_stop, "STOP_GRACE_S", 0.2)
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield calls
    for sig, handler in old.items():
        signal.signal(sig, handler)


def _term_and_wait(seconds: float) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(seconds)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals")
def test_unagreed_stop_exits_after_the_grace_period(exits):
    stop = worker_stop.StopRequest().install()
    _term_and_wait(0.6)
    assert stop.requested and not stop.agreed
    assert exits == [worker_stop.EXIT_STOPPED]


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals")
def test_agreed_stop_is_not_cut_short_by_the_grace_timer(exits):
    stop = worker_stop.StopRequest().install()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert stop.requested
    stop.agree()  # the step's all-gather carried the request: the stop checkpoint follows
    time.sleep(0.6)  # three grace periods: a slow checkpoint on a busy machine
    assert exits == []
    _term_and_wait(0.6)  # a second SIGTERM (another agent's) after agreement starts no timer
    assert exits == []


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals")
def test_repeated_sigterm_keeps_one_grace_period(exits):
    stop = worker_stop.StopRequest().install()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.6)
    assert stop.requested and exits == [worker_stop.EXIT_STOPPED]  # one exit, not two


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals")
def test_sigint_is_a_stop_request_and_handlers_are_restored(exits):
    before = signal.getsignal(signal.SIGINT)
    stop = worker_stop.StopRequest(grace=False).install()
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: no KeyboardInterrupt, a stop after the step
    time.sleep(0.3)
    assert stop.requested and stop.signal_name == "SIGINT" and stop.exit_code == 130
    assert exits == []  # one rank (grace=False): no timer, the step always finishes
    stop.restore()
    assert signal.getsignal(signal.SIGINT) is before
