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

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.costmodel import ProfilePrefix, link_bandwidths_bytes_per_s, stage_compute_s

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


def empty_table(num_stages: int, microbatch_size: int) -> SplitTable:
    """A :class:`SplitTable` without splits (nothing fits), bounds of shape ``(0, K + 1)``."""
    return SplitTable(
        np.zeros((0, num_stages + 1), dtype=np.int64), np.zeros(0), np.zeros(0),
        np.zeros(0, dtype=np.int64), int(microbatch_size),
    )  # fmt: skip


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
    fill, bottleneck, nmax = split_rows(state, prefix, devices, bounds, mu,
                                        optimizer_state_factor, schedule)  # fmt: skip
    return SplitTable(bounds, fill, bottleneck, nmax, mu)


def split_rows(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: np.ndarray,
    bounds: np.ndarray,
    microbatch_sizes: int | np.ndarray,
    optimizer_state_factor: float,
    schedule: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`split_table`'s ``(fill_s, bottleneck_s, max_microbatches)`` (shape ``(P,)``
    each) of splits ``bounds`` (shape ``(P, K + 1)``) with a micro-batch size per split
    (``microbatch_sizes``: shape ``(P,)``, or one ``int`` for all), so that the splits of
    several ``μ`` are timed in one pass."""
    mu = microbatch_sizes
    if not isinstance(mu, int):
        mu = np.asarray(mu, dtype=np.int64)[:, None]
    compute = stage_compute_s(state, prefix, devices, bounds[:, :-1], bounds[:, 1:], mu)
    fill = compute.sum(axis=1)
    bottleneck = compute.max(axis=1)
    if len(devices) > 1:
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
    return fill, bottleneck, nmax


def max_microbatches(
    theta_bytes: np.ndarray | None,
    act_bytes_per_sample: np.ndarray,
    limit_bytes: np.ndarray,
    microbatch_size: int | np.ndarray,
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
    act = np.asarray(act_bytes_per_sample)
    if act.ndim < 2:
        act = np.atleast_2d(act)
    if fixed_bytes is None:
        fixed = np.atleast_2d(theta_bytes) * (2.0 + optimizer_state_factor)
    else:
        fixed = np.asarray(fixed_bytes)
        if fixed.ndim < 2:
            fixed = np.atleast_2d(fixed)
    k_stages = fixed.shape[1]
    free = limit_bytes - fixed
    per_mb = microbatch_size * act
    # (the divisor is positive where it counts and 1 elsewhere: no division by zero)
    positive = per_mb > 0
    n = np.where(positive, np.floor(free / np.where(positive, per_mb, 1.0)), np.inf)
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


# μ-chunks of the stage matrices hold at most about this many elements per array (a 2 MiB
# float64 array... of 256 Ki elements), so long models stay within memory
STAGE_MATRIX_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class _StageMatrices:
    """Per micro-batch size ``u`` and stage ``k`` over ``(i, j)`` (stage = layers ``[i, j)``),
    shape ``(U, K, L + 1, L + 1)``: ``total`` = ``C_k + E_k``, ``worst`` = ``max(C_k, E_k)``
    where stage ``k`` can hold ``[i, j)`` (:func:`_stage_positions`), inf elsewhere; the
    memory terms ``fixed`` (``θ' (2 + o) + φ``, bytes, shape ``(1, L + 1, L + 1)``) and
    ``per_alive`` (``μ Σ m``, bytes per micro-batch held alive, shape
    ``(U, 1, L + 1, L + 1)``), with ``limit`` ``M_{d_k}`` (shape ``(K, 1, 1)``).
    ``monotone``: both memory terms grow with the layer range (no negative bytes in the
    profile), so each stage's largest range needs the most memory."""

    total: np.ndarray
    worst: np.ndarray
    fixed: np.ndarray
    per_alive: np.ndarray
    limit: np.ndarray
    schedule: str
    monotone: bool

    def masked(self, levels: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(total, worst)`` of the micro-batch sizes ``rows`` (shape ``(R,)``), shape
        ``(R, K, L + 1, L + 1)``, with stages that do not fit ``levels[r]`` micro-batches set to
        inf (``h_k = min(n, K − k + 1)`` under 1F1B, ``n`` under GPipe). The result may be
        ``total`` / ``worst`` themselves (when every row is asked for and every range fits):
        callers must not write into it.

        When ``monotone`` and each stage's largest range ``[k, L − (K − 1 − k))`` fits (the
        same sum and comparison as the full check, on one entry per row and stage), every
        range fits and the memory check over all ``(i, j)`` is skipped: the same arrays."""
        k_stages, n1 = self.total.shape[1], self.total.shape[2]
        n_d = np.maximum(np.asarray(levels, dtype=np.int64), 1)[:, None, None, None]
        if self.schedule == "gpipe":
            alive = np.broadcast_to(n_d, (len(n_d), k_stages, 1, 1))
        else:
            alive = np.minimum(n_d, (k_stages - np.arange(k_stages))[None, :, None, None])
        alive = alive.astype(float)  # (small integers: exact; no casting in the product)
        every = len(rows) == len(self.total) and np.array_equal(rows, np.arange(len(rows)))
        per_alive = self.per_alive if every else self.per_alive[rows]
        total = self.total if every else self.total[rows]
        worst = self.worst if every else self.worst[rows]
        if self.monotone:
            first = np.arange(k_stages)
            last = (n1 - 1) - (k_stages - 1 - first)
            need = (self.fixed[0, first, last][None, :]
                    + alive[:, :, 0, 0] * per_alive[:, 0, first, last])  # fmt: skip
            if np.all(need <= self.limit[None, :, 0, 0]):
                return total, worst
        ok = self.fixed + alive * per_alive <= self.limit
        return np.where(ok, total, np.inf), np.where(ok, worst, np.inf)


@functools.lru_cache(maxsize=16)
def _stage_positions(k_stages: int, num_layers: int) -> np.ndarray:
    """Where stage ``k`` can hold layers ``[i, j)``, shape ``(K, L + 1, L + 1)`` (bool,
    read-only): ``k ≤ i < j ≤ L − (K − 1 − k)`` (every stage holds a layer), the last stage
    ends at ``L``."""
    idx = np.arange(num_layers + 1)
    i, j = idx[None, :, None], idx[None, None, :]
    kk = np.arange(k_stages)[:, None, None]
    ok = (j > i) & (i >= kk) & (j <= num_layers - (k_stages - 1 - kk))
    ok &= (kk != k_stages - 1) | (j == num_layers)
    ok.flags.writeable = False
    return ok


@functools.lru_cache(maxsize=16)
def _stage_outside(k_stages: int, num_layers: int) -> np.ndarray:
    """``~`` :func:`_stage_positions` (read-only)."""
    out = ~_stage_positions(k_stages, num_layers)
    out.flags.writeable = False
    return out


def _stage_matrices(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: np.ndarray,
    microbatch_sizes: Sequence[int],
    optimizer_state_factor: float,
    schedule: str,
    cache: dict | None = None,
) -> _StageMatrices:
    """The :class:`_StageMatrices` of one group for each ``μ`` of ``microbatch_sizes`` (same
    formulas as :func:`hetrain.costmodel.stage_times_s` /
    :func:`~hetrain.costmodel.stage_memory_bytes`). ``cache``: a dict for the matrices that
    depend only on the profile (the caller's, for one profile)."""
    num_layers = prefix.num_layers
    k_stages = len(devices)
    key = ("stage-matrices", num_layers, float(optimizer_state_factor))
    base = None if cache is None else cache.get(key)
    if base is None:
        idx = np.arange(num_layers + 1)
        fixed = prefix.fixed_memory_bytes(idx[:, None], idx[None, :], optimizer_state_factor)[None]
        act = (prefix.act_mem_bytes[None, :] - prefix.act_mem_bytes[:, None])[None]
        monotone = bool(
            np.all(np.diff(prefix.param_bytes) >= 0)
            and np.all(np.diff(prefix.frozen_bytes) >= 0)
            and np.all(np.diff(prefix.act_mem_bytes) >= 0)
            and np.all(prefix.shared_bytes >= 0)
        )
        base = (fixed, act, monotone)
        if cache is not None:
            cache[key] = base
    fixed, act, monotone = base
    idx = np.arange(num_layers + 1)
    # (U, 1, 1, 1); integers as floats: exact, and no casting in the products
    mu_whole = np.asarray(microbatch_sizes, dtype=np.int64)[:, None, None, None]
    mu = mu_whole.astype(float)
    # (U, K, L + 1, L + 1): stage [i, j) on device k (entries with j <= i are masked later;
    # the sizes as integers: stage_compute_s's lookup by size, the same values)
    compute = stage_compute_s(
        state, prefix, np.asarray(devices)[:, None, None], idx[:, None], idx[None, :], mu_whole
    )
    full = (len(mu), len(devices), num_layers + 1, num_layers + 1)
    if compute.shape != full or not compute.flags.writeable:
        compute = np.broadcast_to(compute, full).astype(float, copy=True)
    if k_stages > 1:
        bw = np.concatenate((link_bandwidths_bytes_per_s(state, devices), [np.inf]))
        last = np.clip(idx - 1, 0, num_layers - 1)
        transfer = (
            mu[:, :, 0] * prefix.boundary_bytes[last][None, None, :] / bw[None, :, None]
            + 2.0 * state.latency_s
        )  # (U, K, L + 1)
        transfer[:, -1] = 0.0
        transfer = transfer[:, :, None, :]
        total = compute + transfer
        worst = np.maximum(compute, transfer, out=compute)
    else:
        total = worst = compute
    # entries where stage k cannot hold [i, j): inf (in place; total and worst are new arrays)
    outside = _stage_outside(k_stages, num_layers)
    np.copyto(total, np.inf, where=outside)
    if worst is not total:
        np.copyto(worst, np.inf, where=outside)
    # (alive * mu) * act in the cost model; here alive * (mu * act): equal up to rounding,
    # and every split found is re-checked exactly by split_table
    return _StageMatrices(
        total=total,
        worst=worst,
        fixed=fixed,
        per_alive=mu * act,
        limit=state.memory_bytes[devices][:, None, None],
        schedule=schedule,
        monotone=monotone,
    )


def _stage_window(k: int, k_stages: int, num_layers: int) -> tuple[int, int]:
    """``(lo, hi)``: a middle stage ``k`` (``0 < k < K − 1``) starts at a layer in
    ``[lo, hi)`` and ends in ``(lo, hi]`` (every stage holds at least one layer); outside, its
    entries of :class:`_StageMatrices` are inf."""
    return k, num_layers - (k_stages - 1 - k)


def _least_bottleneck(maxes: np.ndarray) -> np.ndarray:
    """Least possible ``M`` over splits (min-max DP), per row of ``maxes`` (shape
    ``(R, K, L + 1, L + 1)``), shape ``(R,)``. The first stage starts at layer 0 and the last
    ends at ``L``, so only that row/column of theirs is read (the values are those of the DP
    over every ``(i, j)``: the entries skipped are inf)."""
    k_stages, n1 = maxes.shape[1], maxes.shape[2]
    best = maxes[:, 0, 0, :]
    if k_stages == 1:
        return best[:, -1].copy()
    for k in range(1, k_stages - 1):
        lo, hi = _stage_window(k, k_stages, n1 - 1)
        new = np.full((len(best), n1), np.inf)
        new[:, lo + 1 : hi + 1] = np.min(
            np.maximum(best[:, lo:hi, None], maxes[:, k, lo:hi, lo + 1 : hi + 1]), axis=1
        )
        best = new
    last = maxes[:, k_stages - 1, k_stages - 1 : n1 - 1, n1 - 1]
    return np.min(np.maximum(best[:, k_stages - 1 : n1 - 1], last), axis=1)


def _min_sum_splits(
    sums: np.ndarray, maxes: np.ndarray, owner: np.ndarray, betas: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Min-sum DP over split points with every stage/boundary time ``≤ betas[r]``, for all
    ``betas`` (shape ``(R,)``) at once, row ``r`` on the matrices ``sums[owner[r]]`` /
    ``maxes[owner[r]]`` (shape ``(U, K, L + 1, L + 1)``). Returns the bounds (shape
    ``(F, K + 1)``) of the feasible rows and those rows' indices (shape ``(F,)``, in order).

    Only the window of each stage where its entries can be finite is computed (the first
    stage starts at layer 0, the last ends at ``L``, :func:`_stage_window`); the minimum and
    the first index reaching it are those of the DP over every ``(i, j)``."""
    k_stages, n1 = maxes.shape[1], maxes.shape[2]
    rows = np.arange(len(betas))
    beta2 = betas[:, None]
    m = maxes[owner, 0, 0, :]
    best = np.where(m <= beta2, sums[owner, 0, 0, :], np.inf)  # 0 + the first stage's time
    choices: list[np.ndarray | None] = [None]
    if k_stages > 1:
        beta3 = betas[:, None, None]
        for k in range(1, k_stages - 1):
            lo, hi = _stage_window(k, k_stages, n1 - 1)
            # (best + the stage's time where its bottleneck is within β, inf elsewhere; in
            # place on the gathered copy)
            cand = sums[owner, k, lo:hi, lo + 1 : hi + 1]
            np.putmask(cand, maxes[owner, k, lo:hi, lo + 1 : hi + 1] > beta3, np.inf)
            cand += best[:, lo:hi, None]
            arg = cand.argmin(axis=1)
            value = cand[np.arange(len(cand))[:, None], arg, np.arange(cand.shape[2])[None, :]]
            best = np.full((len(betas), n1), np.inf)
            best[:, lo + 1 : hi + 1] = value
            choice = np.zeros((len(betas), n1), dtype=np.int64)
            choice[:, lo + 1 : hi + 1] = np.where(np.isfinite(value), arg + lo, 0)
            choices.append(choice)
        k = k_stages - 1
        m = maxes[owner, k, k : n1 - 1, n1 - 1]
        cand = best[:, k : n1 - 1] + np.where(m <= beta2, sums[owner, k, k : n1 - 1, n1 - 1],
                                              np.inf)  # fmt: skip
        arg = np.argmin(cand, axis=1)
        final = cand[rows, arg]
        last_choice = arg + k
    else:
        final = best[:, n1 - 1]
    ok = np.flatnonzero(np.isfinite(final))
    bounds = np.zeros((len(ok), k_stages + 1), dtype=np.int64)
    bounds[:, k_stages] = n1 - 1
    if k_stages > 1:
        bounds[:, k_stages - 1] = last_choice[ok]
        for k in range(k_stages - 2, 0, -1):
            bounds[:, k] = choices[k][ok, bounds[:, k + 1]]
    return bounds, ok


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
    return envelope_splits_many(
        state, prefix, devices, [microbatch_size], optimizer_state_factor, schedule, [n_design],
        exact=exact, n_caps=[n_cap], ladder=ladder, ladder_ratio=ladder_ratio,
    )[0]  # fmt: skip


def envelope_splits_many(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: np.ndarray,
    microbatch_sizes: Sequence[int],
    optimizer_state_factor: float,
    schedule: str,
    n_designs: Sequence[int],
    *,
    exact: bool | None = None,
    n_caps: Sequence[int | None] | None = None,
    ladder: int = 8,
    ladder_ratio: float = 1.25,
    cache: dict | None = None,
) -> list[SplitTable]:
    """:func:`envelope_splits` of one group for each ``μ`` of ``microbatch_sizes`` (with its
    ``n_designs`` and ``n_caps`` entry), the same tables, computed together: the stage
    matrices, the least bottlenecks and the min-sum DPs of every ``μ`` and ``β`` run as one
    numpy pass per stage (the planner asks for several ``μ`` of a group at once).
    ``cache``: a dict for matrices that depend only on the profile (one profile per dict)."""
    devices = np.asarray(devices, dtype=np.int64)
    mus = [int(m) for m in microbatch_sizes]
    designs = [int(n) for n in n_designs]
    caps = [designs[u] if n_caps is None or n_caps[u] is None else int(n_caps[u])
            for u in range(len(mus))]  # fmt: skip
    k_stages = len(devices)
    num_layers = prefix.num_layers

    def none_fit(mu: int) -> SplitTable:
        return empty_table(k_stages, mu)

    if k_stages > num_layers:
        return [none_fit(mu) for mu in mus]
    # (a lower bound on the memory every split needs: shared tensors counted once)
    params = prefix.total_fixed_memory_bytes(optimizer_state_factor)
    memory = float(np.sum(state.memory_bytes[devices]))
    if params > memory:
        return [none_fit(mu) for mu in mus]
    out: list[SplitTable | None] = [None] * len(mus)
    if np.all(np.diff(prefix.act_mem_bytes) >= 0):
        # every stage holds at least one micro-batch of its layers' activations, so a split
        # that fits needs at least params + μ Σ m bytes on the group's devices (a relative
        # 1e-9 above, for the rounding of the per-stage sums): the μ above have no split
        act_total = float(prefix.act_mem_bytes[-1])
        for u, mu in enumerate(mus):
            if params + mu * act_total > memory * (1.0 + 1e-9):
                out[u] = none_fit(mu)
    live = [u for u in range(len(mus)) if out[u] is None]
    step = max(1, STAGE_MATRIX_ELEMENTS // (k_stages * (num_layers + 1) ** 2))
    for c0 in range(0, len(live), step):
        chunk = live[c0 : c0 + step]
        mats = _stage_matrices(state, prefix, devices, [mus[u] for u in chunk],
                               optimizer_state_factor, schedule, cache)  # fmt: skip
        count = len(chunk)
        # memory at n_design; when nothing fits, lower levels (halving) down to one
        # micro-batch; when even one does not fit, nothing does. (Feasibility only shrinks
        # as the level grows, so a split fitting n_design also fits one micro-batch: the
        # design level is tried first, one micro-batch only where it fails.)
        design = np.maximum(np.array([designs[u] for u in chunk], dtype=np.int64), 1)
        sums, maxes = mats.masked(design, np.arange(count))
        beta_star = _least_bottleneck(maxes)
        # where it fails: the halved levels n_design // 2, // 4, ... (> 1), then one
        # micro-batch (none: nothing fits), one round per level for the rows still failing
        ladders = {}
        for row in np.flatnonzero(~np.isfinite(beta_star) & (design > 1)):
            level, steps = int(design[row]), []
            while level > 2:
                level //= 2
                if level > 1:
                    steps.append(level)
            ladders[int(row)] = [*steps, 1]
        while ladders:
            rows_p = np.array(list(ladders), dtype=np.int64)
            levels = np.array([steps.pop(0) for steps in ladders.values()], dtype=np.int64)
            s2, m2 = mats.masked(levels, rows_p)
            b2 = _least_bottleneck(m2)
            for p, row in enumerate(rows_p):
                if np.isfinite(b2[p]):
                    if sums is mats.total or maxes is mats.worst:  # (never write into them)
                        sums, maxes = sums.copy(), maxes.copy()
                    sums[row], maxes[row], beta_star[row] = s2[p], m2[p], b2[p]
                    del ladders[int(row)]
                elif not ladders[int(row)]:
                    del ladders[int(row)]
        owners, betas = [], []
        for r, u in enumerate(chunk):
            if not np.isfinite(beta_star[r]):
                out[u] = none_fit(mus[u])
                continue
            m = maxes[r]
            values = np.unique(m[(m >= beta_star[r]) & (m < np.inf)])
            use_exact = len(values) <= 24 if exact is None else exact
            if use_exact:
                found = values
            else:
                found = np.concatenate((beta_star[r] * ladder_ratio ** np.arange(ladder), [np.inf]))
            betas.append(np.asarray(found, dtype=float) * (1 + 1e-12))
            owners.append(np.full(len(found), r, dtype=np.int64))
        if not betas:
            continue
        owner = np.concatenate(owners)
        all_bounds, feasible = _min_sum_splits(sums, maxes, owner, np.concatenate(betas))
        row_of = owner[feasible]
        per_u, mu_rows = [], []
        for r, u in enumerate(chunk):
            if out[u] is not None:
                continue
            found_b: dict[tuple[int, ...], None] = dict.fromkeys(
                map(tuple, all_bounds[row_of == r].tolist())
            )
            bounds = np.asarray(list(found_b), dtype=np.int64).reshape(-1, k_stages + 1)
            per_u.append((u, bounds))
            mu_rows.append(np.full(len(bounds), mus[u], dtype=np.int64))
        stacked = np.concatenate([b for _, b in per_u])
        fill, bottleneck, nmax = split_rows(state, prefix, devices, stacked,
                                            np.concatenate(mu_rows),
                                            optimizer_state_factor, schedule)  # fmt: skip
        start = 0
        for u, bounds in per_u:
            sl = slice(start, start + len(bounds))
            start += len(bounds)
            cap = max(caps[u], 1)
            out[u] = pareto(SplitTable(bounds, fill[sl], bottleneck[sl],
                                       np.minimum(nmax[sl], cap), mus[u]))  # fmt: skip
    return out  # type: ignore[return-value]


def pareto(table: SplitTable) -> SplitTable:
    """Drop splits dominated by another one: ``A`` and ``M`` no larger and at least as many
    micro-batches allowed (ties: the first is kept). ``O(P²)``."""
    if len(table) <= 1:
        return table
    a, m, n = table.fill_s, table.bottleneck_s, table.max_microbatches
    if np.all(n == n[0]):
        # one micro-batch limit (the usual case): sorted by (A, M, index), a split is
        # dominated iff an earlier one has M no larger; the same splits as below, O(P log P)
        order = np.lexsort((np.arange(len(a)), m, a))
        m_sorted = m[order]
        before = np.concatenate(([np.inf], np.minimum.accumulate(m_sorted)[:-1]))
        keep = np.sort(order[before > m_sorted])
        if len(keep) == len(a):
            return table
        return SplitTable(table.bounds[keep], a[keep], m[keep], n[keep],
                          table.microbatch_size)  # fmt: skip
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
