"""The planner's fast paths (issue 12, planning time) against the plain computations they
replace: they must give the same values and the same first-index tie-breaking, since the
plans depend on both."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import (
    TrainingConfig,
    evaluate_plan,
    flat_sync_bandwidths_bytes_per_s,
    group_fill_and_bottleneck_s,
    group_time_s,
    link_bandwidths_bytes_per_s,
    profile_prefix,
    stage_compute_s,
    stage_memory_bytes,
    stage_times_s,
)
from hetrain.errors import NoFeasiblePlanError
from hetrain.plan import plan_from_dict
from hetrain.planner.partition import (
    SplitTable,
    _stage_matrices,
    enumerate_splits,
    envelope_splits,
    envelope_splits_many,
    pareto,
)
from hetrain.planner.search import SearchContext
from hetrain.planner.shares import GroupOptions, ShareChain, ShareProblem, _min_max_step
from hetrain.profile import profile_from_dict


def _monotone(rng: np.random.Generator, size: int) -> np.ndarray:
    """Non-decreasing times from 0, with ties and an infeasible (inf) tail."""
    values = rng.choice([0.5, 1.0, 1.5, 2.0, 3.0], size) if rng.random() < 0.5 else rng.random(size)
    out = np.sort(values)
    out[0] = 0.0
    if rng.random() < 0.5:
        out[int(rng.integers(1, size)) :] = np.inf
    return out


@pytest.mark.parametrize("seed", range(5))
def test_min_max_step_equals_the_quadratic_scan(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(40):
        size = int(rng.integers(64, 200))  # (the binary-search path: B >= 63)
        f, g = _monotone(rng, size), _monotone(rng, size)
        b = np.arange(size)[:, None]
        x = np.arange(size)[None, :]
        vals = np.where(x <= b, np.maximum(f[np.clip(b - x, 0, None)], g[x]), np.inf)
        want_arg = np.argmin(vals, axis=1)
        got, got_arg = _min_max_step(f, g)
        np.testing.assert_array_equal(got_arg, want_arg)
        np.testing.assert_array_equal(got, vals[np.arange(size), want_arg])


@pytest.mark.parametrize("seed", range(5))
def test_pareto_sweep_keeps_the_same_splits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(100):
        count = int(rng.integers(2, 30))
        fill = rng.choice([1.0, 2.0, 3.0], count)
        bottleneck = rng.choice([0.5, 1.0, 1.5], count)
        nmax = np.full(count, 7, dtype=np.int64)
        bounds = rng.integers(0, 9, (count, 3))
        kept = pareto(SplitTable(bounds, fill, bottleneck, nmax, 2))
        # the definition: q is dropped iff some p != q is no worse in A and M and (better in
        # one of them, or equal and listed first)
        want = [
            q for q in range(count)
            if not any(
                p != q and fill[p] <= fill[q] and bottleneck[p] <= bottleneck[q]
                and (fill[p] < fill[q] or bottleneck[p] < bottleneck[q] or p < q)
                for p in range(count)
            )
        ]  # fmt: skip
        np.testing.assert_array_equal(kept.bounds, bounds[want])
        np.testing.assert_array_equal(kept.fill_s, fill[want])


def test_envelope_of_several_micro_batch_sizes_equals_one_at_a_time() -> None:
    """One call for many μ (stacked stage matrices, memory levels per μ, one DP pass) gives
    each μ's table exactly; memory-tight devices exercise the halved levels."""
    rng = np.random.default_rng(7)
    devices = [
        {"id": f"d{i}", "node": f"n{i % 2}", "tflops": float(rng.uniform(1, 50)),
         "memory_gib": float(rng.choice([0.5, 1.0, 2.0])), "nic_gbps": float(rng.choice([1, 100])),
         "microbatch_overhead_ms": 1.0, "layer_overhead_ms": float(rng.choice([0.0, 0.3]))}
        for i in range(4)
    ]  # fmt: skip
    layers = [
        {"fwd_flops": float(rng.uniform(1e9, 5e10)),
         "activation_bytes": float(rng.uniform(1e6, 3e7)),
         "param_bytes": float(rng.uniform(1e7, 6e7))}
        for _ in range(14)
    ]  # fmt: skip
    state = cluster_from_dict({"devices": devices}).state()
    prefix = profile_prefix(profile_from_dict({"layers": layers}).arrays())
    mus = [1, 2, 3, 5, 8, 13]
    for schedule in ("1f1b", "gpipe"):
        for k in (1, 2, 3, 4):
            devs = np.arange(k)
            designs = [-(-40 // mu) for mu in mus]
            tops = [min(n, k) if schedule == "1f1b" else n for n in designs]
            many = envelope_splits_many(state, prefix, devs, mus, 2.0, schedule, tops,
                                        n_caps=designs, cache={})  # fmt: skip
            assert any(len(t) for t in many)
            for mu, top, cap, got in zip(mus, tops, designs, many, strict=True):
                want = envelope_splits(state, prefix, devs, mu, 2.0, schedule, top, n_cap=cap)
                np.testing.assert_array_equal(got.bounds, want.bounds)
                np.testing.assert_array_equal(got.fill_s, want.fill_s)
                np.testing.assert_array_equal(got.bottleneck_s, want.bottleneck_s)
                np.testing.assert_array_equal(got.max_microbatches, want.max_microbatches)
                assert got.microbatch_size == want.microbatch_size == mu


@pytest.mark.parametrize("seed", range(5))
def test_lp_bound_newton_matches_bisection_and_stays_below(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(50):
        groups = []
        for _ in range(int(rng.integers(1, 6))):
            count = int(rng.integers(1, 10))
            mu = rng.integers(1, 30, count)
            bottleneck = rng.uniform(1e-3, 1.0, count)
            fill = bottleneck * rng.uniform(1.0, 6.0, count)
            groups.append(GroupOptions(mu, fill, bottleneck, rng.integers(1, 50, count),
                                       np.zeros((count, 2), np.int64)))  # fmt: skip
        problem = ShareProblem(groups, int(rng.integers(1, 3000)), rng.integers(1, 4, len(groups)))
        alpha = problem._bottleneck / problem._mu
        delta = problem._fill - problem._bottleneck
        bisected = problem._lp_bound_bisection(alpha, delta)
        newton = problem.lp_bound_s()
        assert newton == pytest.approx(bisected, rel=2e-12)
        # a lower bound: the relaxed capacity at it does not exceed B
        per = np.maximum((newton - delta) / alpha, 0.0)
        per_group = np.maximum.reduceat(per, problem._starts)
        assert float(np.dot(per_group, problem.counts)) <= problem.batch * (1 + 1e-9)


# --- stage times: the broadcast calls of the planner and the grouped pass of evaluate_plan --


@st.composite
def measured_instances(draw: st.DrawFn) -> tuple[dict, dict, np.ndarray]:
    """A random profile of 1-6 layers (FLOPs, ν_l) with measured times for some of 1-3 device
    kinds (1-3 sizes, ±noise, times that may fall with μ), a cluster of 1-5 devices of those
    kinds (κ, λ, one or two nodes) and a speed factor per device (a state whose speeds moved
    away from the file's, so measured times scale)."""
    num_layers = draw(st.integers(1, 6))
    kinds = [f"k{q}" for q in range(draw(st.integers(1, 3)))]
    floats = st.floats(0.0, 1.0, allow_nan=False)
    layers = [
        {"name": f"l{i}", "fwd_flops": draw(st.floats(0.0, 5e9)), "activation_bytes": 1e6,
         "param_bytes": 1e6, "overhead_weight": draw(st.sampled_from([0.5, 1.0, 2.0]))}
        for i in range(num_layers)
    ]  # fmt: skip
    measured = {}
    for kind in kinds:
        if not draw(st.booleans()):
            continue  # this kind keeps the FLOP model
        sizes = sorted(draw(st.sets(st.integers(1, 16), min_size=1, max_size=3)))
        rows = [[draw(floats) * 1e-2 for _ in range(num_layers)] for _ in sizes]
        back = [[draw(floats) * 1e-2 for _ in range(num_layers)] for _ in sizes]
        measured[kind] = {"microbatch_sizes": sizes, "fwd_s": rows, "bwd_s": back}
    num_dev = draw(st.integers(1, 5))
    devices = [
        {"id": f"dev{d}", "kind": draw(st.sampled_from(kinds)), "node": f"n{d % 2}",
         "tflops": draw(st.sampled_from([0.5, 1.0, 4.0])), "memory_gib": 16, "nic_gbps": 10,
         "microbatch_overhead_ms": draw(st.sampled_from([0.0, 2.0])),
         "layer_overhead_ms": draw(st.sampled_from([0.0, 0.5]))}
        for d in range(num_dev)
    ]  # fmt: skip
    factors = np.array([draw(st.sampled_from([0.5, 1.0, 1.7])) for _ in range(num_dev)])
    profile = {"name": "p", "layers": layers, "measured_times": measured}
    cluster = {"links": {"intra_node_gbps": 100, "latency_us": 5}, "devices": devices}
    return profile, cluster, factors


def _stage_definition_s(state, arrays, d: int, start: int, end: int, mu: float, part: str):
    """docs/model.md §3's stage time, element by element: the kind's interpolated measured
    times summed over the stage and scaled by nominal / speed, else the FLOP model."""
    kinds = {m.kind.casefold(): m for m in arrays.measured}
    table = kinds.get(state.kinds[d].casefold())
    if table is not None:
        scale = float(state.measured_time_scale()[d])
        return scale * float(np.sum(table.layer_times_s(mu, part)[start:end]))
    if part == "bwd":
        return mu * float(np.sum(arrays.bwd_flops[start:end])) / state.speed_flops[d]
    flops = float(np.sum(arrays.train_flops[start:end]))
    units = float(np.sum(arrays.overhead_weights[start:end]))
    return (mu * flops / state.speed_flops[d] + state.kappa_s[d]
            + state.layer_overhead_s[d] * units)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(measured_instances(), st.lists(st.integers(1, 24), min_size=1, max_size=4),
       st.sampled_from(["train", "bwd"]))  # fmt: skip
def test_stage_compute_s_broadcasts_equal_the_definition(instance, mus, part) -> None:
    """Every shape the planner calls :func:`stage_compute_s` with (the partitioner's
    ``(U, K, L + 1, L + 1)`` matrices with float μ, per-split μ, one μ) gives, element by
    element, the stage time of docs/model.md §3 (measured or FLOP model)."""
    profile, cluster, factors = instance
    arrays = profile_from_dict(profile).arrays()
    base = cluster_from_dict(cluster).state()
    state = base.with_changes(speed_flops=base.speed_flops * factors)
    prefix = profile_prefix(arrays)
    num_layers, devs = arrays.num_layers, np.arange(state.num_devices)
    total = max(
        _stage_definition_s(state, arrays, int(d), 0, num_layers, float(mu), part)
        for d in devs for mu in mus
    )  # fmt: skip
    tol = 1e-12 * max(total, 1e-300)  # prefix differences round like the whole chain
    idx = np.arange(num_layers + 1)
    mu4 = np.asarray(mus, dtype=float)[:, None, None, None]
    got = stage_compute_s(state, prefix, devs[:, None, None], idx[:, None], idx[None, :], mu4,
                          part)  # fmt: skip
    got = np.broadcast_to(got, (len(mus), len(devs), num_layers + 1, num_layers + 1))
    for u, mu in enumerate(mus):
        for d in devs:
            for i in range(num_layers):
                for j in range(i + 1, num_layers + 1):
                    want = _stage_definition_s(state, arrays, int(d), i, j, float(mu), part)
                    assert got[u, d, i, j] == pytest.approx(want, rel=1e-12, abs=tol)
    # per-split μ (split_rows) and one μ (stage_times_s): the same values as the matrices
    starts = np.zeros(len(mus), dtype=np.int64)
    ends = np.full(len(mus), num_layers)
    rows = stage_compute_s(state, prefix, devs[-1], starts[:, None], ends[:, None],
                           np.asarray(mus, dtype=np.int64)[:, None], part)  # fmt: skip
    np.testing.assert_array_equal(rows[:, 0], got[:, -1, 0, num_layers])
    one = stage_compute_s(state, prefix, devs, np.zeros_like(devs), np.full_like(devs, num_layers),
                          mus[0], part)  # fmt: skip
    np.testing.assert_array_equal(one, got[0, :, 0, num_layers])


@settings(max_examples=40, deadline=None)
@given(measured_instances(), st.randoms(use_true_random=False), st.sampled_from(["1f1b", "gpipe"]))
def test_evaluate_plan_groups_equal_the_one_group_functions(instance, rng, schedule) -> None:
    """:func:`evaluate_plan` times groups of one depth together; every figure equals the
    one-group functions (:func:`stage_times_s`, :func:`group_fill_and_bottleneck_s`,
    :func:`group_time_s`, :func:`stage_memory_bytes`) bit for bit, idle groups included."""
    profile, cluster, factors = instance
    arrays = profile_from_dict(profile).arrays()
    base = cluster_from_dict(cluster).state()
    state = base.with_changes(speed_flops=base.speed_flops * factors)
    prefix = profile_prefix(arrays)
    num_layers = arrays.num_layers
    ids = list(state.ids)
    rng.shuffle(ids)
    groups, at = [], 0
    while at < len(ids):
        k = rng.randint(1, min(num_layers, len(ids) - at))
        cuts = sorted(rng.sample(range(1, num_layers), k - 1))
        bounds = [0, *cuts, num_layers]
        groups.append({"devices": ids[at : at + k], "microbatch_size": rng.randint(1, 9),
                       "stages": [[bounds[s], bounds[s + 1]] for s in range(k)],
                       "batch": rng.choice([0, rng.randint(1, 30)])})  # fmt: skip
        at += k
    plan = plan_from_dict({"schedule": schedule, "groups": groups})
    config = TrainingConfig(batch=max(1, sum(g["batch"] for g in groups)))
    ev = evaluate_plan(plan, state, arrays, config)
    index = state.index()
    for g, group in enumerate(plan.groups):
        devs = np.array([index[d] for d in group.devices])
        bounds = np.array([s for s, _ in group.stages] + [num_layers])
        compute, transfer = stage_times_s(state, prefix, devs, bounds, group.microbatch_size)
        assert ev.stage_compute_s[g] == tuple(compute.tolist())
        assert ev.stage_transfer_s[g] == tuple(transfer.tolist())
        n = group.num_microbatches
        assert ev.group_times_s[g] == group_time_s(
            *group_fill_and_bottleneck_s(compute, transfer), n
        )
        memory = stage_memory_bytes(prefix, bounds, group.microbatch_size, n, 2.0, schedule)
        assert [ev.memory_bytes[d] for d in group.devices] == memory.tolist()


def test_share_solution_times_equal_time_for_of_every_member() -> None:
    """:meth:`ShareProblem._finish` looks each (entry, share) pair up once: every member's
    time and option equal :meth:`GroupOptions.time_for` of its own share."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        opts = []
        for _ in range(int(rng.integers(1, 4))):
            size = int(rng.integers(1, 6))
            opts.append(GroupOptions(
                rng.integers(1, 9, size), rng.random(size), rng.random(size) * 0.1,
                rng.choice([1, 3, 100], size), np.zeros((size, 2), dtype=np.int64),
            ))  # fmt: skip
        counts = rng.integers(1, 5, len(opts))
        problem = ShareProblem(opts, 40, counts)
        shares = rng.integers(0, 41, int(counts.sum()))
        sol = problem._finish(shares)
        entry = np.repeat(np.arange(len(opts)), counts)
        want = [opts[e].time_for(int(b)) for e, b in zip(entry, shares, strict=True)]
        if not all(np.isfinite(t) for t, _ in want):
            assert sol is None
            continue
        assert sol.group_times_s.tolist() == [t for t, _ in want]
        assert sol.option.tolist() == [p for _, p in want]


@settings(max_examples=60, deadline=None)
@given(measured_instances(), st.randoms(use_true_random=False), st.integers(1, 32))
def test_rate_bound_equals_the_bottleneck_over_every_split(instance, rng, batch) -> None:
    """:meth:`SearchContext.rate_bound` (a min-max DP that reads one row for the first stage
    and one column for the last) is ``1 / min over splits of max_k`` of the per-sample stage
    time (FLOP model ``F / s``, or the kind's per-sample rate bound times its scale; inf where
    the stage's parameters do not fit) and boundary time ``2 a / bw``, over every split."""
    profile, cluster, factors = instance
    for dev, mem in zip(cluster["devices"], factors, strict=True):
        dev["memory_gib"] = 2e6 * 4 * mem / 2**30 * rng.choice([0.5, 1.0, 10.0])
    arrays = profile_from_dict(profile).arrays()
    base = cluster_from_dict(cluster).state()
    state = base.with_changes(speed_flops=base.speed_flops * factors)
    ctx = SearchContext(state, arrays, TrainingConfig(batch=batch))
    pre = ctx.prefix
    num_layers = arrays.num_layers
    order = list(range(state.num_devices))
    rng.shuffle(order)
    devs = order[: rng.randint(1, min(num_layers, len(order)))]
    bw = link_bandwidths_bytes_per_s(state, np.array(devs))
    theta = pre.fixed_memory_bytes(np.arange(num_layers + 1)[:, None],
                                   np.arange(num_layers + 1)[None, :], 2.0)  # fmt: skip
    best = np.inf
    for bounds in enumerate_splits(num_layers, len(devs)):
        worst = 0.0
        for k, d in enumerate(devs):
            i, j = int(bounds[k]), int(bounds[k + 1])
            if theta[i, j] > state.memory_bytes[d]:
                worst = np.inf
            elif ctx.kind_index[d] >= 0:
                rate = pre.measured_rate_prefix_s(batch)[ctx.kind_index[d]]
                worst = max(worst, (rate[j] - rate[i]) * float(ctx.time_scale[d]))
            else:
                worst = max(worst, (pre.train_flops[j] - pre.train_flops[i]) / state.speed_flops[d])
            if k < len(devs) - 1:
                worst = max(worst, pre.boundary_bytes[j - 1] / bw[k])
        best = min(best, worst)
    want = 0.0 if not np.isfinite(best) else 1.0 / max(best, 1e-300)
    assert ctx.rate_bound(tuple(devs)) == want


# --- issue 21 (planning time with measured times): the fast paths below against the plain
# computations they replace


@pytest.mark.parametrize("seed", range(4))
def test_masked_skips_the_memory_check_only_where_everything_fits(seed: int) -> None:
    """:meth:`_StageMatrices.masked` returns the stage matrices unmasked when each stage's
    largest layer range fits (memory grows with the range): the same arrays as the check over
    every ``(i, j)`` (``monotone=False``), for ample, tight and too small memory, both
    schedules and every level; the fast path must be taken in some of them."""
    rng = np.random.default_rng(seed)
    fast = 0
    for _ in range(12):
        layers = [
            {"fwd_flops": float(rng.uniform(1e9, 5e10)),
             "activation_bytes": float(rng.uniform(1e5, 3e7)),
             "param_bytes": float(rng.uniform(1e6, 6e7)),
             "frozen_param_bytes": float(rng.choice([0.0, 1e7]))}
            for _ in range(int(rng.integers(3, 12)))
        ]  # fmt: skip
        profile: dict = {"layers": layers}
        if rng.random() < 0.5:
            profile["shared"] = [{"name": "tied", "bytes": 3e7, "layers": [0, len(layers) - 1],
                                  "frozen": bool(rng.random() < 0.5)}]  # fmt: skip
        devices = [
            {"id": f"d{i}", "node": "n0", "tflops": float(rng.uniform(1, 50)),
             "memory_gib": float(rng.choice([0.3, 1.0, 4.0, 64.0])), "nic_gbps": 100}
            for i in range(4)
        ]  # fmt: skip
        state = cluster_from_dict({"devices": devices}).state()
        prefix = profile_prefix(profile_from_dict(profile).arrays())
        k = int(rng.integers(1, min(4, len(layers)) + 1))
        mus = sorted({int(x) for x in rng.integers(1, 40, 4)})
        schedule = str(rng.choice(["1f1b", "gpipe"]))
        mats = _stage_matrices(state, prefix, np.arange(k), mus, 2.0, schedule)
        assert mats.monotone
        plain = dataclasses.replace(mats, monotone=False)
        for levels in ([1] * len(mus), [k] * len(mus), list(rng.integers(1, 9, len(mus)))):
            rows = np.arange(len(mus))
            for rows_asked in (rows, rows[::2]):
                lv = np.asarray(levels)[rows_asked]
                got = mats.masked(lv, rows_asked)
                want = plain.masked(lv, rows_asked)
                fast += got[0] is mats.total
                np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_array_equal(got[1], want[1])
    assert fast > 0


def _random_options(rng: np.random.Generator, groups: int) -> list[GroupOptions]:
    out = []
    for _ in range(groups):
        count = int(rng.integers(0, 6)) if rng.random() < 0.1 else int(rng.integers(1, 6))
        bottleneck = rng.choice([0.25, 0.5, 1.0], count) if rng.random() < 0.3 \
            else rng.uniform(1e-3, 1.0, count)  # fmt: skip
        out.append(GroupOptions(
            rng.integers(1, 30, count), bottleneck * rng.uniform(1.0, 6.0, count), bottleneck,
            rng.choice([1, 3, 50, 10**9], count), np.zeros((count, 2), np.int64),
        ))  # fmt: skip
    return out


@pytest.mark.parametrize("seed", range(4))
def test_share_chain_gives_each_prefix_its_own_solution(seed: int) -> None:
    """Share problems over prefixes of one ranked list (the search's active prefixes, largest
    first, then a different list) built through one :class:`ShareChain` (DP states, option
    arrays sliced from the longest list) equal each problem built alone: LP bound, DP and
    bisection solutions."""
    rng = np.random.default_rng(seed)
    chain = ShareChain()
    for _ in range(15):
        batch = int(rng.integers(1, 90))
        opts = _random_options(rng, int(rng.integers(1, 5)))
        counts = list(rng.integers(1, 3, len(opts)))
        sizes = range(sum(counts), 0, -1)
        for size in rng.permutation(list(sizes)) if rng.random() < 0.3 else sizes:
            take, left = [], int(size)
            for o, c in zip(opts, counts, strict=True):
                if left <= 0:
                    break
                take.append((o, min(c, left)))
                left -= min(c, left)
            plain = ShareProblem([o for o, _ in take], batch, [m for _, m in take])
            chained = ShareProblem([o for o, _ in take], batch, [m for _, m in take], chain)
            assert chained.lp_bound_s() == plain.lp_bound_s()
            for method in ("_solve_dp", "_solve_bisection"):
                alone, shared = getattr(plain, method)(), getattr(chained, method)()
                if alone is None:
                    assert shared is None
                    continue
                assert shared.max_group_time_s == alone.max_group_time_s
                assert shared.shares.tolist() == alone.shares.tolist()
                assert shared.option.tolist() == alone.option.tolist()
                assert shared.group_times_s.tolist() == alone.group_times_s.tolist()


def _sync_bandwidths_per_group(state, prefix, devices, starts, ends, num_active):
    """docs/model.md §3's ``β_d`` by its words: intra-node iff every owner, in every active
    group, of every layer of ``d`` is on ``d``'s node."""
    group = np.cumsum(starts == 0) - 1
    owner = np.full((num_active, prefix.num_layers), -1)
    for g, d, s, e in zip(group, devices, starts, ends, strict=True):
        owner[g, s:e] = state.node[d]
    out = []
    for d, s, e in zip(devices, starts, ends, strict=True):
        local = bool(np.all(owner[:, s:e] == state.node[d]))
        out.append(state.intra_node_bytes_per_s if local else state.nic_bytes_per_s[d])
    return np.array(out)


@pytest.mark.parametrize("seed", range(4))
def test_flat_sync_bandwidths_equal_the_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(30):
        num_dev = int(rng.integers(2, 12))
        devices = [{"id": f"d{i}", "node": f"n{rng.integers(0, 3)}", "tflops": 1.0,
                    "memory_gib": 16, "nic_gbps": float(rng.choice([1, 10, 25]))}
                   for i in range(num_dev)]  # fmt: skip
        state = cluster_from_dict({"devices": devices}).state()
        num_layers = int(rng.integers(1, 8))
        prefix = profile_prefix(profile_from_dict(
            {"layers": [{"fwd_flops": 1e9, "activation_bytes": 1e6, "param_bytes": 1e6}]
             * num_layers}).arrays())  # fmt: skip
        order = rng.permutation(num_dev)
        devs, starts, ends, used, groups = [], [], [], 0, 0
        while used < num_dev:
            k = int(rng.integers(1, min(num_layers, num_dev - used) + 1))
            cuts = np.sort(rng.choice(np.arange(1, num_layers), k - 1, replace=False))
            bounds = np.concatenate(([0], cuts, [num_layers])).astype(np.int64)
            devs.extend(order[used : used + k])
            starts.extend(bounds[:-1])
            ends.extend(bounds[1:])
            used += k
            groups += 1
        if groups < 2:
            continue
        args = (np.array(devs), np.array(starts), np.array(ends))
        got = flat_sync_bandwidths_bytes_per_s(state, prefix, *args, groups)
        want = _sync_bandwidths_per_group(state, prefix, *args, groups)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(4))
def test_time_table_equals_time_for_of_every_share(seed: int) -> None:
    """:meth:`GroupOptions.time_table` (a float ceil over a ``(B + 1, P)`` array) gives, for
    every share ``b``, :meth:`GroupOptions.time_for`'s time and first best option."""
    rng = np.random.default_rng(seed)
    for _ in range(30):
        (opts,) = _random_options(rng, 1)
        batch = int(rng.integers(0, 300))
        times, best = opts.time_table(batch)
        for b in range(batch + 1):
            t, p = opts.time_for(b)
            assert times[b] == t
            if np.isfinite(t) and b > 0:
                assert best[b] == p


def test_measured_stage_times_of_no_splits() -> None:
    """A split table without rows (a μ per row, none): stage times of shape ``(0, K)`` also
    for devices with measured times (the whole-size table path with nothing to look up)."""
    layers = [{"fwd_flops": 1e9, "activation_bytes": 1e6, "param_bytes": 1e6}] * 3
    measured = {"ka": {"microbatch_sizes": [1, 4], "fwd_s": [[1e-3] * 3, [3e-3] * 3],
                       "bwd_s": [[2e-3] * 3, [6e-3] * 3]}}  # fmt: skip
    arrays = profile_from_dict({"layers": layers, "measured_times": measured}).arrays()
    devices = [{"id": f"ka-{i}", "tflops": 1.0, "memory_gib": 16, "nic_gbps": 10}
               for i in range(2)]  # fmt: skip
    state = cluster_from_dict({"devices": devices}).state()
    prefix = profile_prefix(arrays)
    bounds = np.zeros((0, 3), dtype=np.int64)
    mus = np.zeros((0, 1), dtype=np.int64)
    out = stage_compute_s(state, prefix, np.arange(2), bounds[:, :-1], bounds[:, 1:], mus)
    assert out.shape == (0, 2)
    one = stage_compute_s(state, prefix, np.arange(2), np.array([[0, 1]]), np.array([[1, 3]]),
                          np.array([[3]]))  # fmt: skip
    # μ = 3 between the measured 1 and 4: 1e-3 + 2/3 · 2e-3 forward, 2e-3 + 2/3 · 4e-3
    # backward, 7e-3 s per layer
    np.testing.assert_allclose(one, [[7e-3, 14e-3]], rtol=1e-12)


# --- issue 21: shared prefix and speeds, the share solution's direct path -------------------


@settings(max_examples=40, deadline=None)
@given(measured_instances())
def test_profile_prefix_is_built_once_per_profile_and_equals_a_fresh_build(instance) -> None:
    """:func:`profile_prefix` keeps one prefix per profile object (what the planner, its
    baselines and every evaluate_plan share), with the values of a fresh build; a changed copy
    of the profile (``dataclasses.replace``, as the norm-block planner makes) gets its own."""
    from hetrain.costmodel import _build_prefix

    profile, _, _ = instance
    arrays = profile_from_dict(profile).arrays()
    prefix = profile_prefix(arrays)
    assert profile_prefix(arrays) is prefix
    fresh = _build_prefix(arrays)
    for name in ("train_flops", "bwd_flops", "act_mem_bytes", "param_bytes", "boundary_bytes",
                 "frozen_bytes", "layer_units", "shared_bytes", "shared_uses"):  # fmt: skip
        assert getattr(prefix, name).tolist() == getattr(fresh, name).tolist()
    assert prefix.measured == fresh.measured
    doubled = dataclasses.replace(arrays, fwd_flops=2.0 * arrays.fwd_flops)
    other = profile_prefix(doubled)
    assert other is not prefix
    assert other.train_flops.tolist() == _build_prefix(doubled).train_flops.tolist()
    assert profile_prefix(arrays) is prefix


@settings(max_examples=40, deadline=None)
@given(measured_instances(), st.integers(1, 32))
def test_bound_and_effective_speeds_are_kept_per_state_object(instance, batch) -> None:
    """The speeds the search prunes and orders with are kept for the last state object and
    batch (read-only) and equal a fresh computation; a state with changed speeds (a new
    object) and another batch get their own values."""
    from hetrain.costmodel import (
        _bound_speed_flops,
        _effective_speed_flops,
        bound_speed_flops,
        effective_speed_flops,
    )

    profile, cluster, factors = instance
    arrays = profile_from_dict(profile).arrays()
    base = cluster_from_dict(cluster).state()
    prefix = profile_prefix(arrays)
    for state in (base, base.with_changes(speed_flops=base.speed_flops * factors)):
        for b in (batch, batch + 7):
            for cached, plain in ((bound_speed_flops, _bound_speed_flops),
                                  (effective_speed_flops, _effective_speed_flops)):  # fmt: skip
                got = cached(state, prefix, b)
                assert not got.flags.writeable
                assert got.tolist() == plain(state, prefix, b).tolist()
                assert cached(state, prefix, b) is got


@pytest.mark.parametrize("seed", range(3))
def test_share_solution_direct_and_distinct_pair_paths_agree(seed: int) -> None:
    """:meth:`ShareProblem._finish` times each member directly up to
    ``FINISH_DIRECT_MAX`` members and each distinct (entry, share) pair beyond: both give every
    member :meth:`GroupOptions.time_for` of its own share (also with 100+ members)."""
    import hetrain.planner.shares as shares_module

    rng = np.random.default_rng(100 + seed)
    for _ in range(20):
        opts = _random_options(rng, int(rng.integers(1, 4)))
        counts = rng.integers(1, 60, len(opts))
        batch = int(rng.integers(1, 200))
        shares = rng.integers(0, batch + 1, int(counts.sum()))
        entry = np.repeat(np.arange(len(opts)), counts)
        want = [opts[e].time_for(int(b)) for e, b in zip(entry, shares, strict=True)]
        got = []
        for limit in (0, 10**9):  # distinct pairs only / every member directly
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(shares_module, "FINISH_DIRECT_MAX", limit)
                got.append(ShareProblem(opts, batch, counts)._finish(shares))
        if not all(np.isfinite(t) for t, _ in want):
            assert got == [None, None]
            continue
        for sol in got:
            assert sol.group_times_s.tolist() == [t for t, _ in want]
            assert sol.option.tolist() == [p for _, p in want]
            assert sol.max_group_time_s == max(t for t, _ in want)


@settings(max_examples=25, deadline=None)
@given(st.integers(7, 9), st.integers(0, 10**6), st.booleans())
def test_plans_equal_without_the_shared_prefix_speeds_and_direct_shares(
    num_devices: int, seed: int, measured: bool
) -> None:
    """best_plan (solve-count budget, so the same work every run) gives the same plan, to the
    last bit of every figure, when every call builds its own prefix and speeds, ``weight``
    sums the (zero) device weights and the share solutions find distinct pairs: the pruned
    search and polish of 7-9 devices, with and without measured times."""
    from test_exhaustive import wide_instance, with_measured_times

    import hetrain.costmodel as costmodel
    import hetrain.planner.baselines as baselines_module
    import hetrain.planner.search as search_module
    import hetrain.planner.shares as shares_module
    from hetrain.planner import best_plan

    case = wide_instance(num_devices, seed)
    if measured:
        case = with_measured_times(case, seed)
    state = cluster_from_dict(case["cluster"]).state()
    config = TrainingConfig(batch=case["batch"], schedule=case["schedule"])

    def plan_json(fast: bool) -> str:
        arrays = profile_from_dict(case["profile"]).arrays()  # (a new profile object)
        with pytest.MonkeyPatch.context() as mp:
            if not fast:
                for module in (costmodel, search_module, baselines_module):
                    mp.setattr(module, "profile_prefix", costmodel._build_prefix)
                for module in (costmodel, search_module, baselines_module):
                    if hasattr(module, "bound_speed_flops"):
                        mp.setattr(module, "bound_speed_flops", costmodel._bound_speed_flops)
                    if hasattr(module, "effective_speed_flops"):
                        mp.setattr(module, "effective_speed_flops",
                                   costmodel._effective_speed_flops)  # fmt: skip
                mp.setattr(search_module.SearchContext, "weight",
                           lambda self, devices: self.v + float(
                               np.sum(self.weight_per_device[devices])))  # fmt: skip
                mp.setattr(shares_module, "FINISH_DIRECT_MAX", 0)
            try:
                plan = best_plan(state, arrays, config, queues=case["queues"] or None,
                                 reproducible=True)  # fmt: skip
            except NoFeasiblePlanError:  # (the same verdict both ways)
                return "infeasible"
        return plan.model_dump_json()

    assert plan_json(True) == plan_json(False)


# --- issue 21: planning time with measured times -------------------------------------------


@settings(max_examples=40, deadline=None)
@given(measured_instances(), st.integers(0, 10**6))
def test_stage_times_of_whole_sizes_and_kept_device_kinds_equal_the_plain_computation(
    instance, seed
) -> None:
    """``stage_compute_s`` with integer micro-batch sizes (the partitioner's and search's
    calls: the size indexes the table, ``ProfilePrefix.device_kinds`` kept per device array
    for the last state) gives the bits of the float sizes through a fresh prefix, for two
    states asked in turn (speeds moved: the time scale changes)."""
    from hetrain.costmodel import _build_prefix

    profile, cluster, factors = instance
    arrays = profile_from_dict(profile).arrays()
    base = cluster_from_dict(cluster).state()
    moved = base.with_changes(speed_flops=base.speed_flops * factors)
    prefix = profile_prefix(arrays)
    rng = np.random.default_rng(seed)
    num_layers, num_dev = arrays.num_layers, base.num_devices
    for state in (base, moved, base, moved):
        devices = rng.integers(0, num_dev, size=(1, int(rng.integers(1, 4))))
        starts = rng.integers(0, num_layers, size=(5, devices.shape[1]))
        ends = np.minimum(starts + rng.integers(1, num_layers + 1, size=starts.shape), num_layers)
        mus = rng.integers(1, 20, size=(5, 1))
        for part in ("train", "bwd"):
            got = stage_compute_s(state, prefix, devices, starts, ends, mus, part)
            want = stage_compute_s(state, _build_prefix(arrays), devices, starts, ends,
                                   mus.astype(float), part)  # fmt: skip
            assert got.tolist() == want.tolist()
        kind, scale, share = prefix.device_kinds(state, devices)
        assert kind.tolist() == prefix.kind_index(state)[devices].tolist()
        assert scale.tolist() == state.measured_time_scale()[devices].tolist()
        mine = kind >= 0
        assert share == (1.0 if mine.all() else 0.0 if not mine.any() else 0.5)


@pytest.mark.parametrize("seeds", [range(0, 4), range(4, 8)])
def test_plans_equal_without_pruning_the_refinement_by_the_incumbent(seeds) -> None:
    """``best_plan`` (solve-count budget) gives the same plan JSON, to the last bit, when
    ``solve_structure``'s refinement pass prunes against 1.5 × the incumbent instead of the
    incumbent (``REFINE_BOUND_IS_INCUMBENT``), on random instances with measured times (5-16
    devices of 2-4 kinds, 8-30 layers, B 16-128), and solves fewer share problems."""
    from random_inputs import measured_times_case

    import hetrain.planner.search as search_module
    import hetrain.planner.shares as shares_module
    from hetrain.planner import best_plan

    counts = {True: 0, False: 0}
    for seed in seeds:
        case = measured_times_case(seed)
        state = cluster_from_dict(case["cluster"]).state()
        config = TrainingConfig(batch=case["batch"])
        plans = {}
        for pruned in (True, False):
            arrays = profile_from_dict(case["profile"]).arrays()  # (a new profile object)
            solve = shares_module.ShareProblem.solve

            def counted(problem, pruned=pruned, solve=solve):
                counts[pruned] += 1
                return solve(problem)

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(search_module, "REFINE_BOUND_IS_INCUMBENT", pruned)
                mp.setattr(shares_module.ShareProblem, "solve", counted)
                plans[pruned] = best_plan(state, arrays, config, reproducible=True)
        assert plans[True].model_dump_json() == plans[False].model_dump_json()
    assert counts[True] < counts[False]


@pytest.mark.parametrize("seed", range(3))
def test_padded_time_arrays_row_by_row_equal_the_scatter(seed: int) -> None:
    """The share solution's padded ``(G, P_max)`` option arrays filled row by row (up to
    ``PADDED_BY_ROWS_MAX`` groups) equal those of one scatter of all options: values, dtypes
    and shapes, with groups without options among them."""
    import hetrain.planner.shares as shares_module
    from hetrain.planner.shares import _padded_time_arrays

    rng = np.random.default_rng(200 + seed)
    for _ in range(40):
        opts = _random_options(rng, int(rng.integers(1, 17)))
        if rng.random() < 0.3:
            opts.insert(int(rng.integers(0, len(opts) + 1)), GroupOptions.from_tables([], 2))
        rows = _padded_time_arrays(opts)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(shares_module, "PADDED_BY_ROWS_MAX", 0)
            scatter = _padded_time_arrays(opts)
        for a, b in zip(rows, scatter, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tolist() == b.tolist()


@pytest.mark.parametrize("seed", range(3))
def test_approx_signature_is_kept_per_device_sequence(seed: int) -> None:
    """``SearchContext.approx_signature`` is computed once per device sequence (the same
    object when asked again) with the value a fresh context computes, for orders of the
    devices of a seeded measured-times instance."""
    from random_inputs import measured_times_case

    case = measured_times_case(seed)
    state = cluster_from_dict(case["cluster"]).state()
    arrays = profile_from_dict(case["profile"]).arrays()
    config = TrainingConfig(batch=case["batch"])
    ctx = SearchContext(state, arrays, config)
    rng = np.random.default_rng(seed)
    for _ in range(10):
        devices = rng.permutation(state.num_devices)[: int(rng.integers(1, 5))]
        first = ctx.approx_signature(devices)
        assert ctx.approx_signature(devices.copy()) is first
        assert SearchContext(state, arrays, config).approx_signature(devices) == first


@pytest.mark.parametrize("seeds", [range(0, 4), range(4, 8)])
def test_plans_equal_with_each_prefix_s_devices_concatenated(seeds) -> None:
    """``best_plan`` (solve-count budget) gives the same plan JSON, to the last bit, when
    ``_solve_entries`` concatenates each active prefix's members' device arrays instead of
    slicing those of all members (``PREFIX_DEVICES_SLICED``), and builds the same share
    problems (the prefixes' lower bounds prune the same ones): random instances with measured
    times (5-16 devices of 2-4 kinds, 8-30 layers, B 16-128) and the same instances without
    measured times."""
    from random_inputs import measured_times_case

    import hetrain.planner.search as search_module
    import hetrain.planner.shares as shares_module
    from hetrain.planner import best_plan

    for seed in seeds:
        for measured in (True, False):
            case = measured_times_case(seed)
            if not measured:
                case["profile"].pop("measured_times")
            state = cluster_from_dict(case["cluster"]).state()
            config = TrainingConfig(batch=case["batch"])
            plans, problems = [], []
            for sliced in (True, False):
                arrays = profile_from_dict(case["profile"]).arrays()  # (a new profile object)
                built: list[tuple[int, ...]] = []
                init = shares_module.ShareProblem.__init__

                def counted(problem, groups, batch, counts=None, chain=None, built=built,
                            init=init):  # fmt: skip
                    built.append(tuple(int(c) for c in (counts if counts is not None else [])))
                    init(problem, groups, batch, counts, chain)

                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(search_module, "PREFIX_DEVICES_SLICED", sliced)
                    mp.setattr(shares_module.ShareProblem, "__init__", counted)
                    try:
                        plan = best_plan(state, arrays, config, reproducible=True)
                        plans.append(plan.model_dump_json())
                    except NoFeasiblePlanError:  # (the same verdict both ways)
                        plans.append("infeasible")
                problems.append(built)
            assert plans[0] == plans[1]
            assert problems[0] == problems[1]
