"""Issue 12's two kinds of search misses, rebuilt with hand-checked numbers: shares and μ
solved jointly, and stages chosen by the iteration time (sync included), not the group
time alone."""

from __future__ import annotations

import numpy as np
import pytest

from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.planner import best_plan
from hetrain.planner.search import (
    Candidate,
    SearchContext,
    candidate_to_plan,
    polish_splits,
    solve_structure,
)
from hetrain.profile import profile_from_dict

# -- 1. shares and μ jointly -----------------------------------------------------------------
# v100 13.2, p100 8.5, t4 6.3 TFLOP/s (κ 8 ms, 10 Gbit/s NICs, each its own node, 20 µs);
# five layers of 2-3 GFLOP forward (12.5 GFLOP, 37.5 GFLOP with the backward per sample);
# 1e8 B of activation memory per layer and sample, so at most 3 samples per micro-batch fit;
# 2.8 MB of parameters per layer (14 MB in all). Two k80s too small to hold anything.
FWD_GFLOP = [2.0, 2.5, 3.0, 2.5, 2.5]
JOINT_PROFILE = {
    "layers": [
        {"name": f"l{i}", "fwd_flops": f * 1e9, "activation_bytes": 1e6,
         "activation_memory_bytes": 1e8, "param_bytes": 2.8e6}
        for i, f in enumerate(FWD_GFLOP)
    ]
}  # fmt: skip
JOINT_CLUSTER = {
    "links": {"intra_node_gbps": 800, "latency_us": 20},
    "devices": [
        {"id": name, "tflops": tflops, "memory_gib": (8e7 + 3.5 * 5e8) / 2**30, "nic_gbps": 10,
         "microbatch_overhead_ms": 8.0}
        for name, tflops in (("v100", 13.2), ("p100", 8.5), ("t4", 6.3))
    ] + [{"id": f"k80-{i}", "tflops": 2.9, "memory_gib": 0.05, "nic_gbps": 10} for i in (0, 1)],
}  # fmt: skip
# (3, 2, 1) with μ = b_g: max(3*37.5e9/13.2e12, 2*37.5e9/8.5e12, 37.5e9/6.3e12) + κ
# = 8.8235 + 8 ms; sync (G' = 3, NIC 1.25e9 B/s): 2*2*20e-6 + 2*(2/3)*14e6/1.25e9 = 15.013 ms
T_JOINT = 2 * 37.5e9 / 8.5e12 + 8e-3 + 4 * 20e-6 + 4 / 3 * 14e6 / 1.25e9  # 31.84 ms
# (2, 2, 2) with μ = 2: the t4 needs 2*37.5e9/6.3e12 + κ = 19.905 ms: 34.92 ms
T_EVEN = 2 * 37.5e9 / 6.3e12 + 8e-3 + 4 * 20e-6 + 4 / 3 * 14e6 / 1.25e9


def test_shares_and_microbatch_sizes_are_solved_jointly() -> None:
    state = cluster_from_dict(JOINT_CLUSTER).state()
    profile = profile_from_dict(JOINT_PROFILE).arrays()
    config = TrainingConfig(batch=6)
    ctx = SearchContext(state, profile, config)
    cand = solve_structure(ctx, [(0,), (1,), (2,)])
    plan = candidate_to_plan(ctx, cand)
    shares = {g.devices[0]: (g.batch, g.microbatch_size) for g in plan.groups}
    assert shares == {"v100": (3, 3), "p100": (2, 2), "t4": (1, 1)}
    assert plan.iteration_time_s == pytest.approx(T_JOINT, rel=1e-9)
    # what solving shares first (μ from powers of two), then μ, found: (2, 2, 2), μ = 2
    even = plan.model_copy(update={"groups": tuple(
        g.model_copy(update={"batch": 2, "microbatch_size": 2}) for g in plan.groups
    )})  # fmt: skip
    assert evaluate_plan(even, state, profile, config).iteration_time_s == pytest.approx(
        T_EVEN, rel=1e-9
    )
    assert T_EVEN > T_JOINT * 1.09
    best = best_plan(state, profile, config)
    assert best.iteration_time_s <= T_JOINT * (1 + 1e-12)
    ev = evaluate_plan(best, state, profile, config)
    assert ev.iteration_time_s == pytest.approx(best.iteration_time_s, rel=1e-12)


# -- 2. splits with the same group time, different all-reduce --------------------------------
# a1 (10 TFLOP/s, 100 Gbit/s) -> a2 (10 TFLOP/s, 0.79 Gbit/s = 9.875e7 B/s): a slow boundary
# (1e5 B activations: 2 * 1e5 / 9.875e7 + 40 µs = 2.065 ms per sample) dominates every split
# of six 3-GFLOP layers, so every split has the same group time; b (5 TFLOP/s) is a second
# group. The last layer has 2 MB of parameters, the others 0.1 MB: a2 all-reduces 2 MB when it
# holds only the last layer, 2.4 MB when it holds five.
SPLIT_PROFILE = {
    "layers": [
        {"name": f"l{i}", "fwd_flops": 1e9, "activation_bytes": 1e5,
         "param_bytes": 2e6 if i == 5 else 1e5}
        for i in range(6)
    ]
}  # fmt: skip
SPLIT_CLUSTER = {
    "links": {"intra_node_gbps": 800, "latency_us": 20},
    "devices": [
        {"id": "a1", "tflops": 10, "memory_gib": 8, "nic_gbps": 100},
        {"id": "a2", "tflops": 10, "memory_gib": 8, "nic_gbps": 0.79},
        {"id": "b", "tflops": 5, "memory_gib": 8, "nic_gbps": 100},
    ],
}
# shares 40 (μ 1) and 24 (μ 2): T_A = (1.5 + 0.3 + 2.0653) ms + 39 * 2.0653 ms = 84.41 ms,
# T_b = 12 * 2 * 18e9 / 5e12 = 86.4 ms; sync of a2 = 2 * 20 µs + θ_a2 / 9.875e7
BETA_A2 = 0.79e9 / 8


def _t_split(theta_a2: float) -> float:
    return 86.4e-3 + 40e-6 + theta_a2 / BETA_A2


def test_stages_are_chosen_by_iteration_time_not_group_time() -> None:
    state = cluster_from_dict(SPLIT_CLUSTER).state()
    profile = profile_from_dict(SPLIT_PROFILE).arrays()
    config = TrainingConfig(batch=64)
    ctx = SearchContext(state, profile, config)
    plan = candidate_to_plan(ctx, solve_structure(ctx, [(0, 1), (2,)]))
    pipe = plan.groups[0]
    assert pipe.devices == ("a1", "a2") and (pipe.batch, pipe.microbatch_size) == (40, 1)
    # every cut gives the pipeline the same group time; the iteration times differ
    times = {}
    for cut in range(1, 6):
        other = pipe.model_copy(update={"stages": ((0, cut), (cut, 6))})
        ev = evaluate_plan(plan.model_copy(update={"groups": (other, *plan.groups[1:])}),
                           state, profile, config)  # fmt: skip
        assert ev.group_times_s[0] == pytest.approx(84.41e-3, rel=1e-4)
        times[cut] = ev.iteration_time_s
    assert times[1] == pytest.approx(_t_split(2.4e6), rel=1e-9)  # 110.74 ms
    assert times[5] == pytest.approx(_t_split(2.0e6), rel=1e-9)  # 106.69 ms
    assert pipe.stages == ((0, 5), (5, 6))
    assert plan.iteration_time_s == pytest.approx(min(times.values()), rel=1e-12)


def test_polish_splits_rechooses_stages_with_sync() -> None:
    """The final polish of best_plan moves a pipeline's cut to where the iteration time is
    least, shares and μ fixed."""
    state = cluster_from_dict(SPLIT_CLUSTER).state()
    profile = profile_from_dict(SPLIT_PROFILE).arrays()
    config = TrainingConfig(batch=64)
    ctx = SearchContext(state, profile, config)
    bad = Candidate(
        _t_split(2.4e6), _t_split(2.4e6), [np.array([0, 1]), np.array([2])],
        [np.array([0, 1, 6]), np.array([0, 6])], [1, 2], [40, 24],
    )  # fmt: skip
    good = polish_splits(ctx, bad)
    assert [list(b) for b in good.bounds] == [[0, 5, 6], [0, 6]]
    assert good.iteration_time_s == pytest.approx(_t_split(2.0e6), rel=1e-9)
    plan = candidate_to_plan(ctx, good)
    assert plan.iteration_time_s == pytest.approx(good.iteration_time_s, rel=1e-12)
