"""Measured per-layer times per device kind (docs/model.md §3 "Measured times", §7): the
profile field round-trips through JSON and is validated; cluster devices have a kind; the cost
model charges a device of a measured kind its interpolated measured times (no κ, no λ) and any
other device the FLOP model, checked against hand computations; the planner's fast paths and
the cost model agree on the same figures."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cli import main
from hetrain.cluster import cluster_from_dict, default_kind
from hetrain.costmodel import (
    TrainingConfig,
    evaluate_plan,
    lower_bound_s,
    profile_prefix,
    stage_compute_s,
)
from hetrain.errors import InputError
from hetrain.plan import plan_from_dict
from hetrain.planner import best_plan
from hetrain.planner.partition import split_table
from hetrain.profile import profile_from_dict

# 3 layers; kind "a" measured at μ = 1 and 4 (forward + backward per layer: 0.03, 0.06,
# 0.09 s at μ = 1 and 0.075, 0.15, 0.27 s at μ = 4); kind "b" has no measured times
PROFILE = {
    "name": "three",
    "layers": [
        {"name": "l0", "fwd_flops": 1e9, "activation_bytes": 1e6},
        {"name": "l1", "fwd_flops": 2e9, "activation_bytes": 1e6},
        {"name": "l2", "fwd_flops": 3e9, "activation_bytes": 1e6},
    ],
    "measured_times": {
        "a": {
            "microbatch_sizes": [1, 4],
            "fwd_s": [[0.01, 0.02, 0.03], [0.025, 0.05, 0.09]],
            "bwd_s": [[0.02, 0.04, 0.06], [0.05, 0.10, 0.18]],
        }
    },
}
DEV = {"memory_gib": 16, "nic_gbps": 8, "latency_us": 0}
CLUSTER = {
    "links": {"intra_node_gbps": 800, "latency_us": 0},
    "devices": [
        # kind "a" from the id; its κ and λ are not charged (measured times include them)
        {"id": "a-0", "node": "n0", "tflops": 5, "memory_gib": 16, "nic_gbps": 8,
         "microbatch_overhead_ms": 5, "layer_overhead_ms": 7},
        # explicit kind "b": the FLOP model at 1 TFLOP/s, κ = 2 ms, λ = 1 ms per layer
        {"id": "gpu7", "kind": "b", "node": "n1", "tflops": 1, "memory_gib": 16,
         "nic_gbps": 8, "microbatch_overhead_ms": 2, "layer_overhead_ms": 1},
    ],
}  # fmt: skip


def _pipeline(mu: int, batch: int) -> dict:
    return {"groups": [{"devices": ["a-0", "gpu7"], "stages": [[0, 2], [2, 3]],
                        "microbatch_size": mu, "batch": batch}]}  # fmt: skip


def test_profile_with_measured_times_round_trips_through_json() -> None:
    prof = profile_from_dict(PROFILE, "m.json")
    text = json.dumps(prof.to_json_dict())
    again = profile_from_dict(json.loads(text), "again.json")
    assert again == prof
    assert again.to_json_dict()["measured_times"]["a"]["fwd_s"][1] == [0.025, 0.05, 0.09]
    (m,) = again.arrays().measured
    assert m.kind == "a" and m.microbatch_sizes.tolist() == [1.0, 4.0]
    assert m.bwd_s.shape == (2, 3)
    # a profile without measured times writes none
    plain = {k: v for k, v in PROFILE.items() if k != "measured_times"}
    assert "measured_times" not in profile_from_dict(plain).to_json_dict()


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({"microbatch_sizes": [1, 2], "fwd_s": [[1, 2, 3]] * 2, "bwd_s": [[1, 2, 3]]},
         ["measured_times.a", "bwd_s", "one row per micro-batch size (2), got 1"]),
        ({"microbatch_sizes": [2, 1], "fwd_s": [[1, 2, 3]] * 2, "bwd_s": [[1, 2, 3]] * 2},
         ["measured_times.a", "microbatch_sizes[1]", "strictly increasing"]),
        ({"microbatch_sizes": [1], "fwd_s": [[1, 2]], "bwd_s": [[1, 2, 3]]},
         ["measured_times.a.fwd_s[0]", "one time per layer (3), got 2"]),
        ({"microbatch_sizes": [1], "fwd_s": [[1, -2, 3]], "bwd_s": [[1, 2, 3]]},
         ["measured_times.a", "fwd_s[0][1]", "seconds >= 0"]),
        ({"microbatch_sizes": [0], "fwd_s": [[1, 2, 3]], "bwd_s": [[1, 2, 3]]},
         ["measured_times.a", "microbatch_sizes[0]", "integer >= 1"]),
        ({"microbatch_sizes": [1], "fwd_s": [[1, 2, 3]]},
         ["measured_times.a.bwd_s", "missing"]),
        ({"microbatch_sizes": [1], "fwd_s": [[1, 2, 3]], "bwd_s": [[1, 2, 3]], "upd_s": 1},
         ["measured_times.a.upd_s", "unknown key"]),
    ],
)  # fmt: skip
def test_bad_measured_times_name_file_field_and_expectation(table: dict, words: list) -> None:
    with pytest.raises(InputError) as err:
        profile_from_dict({**PROFILE, "measured_times": {"a": table}}, "m.json")
    line = str(err.value)
    assert line.startswith("m.json: ") and "\n" not in line
    for w in words:
        assert w in line


def test_bad_measured_times_exit_2_with_one_line(tmp_path, capsys) -> None:
    bad = {**PROFILE, "measured_times": {"a": {**PROFILE["measured_times"]["a"],
                                               "fwd_s": [[0.1, 0.2]] * 2}}}  # fmt: skip
    (tmp_path / "m.json").write_text(json.dumps(bad))
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    code = main(["plan", "--cluster", str(tmp_path / "c.json"), "--model",
                 str(tmp_path / "m.json"), "--batch", "4"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "m.json" in err[0] and "measured_times.a.fwd_s[0]" in err[0]


def test_device_kind_defaults_to_the_id_without_its_number() -> None:
    assert default_kind("v100-0") == "v100"
    assert default_kind("A100-40-3") == "A100-40"
    assert default_kind("w0") == "w0"
    assert default_kind("node-a") == "node-a"
    state = cluster_from_dict(CLUSTER).state()
    assert state.kinds == ("a", "b")
    # kinds match without regard to case; one kind twice (by case) is refused
    upper = {**PROFILE, "measured_times": {"A": PROFILE["measured_times"]["a"]}}
    prefix = profile_prefix(profile_from_dict(upper).arrays())
    assert prefix.kind_index(state).tolist() == [0, -1]
    twice = {**PROFILE, "measured_times": {"A": PROFILE["measured_times"]["a"],
                                           "a": PROFILE["measured_times"]["a"]}}  # fmt: skip
    with pytest.raises(InputError, match="each device kind once"):
        profile_from_dict(twice, "m.json")


def test_cost_model_equals_a_hand_computation_on_three_layers_and_two_kinds() -> None:
    state = cluster_from_dict(CLUSTER).state()
    arrays = profile_from_dict(PROFILE).arrays()
    # μ = 2 interpolates kind a at w = 1/3: layer times 0.045, 0.09, 0.15 s
    # C_1 (a-0, layers 0-1) = 0.135; C_2 (gpu7, layer 2, FLOP model) = 2 * 9e9 / 1e12 + 2 ms
    # + 1 ms = 0.021; E_1 = 2 * 2 * 1e6 B / 1e9 B/s = 0.004; n = 2:
    # T = (0.135 + 0.021 + 0.004) + (2 - 1) * 0.135 = 0.295
    ev = evaluate_plan(plan_from_dict(_pipeline(2, 4)), state, arrays, TrainingConfig(batch=4))
    assert ev.stage_compute_s[0] == pytest.approx((0.135, 0.021), rel=1e-12)
    assert ev.stage_transfer_s[0] == pytest.approx((0.004,), rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(0.295, rel=1e-12)
    # μ = 8 extrapolates along μ = 1..4 (w = 7/3): 0.135 + 0.27 = 0.405 s; gpu7 8 * 9e9 /
    # 1e12 + 3 ms = 0.075; E = 0.016; n = 1: T = 0.405 + 0.075 + 0.016 = 0.496
    ev = evaluate_plan(plan_from_dict(_pipeline(8, 8)), state, arrays, TrainingConfig(batch=8))
    assert ev.iteration_time_s == pytest.approx(0.496, rel=1e-12)
    # a trace that halves a-0's speed doubles its measured times: C_1 = 0.27 at μ = 2,
    # T = (0.27 + 0.021 + 0.004) + 0.27 = 0.565
    slow = state.with_changes(speed_flops=state.speed_flops * np.array([0.5, 1.0]))
    ev = evaluate_plan(plan_from_dict(_pipeline(2, 4)), slow, arrays, TrainingConfig(batch=4))
    assert ev.iteration_time_s == pytest.approx(0.565, rel=1e-12)
    # backward only (the sync overlap's drain): a-0 at μ = 2: 0.03 + 0.06 = 0.09 of bwd;
    # gpu7: 2 * 6e9 / 1e12 = 0.012 (no κ, no λ)
    prefix = profile_prefix(arrays)
    bwd = stage_compute_s(state, prefix, np.array([0, 1]), np.array([0, 2]), np.array([2, 3]),
                          2, "bwd")  # fmt: skip
    assert bwd == pytest.approx([0.09, 0.012], rel=1e-12)


def test_one_measured_size_scales_with_the_micro_batch_and_never_goes_below_zero() -> None:
    prof = {**PROFILE, "measured_times": {"a": {"microbatch_sizes": [2],
                                                "fwd_s": [[0.01, 0.02, 0.03]],
                                                "bwd_s": [[0.01, 0.02, 0.03]]}}}  # fmt: skip
    (m,) = profile_from_dict(prof).arrays().measured
    assert m.layer_times_s(6) == pytest.approx([0.06, 0.12, 0.18])
    # times falling with μ: extrapolation stops at 0
    falling = {"microbatch_sizes": [1, 2], "fwd_s": [[0.03, 0.0, 0.0], [0.01, 0.0, 0.0]],
               "bwd_s": [[0.0] * 3, [0.0] * 3]}  # fmt: skip
    (m,) = profile_from_dict({**PROFILE, "measured_times": {"a": falling}}).arrays().measured
    assert m.layer_times_s(3)[0] == 0.0 and m.layer_times_s(1.5)[0] == pytest.approx(0.02)


def test_lower_bound_stays_below_every_plan_with_measured_times() -> None:
    state = cluster_from_dict(CLUSTER).state()
    arrays = profile_from_dict(PROFILE).arrays()
    config = TrainingConfig(batch=8)
    plan = best_plan(state, arrays, config)
    t_lb = lower_bound_s(state, arrays, 8)
    assert 0 < t_lb <= plan.iteration_time_s
    # kind a's best per-sample rate over μ = 1..8 is at μ = 8: (0.135, 0.27, 0.51) / 8 s;
    # its bound speed is max_l F_l / r_l (F = 3e9, 6e9, 9e9 FLOP per sample)
    speed_a = max(3e9 / (0.135 / 8), 6e9 / (0.27 / 8), 9e9 / (0.51 / 8))
    assert t_lb == pytest.approx(8 * 18e9 / (speed_a + 1e12), rel=1e-12)


def test_partitioner_and_cost_model_agree_on_measured_stage_times() -> None:
    state = cluster_from_dict(CLUSTER).state()
    arrays = profile_from_dict(PROFILE).arrays()
    prefix = profile_prefix(arrays)
    bounds = np.array([[0, 1, 3], [0, 2, 3]])
    for mu in (1, 3, 4, 7):
        table = split_table(state, prefix, np.array([0, 1]), bounds, mu, 2.0, "1f1b")
        for row, b in enumerate(bounds):
            plan = plan_from_dict({"groups": [{"devices": ["a-0", "gpu7"],
                                               "stages": [[0, int(b[1])], [int(b[1]), 3]],
                                               "microbatch_size": mu, "batch": mu}]})  # fmt: skip
            ev = evaluate_plan(plan, state, arrays, TrainingConfig(batch=mu))
            assert table.fill_s[row] == pytest.approx(ev.iteration_time_s, rel=1e-12)


def test_a_saved_controller_state_keeps_kinds_and_nominal_speeds() -> None:
    from hetrain.control.decision import state_from_dict, state_to_dict

    state = cluster_from_dict(CLUSTER).state()
    slow = state.with_changes(speed_flops=state.speed_flops * 0.5)
    again = state_from_dict(json.loads(json.dumps(state_to_dict(slow))))
    assert again.kinds == ("a", "b")  # gpu7's explicit kind, not its id
    assert again.measured_time_scale().tolist() == [2.0, 2.0]


@st.composite
def _tables(draw):
    """A measured-times table of 1-4 sizes and 1-5 layers, times 0-1 s (any shape, so that
    some layers fall with μ and the extrapolation reaches 0)."""
    sizes = sorted(draw(st.sets(st.integers(1, 64), min_size=1, max_size=4)))
    layers = draw(st.integers(1, 5))
    times = st.lists(st.floats(0.0, 1.0), min_size=layers, max_size=layers)
    rows = draw(st.lists(times, min_size=len(sizes), max_size=len(sizes)))
    return sizes, rows


@settings(max_examples=150, deadline=None)
@given(_tables(), st.integers(1, 100))
def test_measured_interpolation_hits_the_measured_sizes_and_bounds_every_micro_batch(
    table, batch
) -> None:
    """Exact at every measured size; linear between two; the per-sample bound used by the
    search's pruning (docs/planner.md) is at most ``t_l(μ)/μ`` for every ``μ = 1..B``."""
    from hetrain.profile import MeasuredTimes

    sizes, rows = table
    zeros = np.zeros((len(sizes), len(rows[0])))
    m = MeasuredTimes("k", np.asarray(sizes, dtype=float), np.asarray(rows), zeros)
    for mu, row in zip(sizes, rows, strict=True):
        assert m.layer_times_s(mu) == pytest.approx(row, abs=1e-12)
    if len(sizes) >= 2:
        mid = (sizes[0] + sizes[1]) / 2
        want = (np.asarray(rows[0]) + np.asarray(rows[1])) / 2
        assert m.layer_times_s(mid) == pytest.approx(want, abs=1e-12)
    bound = np.diff(m.rate_prefix_s(batch))
    for mu in range(1, batch + 1):
        assert np.all(bound <= m.layer_times_s(mu) / mu + 1e-12)
    assert np.all(m.layer_times_s(batch + 7) >= 0.0)


def test_a_profile_with_measured_times_and_no_flops_plans_and_evaluates() -> None:
    prof = {**PROFILE, "layers": [{**ly, "fwd_flops": 0.0} for ly in PROFILE["layers"]]}
    cluster = {
        **CLUSTER,
        "devices": [CLUSTER["devices"][0], {**CLUSTER["devices"][0], "id": "a-1", "node": "n1"}],
    }
    state = cluster_from_dict(cluster).state()
    arrays = profile_from_dict(prof).arrays()
    plan = best_plan(state, arrays, TrainingConfig(batch=4))
    ev = evaluate_plan(plan, state, arrays, TrainingConfig(batch=4))
    assert ev.lower_bound_s == 0.0 and ev.iteration_time_s == plan.iteration_time_s > 0
