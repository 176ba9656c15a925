"""The one integer-share solver of the controller (docs/model.md §4 "shares").

Every share decision of the controller, of the simulator's references and of the runtime's
controller process is an instance of one problem: group ``g`` finishes ``b`` samples in

    ``T_g(b) = A_g + (⌈b/μ_g⌉ − 1) M_g``   for ``1 ≤ ⌈b/μ_g⌉ ≤ n_g``, ``T_g(0) = 0``

(docs/model.md §3: fill ``A_g`` and bottleneck ``M_g`` of its stages, ``μ_g`` samples per
micro-batch, at most ``n_g`` micro-batches in memory), and the shares minimise
``max_{g: b_g > 0} T_g(b_g)`` subject to ``Σ_g b_g = B``, ``b_g ≥ 0`` integer. A single-device
group that runs its share as one micro-batch (the runtime's convention,
``hetrain.runtime.ctldecision.runtime_plan``) is the case ``μ_g = 1``, ``A_g = κ + λΣν + c``,
``M_g = c``: ``T_g(b) = κ + λΣν + b c``.

The solver is exact and vectorised over the groups (one ``(G,)`` array per quantity, so a
1024-group re-balance costs a few milliseconds): group ``g`` can take
``cap_g(T) = μ_g · min(n_g, ⌊(T − A_g)/M_g⌋ + 1)`` samples by time ``T`` (0 if ``T < A_g``),
the optimum is the least staircase breakpoint ``A_g + j M_g`` with ``Σ_g cap_g(T) ≥ B``, found
by bisection on ``T`` and snapped to that breakpoint, and the excess ``Σ cap_g − B`` is taken
off the groups that finish last (a smaller share never takes longer, so the makespan stays the
optimum). It is the single-option case of the planner's
:class:`hetrain.planner.shares.ShareProblem` (the same capacities and breakpoints; the planner's
solver also chooses among several ``(μ, split)`` options per group): tests/control/test_shares.py
checks both against brute force and against each other.
"""

from __future__ import annotations

import math

import numpy as np

_NO_MEMORY_CAP = np.int64(2**40)
"""``n_g`` for a group whose memory never binds (any finite count above every batch)."""

SCALAR_GROUPS = 16
"""Up to this many groups the bisection sums the capacities in a Python loop over the usable
groups instead of numpy's (about 45 sums per solve; a numpy pass costs 10-15 µs whatever the
number of groups, the loop under 1 µs a group). The same float: the same IEEE operations per
group, and the capacities are whole numbers whose sum is exact in any order. 0: numpy
always (tests compare both)."""


def solve_shares(
    fill_s: np.ndarray,
    bottleneck_s: np.ndarray,
    microbatch: np.ndarray,
    max_microbatches: np.ndarray,
    batch: int,
) -> np.ndarray | None:
    """Integer shares ``b_g`` minimising ``max_{g: b_g > 0} T_g(b_g)`` (module docstring).

    Args:
        fill_s: ``A_g`` (s), shape ``(G,)``; a non-finite value leaves the group idle.
        bottleneck_s: ``M_g`` (s, ≥ 0), shape ``(G,)``.
        microbatch: ``μ_g`` (samples, ≥ 1), shape ``(G,)``.
        max_microbatches: ``n_g`` (≥ 0; values above ``2^40`` or non-finite: no memory cap),
            shape ``(G,)``; a group with ``n_g < 1`` stays idle.
        batch: ``B`` (samples, ≥ 0).

    Returns:
        ``b_g`` (int64, shape ``(G,)``, summing to ``batch``), or None when the groups cannot
        hold ``batch`` samples (memory) or no group can take work. Among optimal assignments
        the solver's tie-breaking decides (groups that are not needed go idle).

    Raises:
        ValueError: arrays of different shapes or a negative ``batch``.
    """
    fill = np.asarray(fill_s, dtype=float).ravel()
    bottleneck = np.asarray(bottleneck_s, dtype=float).ravel()
    mu = np.asarray(microbatch).ravel()
    n_max = np.asarray(max_microbatches, dtype=float).ravel()
    if not (len(fill) == len(bottleneck) == len(mu) == len(n_max)):
        raise ValueError(
            "solve_shares: fill_s, bottleneck_s, microbatch and max_microbatches must have "
            f"one entry per group, got {len(fill)}, {len(bottleneck)}, {len(mu)}, {len(n_max)}"
        )
    batch = int(batch)
    if batch < 0:
        raise ValueError(f"batch: expected >= 0, got {batch}")
    if batch == 0:
        return np.zeros(len(fill), dtype=np.int64)
    n_cap = np.where(
        np.isfinite(n_max), np.minimum(n_max, float(_NO_MEMORY_CAP)), float(_NO_MEMORY_CAP)
    )
    usable = np.isfinite(fill) & np.isfinite(bottleneck) & (n_cap >= 1) & (mu >= 1)
    if not usable.any():
        return None
    a = np.where(usable, fill, np.inf)
    m = np.where(usable, np.maximum(bottleneck, 0.0), 0.0)
    mb = np.where(usable, mu, 1).astype(float)
    # no group ever needs more than ⌈B/μ⌉ micro-batches
    n = np.where(usable, np.minimum(np.floor(n_cap), np.ceil(batch / mb)), 0.0)
    if float(np.minimum(mb * n, batch).sum()) < batch:
        return None

    inv_m = 1.0 / np.where(m > 0, m, 1e-300)
    flat = usable & (m <= 0)  # every micro-batch done by A_g
    any_flat = bool(flat.any())

    def capacity(t: float) -> np.ndarray:
        # (+1e-9 of a step: a breakpoint is never lost to rounding)
        steps = np.floor((t - a) * inv_m + 1e-9) + 1.0
        np.clip(steps, 0.0, n, out=steps)
        if any_flat:
            steps = np.where(flat, np.where(t >= a, n, 0.0), steps)
        return np.minimum(mb * steps, float(batch))

    # (a_g, 1/M_g, n_g, μ_g) of the usable groups for the loop (the others' capacity is 0)
    scalar = None
    if len(a) <= SCALAR_GROUPS and not any_flat:
        scalar = [
            (float(a[g]), float(inv_m[g]), float(n[g]), float(mb[g]))
            for g in np.flatnonzero(usable)
        ]
    whole = float(batch)

    def total(t: float) -> float:
        """``capacity(t).sum()`` (the same float)."""
        if scalar is None:
            return float(capacity(t).sum())
        out = 0.0
        for a_g, inv_g, n_g, mb_g in scalar:
            x = (t - a_g) * inv_g + 1e-9
            if not math.isfinite(x):  # numpy's infinities and NaN: its own answer
                return float(capacity(t).sum())
            steps = min(max(math.floor(x) + 1.0, 0.0), n_g)
            out += min(mb_g * steps, whole)
        return out

    hi = float(np.max(np.where(usable, a + (n - 1.0) * m, -np.inf)))  # every group full
    lo = float(np.nextafter(np.min(a), -np.inf))  # below every fill: nothing fits
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if not (lo < mid < hi) or hi - lo <= 1e-12 * abs(hi):
            break
        if total(mid) >= batch:
            hi = mid
        else:
            lo = mid
    # the least breakpoint A_g + j M_g in (lo, hi] that suffices
    with np.errstate(divide="ignore", invalid="ignore"):
        j = np.where(m > 0, np.floor((lo - a) / np.where(m > 0, m, 1.0)) + 1.0, 0.0)
    j = np.clip(j, 0.0, np.maximum(n - 1.0, 0.0))
    points = a + j * m
    points = np.unique(points[usable & (points > lo) & (points <= hi)])
    for t in points:
        if total(float(t)) >= batch:
            hi = float(t)
            break
    shares = capacity(hi).astype(np.int64)
    excess = int(shares.sum()) - batch
    finish = np.where(shares > 0, a + (np.ceil(shares / mb) - 1.0) * m, -np.inf)
    for g in np.argsort(-finish, kind="stable"):
        if excess <= 0:
            break
        take = min(excess, int(shares[g]))
        shares[g] -= take
        excess -= take
    return shares
