"""The opt-in sync-overlap refinement of the cost model (``TrainingConfig.sync_overlap``)
against hand-computed numbers, and "off = docs/model.md §3 exactly" on random plans."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.catalog import make_mixed_cluster
from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.plan import plan_from_dict
from hetrain.profile import profile_from_dict

sys.path.insert(0, str(Path(__file__).parent / "planner"))
from random_inputs import random_profile  # noqa: E402

MS = 1e-3


def _cluster(nic_gbps: float = 8.0, latency_us: float = 0.0, slow: tuple[str, ...] = ()):
    """Devices x0, x1, y0, y1, each on its own node: 1 TFLOP/s (0.5 for ``slow``), κ = 0,
    NIC ``nic_gbps`` (8 Gbit/s = 1e9 B/s)."""
    return cluster_from_dict(
        {
            "links": {"intra_node_gbps": 800, "latency_us": latency_us},
            "devices": [
                {"id": d, "node": f"n{d}", "tflops": 0.5 if d in slow else 1.0,
                 "memory_gib": 64, "nic_gbps": nic_gbps}
                for d in ("x0", "x1", "y0", "y1")
            ],
        }
    ).state()  # fmt: skip


# 3 layers: f = 1e9, w = 2e9 FLOP/sample (3 ms fwd+bwd per sample at 1 TFLOP/s, 2 ms of it
# backward); a = 0.5e6 B/sample; p = 1e6 B per layer
PROFILE = profile_from_dict(
    {"layers": [{"name": f"l{i}", "fwd_flops": 1e9, "activation_bytes": 0.5e6,
                 "param_bytes": 1e6} for i in range(3)]}
).arrays()  # fmt: skip
PER_LAYER = 1.5e6  # bucket cap below two layers' bytes: every layer its own bucket


def _group(devices, stages, mu=1, batch=1):
    return {"devices": devices, "stages": stages, "microbatch_size": mu, "batch": batch}


def _eval(groups, state, **config):
    plan = plan_from_dict({"groups": groups})
    return evaluate_plan(plan, state, PROFILE, TrainingConfig(batch=2, **config))


DP = [_group(["x0"], [[0, 3]]), _group(["y0"], [[0, 3]])]


def test_dp_overlap_hides_all_but_the_first_layers_bucket() -> None:
    # T_g = 3 layers x 3 ms = 9 ms; the last backward passes layer 2 at 9 - 4 = 5 ms, layer 1
    # at 7 ms, layer 0 at 9 ms; each bucket 2 (2-1)/2 · 1e6 B / 1e9 B/s = 1 ms:
    # F_2 = 6, F_1 = max(7, 6) + 1 = 8, F_0 = max(9, 8) + 1 = 10 -> 1 ms exposed
    ev = _eval(DP, _cluster(), sync_overlap=True, sync_bucket_cap_bytes=PER_LAYER)
    assert ev.group_times_s == pytest.approx((9 * MS, 9 * MS))
    assert ev.exposed_sync_time_s == pytest.approx(1 * MS)
    assert ev.iteration_time_s == pytest.approx(10 * MS)
    assert ev.sync_time_s == pytest.approx(3 * MS)  # docs/model.md's T_sync is still reported
    assert ev.to_json_dict()["exposed_sync_time_s"] == pytest.approx(1 * MS)
    spec = _eval(DP, _cluster())
    assert spec.iteration_time_s == pytest.approx(12 * MS)
    assert spec.exposed_sync_time_s is None and "exposed_sync_time_s" not in spec.to_json_dict()


def test_dp_over_a_slow_link_hides_nothing_but_the_first_ready_time() -> None:
    # NIC 1e8 B/s: 10 ms per bucket, serialised from the first ready time (5 ms):
    # F = 5 + 30 = 35 ms -> exposed 26 ms (docs/model.md: 30 ms after the groups' end)
    ev = _eval(DP, _cluster(nic_gbps=0.8), sync_overlap=True, sync_bucket_cap_bytes=PER_LAYER)
    assert ev.exposed_sync_time_s == pytest.approx(26 * MS)
    assert ev.iteration_time_s == pytest.approx(35 * MS)
    assert ev.sync_time_s == pytest.approx(30 * MS)


def test_one_bucket_per_device_equals_spec_sync() -> None:
    # default cap (64 MiB): one 3e6 B bucket, ready when the backward ends -> nothing hidden,
    # and its time 2 lat + 3e6 / 1e8 is docs/model.md's t_d, latency included
    state = _cluster(nic_gbps=0.8, latency_us=100)
    ev = _eval(DP, state, sync_overlap=True)
    spec = _eval(DP, state)
    assert ev.exposed_sync_time_s == pytest.approx(30.2 * MS)
    assert ev.iteration_time_s == pytest.approx(spec.iteration_time_s, rel=1e-12)


def test_a_later_pipeline_stage_gets_a_longer_window() -> None:
    # two groups of 2 stages [0,1) [1,3), μ = 1, n = 1: C = (3, 6) ms, E = 2 · 0.5e6 / 1e9 =
    # 1 ms, T_g = 10 ms. Stage 2's last backward ends W_1 + E_1 = 2 + 1 = 3 ms before T_g:
    # its bucket (layers 1-2, 2e6 B, 2 ms) is ready at 7 ms and done at 9 ms (hidden); stage
    # 1's bucket (1e6 B, 1 ms) is ready at 10 ms and done at 11 ms -> 1 ms exposed (docs/model.md 2
    # ms)
    groups = [_group(["x0", "x1"], [[0, 1], [1, 3]]), _group(["y0", "y1"], [[0, 1], [1, 3]])]
    ev = _eval(groups, _cluster(), sync_overlap=True)
    assert ev.group_times_s == pytest.approx((10 * MS, 10 * MS))
    assert ev.exposed_sync_time_s == pytest.approx(1 * MS)
    assert ev.iteration_time_s == pytest.approx(11 * MS)
    assert _eval(groups, _cluster()).iteration_time_s == pytest.approx(12 * MS)


def test_a_bucket_starts_when_its_last_owner_is_ready() -> None:
    # y0 at 0.5 TFLOP/s: T = 18 ms, its backward passes layers 2, 1, 0 at 10, 14, 18 ms (x0:
    # 5, 7, 9). Each all-reduce waits for y0: over 1e8 B/s, F_2 = 20, F_1 = 30, F_0 = 40 ->
    # 22 ms exposed after the slow group (x0's own windows alone would leave 26 ms)
    ev = _eval(
        DP, _cluster(nic_gbps=0.8, slow=("y0",)), sync_overlap=True,
        sync_bucket_cap_bytes=PER_LAYER,
    )  # fmt: skip
    assert ev.group_times_s == pytest.approx((9 * MS, 18 * MS))
    assert ev.exposed_sync_time_s == pytest.approx(22 * MS)
    assert ev.iteration_time_s == pytest.approx(40 * MS)


def test_single_active_group_has_no_sync_and_idle_groups_split_buckets() -> None:
    groups = [_group(["x0"], [[0, 3]], batch=2), _group(["y0", "y1"], [[0, 1], [1, 3]], batch=0)]
    ev = _eval(groups, _cluster(), sync_overlap=True)
    assert ev.exposed_sync_time_s == 0.0
    assert ev.iteration_time_s == pytest.approx(ev.group_times_s[0])


@pytest.mark.parametrize(
    "kwargs",
    [{"sync_overlap": 1}, {"sync_bucket_cap_bytes": 0}, {"sync_bucket_cap_bytes": float("inf")},
     {"sync_bucket_cap_bytes": True}],
)  # fmt: skip
def test_config_validates_overlap_options(kwargs) -> None:
    with pytest.raises(ValueError):
        TrainingConfig(batch=1, **kwargs)


def _random_plan(rng: np.random.Generator, ids: list[str], num_layers: int, pure_dp: bool):
    """Random groups over a random subset of ``ids``: contiguous random stages, μ, shares
    (some groups idle)."""
    devs = list(rng.permutation(ids)[: int(rng.integers(1, min(len(ids), 8) + 1))])
    groups = []
    while devs:
        k = 1 if pure_dp else int(rng.integers(1, min(len(devs), num_layers, 3) + 1))
        members, devs = devs[:k], devs[k:]
        cuts = sorted(rng.choice(np.arange(1, num_layers), size=k - 1, replace=False).tolist())
        bounds = [0, *cuts, num_layers]
        groups.append(
            _group(
                [str(d) for d in members],
                [[bounds[i], bounds[i + 1]] for i in range(k)],
                mu=int(rng.integers(1, 9)),
                batch=int(rng.choice([0, 1, 5, 16, 33])),
            )
        )
    return plan_from_dict({"schedule": str(rng.choice(["1f1b", "gpipe"])), "groups": groups})


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_overlap_off_is_spec_and_on_only_changes_the_sync_charge(seed: int) -> None:
    rng = np.random.default_rng(seed)
    state = make_mixed_cluster(8, seed=int(rng.integers(1000))).state()
    profile = profile_from_dict(random_profile(rng, 2, 12)).arrays()
    pure_dp = bool(rng.integers(2))
    plan = _random_plan(rng, list(state.ids), profile.num_layers, pure_dp)
    spec = evaluate_plan(plan, state, profile, TrainingConfig(batch=64))
    off = evaluate_plan(plan, state, profile, TrainingConfig(batch=64, sync_overlap=False))
    assert off == spec and spec.exposed_sync_time_s is None
    assert spec.iteration_time_s == max(spec.group_times_s) + spec.sync_time_s
    cap = float(rng.choice([1e6, 1e8, 1e12]))
    on = evaluate_plan(
        plan, state, profile,
        TrainingConfig(batch=64, sync_overlap=True, sync_bucket_cap_bytes=cap),
    )  # fmt: skip
    # only the sync charge changes
    assert on.group_times_s == spec.group_times_s and on.sync_time_s == spec.sync_time_s
    assert on.memory_bytes == spec.memory_bytes and on.fits == spec.fits
    assert on.exposed_sync_time_s >= 0.0
    assert on.iteration_time_s == pytest.approx(
        max(on.group_times_s) + on.exposed_sync_time_s, rel=1e-12
    )
    if spec.sync_time_s == 0.0:  # at most one active group
        assert on.exposed_sync_time_s == 0.0
    if pure_dp and cap == 1e12:
        # one bucket per device, ready when its group ends: the collective starts when the
        # slowest group ends and lasts the slowest owner's t_d -> docs/model.md §3 exactly
        assert on.iteration_time_s == pytest.approx(spec.iteration_time_s, rel=1e-9)


def test_planner_figures_and_choice_use_the_overlap_when_asked() -> None:
    from hetrain.planner import best_plan

    state = _cluster(nic_gbps=0.8)
    config = TrainingConfig(batch=8, sync_overlap=True, sync_bucket_cap_bytes=PER_LAYER)
    plan = best_plan(state, PROFILE, config)
    ev = evaluate_plan(plan, state, PROFILE, config)
    assert ev.exposed_sync_time_s is not None
    assert plan.iteration_time_s == ev.iteration_time_s
    spec = best_plan(state, PROFILE, TrainingConfig(batch=8))
    assert ev.iteration_time_s <= spec.iteration_time_s * (1 + 1e-12)
