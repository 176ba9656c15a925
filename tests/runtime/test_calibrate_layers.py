"""The runtime's start-up calibration measures every rank's layers on its own device and hands
them to the controller as the measured times of the device's kind (issue 21,
docs/runtime.md "Start-up calibration"): the controller's start-up profile carries them, its
decisions plan with them, and its speed estimates compare measured steps with them."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from hetrain.costmodel import TrainingConfig, evaluate_plan, profile_prefix, stage_compute_s
from hetrain.plan import plan_from_dict
from hetrain.profile import ProfileArrays
from hetrain.runtime.adapt import ControllerThread, PlanController, even_dp_plan
from hetrain.runtime.calibrate import RankLayerTimes, hardware_kind, with_layer_times
from hetrain.runtime.ctlwire import decode_init
from hetrain.runtime.testing import run_ranks
from hetrain.runtime.worker_main import local_cluster_state

SIZES = np.array([1.0, 4.0, 16.0])
BATCH = 64
#: seconds per sample of each of the 4 layers (forward + backward): w0 runs the first two layers
#: 4x faster than the last two, w1 the last two 60x faster than the first two (two kinds that
#: one fitted speed each cannot describe: the whole model takes w1 1.2x w0's time)
PER_SAMPLE_S = {
    "w0": np.array([1.0, 1.0, 4.0, 4.0]) * 1e-3,
    "w1": np.array([6.0, 6.0, 0.1, 0.1]) * 1e-3,
}


def _flop_profile() -> ProfileArrays:
    f = np.full(4, 1e7)
    return ProfileArrays(
        names=tuple(f"layer{i}" for i in range(4)),
        fwd_flops=f,
        bwd_flops=2 * f,
        activation_bytes=np.full(4, 64.0),
        activation_memory_bytes=np.full(4, 64.0),
        param_bytes=np.full(4, 4e3),
    )


def _startup(measured: bool):
    """The controller's start-up state and profile: the FLOP fit of each device (the whole
    model's time: w1 1.55x slower), with or without the per-layer times."""
    total = {d: float(v.sum()) for d, v in PER_SAMPLE_S.items()}
    flops = 3e7 * 4  # FLOP per sample of the whole model
    state = local_cluster_state(["w0", "w1"], [flops / total["w0"], flops / total["w1"]])
    profile = _flop_profile()
    if measured:
        times = [
            RankLayerTimes(SIZES, SIZES[:, None] * v / 3, SIZES[:, None] * v * 2 / 3)
            for v in PER_SAMPLE_S.values()
        ]
        state, profile = with_layer_times(state, profile, ["w0", "w1"], times, own_kinds=True)
    return state, profile


def _true_stage_s(device: str, start: int, end: int, samples: int) -> float:
    return float(PER_SAMPLE_S[device][start:end].sum()) * samples


def _decided_plan(measured: bool):
    """PlanController's first decision after 8 steps of even data parallelism measured as the
    devices really take (``PER_SAMPLE_S``)."""
    state, profile = _startup(measured)
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    plan = even_dp_plan(["w0", "w1"], 4, BATCH, 8)
    ctl = PlanController(state, profile, config, plan, 200)
    for step in range(8):
        compute = {g.devices[0]: _true_stage_s(g.devices[0], 0, 4, g.batch) for g in plan.groups}
        ctl.observe(step, int(plan.plan_id or 0), compute)
    decision = ctl.decide(8)
    return (decision.plan if decision is not None else plan), state, profile


def test_decision_plans_with_the_measured_layer_times():
    """With the per-layer times the controller puts each layer where it runs fast (a pipeline,
    w1 the last two layers) and predicts the plan's time; with the FLOP fit alone it keeps
    data parallelism with w1's shares cut by its average speed, which is slower when evaluated
    with what the devices really take."""
    flop_plan, _, _ = _decided_plan(measured=False)
    plan, state, profile = _decided_plan(measured=True)
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    truth = [evaluate_plan(p, state, profile, config).iteration_time_s for p in (flop_plan, plan)]
    assert all(len(g.devices) == 1 for g in flop_plan.groups if g.batch > 0), flop_plan
    piped = [g for g in plan.groups if g.batch > 0 and len(g.devices) == 2]
    assert piped, plan
    # w1 holds the layers it runs fast, w0 the others
    w1 = piped[0].stages[list(piped[0].devices).index("w1")]
    assert tuple(w1) == (2, 4), plan
    assert truth[1] < 0.9 * truth[0], truth


def test_speed_estimates_compare_steps_with_the_measured_layer_times():
    """A pipeline stage measured exactly as its layer times say keeps the device's estimate at
    its start-up speed (ratio 1): the controller's predicted stage time stays the measured one.
    (Compared with the FLOP fit instead, w1's two fast layers would look 15x faster than
    the fit and the measured times would be scaled down by that.)"""
    state, profile = _startup(measured=True)
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=2.0, sync_overlap=True)
    plan = plan_from_dict(
        {
            "groups": [
                {
                    "devices": ["w0", "w1"],
                    "stages": [[0, 2], [2, 4]],
                    "microbatch_size": 8,
                    "batch": BATCH,
                }
            ],
            "plan_id": 0,
        },  # fmt: skip
        "<test>",
    )
    ctl = PlanController(state, profile, config, plan, 200)
    for step in range(13):
        compute = {"w0": _true_stage_s("w0", 0, 2, BATCH), "w1": _true_stage_s("w1", 2, 4, BATCH)}
        ctl.observe(step, 0, compute)
    slowdowns = ctl.estimates.slowdowns()
    assert sorted(slowdowns) == ["w0", "w1"] and np.allclose(list(slowdowns.values()), 1.0)
    observed = ctl.observed_state()
    prefix = profile_prefix(profile)
    for i, (d, (a, b)) in enumerate(zip(["w0", "w1"], [(0, 2), (2, 4)], strict=True)):
        per_mb = stage_compute_s(observed, prefix, np.array([i]), np.array([a]), np.array([b]), 8)
        assert np.isclose(float(per_mb[0]) * BATCH / 8, _true_stage_s(d, a, b, BATCH)), d


def test_kinds_shared_by_devices_take_the_median_and_scale_each_device():
    """With a cluster file's kinds, devices of one kind share the per-layer median of their
    times; each device's nominal speed scales the kind's times to its own total."""
    from hetrain.cluster import cluster_from_dict

    spec = cluster_from_dict(
        {
            "links": {"intra_node_gbps": 20.0, "latency_us": 20.0},
            "devices": [
                {"id": f"gpu-{i}", "tflops": 1.0, "memory_gib": 16.0, "nic_gbps": 20.0}
                for i in range(3)
            ],
        },
        "<test>",
    )
    state = spec.state().with_changes(speed_flops=np.array([1e9, 2e9, 3e9]))
    base = SIZES[:, None] * np.array([1.0, 2.0, 3.0, 4.0]) * 1e-3
    times = [RankLayerTimes(SIZES, base * k / 3, base * k * 2 / 3) for k in (1.0, 2.0, 4.0)]
    ids = ["gpu-0", "gpu-1", "gpu-2"]
    out_state, profile = with_layer_times(state, _flop_profile(), ids, times, own_kinds=False)
    assert [m.kind for m in profile.measured] == ["gpu"]
    np.testing.assert_allclose(profile.measured[0].fwd_s, base * 2 / 3)  # the median: k = 2
    np.testing.assert_allclose(out_state.measured_time_scale(), [0.5, 1.0, 2.0])
    # local ranks without a hardware name: each device its own kind, running its own times
    own_state, own = with_layer_times(state, _flop_profile(), ids, times, own_kinds=True)
    assert [m.kind for m in own.measured] == ids and own_state.kinds == tuple(ids)
    np.testing.assert_allclose(own_state.measured_time_scale(), 1.0)


@settings(max_examples=40, deadline=None)
@given(
    factors=st.lists(st.sampled_from([1.0, 1.5, 3.0]), min_size=2, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_local_ranks_of_one_hardware_share_its_times_times_their_factor(factors, seed):
    """Local ranks of one hardware kind: whatever contention noise their tables carry (up to
    1.5x per layer and size), the kind's times are the median of the factor-free tables, and
    each rank runs them times its emulated factor: equal ranks plan with equal times (and
    equal fitted speeds), a rank emulated 3x slower with exactly 3x theirs. Two hardware kinds
    never share times."""
    rng = np.random.default_rng(seed)
    ids = [f"w{i}" for i in range(len(factors))]
    hw = ["cpu:A" if i % 3 else "gpu:B" for i in range(len(ids))]
    base = {"cpu:A": SIZES[:, None] * np.array([1.0, 2.0, 3.0, 4.0]) * 1e-3}
    base["gpu:B"] = base["cpu:A"][:, ::-1] * 0.1
    times = [
        RankLayerTimes(
            SIZES,
            base[h] / 3 * f * rng.uniform(1.0, 1.5, (3, 4)),
            base[h] * 2 / 3 * f * rng.uniform(1.0, 1.5, (3, 4)),
            h,
            f,
        )
        for h, f in zip(hw, factors, strict=True)
    ]
    state = local_cluster_state(ids, list(rng.uniform(1e9, 1e10, len(ids))))
    out, profile = with_layer_times(state, _flop_profile(), ids, times, own_kinds=True)
    assert out.kinds == tuple(hw)
    assert sorted(m.kind for m in profile.measured) == sorted(set(hw))
    np.testing.assert_allclose(out.measured_time_scale(), factors, rtol=1e-12)
    # one fitted speed per hardware kind too: the median of the factor-free fits, / factor
    for h in set(hw):
        mine = [i for i in range(len(ids)) if hw[i] == h]
        kind_speed = np.median([state.speed_flops[i] * factors[i] for i in mine])
        np.testing.assert_allclose(
            [out.speed_flops[i] * factors[i] for i in mine], kind_speed, rtol=1e-12
        )
    prefix = profile_prefix(profile)
    for h in set(hw):
        mine = [i for i in range(len(ids)) if hw[i] == h]
        kind = next(m for m in profile.measured if m.kind == h)
        expect = np.median(np.stack([times[i].fwd_s / factors[i] for i in mine]), axis=0)
        np.testing.assert_allclose(kind.fwd_s, expect, rtol=1e-12)
        per_rank = [
            float(stage_compute_s(out, prefix, np.array([i]), np.array([0]), np.array([4]), 16)[0])
            / factors[i]
            for i in mine
        ]
        np.testing.assert_allclose(per_rank, per_rank[0], rtol=1e-12)  # equal ranks start equal
        # the kind's times lie within the noise band of the factor-free truth
        assert np.all(kind.fwd_s >= base[h] / 3 * (1 - 1e-12))
        assert np.all(kind.fwd_s <= base[h] / 3 * 1.5 * (1 + 1e-12))


def _chain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(64, 256), nn.Tanh()),
        nn.Sequential(nn.Linear(256, 256), nn.Tanh()),
        nn.Sequential(nn.Linear(256, 256), nn.Tanh()),
        nn.Linear(256, 4),
    )


def _train_rank(rank, world, job):
    from hetrain.runtime.worker_main import run_worker

    run_worker(job, num_threads=1)
    return rank


def test_startup_feeds_each_ranks_layer_times_to_the_controller(tmp_path):
    """Two local ranks, w1 emulated 3x slower: the controller's start-up profile has measured
    times of every layer for the ranks' one hardware kind (this CPU) at sizes up to the global
    batch, w1 runs them 3x, and the planner's stage time is their sum."""
    from hetrain.runtime.api import build_job, task_from_objects
    from hetrain.runtime.config import RunConfig

    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=g)
    y = x[:, :4].argmax(dim=1)
    task = task_from_objects(_chain_model(), (x, y), F.cross_entropy)
    run_dir = tmp_path / "run"
    config = RunConfig(
        workers=2,
        steps=3,
        batch=BATCH,
        slowdown={"w1": 3.0},
        run_dir=run_dir,
        metrics_out=run_dir / "metrics.jsonl",
    )
    job = build_job(task, config)
    assert job.adaptive
    # the controller in this process beside the store it hosts (free port), as the launcher
    # runs it; it writes the round's start (profile, state) for replays
    controller = ControllerThread().start()
    try:
        job = dataclasses.replace(job, controller_endpoint=controller.endpoint)
        run_ranks(_train_rank, 2, tmp_path / "ranks", args=(job,), timeout_s=300.0)
        init_path = run_dir / "controller_init.json"
        deadline = time.monotonic() + 60.0
        while not init_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # the controller's thread handles what rank 0 sent
    finally:
        controller.close()
    init = decode_init(init_path.read_bytes())
    state, profile = init["base_state"], init["profile"]
    # both ranks run on this machine's CPU: one hardware kind, its times shared, and the
    # emulated slow-down is w1's scale (3x w0's times, exactly)
    hardware = hardware_kind(torch.device("cpu"))
    assert state.kinds == (hardware, hardware)
    assert [m.kind for m in profile.measured] == [hardware]
    m = profile.measured[0]
    assert m.microbatch_sizes.tolist() == [1.0, 4.0, 16.0, 64.0]  # up to the batch
    assert m.fwd_s.shape == m.bwd_s.shape == (4, 4)
    assert np.all(m.fwd_s > 0) and np.all(m.bwd_s > 0)
    np.testing.assert_allclose(state.measured_time_scale(), [1.0, 3.0], rtol=1e-12)
    np.testing.assert_allclose(state.speed_flops[0], 3.0 * state.speed_flops[1], rtol=1e-12)
    train = m.fwd_s + m.bwd_s
    total = {"w0": float(train[-1].sum()), "w1": 3.0 * float(train[-1].sum())}
    # the planner's stage time of the whole model at 64 samples is the measured sum, and it
    # grows with the work (64 samples take well over one sample's time; a comparison with the
    # start-up FLOP fit is not made: on a loaded machine that fit put κ at the whole time)
    prefix = profile_prefix(profile)
    for i, d in enumerate(("w0", "w1")):
        args = (np.array([i]), np.array([0]), np.array([4]), 64)
        assert np.isclose(float(stage_compute_s(state, prefix, *args)[0]), total[d])
    assert total["w0"] >= 1.5 * float(train[0].sum()), train


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
    own=st.booleans(),
)
def test_every_device_starts_with_its_own_whole_model_time(kinds, seed, own):
    """Whatever kinds the devices share: at start-up the planner's time of the whole model on
    a device at the largest measured size is the device's own measured total (its kind's
    median times scaled to it), and with ``own_kinds`` each device's times are its own."""
    from hetrain.cluster import cluster_from_dict

    rng = np.random.default_rng(seed)
    ids = [f"{k}-{i}" for i, k in enumerate(kinds)]
    spec = cluster_from_dict(
        {
            "links": {"intra_node_gbps": 20.0, "latency_us": 20.0},
            "devices": [
                {"id": d, "tflops": 1.0, "memory_gib": 16.0, "nic_gbps": 20.0} for d in ids
            ],
        },
        "<test>",
    )
    state = spec.state().with_changes(speed_flops=rng.uniform(1e9, 1e10, len(ids)))
    times = [
        RankLayerTimes(
            SIZES,
            np.cumsum(rng.uniform(1e-4, 1e-2, (3, 4)), axis=0),
            np.cumsum(rng.uniform(1e-4, 1e-2, (3, 4)), axis=0),
        )
        for _ in ids
    ]
    out, profile = with_layer_times(state, _flop_profile(), ids, times, own_kinds=own)
    assert len(profile.measured) == (len(ids) if own else len(set(kinds)))
    prefix = profile_prefix(profile)
    for i, t in enumerate(times):
        args = (np.array([i]), np.array([0]), np.array([4]), int(SIZES[-1]))
        planned = float(stage_compute_s(out, prefix, *args)[0])
        assert np.isclose(planned, t.fwd_s[-1].sum() + t.bwd_s[-1].sum(), rtol=1e-9)
        if own:
            # every size and layer, not only the total
            mine = next(m for m in profile.measured if m.kind == ids[i])
            np.testing.assert_allclose(mine.fwd_s, t.fwd_s)
