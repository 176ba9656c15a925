"""The controller's one integer-share solver (:func:`hetrain.control.shares.solve_shares`) is
optimal: its makespan equals brute force's over every assignment on small instances, in both
of the exact solver's regimes (the dynamic program and the bisection over breakpoints), with
memory caps, idle-forcing fills and norm-block units; the runtime's and the controller's
re-balances are that solver."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.control.shares import solve_shares


def _group_time(a: float, m: float, mu: int, n_max: float, b: int) -> float:
    if b == 0:
        return 0.0
    n = -(-b // mu)
    return a + (n - 1) * m if n <= n_max else np.inf


def _brute_force(a, m, mu, n_max, batch) -> float:
    """The least ``max_g T_g(b_g)`` over every composition of ``batch`` (inf: none fits)."""
    best = np.inf
    g_count = len(a)
    for head in itertools.product(range(batch + 1), repeat=g_count - 1):
        last = batch - sum(head)
        if last < 0:
            continue
        shares = (*head, last)
        t = max(_group_time(a[g], m[g], mu[g], n_max[g], shares[g]) for g in range(g_count))
        best = min(best, t)
    return best


def _makespan(a, m, mu, n_max, shares) -> float:
    return max(_group_time(a[i], m[i], mu[i], n_max[i], int(b)) for i, b in enumerate(shares))


@st.composite
def _instances(draw, max_groups: int, max_batch: int):
    g_count = draw(st.integers(1, max_groups))
    batch = draw(st.integers(1, max_batch))
    # times on a coarse grid make ties (the tie-breaking paths) frequent
    grid = st.integers(0, 40).map(lambda x: x * 0.25)
    a = [draw(grid) + 0.25 for _ in range(g_count)]
    m = [draw(grid) for _ in range(g_count)]
    mu = [draw(st.integers(1, 6)) for _ in range(g_count)]
    n_max = [draw(st.sampled_from([0, 1, 2, 3, 5, np.inf])) for _ in range(g_count)]
    return a, m, mu, n_max, batch


def _check(a, m, mu, n_max, batch):
    expected = _brute_force(a, m, mu, n_max, batch)
    shares = solve_shares(np.array(a), np.array(m), np.array(mu), np.array(n_max), batch)
    if not np.isfinite(expected):
        assert shares is None
        return
    assert shares is not None
    assert shares.dtype == np.int64 and int(shares.sum()) == batch and (shares >= 0).all()
    assert _makespan(a, m, mu, n_max, shares) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(_instances(max_groups=4, max_batch=12))
def test_shares_are_optimal_against_brute_force_dynamic_program(instance):
    _check(*instance)


@settings(max_examples=60, deadline=None)
@given(_instances(max_groups=2, max_batch=400))
def test_shares_are_optimal_against_brute_force_bisection(instance):
    # 2 groups x (B + 1)^2 above 100 000 for B > 222: the bisection regime
    _check(*instance)


def test_runtime_rebalance_of_one_slow_device_of_four_is_the_solver_optimum():
    # the runtime's data-parallel case: single-device groups run their share as one
    # micro-batch, T_g(b) = κ_g + b c_g, w1 3x slower at all of its work (κ and c). With
    # κ = 2 ms, c = 1 ms/sample, B = 64 the least makespan is 22 ms: the fast three take 20 (22
    # ms) and w1 4-5 (18-21 ms); 19 each and 7 on w1 would be 27 ms
    from hetrain.control.incremental import StructureArrays, rebalance_shares
    from hetrain.profile import ProfileArrays
    from hetrain.runtime.ctldecision import even_dp_plan
    from hetrain.runtime.worker_main import local_cluster_state

    f = np.full(8, 1e-3 * 1e10 / 3 / 8)
    profile = ProfileArrays(
        names=tuple(f"b{i}" for i in range(8)), fwd_flops=f, bwd_flops=2 * f,
        activation_bytes=np.full(8, 256.0), activation_memory_bytes=np.full(8, 256.0),
        param_bytes=np.full(8, 4e4),
    )  # fmt: skip
    ids = ["w0", "w1", "w2", "w3"]
    state = local_cluster_state(ids, [1e10, 1e10 / 3, 1e10, 1e10]).with_changes(
        kappa_s=np.array([2e-3, 6e-3, 2e-3, 2e-3])
    )
    plan = even_dp_plan(ids, 8, 64, 1)
    new = rebalance_shares(
        plan, state, StructureArrays.build(plan, state.ids, profile), 64,
        one_microbatch_single_stage=True,
    )  # fmt: skip
    shares = [g.batch for g in new.groups]
    assert sum(shares) == 64 and [g.microbatch_size for g in new.groups] == shares
    fixed, per = [2e-3, 6e-3, 2e-3, 2e-3], [1e-3, 3e-3, 1e-3, 1e-3]
    times = [fixed[i] + b * per[i] for i, b in enumerate(shares) if b > 0]
    assert max(times) == pytest.approx(0.022, rel=1e-9)
    assert max(times) == pytest.approx(
        _brute_force(list(np.add(fixed, per)), per, [1] * 4, [np.inf] * 4, 64),
        rel=1e-9,
    )
    assert 4 <= shares[1] <= 5


def test_bad_shapes_and_batch_are_one_clear_error():
    with pytest.raises(ValueError, match="one entry per group"):
        solve_shares(np.ones(2), np.ones(3), np.ones(2), np.ones(2), 4)
    with pytest.raises(ValueError, match="batch"):
        solve_shares(np.ones(2), np.ones(2), np.ones(2), np.ones(2), -1)
    assert solve_shares(np.ones(2), np.ones(2), np.ones(2), np.ones(2), 0).tolist() == [0, 0]
    # nothing fits: every group capped at one micro-batch of 2 for 5 samples
    assert solve_shares(np.ones(2), np.ones(2), np.full(2, 2), np.ones(2), 5) is None


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 3000),
    st.integers(0, 2**31 - 1),
)
def test_shares_match_the_planners_share_problem_on_large_instances(g_count, batch, seed):
    # the planner's exact solver with one option per group: the same optimum
    from hetrain.planner.shares import GroupOptions, ShareProblem

    rng = np.random.default_rng(seed)
    a = rng.uniform(0.001, 0.05, g_count)
    m = rng.uniform(0.0, 0.01, g_count)
    mu = rng.integers(1, 9, g_count)
    n_max = rng.choice([1, 4, 16, 10**6], g_count)
    groups = [
        GroupOptions(np.array([mu[g]]), np.array([a[g]]), np.array([m[g]]),
                     np.array([n_max[g]]), np.zeros((1, 2), dtype=np.int64))
        for g in range(g_count)
    ]  # fmt: skip
    reference = ShareProblem(groups, batch).solve()
    shares = solve_shares(a, m, mu, n_max, batch)
    if reference is None:
        assert shares is None
        return
    assert shares is not None and int(shares.sum()) == batch
    assert _makespan(a, m, mu, n_max, shares) == pytest.approx(reference.max_group_time_s, rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(0.3, 3.0), min_size=2, max_size=3),
    st.lists(st.floats(0.0, 5e-3), min_size=3, max_size=3),
    st.integers(2, 10),
)
def test_one_microbatch_rebalance_is_optimal_on_the_cost_model(speed_factors, kappas, batch):
    # single-device groups that run their share as one micro-batch (the runtime's engine):
    # the re-balanced shares' makespan (the cost model's group times, μ_g = b_g) equals the
    # best over every composition of the batch
    from hetrain.control.incremental import StructureArrays, rebalance_shares
    from hetrain.costmodel import TrainingConfig, evaluate_plan
    from hetrain.plan import GroupPlan, Plan
    from hetrain.profile import ProfileArrays
    from hetrain.runtime.worker_main import local_cluster_state

    g_count = len(speed_factors)
    ids = [f"w{i}" for i in range(g_count)]
    f = np.full(4, 1e6)
    profile = ProfileArrays(
        names=tuple(f"l{i}" for i in range(4)), fwd_flops=f, bwd_flops=2 * f,
        activation_bytes=np.full(4, 64.0), activation_memory_bytes=np.full(4, 64.0),
        param_bytes=np.full(4, 1e3),
    )  # fmt: skip
    state = local_cluster_state(ids, [1e9 * s for s in speed_factors]).with_changes(
        kappa_s=np.array(kappas[:g_count])
    )
    config = TrainingConfig(batch=batch)

    def plan_of(shares) -> Plan:
        return Plan(groups=tuple(
            GroupPlan(devices=(d,), stages=((0, 4),), microbatch_size=max(b, 1), batch=b)
            for d, b in zip(ids, shares, strict=True)
        ))  # fmt: skip

    def makespan(plan: Plan) -> float:
        return max(evaluate_plan(plan, state, profile, config).group_times_s)

    start = plan_of([batch // g_count + (1 if i < batch % g_count else 0) for i in range(g_count)])
    new = rebalance_shares(start, state, StructureArrays.build(start, state.ids, profile), batch,
                           one_microbatch_single_stage=True, profile=profile)  # fmt: skip
    assert sum(g.batch for g in new.groups) == batch
    assert all(g.microbatch_size == g.batch for g in new.groups if g.batch > 0)
    best = min(
        makespan(plan_of((*head, batch - sum(head))))
        for head in itertools.product(range(batch + 1), repeat=g_count - 1)
        if sum(head) <= batch
    )
    active = new.model_copy(update={"groups": tuple(g for g in new.groups if g.batch > 0)})
    assert makespan(active) == pytest.approx(best, rel=1e-9)


def _solve_both(monkeypatch, *args):
    """``solve_shares`` with the capacities summed in the Python loop and in numpy."""
    from hetrain.control import shares as shares_module

    monkeypatch.setattr(shares_module, "SCALAR_GROUPS", 0)
    numpy_sums = solve_shares(*args)
    monkeypatch.setattr(shares_module, "SCALAR_GROUPS", 10**6)
    loop_sums = solve_shares(*args)
    return numpy_sums, loop_sums


@settings(max_examples=300, deadline=None)
@given(_instances(max_groups=8, max_batch=200))
def test_the_python_capacity_sum_gives_numpys_shares(instance):
    """The bisection's capacity sums in a Python loop (up to ``SCALAR_GROUPS`` groups) give
    the same shares as numpy's, on the grid instances (ties, flat groups, memory caps)."""
    with pytest.MonkeyPatch.context() as mp:
        a, b = _solve_both(mp, *instance)
    assert (a is None and b is None) or np.array_equal(a, b)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 16),
    st.integers(1, 5000),
    st.integers(0, 2**31 - 1),
    st.sampled_from([1e-12, 1e-6, 1e-3, 1.0, 1e6]),
)
def test_the_python_capacity_sum_gives_numpys_shares_on_random_times(g_count, batch, seed, unit):
    """The same on continuous times of any scale (the runtime's measured fills and
    bottlenecks: milliseconds; near-ties in the bisection), with idle and capped groups."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.1, 3.0, g_count) * unit
    m = rng.uniform(0.0, 1.0, g_count) * unit * rng.choice([1.0, 1.0, 1e-300], g_count)
    a[rng.random(g_count) < 0.1] = np.inf  # idle groups
    mu = rng.integers(1, 9, g_count)
    n_max = rng.choice([0.0, 1.0, 3.0, 40.0, np.inf, 1e12], g_count)
    with pytest.MonkeyPatch.context() as mp, np.errstate(over="ignore", invalid="ignore"):
        x, y = _solve_both(mp, a, m, mu, n_max, batch)  # (1/M of a subnormal M overflows)
    assert (x is None and y is None) or np.array_equal(x, y)
