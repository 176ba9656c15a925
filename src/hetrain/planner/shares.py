"""Integer shares ``b_g`` for fixed group structures (docs/model.md §4 "shares").

Each group offers *options*: a micro-batch size ``μ``, a split with fill ``A`` and bottleneck
``M`` (:mod:`hetrain.planner.partition`) and the largest number of micro-batches ``n_max`` that
fits in memory. With option ``p`` a group finishes ``b`` samples in
``T_g = A_p + (ceil(b / μ_p) − 1) M_p`` (``ceil(b/μ_p) ≤ n_max``), a staircase in ``b``; by time
``T`` it can take ``cap_p(T) = μ_p · min(n_max, ⌊(T − A_p)/M_p⌋ + 1)`` samples (0 if ``T < A_p``),
and the group ``cap_g(T) = max_p cap_p(T)``.

Exact solution of ``min_b max_g T_g(b_g)`` s.t. ``Σ b_g = B``, ``b_g ≥ 0`` integer (a group
with ``b_g = 0`` sits idle):

* small ``G·B²``: a min-max dynamic program over groups on the exact tables ``T_g(b)``,
  ``b = 0..B`` (``O(P B + G B²)``);
* otherwise bisection on ``T`` for the least ``T`` with ``Σ_g cap_g(T) ≥ B`` (``cap`` is a
  staircase with breakpoints ``A_p + j M_p``; bisection runs to float resolution, then shares
  are ``cap_g(T)`` reduced by the excess, slowest groups first, and the time is recomputed
  from the shares so it is exactly the breakpoint reached).

The linear relaxation ``min T s.t. α_p b_g + δ_p ≤ T`` with ``α_p = M_p/μ_p``,
``δ_p = A_p − M_p`` (since ``ceil(b/μ) ≥ b/μ``) is solved in closed form by water filling
(:meth:`ShareProblem.lp_bound_s`) and is a lower bound on the integer optimum used for pruning.
Which groups sit idle changes ``G'`` and ``T_sync`` (and the cost): that choice is made by the
caller (:mod:`hetrain.planner.search`) over active subsets, since it needs the sync model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from hetrain.planner.partition import SplitTable

# ShareProblem._finish times each member's (entry, share) pair directly up to this many
# members, and only the distinct pairs (np.unique) beyond
FINISH_DIRECT_MAX = 64
# _padded_time_arrays fills the rows of up to this many groups one by one (a few slice
# assignments), more groups with one scatter of all options
PADDED_BY_ROWS_MAX = 16


@dataclass(frozen=True)
class GroupOptions:
    """All options of one group, shape ``(P,)`` each (``bounds``: ``(P, K + 1)``)."""

    microbatch_size: np.ndarray
    fill_s: np.ndarray
    bottleneck_s: np.ndarray
    max_microbatches: np.ndarray
    bounds: np.ndarray

    @classmethod
    def from_tables(cls, tables: Sequence[SplitTable], num_stages: int) -> GroupOptions:
        """Concatenate split tables of several ``μ`` (empty tables allowed)."""
        tables = [t for t in tables if len(t)]
        if not tables:
            return cls(
                np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0, np.int64),
                np.zeros((0, num_stages + 1), np.int64),
            )  # fmt: skip
        if len(tables) == 1:
            t = tables[0]
            return cls(np.full(len(t), t.microbatch_size, np.int64), t.fill_s, t.bottleneck_s,
                       t.max_microbatches, t.bounds)  # fmt: skip
        return cls(
            np.repeat(
                np.array([t.microbatch_size for t in tables], dtype=np.int64),
                [len(t) for t in tables],
            ),
            np.concatenate([t.fill_s for t in tables]),
            np.concatenate([t.bottleneck_s for t in tables]),
            np.concatenate([t.max_microbatches for t in tables]),
            np.concatenate([t.bounds for t in tables]),
        )

    def __len__(self) -> int:
        return len(self.fill_s)

    def time_for(self, batch: int) -> tuple[float, int]:
        """``(min_p T_g, p)`` for ``b_g = batch`` over options that fit; ``(inf, -1)`` if
        none; ``(0, -1)`` for ``batch = 0``."""
        if batch <= 0:
            return 0.0, -1
        n = -(-batch // self.microbatch_size)
        t = np.where(n <= self.max_microbatches, self.fill_s + (n - 1) * self.bottleneck_s, np.inf)
        if not len(t):
            return np.inf, -1
        p = int(np.argmin(t))
        return float(t[p]), p

    def time_table(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact ``T_g(b)`` for ``b = 0..B`` and the best option per ``b``, shape ``(B+1,)``."""
        b = np.arange(batch + 1)
        if not len(self):
            t = np.full(batch + 1, np.inf)
            t[0] = 0.0
            return t, np.full(batch + 1, -1)
        # (B + 1, P): ceil(b / μ) by a float division (exact: b / μ is an integer or at least
        # 1/μ from one, far above the rounding error while B < 2^40), the argmin along rows
        n = np.ceil(b[:, None] / self.microbatch_size.astype(float))
        t = self.fill_s + (n - 1.0) * self.bottleneck_s
        np.copyto(t, np.inf, where=n > self.max_microbatches)
        p = np.argmin(t, axis=1)
        best = t[b, p]
        best[0] = 0.0
        p[0] = -1
        return best, p


def _min_max_step(f: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One step of the share DP: ``h[b] = min_{x ≤ b} max(f[b − x], g[x])`` and the first
    ``x`` reaching it, ``b = 0..B`` (shapes ``(B + 1,)``; ``f``: the best time of the groups
    so far for ``b`` samples, ``g``: the next group's time for ``x``).

    Both are non-decreasing with ``f[0] ≤ g[0]`` (times of more samples are never shorter;
    0 samples take 0 s), so for each ``b`` ``max(f[b − x], g[x])`` is ``f[b − x]``
    (non-increasing) before the first ``x₀`` with ``g[x] ≥ f[b − x]`` and ``g[x]``
    (non-decreasing) from it: the minimum is ``min(f[b − x₀ + 1], g[x₀])``, and ``x₀`` and
    the first ``x`` with ``f[b − x]`` equal to the left value are found by binary search
    (``O(B log B)``, comparisons only: the same values and indices as the ``O(B²)`` scan,
    which is used when the inputs are not monotone, and below ``B = 63`` where it is
    faster)."""
    n1 = len(f)
    if n1 < 64 or not (f[0] <= g[0] and (f[1:] >= f[:-1]).all() and (g[1:] >= g[:-1]).all()):
        # vals[b, x] = max(f[b − x], g[x]) for x ≤ b, inf for x > b: row b of a sliding
        # window over f reversed and padded with inf
        pad = np.full(n1 - 1, np.inf)
        window = sliding_window_view(np.concatenate((f[::-1], pad)), n1)
        vals = np.maximum(window[::-1], g[None, :])
        arg = np.argmin(vals, axis=1)
        return vals[np.arange(n1), arg], arg
    b = np.arange(n1)
    # g[x] >= f[b - x]  <=>  b <= x + (last y with f[y] <= g[x]), increasing in x
    reach = b + np.searchsorted(f, g, side="right") - 1
    x0 = np.searchsorted(reach, b, side="left")
    right = g[x0]
    left = np.where(x0 >= 1, f[np.minimum(np.maximum(b - x0 + 1, 0), n1 - 1)], np.inf)
    use_left = left <= right
    first_left = np.maximum(b - (np.searchsorted(f, left, side="right") - 1), 0)
    return np.where(use_left, left, right), np.where(use_left, first_left, x0)


def _option_arrays(groups: Sequence[GroupOptions], batch: int) -> dict:
    """The options of ``groups`` laid end to end (groups with options only): ``mu`` (float),
    ``fill``, ``bottleneck`` (at least 1e-300), ``nmax`` (at most ``ceil(B / μ)``, float),
    shape ``(P,)``; ``starts`` (each such group's first option), ``nonempty`` (per group),
    ``sizes`` (options per group)."""
    sizes = np.array([len(g) for g in groups], dtype=np.int64)
    nonempty = sizes > 0
    live = [g for g in groups if len(g)]
    out = {"groups": list(groups), "batch": int(batch), "sizes": sizes, "nonempty": nonempty,
           "starts": np.concatenate(([0], np.cumsum(sizes[nonempty])[:-1]))}  # fmt: skip
    if live:
        mu = np.concatenate([g.microbatch_size for g in live]).astype(float)
        nmax = np.concatenate([g.max_microbatches for g in live])
        out["mu"] = mu
        out["fill"] = np.concatenate([g.fill_s for g in live])
        out["bottleneck"] = np.maximum(np.concatenate([g.bottleneck_s for g in live]), 1e-300)
        # no group ever needs more than ceil(B / μ) micro-batches
        out["nmax"] = np.minimum(nmax, -(-int(batch) // mu)).astype(float)
    else:
        out["mu"] = out["fill"] = out["bottleneck"] = out["nmax"] = np.zeros(0)
    return out


def _padded_time_arrays(groups: Sequence[GroupOptions]) -> tuple[np.ndarray, ...]:
    """The options' own ``(μ, A, M, n_max)`` (:meth:`GroupOptions.time_for`'s inputs) as
    ``(G, P_max)`` arrays (``n_max`` as floats: exact for any count of micro-batches),
    padded with ``μ = 1``, ``A = inf``, ``M = 0``, ``n_max = −1``."""
    sizes = [len(g) for g in groups]
    width = max(max(sizes, default=0), 1)
    by_rows = len(groups) <= PADDED_BY_ROWS_MAX
    if not by_rows:
        counts = np.array(sizes, dtype=np.int64)
        rows = np.repeat(np.arange(len(groups)), counts)
        cols = np.arange(int(counts.sum())) - (counts.cumsum() - counts).repeat(counts)
    mu_type = np.result_type(np.int64, *[g.microbatch_size for g in groups])
    arrays = []
    for name, pad, dtype in (("microbatch_size", 1, mu_type), ("fill_s", np.inf, float),
                             ("bottleneck_s", 0.0, float),
                             ("max_microbatches", -1.0, float)):  # fmt: skip
        out = np.empty((len(groups), width), dtype=dtype)
        out.fill(pad)
        if by_rows:
            for row, (g, size) in enumerate(zip(groups, sizes, strict=True)):
                if size:
                    out[row, :size] = getattr(g, name)
        elif len(rows):
            out[rows, cols] = np.concatenate([getattr(g, name) for g in groups])
        arrays.append(out)
    return tuple(arrays)


class ShareChain:
    """The share DP's states along one sequence of group options, kept for the next problem
    whose members start with the same options (the same objects): the search solves the
    prefixes of one ranked list of groups (all of them, then without the last, ...), and the
    DP over members ``1..m`` is the first ``m − 1`` steps of the DP over more members. The
    states are those of the DP run on the problem alone (the same steps on the same tables),
    so solutions are identical; one chain per ranked list (and per batch ``B``)."""

    def __init__(self) -> None:
        self._members: list[GroupOptions] = []  # the options of member k (chain order)
        self._best: list[np.ndarray] = []  # DP value after members 0..k, shape (B + 1,)
        self._choices: list[np.ndarray] = []  # first x reaching it at step k (k ≥ 1)
        self._tables: dict[int, tuple[GroupOptions, np.ndarray]] = {}  # id → T_g(b) table
        self._batch: int | None = None
        self._arrays: dict | None = None  # _option_arrays of the longest list asked for

    def option_arrays(self, groups: Sequence[GroupOptions], batch: int) -> dict:
        """:func:`_option_arrays` (with ``"time"``: :func:`_padded_time_arrays`) of
        ``groups``: a slice of those of the last list asked for when ``groups`` starts it
        (the same objects; the options of the first groups are the first entries, padding
        columns never win), else computed and kept."""
        full = self._arrays
        count = len(groups)
        if (full is None or full["batch"] != batch or len(full["groups"]) < count
                or any(a is not b for a, b in zip(full["groups"][:count], groups, strict=True))
                ):  # fmt: skip
            full = self._arrays = _option_arrays(groups, batch)
            full["time"] = _padded_time_arrays(groups)
        if len(full["groups"]) == count:
            return full
        nonempty = full["nonempty"][:count]
        total = int(full["sizes"][:count].sum())
        out = {"nonempty": nonempty, "starts": full["starts"][: int(nonempty.sum())]}
        for name in ("mu", "fill", "bottleneck", "nmax"):
            out[name] = full[name][:total]
        out["time"] = tuple(a[:count] for a in full["time"])
        return out

    def _table(self, options: GroupOptions, batch: int) -> np.ndarray:
        found = self._tables.get(id(options))
        if found is None or found[0] is not options:
            found = (options, options.time_table(batch)[0])
            self._tables[id(options)] = found
        return found[1]

    def run(self, members: Sequence[GroupOptions], batch: int
            ) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
        """``(h, choices)``: the min-max DP value over ``members`` (shape ``(B + 1,)``) and the
        first ``x`` reaching it at each step ``1..m − 1`` (:func:`_min_max_step`)."""
        if batch != self._batch:
            self.__init__()
            self._batch = batch
        common = 0
        while (common < min(len(members), len(self._members))
               and self._members[common] is members[common]):  # fmt: skip
            common += 1
        del self._members[common:], self._best[common:], self._choices[max(common - 1, 0) :]
        for k in range(common, len(members)):
            table = self._table(members[k], batch)
            if k == 0:
                self._best.append(table)
            else:
                value, arg = _min_max_step(self._best[k - 1], table)
                self._best.append(value)
                self._choices.append(arg)
            self._members.append(members[k])
        return self._best[len(members) - 1], self._choices[: len(members) - 1]


@dataclass(frozen=True)
class ShareSolution:
    """``max_group_time_s`` = ``max_g T_g``; ``shares`` ``b_g`` and chosen ``option`` index per
    group (``-1`` for idle groups), shape ``(G,)``; ``group_times_s`` ``T_g``."""

    max_group_time_s: float
    shares: np.ndarray
    option: np.ndarray
    group_times_s: np.ndarray


class ShareProblem:
    """The share problem of one structure: ``groups`` options, global batch ``batch``.

    ``counts`` (optional, shape ``(G,)``) makes entry ``g`` stand for ``counts[g]`` identical
    groups (same options): capacities are summed with that multiplicity, so a structure of
    1024 groups of 5 kinds costs as much as one of 5 groups. Solutions list shares per group
    *member*, entry by entry (``counts[0]`` members of entry 0 first, ...).
    """

    def __init__(
        self,
        groups: Sequence[GroupOptions],
        batch: int,
        counts: Sequence[int] | np.ndarray | None = None,
        chain: ShareChain | None = None,
    ) -> None:
        self.groups = list(groups)
        self.batch = int(batch)
        self.chain = chain
        self.counts = (
            np.ones(len(self.groups), dtype=np.int64)
            if counts is None
            else np.asarray(counts, dtype=np.int64)
        )
        arrays = (
            _option_arrays(self.groups, self.batch)
            if chain is None
            else chain.option_arrays(self.groups, self.batch)
        )
        self._nonempty = arrays["nonempty"]
        self._every_group_has_options = bool(self._nonempty.all())
        self._starts = arrays["starts"]
        self._mu, self._fill = arrays["mu"], arrays["fill"]
        self._bottleneck, self._nmax = arrays["bottleneck"], arrays["nmax"]
        self._time_padded = arrays.get("time")

    # -- capacities -----------------------------------------------------------------------
    def capacity(self, time_s: float) -> np.ndarray:
        """``cap_g(T)`` samples per group, shape ``(G,)`` (capped at ``B``)."""
        if not len(self._mu):
            return np.zeros(len(self.groups))
        n = np.floor((time_s - self._fill) / self._bottleneck) + 1.0
        n = np.maximum(np.minimum(n, self._nmax), 0.0)
        per_option = self._mu * n
        if self._every_group_has_options:
            out = np.maximum.reduceat(per_option, self._starts)
        else:
            out = np.zeros(len(self.groups))
            out[self._nonempty] = np.maximum.reduceat(per_option, self._starts)
        return np.minimum(out, self.batch)

    def total_capacity(self, time_s: float) -> float:
        """``Σ_g counts_g · cap_g(T)``."""
        return float(np.dot(self.capacity(time_s), self.counts))

    def lp_bound_s(self) -> float:
        """The LP relaxation's optimum: least ``T`` with ``Σ_g max_p (T − δ_p)/α_p ≥ B``
        (memory and integrality dropped), a lower bound on ``max_g T_g``.

        The capacity ``f(T) = Σ_g counts_g max(0, max_p (T − δ_p)/α_p)`` is convex,
        piecewise linear and increasing where positive, so Newton's method from
        ``T_0 = min_p (δ_p + α_p B)`` (``f(T_0) ≥ B``), with the slope of each group's best
        option, stays at or above the root and reaches it in at most one step per linear
        piece (a few); the root is returned less a relative ``1e-12`` (a lower bound also
        after rounding). Falls back to bisection if it has not converged after 64 steps."""
        if not len(self._mu):
            return np.inf
        alpha = self._bottleneck / self._mu
        delta = self._fill - self._bottleneck
        inv_alpha = 1.0 / alpha
        counts = self.counts[self._nonempty].astype(float)
        starts = self._starts
        sizes = np.empty(len(starts), dtype=np.int64)  # options per group with options
        sizes[:-1] = starts[1:] - starts[:-1]
        sizes[-1] = len(alpha) - starts[-1]
        batch = float(self.batch)
        t = float((delta + alpha * self.batch).min())
        for _ in range(64):
            per = (t - delta) * inv_alpha
            best = np.maximum.reduceat(per, starts)
            total = float(np.dot(np.maximum(best, 0.0), counts))
            excess = total - batch
            if not np.isfinite(excess):
                break
            if excess <= 1e-12 * batch:
                return max(t * (1.0 - 1e-12), 0.0)
            # each positive group's slope: 1/α of its best option at t
            hit = per == best.repeat(sizes)
            first = np.maximum.reduceat(np.where(hit, inv_alpha, 0.0), starts)
            slope = float(np.dot(np.where(best > 0.0, first, 0.0), counts))
            if not (slope > 0.0 and np.isfinite(slope)):
                break
            step = excess / slope
            if not step > 1e-15 * abs(t):
                return max(t * (1.0 - 1e-12), 0.0)
            t -= step
        return self._lp_bound_bisection(alpha, delta)

    def _lp_bound_bisection(self, alpha: np.ndarray, delta: np.ndarray) -> float:
        """:meth:`lp_bound_s` by bisection (to a relative ``1e-12``; returns the infeasible
        end, a lower bound)."""

        def cap(t: float) -> float:
            per = np.maximum((t - delta) / alpha, 0.0)
            per_group = np.zeros(len(self.groups))
            per_group[self._nonempty] = np.maximum.reduceat(per, self._starts)
            return float(np.dot(per_group, self.counts))

        lo, hi = 0.0, float(np.min(delta + alpha * self.batch))
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            if cap(mid) >= self.batch:
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-12 * hi:
                break
        return lo

    # -- exact solution -------------------------------------------------------------------
    def solve(self) -> ShareSolution | None:
        """Exact integer shares minimising ``max_g T_g``; None when ``B`` samples cannot be
        placed (memory)."""
        members = int(self.counts.sum())
        if members * (self.batch + 1) ** 2 <= 100_000:
            return self._solve_dp()
        return self._solve_bisection()

    def _solve_dp(self) -> ShareSolution | None:
        b_total = self.batch
        members = [g for g, c in zip(self.groups, self.counts, strict=True) for _ in range(c)]
        chain = self.chain if self.chain is not None else ShareChain()
        best, choices = chain.run(members, b_total)
        g_count = len(members)
        if not np.isfinite(best[b_total]):
            return None
        shares = np.zeros(g_count, dtype=np.int64)
        left = b_total
        for g in range(g_count - 1, 0, -1):
            x = int(choices[g - 1][left])
            shares[g] = x
            left -= x
        shares[0] = left
        return self._finish(shares)

    def _solve_bisection(self) -> ShareSolution | None:
        b_total = self.batch
        if not len(self._mu):
            return None
        # the least GroupOptions.time_for(B) over the groups, every option at once
        mu, fill, bottleneck, nmax = self._time_arrays()
        n = -(-b_total // mu)
        hi = float(np.min(np.where(n <= nmax, fill + (n - 1) * bottleneck, np.inf)))
        # (nudged: the floor in `capacity` must not lose the breakpoint to rounding)
        hi = hi * (1 + 1e-9) if np.isfinite(hi) else max(float(np.max(self._fill)), 1e-12)
        for _ in range(200):
            if self.total_capacity(hi) >= b_total:
                break
            hi *= 2.0
        else:
            return None
        lo = 0.0
        for _ in range(80):
            mid = 0.5 * (lo + hi)
            if mid <= lo or mid >= hi or hi - lo <= 1e-7 * hi:
                break
            if self.total_capacity(mid) >= b_total:
                hi = mid
            else:
                lo = mid
        hi = self._snap(lo, hi)
        cap = np.repeat(self.capacity(hi).astype(np.int64), self.counts)
        excess = int(cap.sum()) - b_total
        # slowest groups (least capacity) give back first, so marginal groups go idle
        for g in np.argsort(cap, kind="stable"):
            if excess <= 0:
                break
            take = min(int(cap[g]), excess)
            cap[g] -= take
            excess -= take
        return self._finish(cap)

    def _time_arrays(self) -> tuple[np.ndarray, ...]:
        """:func:`_padded_time_arrays` of the groups (the chain's, when it has them)."""
        if self._time_padded is None:
            self._time_padded = _padded_time_arrays(self.groups)
        return self._time_padded

    def _snap(self, lo: float, hi: float) -> float:
        """The least staircase breakpoint ``A_p + j M_p`` in ``(lo, hi]`` at which the
        capacities suffice (``hi`` is feasible, ``lo`` is not), nudged up by 1e-12 relative so
        that the floor in :meth:`capacity` is safe from rounding."""
        first = np.floor((lo - self._fill) / self._bottleneck) + 1.0
        first = np.maximum(first, 0.0)
        points = []
        for step in range(3):
            j = first + step
            t = self._fill + j * self._bottleneck
            ok = (t <= hi) & (j < self._nmax)
            points.append(t[ok])
        cands = np.unique(np.concatenate(points)) if points else np.zeros(0)
        for t in cands:
            t_safe = float(t) * (1 + 1e-12)
            if t_safe < hi and self.total_capacity(t_safe) >= self.batch:
                return t_safe
        return hi

    def _finish(self, shares: np.ndarray) -> ShareSolution | None:
        entry = np.arange(len(self.groups)).repeat(self.counts)
        # GroupOptions.time_for of each distinct (entry, share) pair, all pairs in one pass
        # over the options padded to (G, P_max) (padding never fits: n_max = -1, so it is
        # inf and after every option, and argmin keeps time_for's first index); up to
        # FINISH_DIRECT_MAX members, every member's pair as it is (the same values, without
        # the sort that finds the distinct pairs)
        shares = np.asarray(shares, dtype=np.int64)
        if len(shares) <= FINISH_DIRECT_MAX:
            e, b = entry, shares
            which = np.arange(len(shares))
        else:
            width = self.batch + 1
            pairs, which = np.unique(entry * width + shares, return_inverse=True)
            e, b = pairs // width, pairs % width
        mu, fill, bottleneck, nmax = self._time_arrays()
        n = -(-b[:, None] // mu[e])
        t = np.where(n <= nmax[e], fill[e] + (n - 1) * bottleneck[e], np.inf)
        p = np.argmin(t, axis=1)
        found_t = np.where(b <= 0, 0.0, t[np.arange(len(p)), p])
        found_p = np.where((b <= 0) | ~np.isfinite(found_t), -1, p)
        times = found_t[which.ravel()]
        option = found_p[which.ravel()]
        if not np.all(np.isfinite(times)):
            return None
        return ShareSolution(float(times.max(initial=0.0)), shares, option, times)
