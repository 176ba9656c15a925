"""The controller's messages are JSON data (hetrain.runtime.ctlwire): they round-trip the
planning types exactly, anything else is refused with one line and changes nothing (a
crafted pickle in the store executes nothing), and the controller's store listens on
loopback only."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.costmodel import TrainingConfig
from hetrain.profile import ProfileArrays, SharedTensor
from hetrain.runtime.adapt import ControllerThread
from hetrain.runtime.ctldecision import Decision, even_dp_plan
from hetrain.runtime.ctlstore import PREFIX, ControllerLink, publish
from hetrain.runtime.ctlwire import (
    WireError,
    decode_decision,
    decode_init,
    decode_record,
    encode_decision,
    encode_init,
    encode_record,
    merge_records,
)
from hetrain.runtime.worker_main import local_cluster_state

DEVICES = ["w0", "w1", "w2"]


def _init() -> dict:
    state = local_cluster_state(DEVICES, [1e9, 2e9, 3.5e9])
    state = state.with_changes(kappa_s=np.array([1e-3, 2e-3, 0.0]))
    profile = ProfileArrays(
        names=("a", "b", "c", "d"),
        fwd_flops=np.array([1.0, 2.0, 3.0, 4.5]),
        bwd_flops=np.array([2.0, 4.0, 6.0, 9.0]),
        activation_bytes=np.array([10.0, 10.0, 10.0, 4.0]),
        activation_memory_bytes=np.array([20.0, 20.0, 20.0, 8.0]),
        param_bytes=np.array([100.0, 50.0, 50.0, 0.0]),
        shared=(SharedTensor("tied", 64.0, (0, 3), False),),
        overhead_weights=np.array([1.0, 0.5, 0.5, 2.0]),
    )
    config = TrainingConfig(batch=12, sync_overlap=True, group_time_jitter=0.05)
    plan = even_dp_plan(DEVICES, 4, 12, 4)
    return {
        "round": "r1",
        "world_size": 3,
        "base_state": state,
        "profile": profile,
        "config": config,
        "plan": plan,
        "steps": 50,
        "start_step": 5,
        "optimizer_state_factor": 2.0,
        "checkpoint_dir": None,
        "checkpoint_every": 0,
        "log_path": "/tmp/x.jsonl",
    }


def _decision() -> Decision:
    plan = even_dp_plan(DEVICES, 4, 12, 4).model_copy(update={"plan_id": 3})
    return Decision(
        plan, "rebalance", 7, 0.2, 0.1, 0.01, 10.0, False, {"w0": 1e9}, {"w0": 4}, {"w0": 5}
    )


def test_messages_round_trip_the_planning_types():
    init = _init()
    back = decode_init(encode_init(init))
    for key in ("round", "world_size", "steps", "start_step", "log_path", "checkpoint_dir"):
        assert back[key] == init[key]
    assert back["config"] == init["config"]
    assert back["plan"] == init["plan"]
    for field in ("speed_flops", "kappa_s", "node", "available", "layer_overhead_s"):
        np.testing.assert_array_equal(
            getattr(back["base_state"], field), getattr(init["base_state"], field)
        )
    assert back["base_state"].ids == init["base_state"].ids
    assert back["profile"].shared == init["profile"].shared
    np.testing.assert_array_equal(back["profile"].overhead_weights, [1.0, 0.5, 0.5, 2.0])
    round_id, decision = decode_decision(encode_decision("r1", _decision()), Decision)
    assert round_id == "r1" and decision == _decision()
    rec = {"round": "r1", "rank": 1, "device": "w1", "plan_id": 2, "compute_time_s": 0.5,
           "iteration_time_s": 0.7, "send_recv_time_s": 0.0, "sync_time_s": 0.1}  # fmt: skip
    assert decode_record(encode_record(rec)) == rec
    other = {**rec, "rank": 0, "device": "w0", "iteration_time_s": 0.9, "compute_time_s": 0.2}
    merged = merge_records([rec, other])
    assert merged["iteration_time_s"] == 0.9
    assert merged["compute_time_s"] == {"w0": 0.2, "w1": 0.5}


class _Payload:
    """Unpickling it opens (creates) a file: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _decoders():
    return [
        decode_init,
        decode_record,
        lambda raw: decode_decision(raw, Decision),
    ]


def test_a_crafted_pickle_is_rejected_by_every_decoder_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Payload(marker))
    for decode in _decoders():
        with pytest.raises(WireError) as err:
            decode(blob)
        assert "\n" not in str(err.value)
    assert not marker.exists()


def test_the_controller_ignores_a_crafted_pickle_in_its_store(tmp_path, capfd):
    """A pickle written to the controller store's keys (the init, a measurement record, the
    decision rank 0 reads) is refused with one line each; nothing runs and nothing changes."""
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Payload(marker))
    thread = ControllerThread().start()
    link = None
    try:
        store = thread.service.store
        store.set(PREFIX + "init", blob)
        store.set(PREFIX + "init_id", "evil")
        deadline = time.time() + 10
        while thread.service.rejected_init_id != b"evil":
            assert time.time() < deadline
            time.sleep(0.02)
        assert thread.service.controller is None  # nothing started from it
        # a real round, then a hostile record for its step 0 and a hostile decision
        link = ControllerLink(thread.endpoint, timeout_s=10)
        init = {k: v for k, v in _init().items() if k != "round"}
        init["start_step"] = 0
        init["world_size"] = 1
        link.start_round(init)
        while thread.service.controller is None:
            assert time.time() < deadline
            time.sleep(0.02)
        store.set(PREFIX + "m/0/0", blob)
        publish(store, "plan", blob)  # the counter raised too: rank 0's link reads it
        # a hostile init in the middle of a round: refused, the round goes on
        store.set(PREFIX + "init", blob)
        store.set(PREFIX + "init_id", "evil2")
        while thread.service.rejected_init_id != b"evil2":
            assert time.time() < deadline
            time.sleep(0.02)
        assert thread.service.controller is not None
        assert thread.service._init_id == link.round_id.encode()
        while store.check([PREFIX + "m/0/0"]):  # read, refused and deleted
            assert time.time() < deadline
            time.sleep(0.02)
        time.sleep(3 * ControllerLink.REFRESH_S)
        assert link.poll(0) is None
        assert thread.service.controller.observed_steps == 0
        assert thread.error is None and thread.thread.is_alive()
    finally:
        if link is not None:
            link.close(wait_s=1)
        thread.close()
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if "ignored" in x]
    assert any("controller init: not JSON" in x for x in lines), err
    assert any("measurement record: not JSON" in x for x in lines), err
    assert any("controller decision: not JSON" in x for x in lines), err
    assert not marker.exists()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(value=JSON, key=st.sampled_from(["init", "record", "decision"]), drop=st.integers(0, 30))
def test_malformed_messages_raise_wire_error_only(value, key, drop):
    """Arbitrary JSON, and valid messages with one field removed or replaced by arbitrary JSON,
    either decode or raise WireError (never another exception)."""
    if key == "init":
        good, decode = json.loads(encode_init(_init())), decode_init
    elif key == "record":
        rec = {"round": "r", "rank": 0, "device": "w0", "plan_id": 0, "compute_time_s": 1.0,
               "iteration_time_s": 1.0, "send_recv_time_s": 0.0, "sync_time_s": 0.0}  # fmt: skip
        good, decode = json.loads(encode_record(rec)), decode_record
    else:
        good = json.loads(encode_decision("r", _decision()))

        def decode(raw):
            return decode_decision(raw, Decision)

    for candidate in (value, _mutate(good, drop, value)):
        raw = json.dumps(candidate).encode()
        try:
            decode(raw)
        except WireError as exc:
            assert "\n" not in str(exc)


def _mutate(message: dict, index: int, value) -> dict:
    """``message`` with its ``index``-th field (depth first) removed (even) or replaced."""
    paths = []

    def walk(obj, path):
        if isinstance(obj, dict):
            for k, v in obj.items():
                paths.append((*path, k))
                walk(v, (*path, k))

    walk(message, ())
    out = json.loads(json.dumps(message))
    path = paths[index % len(paths)]
    parent = out
    for k in path[:-1]:
        parent = parent[k]
    if index % 2 == 0:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def _listen_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on ``port`` (Linux /proc/net/tcp*)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.is_file():
            continue
        for line in path.read_text().splitlines()[1:]:
            parts = line.split()
            addr, state = parts[1], parts[3]
            host, port_hex = addr.rsplit(":", 1)
            if int(port_hex, 16) == port and state == "0A":
                out.append(host)
    return out


def test_the_controller_store_listens_on_loopback_only():
    if not Path("/proc/net/tcp").is_file():
        pytest.skip("needs Linux /proc/net/tcp")
    thread = ControllerThread().start()
    try:
        port = int(thread.endpoint.rsplit(":", 1)[1])
        addresses = _listen_addresses(port)
    finally:
        thread.close()
    # 127.0.0.1 as /proc/net/tcp writes it (little-endian hex); torch's own server listens
    # on every interface ("::", all zeros, in tcp6)
    assert addresses == ["0100007F"]


def test_a_fork_waits_for_a_store_call_in_progress():
    """The launching process forks the ranks while its controller thread talks to the store;
    a child forked inside a store call inherits torch's native mutexes locked (a rank hung in
    init_process_group). Every controller store call holds a lock a fork waits for."""
    import os
    import threading

    from hetrain.runtime.ctlstore import _ForkSafeStore

    started, done = threading.Event(), []

    class _SlowStore:
        def get(self, key):
            started.set()
            time.sleep(0.3)
            done.append(key)
            return b""

    caller = threading.Thread(target=_ForkSafeStore(_SlowStore()).get, args=("k",))
    caller.start()
    started.wait(5)
    pid = os.fork()
    if pid == 0:  # the child exits at once
        os._exit(0)
    seen = list(done)  # the parent right after the fork
    os.waitpid(pid, 0)
    caller.join()
    assert seen == ["k"]


def test_device_kinds_and_measured_times_reach_the_controller():
    """The controller plans with the profile's measured per-layer times per device kind
    (docs/model.md §3): the round's start carries the kinds, nominal speeds and times."""
    import dataclasses

    from hetrain.costmodel import evaluate_plan
    from hetrain.profile import MeasuredTimes

    init = _init()
    ids = init["base_state"].ids
    kinds = tuple("v100" if i % 2 else "a100" for i in range(len(ids)))
    state = dataclasses.replace(init["base_state"], kinds=kinds)
    n = init["profile"].num_layers
    sizes = np.array([1.0, 4.0])
    times = MeasuredTimes("v100", sizes, np.full((2, n), 2e-3) * [[1], [3]], np.full((2, n), 5e-3))
    profile = dataclasses.replace(init["profile"], measured=(times,))
    back = decode_init(encode_init({**init, "base_state": state, "profile": profile}))
    assert back["base_state"].kinds == state.kinds
    np.testing.assert_array_equal(back["base_state"].nominal_speed_flops, state.nominal_speed_flops)
    (got,) = back["profile"].measured
    assert got.kind == "v100"
    np.testing.assert_array_equal(got.fwd_s, times.fwd_s)
    np.testing.assert_array_equal(got.microbatch_sizes, sizes)
    before = evaluate_plan(init["plan"], state, profile, init["config"]).iteration_time_s
    after = evaluate_plan(init["plan"], back["base_state"], back["profile"], init["config"])
    assert after.iteration_time_s == before
