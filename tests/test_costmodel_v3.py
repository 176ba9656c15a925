"""docs/model.md (v3) inputs of the cost model against hand-computed numbers: the per-layer overhead
λ,
frozen parameters and shared (tied) tensors; and the norm block of the planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetrain.cli import main
from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.errors import InputError
from hetrain.plan import check_norm_block, plan_from_dict
from hetrain.planner import baselines, best_plan
from hetrain.profile import profile_from_dict

# a: 1 TFLOP/s, κ 1 ms, λ 0.5 ms, nic 8 Gbit/s = 1e9 B/s, node n0
# b: 2 TFLOP/s, κ 0, λ 1 ms, nic 16 Gbit/s = 2e9 B/s, node n1
# c: 1 TFLOP/s, node n0 (intra-node 800 Gbit/s = 1e11 B/s); latency 0
CLUSTER = {
    "links": {"intra_node_gbps": 800, "latency_us": 0},
    "devices": [
        {"id": "a", "node": "n0", "tflops": 1, "memory_gib": 4, "nic_gbps": 8,
         "microbatch_overhead_ms": 1.0, "layer_overhead_ms": 0.5},
        {"id": "b", "node": "n1", "tflops": 2, "memory_gib": 4, "nic_gbps": 16,
         "layer_overhead_ms": 1.0},
        {"id": "c", "node": "n0", "tflops": 1, "memory_gib": 4, "nic_gbps": 8},
    ],
}  # fmt: skip
# 3 layers: f = 1e9, w = 2e9 -> 3e9 FLOP/sample each; a = m = 1e6 B/sample; p = 1e8 B;
# layer 1 also has 5e7 frozen bytes; a tied tensor of 1e8 B used by layers 0 and 2.
LAYERS = [
    {"name": f"l{i}", "fwd_flops": 1e9, "activation_bytes": 1e6, "param_bytes": 1e8,
     "frozen_param_bytes": 5e7 if i == 1 else 0.0}
    for i in range(3)
]  # fmt: skip
SHARED = [{"name": "tied", "bytes": 1e8, "layers": [0, 2]}]
PIPE = {"groups": [{"devices": ["a", "b"], "stages": [[0, 2], [2, 3]],
                    "microbatch_size": 2, "batch": 4}]}  # fmt: skip


def _evaluate(plan: dict, shared=None, *, batch: int = 4, sync_overlap: bool = False):
    state = cluster_from_dict(CLUSTER).state()
    profile = {"layers": LAYERS}
    if shared is not None:
        profile["shared"] = shared
    arrays = profile_from_dict(profile).arrays()
    config = TrainingConfig(batch=batch, sync_overlap=sync_overlap)
    return evaluate_plan(plan_from_dict(plan), state, arrays, config)


def test_layer_overhead_in_stage_times() -> None:
    ev = _evaluate(PIPE)
    # C1 = 2*6e9/1e12 + 1e-3 + 2 layers * 0.5e-3 = 14e-3; C2 = 2*3e9/2e12 + 1 layer * 1e-3
    # = 4e-3; E1 = 2 * 2*1e6 / min(1e9, 2e9) = 4e-3; A = 22e-3, M = 14e-3, n = 2
    assert ev.stage_compute_s[0] == pytest.approx((14e-3, 4e-3), rel=1e-12)
    assert ev.stage_transfer_s[0] == pytest.approx((4e-3,), rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(36e-3, rel=1e-12)
    assert ev.sync_time_s == 0.0


def test_layer_overhead_weights_in_stage_times_planner_and_fast_path() -> None:
    """Per-layer overhead weights ν_l (docs/model.md §3): stage k pays λ Σ_{l∈S_k} ν_l."""
    weighted = [{**ly, "overhead_weight": nu} for ly, nu in zip(LAYERS, (0.5, 2.0, 0.5),
                                                                  strict=True)]  # fmt: skip
    arrays = profile_from_dict({"layers": weighted}).arrays()
    state = cluster_from_dict(CLUSTER).state()
    ev = evaluate_plan(plan_from_dict(PIPE), state, arrays, TrainingConfig(batch=4))
    # C1 = 12e-3 + 1e-3 + 0.5e-3 (0.5 + 2.0) = 14.25e-3; C2 = 3e-3 + 1e-3 x 0.5 = 3.5e-3
    # E1 = 4e-3: A = 21.75e-3, M = 14.25e-3, n = 2 -> T = 36e-3
    assert ev.stage_compute_s[0] == pytest.approx((14.25e-3, 3.5e-3), rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(36e-3, rel=1e-12)
    # the controller's fast evaluation sees the same weights, and the planner's best plan is
    # never worse than this one under them (its figure is the cost model's)
    from hetrain.control.incremental import StructureArrays, evaluate_fast

    plan = plan_from_dict(PIPE)
    fast = evaluate_fast(plan, StructureArrays.build(plan, state.ids, arrays), state)
    assert fast.group_times_s == pytest.approx(ev.group_times_s, rel=1e-12)
    best = best_plan(state, arrays, TrainingConfig(batch=4))
    again = evaluate_plan(best, state, arrays, TrainingConfig(batch=4)).iteration_time_s
    assert best.iteration_time_s == pytest.approx(again, rel=1e-12)
    assert best.iteration_time_s <= ev.iteration_time_s
    # without weights: the v3 formula, C1 = 14e-3
    plain = profile_from_dict({"layers": LAYERS}).arrays()
    assert plain.layer_units(0, 2) == 2.0
    assert evaluate_plan(plan_from_dict(PIPE), state, plain, TrainingConfig(batch=4)
                         ).stage_compute_s[0][0] == pytest.approx(14e-3)  # fmt: skip


def test_frozen_and_trainable_shared_memory_and_sync() -> None:
    ev = _evaluate(PIPE, SHARED)
    # a holds layers 0-1 and the tied tensor: θ' = 2e8 + 1e8 -> 3e8 * (2 + 2) = 1.2e9,
    # φ = 5e7, activations h = min(2, 2) = 2 micro-batches of 2 samples * 2e6 = 8e6
    assert ev.memory_bytes["a"] == pytest.approx(1.2e9 + 5e7 + 8e6, rel=1e-12)
    # b holds layer 2 and the tied tensor: θ' = 2e8 -> 8e8; h = 1: 2 * 1e6
    assert ev.memory_bytes["b"] == pytest.approx(8e8 + 2e6, rel=1e-12)
    # one group, but the tied tensor has n_s = 2 holders on different nodes: each syncs
    # 2 (2-1)/2 * 1e8 / nic_d (latency 0): a 0.1 s, b 0.05 s; T = 36 ms + 0.1 s
    assert ev.sync_times_s == pytest.approx({"a": 0.1, "b": 0.05}, rel=1e-12)
    assert ev.sync_time_s == pytest.approx(0.1, rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(0.136, rel=1e-12)


def test_frozen_shared_tensor_is_weights_only_and_never_synced() -> None:
    ev = _evaluate(PIPE, [{**SHARED[0], "frozen": True}])
    assert ev.memory_bytes["a"] == pytest.approx(2e8 * 4 + 5e7 + 1e8 + 8e6, rel=1e-12)
    assert ev.memory_bytes["b"] == pytest.approx(1e8 * 4 + 1e8 + 2e6, rel=1e-12)
    assert ev.sync_time_s == 0.0
    assert ev.iteration_time_s == pytest.approx(36e-3, rel=1e-12)


def test_shared_tensor_across_data_parallel_groups() -> None:
    plan = {"groups": [
        {"devices": ["a"], "stages": [[0, 3]], "microbatch_size": 2, "batch": 2},
        {"devices": ["c"], "stages": [[0, 3]], "microbatch_size": 2, "batch": 2},
    ]}  # fmt: skip
    ev = _evaluate(plan, SHARED)
    # G' = 2, a and c on node n0 -> intra 1e11 B/s. Layers: θ = 3e8 (frozen and shared
    # excluded): 2 (1/2) 3e8 / 1e11 = 3e-3; shared, n_s = 2: 1e8 / 1e11 = 1e-3
    assert ev.sync_times_s == pytest.approx({"a": 4e-3, "c": 4e-3}, rel=1e-12)
    # a: μ 2 * 9e9 / 1e12 + 1 ms + 3 * 0.5 ms = 20.5 ms; c: 18 ms
    assert ev.group_times_s == pytest.approx((20.5e-3, 18e-3), rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(24.5e-3, rel=1e-12)
    # memory: 3e8 + 1e8 trainable -> 1.6e9, frozen 5e7, h = 1 activations 2 * 3e6
    assert ev.memory_bytes["c"] == pytest.approx(1.6e9 + 5e7 + 6e6, rel=1e-12)


def test_sync_overlap_charges_shared_tensors_in_full() -> None:
    ev = _evaluate(PIPE, SHARED, sync_overlap=True)
    # one active group: no layer all-reduce to overlap; the tied tensor's 0.1 s stays
    assert ev.exposed_sync_time_s == pytest.approx(0.1, rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(0.136, rel=1e-12)


def test_planner_accounts_for_shared_sync() -> None:
    """With the tied tensor a two-stage pipeline pays 0.1 s of sync; the planner knows it and
    keeps the whole model on one device (its objective equals the cost model's)."""
    state = cluster_from_dict(CLUSTER).state()
    arrays = profile_from_dict({"layers": LAYERS, "shared": SHARED}).arrays()
    config = TrainingConfig(batch=4)
    plan = best_plan(state, arrays, config)
    ev = evaluate_plan(plan, state, arrays, config)
    assert ev.iteration_time_s == pytest.approx(plan.iteration_time_s, rel=1e-12)
    assert all(len(g.devices) == 1 for g in plan.groups)
    assert ev.iteration_time_s < 0.1


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"shared": [{"name": "t", "bytes": 1, "layers": [3]}]}, "shared[0].layers[0]"),
        ({"shared": [{"name": "t", "bytes": 1, "layers": [0, 0]}]}, "shared[0].layers"),
        ({"shared": [{"name": "t", "bytes": 1, "layers": [0], "frozen": "yes"}]},
         "shared[0].frozen"),
        ({"shared": [{"name": "t", "bytes": -1, "layers": [0]}]}, "shared[0].bytes"),
        ({"shared": [{"name": "t", "bytes": 1, "layers": [0]},
                     {"name": "t", "bytes": 1, "layers": [1]}]}, "shared[1].name"),
    ],
)  # fmt: skip
def test_bad_shared_tensors_are_input_errors(bad: dict, field: str) -> None:
    with pytest.raises(InputError) as info:
        profile_from_dict({"layers": LAYERS, **bad}, "m.json")
    assert field in str(info.value)


def test_negative_layer_overhead_is_an_input_error() -> None:
    bad = {**CLUSTER, "devices": [{**CLUSTER["devices"][0], "layer_overhead_ms": -1}]}
    with pytest.raises(InputError, match=r"devices\[0\]\.layer_overhead_ms"):
        cluster_from_dict(bad, "c.json")


# -- norm block ------------------------------------------------------------------------------


def test_norm_block_must_divide_the_batch() -> None:
    with pytest.raises(InputError, match="global batch 10.*norm block 4"):
        TrainingConfig(batch=10, norm_block=4)
    with pytest.raises(InputError, match="--norm-block"):
        TrainingConfig(batch=8, norm_block=0)


# three devices on one node, 3, 2 and 1 TFLOP/s: data parallelism with shares ~ 6, 4, 2
DP_CLUSTER = {
    "devices": [
        {"id": f"d{i}", "node": "n0", "tflops": t, "memory_gib": 4, "nic_gbps": 8}
        for i, t in enumerate((3, 2, 1))
    ]
}


def test_planner_and_baselines_keep_norm_block_multiples() -> None:
    state = cluster_from_dict(DP_CLUSTER).state()
    arrays = profile_from_dict({"layers": LAYERS}).arrays()
    plain = TrainingConfig(batch=12)
    blocked = TrainingConfig(batch=12, norm_block=4)
    free = best_plan(state, arrays, plain)
    # without the rule the best plan uses shares that are not multiples of 4
    assert any(g.batch % 4 for g in free.groups)
    plan = best_plan(state, arrays, blocked)
    check_norm_block(plan, 4)
    assert all(g.batch % 4 == 0 and g.microbatch_size % 4 == 0 for g in plan.groups)
    assert plan.global_batch == 12
    ev = evaluate_plan(plan, state, arrays, blocked)
    assert plan.iteration_time_s == pytest.approx(ev.iteration_time_s, rel=1e-12)
    assert ev.iteration_time_s >= free.iteration_time_s
    for make in (baselines.dp_even_plan, baselines.dp_proportional_plan,
                 baselines.pipeline_plan, baselines.static_hybrid_plan):  # fmt: skip
        other = make(state, arrays, blocked)
        assert other is not None
        check_norm_block(other, 4)
        assert other.global_batch == 12


def test_check_norm_block_names_the_group() -> None:
    plan = plan_from_dict({"groups": [
        {"devices": ["a"], "stages": [[0, 3]], "microbatch_size": 4, "batch": 8},
        {"devices": ["b"], "stages": [[0, 3]], "microbatch_size": 2, "batch": 4},
    ]})  # fmt: skip
    check_norm_block(plan, 2)
    with pytest.raises(InputError, match=r"groups\[1\]\.microbatch_size.*norm block 4"):
        check_norm_block(plan, 4)


def test_cli_norm_block(tmp_path: Path, capsys) -> None:
    cluster = tmp_path / "c.json"
    model = tmp_path / "m.json"
    cluster.write_text(json.dumps(CLUSTER))
    model.write_text(json.dumps({"layers": LAYERS}))
    common = ["--cluster", str(cluster), "--model", str(model), "--batch", "12"]
    assert main(["plan", *common, "--norm-block", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert all(g["batch"] % 4 == 0 and g["microbatch_size"] % 4 == 0 for g in plan["groups"])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(plan))
    assert main(["evaluate", *common, "--plan", str(path), "--norm-block", "4"]) == 0
    capsys.readouterr()
    bad = {"groups": [{"devices": ["a"], "stages": [[0, 3]], "microbatch_size": 2,
                       "batch": 6},
                      {"devices": ["c"], "stages": [[0, 3]], "microbatch_size": 6,
                       "batch": 6}]}  # fmt: skip
    path.write_text(json.dumps(bad))
    assert main(["evaluate", *common, "--plan", str(path), "--norm-block", "3"]) == 2
    err = capsys.readouterr().err
    assert "groups[0].microbatch_size" in err and "norm block 3" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["plan", *common, "--norm-block", "5"]) == 2
    err = capsys.readouterr().err
    assert "--norm-block" in err and "12" in err
