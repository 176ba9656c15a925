"""Store requests of the controller's protocol while a round runs: the service checks for the
next step's records from three quarters of a step on, reads them in one request, and rank 0's
link reads the decision keys only when the controller's news counter moved."""

from __future__ import annotations

import threading
import time
from collections import Counter

from test_train_controller import DEVICES, _controller

import hetrain.runtime.ctlstore as ctlstore
from hetrain.runtime.adapt import ControllerService
from hetrain.runtime.ctlstore import ControllerLink, _store


class _Counting:
    """A store whose calls are counted by method name."""

    def __init__(self, store) -> None:
        self._store = store
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return call


def test_requests_per_step_of_the_service_and_of_rank_0s_link(tmp_path, monkeypatch):
    """30 steps of 4 ranks 40 ms apart with steady times (the controller keeps the plan after
    its first decisions): the service makes at most 14 store requests per step (a few
    checks, one multi_get, 4 deletes, round checks every 0.1 s; a check every 5 ms and a get
    per record made 16-20), and rank
    0's link, between decisions, one request per read (the news counter) and no check."""
    server = _store("127.0.0.1", 0, master=True)
    counted = _Counting(server)
    service = ControllerService(counted)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    links: list[_Counting] = []
    real_store = ctlstore._store

    def counting_store(*args, **kwargs):
        links.append(_Counting(real_store(*args, **kwargs)))
        return links[-1]

    monkeypatch.setattr(ctlstore, "_store", counting_store)
    endpoint = f"127.0.0.1:{server.port}"
    ctl = _controller(200)
    link = ControllerLink(endpoint, timeout_s=10)
    others = [ControllerLink(endpoint, timeout_s=10, rank=r, round_id=link.round_id)
              for r in range(1, len(DEVICES))]  # fmt: skip
    try:
        link.start_round({"world_size": len(DEVICES), "base_state": ctl.base_state,
                          "profile": ctl.profile, "config": ctl.config, "plan": ctl.current,
                          "steps": 200, "start_step": 0, "optimizer_state_factor": 2.0,
                          "checkpoint_dir": None, "checkpoint_every": 0,
                          "log_path": None})  # fmt: skip
        deadline = time.time() + 20
        while service.controller is None:
            assert time.time() < deadline
            time.sleep(0.01)
        flops = float(ctl.profile.train_flops.sum())
        compute = {d: flops * 16 / 2e10 for d in DEVICES}

        def post(step: int) -> None:
            for rank, each in enumerate([link, *others]):
                each.post(step, {"device": DEVICES[rank], "plan_id": 0,
                                 "compute_time_s": compute[DEVICES[rank]],
                                 "iteration_time_s": 0.04, "send_recv_time_s": 0.0,
                                 "sync_time_s": 0.0})  # fmt: skip

        for step in range(10):  # warm-up: the first decisions (none expected: equal ranks)
            post(step)
            time.sleep(0.04)
        while service._last < 9:
            assert time.time() < deadline
            time.sleep(0.01)
        rank0 = link.store  # this link's (counted) connection
        assert rank0 in links
        assert service.controller is not None and link.poll(0) is None
        counted.calls.clear()
        rank0.calls.clear()
        steps = 30
        for step in range(10, 10 + steps):
            post(step)
            time.sleep(0.04)
        while service._last < 9 + steps:
            assert time.time() < deadline + 30
            time.sleep(0.01)
        served = sum(counted.calls.values())
        assert served <= 14 * steps, counted.calls
        assert counted.calls["multi_get"] == steps and counted.calls["get"] <= steps, counted.calls
        # rank 0's link: its record per step, the news counter per read, nothing else
        assert rank0.calls["check"] == 0 and rank0.calls["get"] == 0, rank0.calls
        assert steps <= rank0.calls["add"] <= 2 * steps + 20, rank0.calls
        assert rank0.calls["set"] == steps, rank0.calls
    finally:
        link.close(wait_s=1)
        for each in others:
            each.close(wait_s=1)
        service.stop.set()
        thread.join(timeout=10)
