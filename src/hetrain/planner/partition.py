"""Stages of one group: contiguous splits of the layer chain over the group's ordered devices
(docs/model.md §4 "stages").

For a group with ordered devices ``d_1..d_K`` and micro-batch size ``μ``, a split (``bounds``
``0 = x_0 < x_1 < ... < x_K = L``) has fill time ``A`` and bottleneck ``M`` (docs/model.md §3), so
its
group time is the line ``T_g(n) = A + (n − 1) M`` in the number of micro-batches ``n``. Since
``n = ceil(b_g / μ)`` depends on the share that the share solver picks later, this module does
not optimise for one ``n``: it returns the **lower envelope** of those lines over all splits
that fit in memory (the Pareto set of ``(A, M)``), and the share solver picks, per group, the
split that is best for the share it gives the group (:mod:`hetrain.planner.shares`).

The envelope is found with docs/model.md §4's method: for each candidate bottleneck ``β``, a min-sum
dynamic program over split points with every stage and boundary time ``≤ β`` and memory
respected gives the least ``A`` with ``M ≤ β``; a split that is optimal for some ``n`` is
reproduced by the candidate ``β = M`` of that split. With every distinct stage/boundary time
as a candidate (``exact=True``) the envelope is exact; otherwise a geometric ladder of ``β``
above the least feasible bottleneck is used (heuristic, see docs/planner.md).

Memory depends on ``n`` (``h_k``): the DP checks it at a design value ``n_design`` (callers pass
the largest ``n`` the group could be given, so every split returned fits for every smaller
``n``), and every split carries its exact largest feasible ``n`` (``max_microbatches``).
Complexity: ``O(K L²)`` per ``β`` (numpy), ``O(K L²)`` more for the least bottleneck.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.costmodel import ProfilePrefix, link_bandwidths_bytes_per_s

NO_LIMIT = np.iinfo(np.int64).max // 4


@dataclass(frozen=True)
class SplitTable:
    """Splits of one group at one micro-batch size, shape ``(P, K + 1)`` for ``bounds`` and
    ``(P,)`` for the rest: ``fill_s`` (A), ``bottleneck_s`` (M), ``max_microbatches`` (largest
    ``n`` that fits in memory, ``NO_LIMIT`` if any; 0 = never fits), ``microbatch_size`` (μ)."""

    bounds: np.ndarray
    fill_s: np.ndarray
    bottleneck_s: np.ndarray
    max_microbatches: np.ndarray
    microbatch_size: int

    def __len__(self) -> int:
        return len(self.fill_s)


def enumerate_splits(num_layers: int, num_stages: int) -> np.ndarray:
    """All ``C(L−1, K−1)`` contiguous splits of ``L`` layers into ``K`` non-empty stages, as
    bounds of shape ``(P, K + 1)``."""
    if num_stages > num_layers:
        return np.zeros((0, num_stages + 1), dtype=np.int64)
    cuts = list(itertools.combinations(range(1, num_layers), num_stages - 1))
    out = np.empty((len(cuts), num_stages + 1), dtype=np.int64)
    out[:, 0] = 0
    out[:, -1] = num_layers
    if num_stages > 1:
        out[:, 1:-1] = np.asarray(cuts, dtype=np.int64).reshape(len(cuts), num_stages - 1)
    return out


def count_splits(num_layers: int, num_stages: int) -> int:
    """``C(L−1, K−1)``."""
    if num_stages > num_layers:
        return 0
    return math.comb(num_layers - 1, num_stages - 1)


def split_table(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: np.ndarray,
    bounds: np.ndarray,
    microbatch_size: int,
    optimizer_state_factor: float,
    schedule: str,
) -> SplitTable:
    """``A``, ``M`` and the largest feasible ``n`` of each split in ``bounds`` (shape
    ``(P, K + 1)``), vectorised over splits; same formulas as
    :func:`hetrain.costmodel.stage_times_s` and :func:`hetrain.costmodel.stage_memory_bytes`."""
    devices = np.asarray(devices, dtype=np.int64)
    bounds = np.asarray(bounds, dtype=np.int64).reshape(-1, len(devices) + 1)
    mu = int(microbatch_size)
    k_stages = len(devices)
    flops = prefix.train_flops[bounds[:, 1:]] - prefix.train_flops[bounds[:, :-1]]
    compute = mu * flops / state.speed_flops[devices] + state.kappa_s[devices]
    lam = state.layer_overhead_s[devices]
    if np.any(lam):
        compute = compute + lam * np.diff(bounds, axis=1)
    fill = compute.sum(axis=1)
    bottleneck = compute.max(axis=1)
    if k_stages > 1:
        bw = link_bandwidths_bytes_per_s(state, devices)
        transfer = mu * prefix.boundary_bytes[bounds[:, 1:-1] - 1] / bw + 2.0 * state.latency_s
        fill = fill + transfer.sum(axis=1)
        bottleneck = np.maximum(bottleneck, transfer.max(axis=1))
    fixed = prefix.fixed_memory_bytes(bounds[:, :-1], bounds[:, 1:], optimizer_state_factor)
    act = prefix.act_mem_bytes[bounds[:, 1:]] - prefix.act_mem_bytes[bounds[:, :-1]]
    nmax = max_microbatches(
        None, act, state.memory_bytes[devices], mu, optimizer_state_factor, schedule,
        fixed_bytes=fixed,
    )  # fmt: skip
    return SplitTable(bounds, fill, bottleneck, nmax, mu)


def max_microbatches(
    theta_bytes: np.ndarray | None,
    act_bytes_per_sample: np.ndarray,
    limit_bytes: np.ndarray,
    microbatch_size: int,
    optimizer_state_factor: float,
    schedule: str,
    *,
    fixed_bytes: np.ndarray | None = None,
) -> np.ndarray:
    """Largest ``n`` with ``θ_k (2 + o) + h_k(n) μ act_k ≤ M_k`` for every stage (docs/model.md §3),
    shape ``(P,)`` from inputs of shape ``(P, K)``; ``NO_LIMIT`` when memory never binds, 0
    when not even the parameters fit. ``fixed_bytes`` (shape ``(P, K)``), when given, is the
    whole micro-batch-independent term ``θ' (2 + o) + φ`` (docs/model.md (v3),
    :meth:`~hetrain.costmodel.ProfilePrefix.fixed_memory_bytes`) and ``theta_bytes`` is
    ignored."""
    act = np.atleast_2d(act_bytes_per_sample)
    if fixed_bytes is None:
        fixed = np.atleast_2d(theta_bytes) * (2.0 + optimizer_state_factor)
    else:
        fixed = np.atleast_2d(fixed_bytes)
    k_stages = fixed.shape[1]
    free = limit_bytes - fixed
    per_mb = microbatch_size * act
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.where(per_mb > 0, np.floor(free / np.where(per_mb > 0, per_mb, 1.0)), np.inf)
    n = np.where(free < 0, 0.0, n)
    if schedule != "gpipe":
        depth = k_stages - np.arange(k_stages)  # K - k + 1 for k = 1..K
        # under 1F1B h_k = min(n, K-k+1): if the deepest stash fits, n is unlimited
        never_binds = fixed + (depth * microbatch_size) * act <= limit_bytes
        n = np.where(never_binds, np.inf, n)
    n = np.minimum(n, float(NO_LIMIT))
    nk = n.astype(np.int64)
    # guard against rounding: recheck with the cost model's expression, step down if needed
    finite = (nk > 0) & (nk < NO_LIMIT)
    if np.any(finite):
        alive = nk if schedule == "gpipe" else np.minimum(nk, k_stages - np.arange(k_stages))
        over = finite & (fixed + (alive * microbatch_size) * act > limit_bytes)
        nk = np.where(over, nk - 1, nk)
    return nk.min(axis=1)


@dataclass(frozen=True)
class _StageMatrices:
    """Per stage k over ``(i, j)`` (stage = layers ``[i, j)``), shape ``(K, L + 1, L + 1)``:
    ``total`` = ``C_k + E_k``, ``worst`` = ``max(C_k, E_k)`` (inf where out of position),
    and the memory terms ``fixed`` (``θ' (2 + o) + φ``, bytes) and ``per_alive`` (``μ Σ m``, bytes
    per micro-batch held alive), with ``limit`` ``M_{d_k}`` (shape ``(K, 1, 1)``)."""

    total: np.ndarray
    worst: np.ndarray
    fixed: np.ndarray
    per_alive: np.ndarray
    limit: np.ndarray
    schedule: str

    def masked(self, n_design: int) -> tuple[np.ndarray, np.ndarray]:
        """``(total, worst)`` with stages that do not fit ``n_design`` micro-batches set to
        inf (``h_k = min(n, K − k + 1)`` under 1F1B, ``n`` under GPipe)."""
        k_stages = self.total.shape[0]
        n_d = max(int(n_design), 1)
        if self.schedule == "gpipe":
            alive = np.full((k_stages, 1, 1), n_d)
        else:
            alive = np.minimum(n_d, k_stages - np.arange(k_stages))[:, None, None]
        ok = self.fixed + alive * self.per_alive <= self.limit
        return np.where(ok, self.total, np.inf), np.where(ok, self.worst, np.inf)


def _stage_matrices(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: np.ndarray,
    microbatch_size: int,
    optimizer_state_factor: float,
    schedule: str,
) -> _StageMatrices:
    """The :class:`_StageMatrices` of one group and ``μ`` (same formulas as
    :func:`hetrain.costmodel.stage_times_s` / :func:`~hetrain.costmodel.stage_memory_bytes`)."""
    num_layers = prefix.num_layers
    k_stages = len(devices)
    idx = np.arange(num_layers + 1)
    i, j = idx[None, :, None], idx[None, None, :]
    kk = np.arange(k_stages)[:, None, None]
    mu = microbatch_size
    flops = (prefix.train_flops[None, :] - prefix.train_flops[:, None])[None]
    fixed = prefix.fixed_memory_bytes(idx[:, None], idx[None, :], optimizer_state_factor)[None]
    act = (prefix.act_mem_bytes[None, :] - prefix.act_mem_bytes[:, None])[None]
    speed = state.speed_flops[devices][:, None, None]
    kappa = state.kappa_s[devices][:, None, None]
    compute = mu * flops / speed + kappa
    lam = state.layer_overhead_s[devices]
    if np.any(lam):
        compute = compute + lam[:, None, None] * (j - i)
    ok = (j > i) & (i >= kk) & (j <= num_layers - (k_stages - 1 - kk))
    ok &= (kk != k_stages - 1) | (j == num_layers)
    if k_stages > 1:
        bw = np.concatenate((link_bandwidths_bytes_per_s(state, devices), [np.inf]))
        last = np.clip(idx - 1, 0, num_layers - 1)
        transfer = mu * prefix.boundary_bytes[last][None, :] / bw[:, None] + 2.0 * state.latency_s
        transfer[-1] = 0.0
        transfer = transfer[:, None, :]
        total = compute + transfer
        worst = np.maximum(compute, transfer)
    else:
        total = worst = compute
    # (alive * mu) * act in the cost model; here alive * (mu * act): equal up to rounding,
    # and every split found is re-checked exactly by split_table
    return _StageMatrices(
        total=np.where(ok, total, np.inf),
        worst=np.where(ok, worst, np.inf),
        fixed=fixed,
        per_alive=mu * act,
        limit=state.memory_bytes[devices][:, None, None],
        schedule=schedule,
    )


def _min_sum_splits(sums: np.ndarray, maxes: np.ndarray, betas: np.ndarray) -> np.ndarray:
    """Min-sum DP over split points with every stage/boundary time ``≤ beta``, for all
    ``betas`` at once (a leading axis of size ``len(betas)``, in chunks of 64); bounds of
    shape ``(R, K + 1)`` for the feasible ``betas``, in order."""
    if len(betas) > 64:
        parts = [_min_sum_splits(sums, maxes, betas[i : i + 64]) for i in range(0, len(betas), 64)]
        return np.concatenate(parts)
    n1 = sums.shape[1]
    nb = len(betas)
    best = np.full((nb, n1), np.inf)
    best[:, 0] = 0.0
    choices = []
    rows = np.arange(nb)[:, None]
    cols = np.arange(n1)[None, :]
    for s, m in zip(sums, maxes, strict=True):
        masked = np.where(m[None, :, :] <= betas[:, None, None], s[None, :, :], np.inf)
        cand = best[:, :, None] + masked
        arg = np.argmin(cand, axis=1)
        best = cand[rows, arg, cols]
        choices.append(arg)
    ok = np.flatnonzero(np.isfinite(best[:, -1]))
    if not len(ok):
        return np.zeros((0, len(sums) + 1), dtype=np.int64)
    k_stages = len(sums)
    bounds = np.empty((len(ok), k_stages + 1), dtype=np.int64)
    bounds[:, k_stages] = n1 - 1
    for k in range(k_stages - 1, -1, -1):
        bounds[:, k] = choices[k][ok, bounds[:, k + 1]]
    return bounds


def _least_bottleneck(maxes: list[np.ndarray]) -> float:
    """Least possible ``M`` over splits (min-max DP)."""
    n1 = maxes[0].shape[0]
    best = np.full(n1, np.inf)
    best[0] = -np.inf
    for m in maxes:
        best = np.min(np.maximum(best[:, None], m), axis=0)
    return float(best[-1])


def envelope_splits(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: np.ndarray,
    microbatch_size: int,
    optimizer_state_factor: float,
    schedule: str,
    n_design: int,
    *,
    exact: bool | None = None,
    n_cap: int | None = None,
    ladder: int = 8,
    ladder_ratio: float = 1.25,
) -> SplitTable:
    """The splits on the lower envelope of ``T_g(n) = A + (n − 1) M`` for one group and one
    ``μ`` (see the module docstring), memory checked at ``n_design`` micro-batches (or, when
    nothing fits that many, at the first of ``n_design / 2, / 4, ..., 1`` where a split fits;
    ``max_microbatches`` of every split is its exact limit).

    Args:
        devices: device indices in pipeline order, shape ``(K,)``.
        exact: use every distinct stage/boundary time as a candidate ``β`` (exact envelope);
            default: exact when there are at most 24 candidates.
        n_cap: the most micro-batches the group can ever be given (``max_microbatches`` is
            capped there before dominated splits are dropped); default ``n_design``.
        ladder, ladder_ratio: otherwise ``β* · ratio^t`` for ``t < ladder`` plus ``β = ∞``.

    Returns:
        a :class:`SplitTable`, empty (P = 0) when no split fits in memory.
    """
    devices = np.asarray(devices, dtype=np.int64)
    k_stages = len(devices)
    num_layers = prefix.num_layers
    if k_stages > num_layers:
        return split_table(state, prefix, devices, np.zeros((0, k_stages + 1), np.int64),
                           microbatch_size, optimizer_state_factor, schedule)  # fmt: skip
    empty = np.zeros((0, k_stages + 1), dtype=np.int64)
    # (a lower bound on the memory every split needs: shared tensors counted once)
    params = prefix.total_fixed_memory_bytes(optimizer_state_factor)
    if params > float(np.sum(state.memory_bytes[devices])):
        return split_table(state, prefix, devices, empty, microbatch_size,
                           optimizer_state_factor, schedule)  # fmt: skip
    mats = _stage_matrices(
        state, prefix, devices, microbatch_size, optimizer_state_factor, schedule
    )
    # memory at n_design; when nothing fits, lower levels (halving) down to one micro-batch
    # (one micro-batch first: when even that does not fit, nothing does)
    levels = [1] if n_design <= 1 else [1, int(n_design)]
    while levels[-1] > 2:
        levels.append(levels[-1] // 2)
    for tried, level in enumerate(levels):
        sums, maxes = mats.masked(level)
        beta_star = _least_bottleneck(maxes)
        if tried == 0 and not np.isfinite(beta_star):
            break
        if tried > 0 and np.isfinite(beta_star):
            break
    else:
        level = 1
        sums, maxes = mats.masked(level)
        beta_star = _least_bottleneck(maxes)
    if not np.isfinite(beta_star):
        return split_table(state, prefix, devices, empty, microbatch_size,
                           optimizer_state_factor, schedule)  # fmt: skip
    values = np.unique(maxes[np.isfinite(maxes)])
    values = values[values >= beta_star]
    if exact is None:
        exact = len(values) <= 24
    if exact:
        betas = values
    else:
        betas = np.concatenate((beta_star * ladder_ratio ** np.arange(ladder), [np.inf]))
    all_bounds = _min_sum_splits(sums, maxes, np.asarray(betas, dtype=float) * (1 + 1e-12))
    found: dict[tuple[int, ...], None] = {}
    for b in all_bounds:
        found[tuple(int(x) for x in b)] = None
    bounds = np.asarray(list(found), dtype=np.int64).reshape(-1, k_stages + 1)
    table = split_table(
        state, prefix, devices, bounds, microbatch_size, optimizer_state_factor, schedule
    )
    cap = max(int(n_design if n_cap is None else n_cap), 1)
    capped = np.minimum(table.max_microbatches, cap)
    return pareto(
        SplitTable(table.bounds, table.fill_s, table.bottleneck_s, capped, table.microbatch_size)
    )


def pareto(table: SplitTable) -> SplitTable:
    """Drop splits dominated by another one: ``A`` and ``M`` no larger and at least as many
    micro-batches allowed (ties: the first is kept). ``O(P²)``."""
    if len(table) <= 1:
        return table
    a, m, n = table.fill_s, table.bottleneck_s, table.max_microbatches
    weak = (a[:, None] <= a[None, :]) & (m[:, None] <= m[None, :]) & (n[:, None] >= n[None, :])
    strict = (a[:, None] < a[None, :]) | (m[:, None] < m[None, :]) | (n[:, None] > n[None, :])
    idx = np.arange(len(a))
    # p dominates q: weakly better everywhere and (strictly better somewhere or earlier)
    dominated = np.any(
        weak & (strict | (idx[:, None] < idx[None, :])) & (idx[:, None] != idx[None, :]), axis=0
    )
    keep = np.flatnonzero(~dominated)
    return SplitTable(
        table.bounds[keep],
        table.fill_s[keep],
        table.bottleneck_s[keep],
        table.max_microbatches[keep],
        table.microbatch_size,
    )


def best_split_for(table: SplitTable, n_microbatches: int) -> tuple[int, float] | None:
    """Index of the split minimising ``T_g = A + (n − 1) M`` among those that fit ``n``
    micro-batches, and that time; None when none fits."""
    ok = table.max_microbatches >= n_microbatches
    if not np.any(ok):
        return None
    t = np.where(ok, table.fill_s + (n_microbatches - 1) * table.bottleneck_s, np.inf)
    p = int(np.argmin(t))
    return p, float(t[p])
