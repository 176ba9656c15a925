"""The one speed estimator of the controller: per-device slow-downs and per-kind fixed costs
from measured compute times (docs/model.md §3), used by the runtime's controller process
(``hetrain.runtime.ctlcontroller.PlanController``) and by replays of its measurements.

Imports numpy and the cluster state only (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.costmodel import profile_prefix, stage_compute_s
from hetrain.profile import ProfileArrays


def _median(values: Sequence[float] | np.ndarray) -> float:
    """``float(np.median(values))`` of a non-empty 1-D sequence, the same float: the middle
    value of the sorted values, or ``(a + b) / 2`` of the two middle ones (numpy's mean:
    their sum from ``+0.0``, divided by their number), without numpy's per-call cost (tens of
    microseconds, against one or two for the 13-39 values the estimator takes medians of,
    dozens of times a step). Values with a NaN go to ``np.median`` (NaN).

    Raises:
        IndexError: ``values`` is empty.
    """
    s = sorted(values.tolist() if isinstance(values, np.ndarray) else values)
    total = sum(s)
    if total != total:  # a NaN among them (or inf and -inf): numpy's own answer
        return float(np.median(np.asarray(s, dtype=float)))
    n = len(s)
    h = n // 2
    # numpy's sum starts at +0.0 (a lone -0.0 gives 0.0)
    return float(0.0 + s[h]) if n % 2 else float((0.0 + s[h - 1] + s[h]) / 2)


def _row_medians(values: np.ndarray) -> np.ndarray:
    """The median of each row of ``values`` (shape ``(R, C)``) over its non-NaN entries,
    ``np.nanmedian(values, axis=1)``'s values (each row holds at least one), without its
    per-call cost on small arrays (its masked-array path: ~0.6 ms a call)."""
    ordered = np.sort(values, axis=1)  # NaN sorted last
    count = np.sum(~np.isnan(ordered), axis=1)
    lo = np.take_along_axis(ordered, ((count - 1) // 2)[:, None], 1)[:, 0]
    hi = np.take_along_axis(ordered, (count // 2)[:, None], 1)[:, 0]
    return 0.5 * (lo + hi)


def level_segments(
    log_t: np.ndarray,
    work: np.ndarray,
    sigma: float,
    tolerance: float,
    z: float,
    least: int = 2,
) -> list[slice]:
    """The pieces of one device's measurements (oldest first) between its changes of speed:
    a change of level of ``log t`` inside a run of consecutive measurements of the same work
    (a change of the time per sample at an unchanged share; a change that coincides with a
    change of share cannot be told from a fixed cost and is not looked for).

    Each run (consecutive rows of ``work`` equal within a relative ``1e-9``, e.g. the
    start-up time and number of micro-batches) is cut by binary segmentation: the cut that
    minimises the two sides' sum of absolute deviations from their own medians, each side
    at least ``least`` measurements, kept where the gap between the two medians exceeds
    ``tolerance`` (log) and ``z`` standard errors ``1.2533 σ √(1/n₁ + 1/n₂)`` (``σ``:
    ``sigma``, the noise of ``log t`` within runs); then each side the same way.

    Args:
        log_t: log of the measured times (shape ``(N,)``).
        work: what each measurement ran (shape ``(N, K)``); rows equal = the same work.
        sigma: noise of ``log t`` (standard deviation); ``inf``: no cut.
        tolerance: least gap (log) between two medians read as a change of speed.
        z: standard errors of that gap at which it is read as one.
        least: least measurements on each side of a cut.

    Returns:
        Slices of ``range(N)``, in order, covering it.
    """
    n = len(log_t)
    if n == 0:
        return []
    work = np.asarray(work, dtype=float).reshape(n, -1)
    same = np.all(np.isclose(work[1:], work[:-1], rtol=1e-9, atol=0.0), axis=1)
    starts = [0, *(np.flatnonzero(~same) + 1).tolist(), n]
    cuts: list[int] = []

    def split(lo: int, hi: int) -> None:
        length = hi - lo
        if length < 2 * least or not math.isfinite(sigma):
            return
        y = np.asarray(log_t[lo:hi], dtype=float)
        ks = np.arange(least, length - least + 1)
        cols = np.arange(length)[None, :]
        left = np.where(cols < ks[:, None], y[None, :], np.nan)
        right = np.where(cols >= ks[:, None], y[None, :], np.nan)
        med_l = _row_medians(left)
        med_r = _row_medians(right)
        cost = np.nansum(np.abs(left - med_l[:, None]), axis=1) + np.nansum(
            np.abs(right - med_r[:, None]), axis=1
        )
        j = int(np.argmin(cost))
        k = int(ks[j])
        gap = abs(float(med_r[j] - med_l[j]))
        se = 1.2533 * sigma * math.sqrt(1.0 / k + 1.0 / (length - k))
        if gap > tolerance and gap > z * se:
            cuts.append(lo + k)
            split(lo, lo + k)
            split(lo + k, hi)

    for a, b in zip(starts[:-1], starts[1:], strict=True):
        split(a, b)
    bounds = [0, *sorted(cuts), n]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def run_noise(log_t: Sequence[np.ndarray], work: Sequence[np.ndarray]) -> float:
    """The noise ``σ`` of ``log t`` within runs of the same work, pooled over series (one per
    device): ``1.4826 · median |Δ log t| / √2`` over consecutive measurements of the same work
    (a change of level moves one difference, a descheduled step two); ``inf`` without any
    such pair."""
    diffs = []
    for y, w in zip(log_t, work, strict=True):
        w = np.asarray(w, dtype=float).reshape(len(y), -1)
        same = np.all(np.isclose(w[1:], w[:-1], rtol=1e-9, atol=0.0), axis=1)
        diffs.append(np.abs(np.diff(np.asarray(y, dtype=float)))[same])
    pooled = np.concatenate(diffs) if diffs else np.zeros(0)
    if not len(pooled):
        return math.inf
    return 1.4826 * _median(pooled) / math.sqrt(2.0)


class SpeedEstimates:
    """Per-device slow-downs and per-kind fixed costs from per-iteration compute measurements,
    and the speeds and fixed costs they give.

    **Model.** Each iteration of device ``d`` gives its measured stage compute time ``t``, the
    start-up calibration's prediction ``e`` for the same work (``e = flops / s_d + n (κ_d +
    λ_d Σν_l)``, docs/model.md §3: each micro-batch of a stage costs ``μ c + κ + λ Σν_l``; or
    the stage's measured per-layer times when the device's kind has them, ``expected_s`` of
    :meth:`observe`) and its number of micro-batches ``n``. The measured time is modelled as

        ``t = r_d (e + φ_k n)``

    ``φ_k`` (s per micro-batch, ``≥ 0``): the fixed cost per micro-batch that a step of a
    device of kind ``k`` takes beyond what the start-up calibration predicted (Python, the
    engine's per-micro-batch work, contention while the ranks train: the calibration times
    layers alone, and its fit can put part of a step's fixed cost into the per-sample term);
    ``r_d``: the device's slow-down, applied to all of its work (a device that slows down,
    thermal throttling, a shared or emulated device, is slower at its fixed work too). One
    ratio without ``φ`` (``t / e``) extrapolates badly across shares: a small share's step is
    mostly fixed cost, so its ratio rises as its share falls (8.4 at 1 sample against 2.2 at 4
    for a 3x slow rank of the README main job).

    **φ fit** (:meth:`close_step`, per kind): the least-absolute-deviation fit of ``log t -
    log(e + φ n) - m_p`` over the kind's devices with at least ``window`` measurements (all
    kept ones of a steady device, the short and long medians of its ratios within
    ``change_tolerance``; the last ``window`` of another), each device's measurements cut
    into pieces ``p`` at its changes of speed (:func:`level_segments`: a change of level of
    ``log t`` by more than ``change_tolerance`` and ``z`` standard errors inside a run of
    steps of the same work, ``σ`` from :func:`run_noise`), ``m_p`` each piece's median of
    ``log(t / (e + φ n))`` (its ``log r_d`` for that ``φ``). A device that changes speed and
    is then given another share (the controller re-balances after the change) has steps at
    its old speed and old share, its new speed and old share, and its new speed and new
    share: one level for all of them read the change of speed as a fixed cost (a device 3x
    slower from step 20 on was given φ = 390 ms, its speed estimate went 3.3 -> 74 -> 3.3
    GFLOP/s and the controller re-planned twice for nothing); each piece its own level
    takes ``φ`` from the steps at one speed only. A change of speed at the very step the
    share changes cannot be told from a fixed cost and is not looked for. Robust to
    descheduled steps (a step 2-5x its usual time counts by its rank, not its size). The
    best ``φ`` is searched on a grid of 65 values (0 and ``m · 10^[-3, 1.5]``, ``m`` the
    median start-up time per micro-batch of those measurements), then on 65 evenly spaced
    values between the best one's two neighbours. ``φ`` only shows where a device's work per
    micro-batch varies at one speed: the kind's ``φ`` is nonzero only where some piece holds
    start-up times per micro-batch at least ``1.5x`` apart and the best fit is
    significantly better than ``φ = 0``
    (:attr:`FIT_CHI2`), and then the lower end of the best fit's likelihood-ratio interval
    (:attr:`INTERVAL_CHI2`); else 0: the start-up calibration's split is the prior, kept
    until the measurements show otherwise. Refitted at every :meth:`close_step` from the
    kept measurements alone (no memory of earlier fits).

    **Slow-downs.** Each iteration gives the ratio ``t / (e + φ_k n)`` (recomputed from the
    kept ``(t, e, n)`` whenever ``φ_k`` changes); the estimate ``r̂_d`` is the median of the
    last ``long_window`` ratios while the median of the last ``window`` ratios is within
    ``change_tolerance`` of it (a steady device: the longer median is the more precise, so
    that identical ranks look identical), else the median of the last ``window`` (a lasting
    change, followed after ``window // 2 + 1`` steps). The device's speed, per-micro-batch
    overhead and per-layer overhead are then ``s_d / r̂_d``, ``(κ_d + φ_k) r̂_d`` and ``λ_d
    r̂_d`` (:meth:`apply`; a device whose kind has measured times runs them scaled by ``r̂_d``
    plus ``φ_k r̂_d`` per micro-batch, ``ClusterState.measured_extra_s``), so that the cost
    model predicts ``r̂_d (e + φ_k n)`` for any share.

    A median, not an EWMA: on a shared machine one step of a rank can take 5-10x its usual
    time (descheduled) for several steps in a row, which an EWMA carries into the next
    decisions; the median of 13 ignores up to 6 such steps and follows a lasting change after 7
    (docs/training.md).

    **Pooled per kind.** Devices of one kind (``kinds``: the start-up calibration's hardware
    kind) are the same hardware, so what their ratios differ by is, unless shown otherwise,
    contention noise (ranks sharing cores are descheduled at random; two equal ranks'
    7-step medians measured 2x apart on a loaded 2-core machine), and estimates that follow
    it give identical ranks unequal shares. A device's estimate is its kind's pooled ratio
    (the median over the kind's measured devices, those apart left out, of their own
    estimates) unless it is *significantly apart* from its kind.

    **Pooled per run.** Each device's ratio is relative to its own start-up calibration, so
    a slow-down common to the run's ranks (their contention while training together, not
    during calibration) moves every kind's ratio alike; a kind's estimate is the run's
    pooled ratio (the median over the measured devices of the kinds not apart, those apart
    from their kinds left out, of their own estimates) unless the kind is significantly
    apart from the run's pool. Devices that each name their own kind (a cluster file
    without ``kind``: ``w0``, ``w1``, ...) on identical hardware are pooled here; before,
    each followed its own noise (1.3-2x apart on a loaded machine: the controller put the
    whole batch on one rank of three identical ones). A device with no measurement takes
    its kind's ratio, or the run's when its kind has none, so an idle device does not look
    faster than its busy peers by the common factor.

    **Significantly apart** (a device from its kind's pool, or a kind from the run's): on
    the last ``window`` steps at which both were measured, ``x_t`` = log of the group's
    median ratio at step ``t`` over the median ratio at ``t`` of the pool's devices (the
    group's own included; those found apart by a first pass, or apart at the last step,
    left out so that a slow device does not pull its peers' pool towards it), so that a
    load common to the ranks cancels step by step (a window of one device against a longer
    one of its peers compares two loads). The group is apart when ``|median x|`` exceeds
    ``change_tolerance`` (relative) and ``z`` standard errors (``1.2533 σ / √n``, the
    median's asymptotic efficiency, e.g. Wilcox, *Introduction to Robust Estimation and
    Hypothesis Testing*, 4th ed., §3.3-3.4; ``σ`` = 1.4826 x the median absolute deviation
    of all groups' ``x`` from their own medians, pooled: one window's own, of 13 values, is
    itself ±30 % noise), and its quartile of ``x`` nearer 0 exceeds ``change_tolerance``
    too: descheduled episodes slow a rank's steps on one side only, so a run of them moves
    a window's median but not its lower quartile, while a lasting slow-down moves both
    (left after 10 of the window's 13 steps). Fewer than ``window // 2 + 1`` such steps
    (an idle device): not apart, unless it was (hysteresis).

    **Estimate of a group apart**: its pool's ratio times its slow-down relative to that
    pool, ``exp(median x)`` over its last ``window`` steps beside the pool's devices (the
    pool without it), or its own estimate without ``window // 2 + 1`` such steps: a load
    common to the ranks, which moves its pool's ratio, moves it too, also while it is idle
    (an idle slow rank's own estimate stayed where its last measurements left it while its
    peers' moved 2x with the load: "5.4x slower" for a rank emulated 3x slower).

    **Hysteresis.** A device or kind found apart stays apart (keeps its own estimate) until
    its ``|median x|`` comes back within ``change_tolerance`` (while idle: its estimate
    within ``change_tolerance`` of its pool's); the significance test decides only whether
    it leaves the pool. A device given little work after it was found slow (a share of one
    sample: its step is mostly scheduling noise) or none (idle: no new ratios) would
    otherwise fall back to its kind's ratio, be given an equal share again, be found slow
    again, and so on (``tests/control/test_estimates_pooled.py``). ``φ`` and the sets of
    devices and kinds apart are updated by :meth:`close_step`, once per step after that
    step's :meth:`observe` calls (a device measured twice without it starts a new step),
    so that :meth:`slowdowns` depends only on the measurements fed and not on how often it
    is asked.

    Args:
        ids: device ids.
        speed_flops: start-up speeds ``s_d`` (FLOP/s, > 0), aligned with ``ids``.
        kappa_s: start-up ``κ_d`` (s, default 0); layer_overhead_s: start-up ``λ_d`` (s per
            layer unit, default 0).
        window: the short window (measurements): its median follows a lasting change.
        long_window: the long window (default ``3 * window``): its median is the estimate of
            a steady device; also the most measurements kept per device.
        change_tolerance: relative gap between the two medians above which the short one is
            used; also the least relative gap from its pool at which a device or kind keeps
            its own estimate.
        kinds: the kind of each device, aligned with ``ids`` (default: every device its own
            kind, no pooling).
        z: standard errors of the gap from its pool at which a device's or kind's own
            estimate is significant (default 3).
    """

    FIT_SPREAD = 1.5
    """Least ratio between the largest and smallest start-up time per micro-batch in one
    device's window at which its measurements show ``φ``."""

    FIT_CHI2 = 10.83
    """Least likelihood-ratio statistic of the fitted ``φ`` against ``φ = 0`` at which the
    kind takes it: ``2 ΔL / τ``, ``ΔL`` the drop of the least-absolute-deviation loss and ``τ
    = σ √(π/2)`` its sparsity for normal residuals (``σ`` = 1.4826 x their MAD; Koenker,
    *Quantile Regression*, 2005, §3.5), against ``χ²₁`` at 0.999 (the test runs every step).
    With a 0.1 % drop of the loss as the threshold instead, a stream without fixed cost beyond
    the start-up one (±15 % uniform noise, ``tests/runtime/test_adapt_reaches_plan.py``) gave
    the slow rank a spurious ``φ`` and a speed estimate 30 % high."""

    INTERVAL_CHI2 = 3.84
    """The kind takes the lower end of the fitted ``φ``'s likelihood-ratio interval at
    ``χ²₁`` 0.95 (the least ``φ`` whose statistic against the best fit is within it): the
    smallest fixed cost the measurements support, so that a weakly determined fit (a flat
    loss over a wide range of ``φ``) stays near the start-up split. The best fit itself in a
    loaded README main job run (4 ranks on 2 cores, where a rank's compute time follows its
    peers' load more than its share) jumped to ``φ`` making the per-sample cost 20-70x
    smaller for one step, and the controller put the whole batch on one rank."""

    def __init__(
        self,
        ids: Sequence[str],
        speed_flops: Sequence[float],
        kappa_s: Sequence[float] | None = None,
        window: int = 13,
        layer_overhead_s: Sequence[float] | None = None,
        *,
        long_window: int | None = None,
        change_tolerance: float = 0.1,
        kinds: Sequence[str] | None = None,
        z: float = 3.0,
    ) -> None:
        self.ids = tuple(ids)
        self.kinds = dict(zip(self.ids, kinds if kinds is not None else self.ids, strict=True))
        self.z = float(z)
        self.speed_flops = dict(zip(self.ids, [float(v) for v in speed_flops], strict=True))
        self.kappa_s = dict(zip(self.ids, kappa_s or [0.0] * len(self.ids), strict=True))
        self.layer_overhead_s = dict(
            zip(self.ids, layer_overhead_s or [0.0] * len(self.ids), strict=True)
        )
        self.window = int(window)
        self.long_window = max(int(long_window or 3 * self.window), self.window)
        self.change_tolerance = float(change_tolerance)
        # per device, (time_s, start-up expected_s, micro-batches) per iteration, newest last
        self._samples: dict[str, list[tuple[float, float, float]]] = {d: [] for d in self.ids}
        # per device, the step index of each kept measurement (aligned with _samples)
        self._steps: dict[str, list[int]] = {d: [] for d in self.ids}
        self._step = 0  # index of the step being measured (close_step moves on)
        self.fixed_s: dict[str, float] = {}  # φ per kind (s per micro-batch; absent = 0)
        self.distinct: set[str] = set()  # devices out of their kind's pool (hysteresis)
        self.distinct_kinds: set[str] = set()  # kinds out of the run's pool (hysteresis)
        self._closed: dict[str, float] | None = None  # slowdowns() at the last close_step

    def observe(
        self,
        device: str,
        flops: float,
        time_s: float,
        num_microbatches: int,
        num_layers: float = 0,
        *,
        expected_s: float | None = None,
    ) -> None:
        """One iteration of ``device``: ``flops`` FLOPs computed in ``time_s`` seconds over
        ``num_microbatches`` micro-batches of a stage of ``num_layers`` layers, or its layer
        units ``Σ ν_l`` (docs/model.md (v3) §3). ``expected_s``: what the start-up
        calibration predicts for this work when it is not the FLOP model's (a device whose
        kind has measured per-layer times: :func:`startup_stage_time_s`), seconds."""
        if flops <= 0 or time_s <= 0 or not math.isfinite(time_s) or device not in self._samples:
            return
        speed = self.speed_flops[device]
        if not (speed > 0 and math.isfinite(speed)):
            return
        if expected_s is None:
            overhead_s = self.kappa_s[device] + num_layers * self.layer_overhead_s[device]
            expected_s = flops / speed + num_microbatches * overhead_s
        if not (expected_s > 0 and math.isfinite(expected_s)):
            return
        recent = self._samples[device]
        steps = self._steps.setdefault(device, [])
        if steps and steps[-1] >= self._step:  # a new step without close_step
            self._step = steps[-1] + 1
        self._closed = None
        recent.append((float(time_s), float(expected_s), float(max(int(num_microbatches), 1))))
        steps.append(self._step)
        del recent[: -self.long_window]
        del steps[: -self.long_window]

    def fixed_overheads_s(self) -> dict[str, float]:
        """``φ_k`` of each device's kind (s per micro-batch at start-up speed, ``≥ 0``; 0
        before :meth:`close_step` found one), for every device."""
        return {d: self.fixed_s.get(self.kinds[d], 0.0) for d in self.ids}

    def ratios(self, device: str) -> list[float]:
        """``device``'s kept ratios ``t / (e + φ_k n)`` (oldest first; class docstring)."""
        phi = self.fixed_s.get(self.kinds[device], 0.0)
        return [t / (e + phi * n) for t, e, n in self._samples[device]]

    def own_slowdowns(self) -> dict[str, float]:
        """Each measured device's own ``r̂_d`` (no pooling): the long window's median, or the
        short window's when they differ by more than ``change_tolerance``."""
        out = {}
        for d, kept in self._samples.items():
            if kept:
                short, long, steady = self._medians(self.ratios(d))
                out[d] = long if steady else short
        return out

    def _medians(self, ratios: list[float]) -> tuple[float, float, bool]:
        """``(short, long, steady)``: the medians of the last ``window`` and of all ``ratios``,
        and whether they are within ``change_tolerance`` of each other (a steady device)."""
        short = _median(ratios[-self.window :])
        long = _median(ratios)
        return short, long, abs(short - long) <= self.change_tolerance * abs(long)

    def slowdowns(self) -> dict[str, float]:
        """``r̂_d``: measured over start-up time for the same work, the fixed cost ``φ_k``
        added to the latter (2.0 = twice as slow as at start-up), for every device once any
        device has a measurement: its own estimate (:meth:`own_slowdowns`) where it is apart
        from its kind, else its kind's pooled ratio where the kind is apart from the run,
        else the run's pooled ratio (class docstring). Kept from :meth:`close_step` until
        the next measurement."""
        if self._closed is not None:
            return dict(self._closed)
        return self._pooled()[0]

    def close_step(self) -> None:
        """End of one step's measurements: each kind's ``φ_k`` is refitted (class
        docstring), then the devices apart from their kinds (:attr:`distinct`) and the kinds
        apart from the run (:attr:`distinct_kinds`) are those :meth:`slowdowns` finds apart
        now (class docstring, "Hysteresis")."""
        for kind in sorted(set(self.kinds.values())):
            phi = self._fit_fixed(kind)
            if phi is not None:
                self.fixed_s[kind] = phi
        out, self.distinct, self.distinct_kinds = self._pooled()
        self._closed = out
        if any(v and v[-1] >= self._step for v in self._steps.values()):
            self._step += 1

    def _fit_fixed(self, kind: str) -> float | None:
        """The kind's new ``φ`` (class docstring), or None to keep its current one."""
        series = []  # per device: its kept measurements (time_s, e, n)
        for d in self.ids:
            if self.kinds[d] != kind or len(self._samples[d]) < self.window:
                continue
            steady = self._medians(self.ratios(d))[2]
            series.append(
                np.asarray(self._samples[d] if steady else self._samples[d][-self.window :])
            )

        def spread(per_mb: np.ndarray) -> bool:
            """Start-up times per micro-batch at least ``FIT_SPREAD`` apart."""
            return bool(len(per_mb)) and per_mb.max() >= self.FIT_SPREAD * per_mb.min()

        # (a piece's spread is at most its device's: none there, none in any piece)
        if not any(spread(kept[:, 1] / kept[:, 2]) for kept in series):
            return 0.0
        # per piece of a device's measurements at one speed (level_segments): (log t, e, n)
        sigma = run_noise([np.log(k[:, 0]) for k in series], [k[:, 1:] for k in series])
        tolerance = math.log1p(self.change_tolerance)
        rows = []
        for kept in series:
            log_t = np.log(kept[:, 0])
            for part in level_segments(log_t, kept[:, 1:], sigma, tolerance, self.z):
                if part.stop - part.start >= 2:
                    rows.append((log_t[part], kept[part, 1], kept[part, 2]))
        per_mb = [e / n for _, e, n in rows]
        if not any(spread(p) for p in per_mb):
            return 0.0
        scale = float(np.median(np.concatenate(per_mb)))

        # the pieces side by side, padded (log t NaN, e 1, n 0) to the longest one
        size = np.array([len(r[0]) for r in rows])
        width = int(size.max())
        pad = np.arange(width)[None, :] >= size[:, None]
        log_t_all = np.full((len(rows), width), np.nan)
        e_all = np.ones((len(rows), width))
        n_all = np.zeros((len(rows), width))
        for i, (log_t, e, n) in enumerate(rows):
            log_t_all[i, : len(log_t)], e_all[i, : len(e)], n_all[i, : len(n)] = log_t, e, n

        def centred(phi: np.ndarray) -> np.ndarray:
            """``|log t - log(e + φ n) - m_p|`` at each ``φ`` of ``phi`` (shape ``(G, P,
            W)``: ``P`` pieces padded to ``W`` with 0; ``m_p`` the median of the first term
            over piece ``p`` at that ``φ``)."""
            res = log_t_all[None] - np.log(e_all[None] + phi[:, None, None] * n_all[None])
            m = _row_medians(res.reshape(-1, width)).reshape(len(phi), len(rows), 1)
            out = np.abs(res - m)
            out[:, pad] = 0.0
            return out

        def loss(phi: np.ndarray) -> np.ndarray:
            """The fit's loss at each ``φ`` of ``phi`` (shape ``(G,)``)."""
            return centred(phi).sum(axis=(1, 2))

        grid = np.concatenate(([0.0], scale * np.logspace(-3.0, 1.5, 64)))
        values = loss(grid)
        j = int(np.argmin(values))
        fine = np.linspace(grid[max(j - 1, 0)], grid[min(j + 1, len(grid) - 1)], 65)
        fine_values = loss(fine)
        k = int(np.argmin(fine_values))
        best, best_loss = float(fine[k]), float(fine_values[k])
        sigma = 1.4826 * _median(centred(np.array([best]))[0][~pad])
        tau = math.sqrt(math.pi / 2.0) * sigma
        if float(loss(np.zeros(1))[0]) - best_loss <= 0.5 * self.FIT_CHI2 * tau:
            return 0.0
        # the interval's lower end: the least φ whose loss is within its bound of the best
        bound = best_loss + 0.5 * self.INTERVAL_CHI2 * tau
        points = np.concatenate((grid, fine))
        inside = points[(points <= best) & (np.concatenate((values, fine_values)) <= bound)]
        hi = float(inside.min()) if len(inside) else best
        below = grid[grid < hi]
        lo = float(below.max()) if len(below) else 0.0
        for _ in range(12):  # bisection: loss(lo) > bound >= loss(hi)
            mid = 0.5 * (lo + hi)
            if float(loss(np.array([mid]))[0]) <= bound:
                hi = mid
            else:
                lo = mid
        return max(hi, 0.0)

    def restore(
        self,
        samples: dict[str, list[tuple[float, float, float]]],
        distinct: set[str],
        fixed_s: dict[str, float] | None = None,
        distinct_kinds: set[str] | None = None,
        steps: dict[str, list[int]] | None = None,
    ) -> None:
        """Set the measurements per device (``samples``: ``(time_s, expected_s,
        micro-batches)`` each, at most ``long_window``, newest last), the devices out of their
        kind's pool, the fixed cost per kind, the kinds out of the run's pool and the step
        index of each measurement (``steps``, aligned with ``samples``; default: each
        device's measurements on the last consecutive steps)."""
        self._samples = {d: [tuple(map(float, x)) for x in v] for d, v in samples.items()}
        steps = steps or {}
        self._steps = {
            d: [int(t) for t in steps[d]] if len(steps.get(d, ())) == len(v)
            else list(range(-len(v), 0))
            for d, v in self._samples.items()
        }  # fmt: skip
        self._step = max([v[-1] + 1 for v in self._steps.values() if v], default=0)
        self.distinct_kinds = set(distinct_kinds or ())
        self.distinct = set(distinct)
        self.fixed_s = dict(fixed_s or {})
        self._closed = None

    def _pooled(self) -> tuple[dict[str, float], set[str], set[str]]:
        """``(slowdowns, devices given their own estimate, kinds given their own pooled
        ratio)`` (class docstring, "Pooled per kind" and "Pooled per run")."""
        own = self.own_slowdowns()
        if not own:
            return {}, set(), set()
        # the kept ratios as a (device, step) matrix, NaN where a device was not measured
        devices = list(own)
        row = {d: i for i, d in enumerate(devices)}
        columns = sorted(set().union(*(self._steps[d] for d in devices)))
        col = {t: j for j, t in enumerate(columns)}
        ratios = np.full((len(devices), len(columns)), np.nan)
        for d in devices:
            ratios[row[d], [col[t] for t in self._steps[d]]] = self.ratios(d)
        by_kind: dict[str, list[str]] = {}
        for d in own:
            by_kind.setdefault(self.kinds[d], []).append(d)
        tolerance = math.log1p(self.change_tolerance)
        least = self.window // 2 + 1

        def step_medians(group: list[str]) -> tuple[np.ndarray, np.ndarray]:
            """Per step, the median ratio of ``group``'s devices measured at it (NaN where
            none was) and their number."""
            sub = np.sort(ratios[[row[d] for d in group]], axis=0)  # NaN sorted last
            count = np.sum(~np.isnan(sub), axis=0)
            lo = np.maximum((count - 1) // 2, 0)[None, :]
            hi = np.maximum(count // 2, 0)[None, :]
            both = np.take_along_axis(sub, lo, 0)[0] + np.take_along_axis(sub, hi, 0)[0]
            return np.where(count > 0, 0.5 * both, np.nan), count

        def relative(
            group: list[str], pool: tuple[np.ndarray, np.ndarray], inside: bool = True
        ) -> np.ndarray:
            """``x_t`` (shape ``(n,)``, newest first) over the last ``long_window`` steps at
            which ``group`` (devices) and the pool's other devices were measured: log of the
            group's median ratio at step ``t`` over the pool's at ``t`` (``pool``:
            :func:`step_medians` of its devices, the group's own among them when
            ``inside``); a load common to the run's ranks cancels."""
            if len(group) == 1:
                mine = ratios[row[group[0]]]
                count = (~np.isnan(mine)).astype(int)
            else:
                mine, count = step_medians(group)
            valid = (count > 0) & (pool[1] > (count if inside else 0))
            return np.log(mine[valid] / pool[0][valid])[::-1][: self.long_window]

        def scale(series: list[np.ndarray]) -> float:
            """The pooled noise of ``series`` (log): 1.4826 x the median absolute deviation
            of every value from its own series' median (one figure for the pool: a window's
            own deviation, of 13 values, is itself ±30 % noise)."""
            dev = [np.abs(x - _median(x)) for x in series if len(x)]
            return 1.4826 * _median(np.concatenate(dev)) if dev else math.inf

        def apart(x: np.ndarray, sigma: float, kept: bool, gap: Callable[[], float]) -> bool:
            """Whether a group whose relative series is ``x`` (:func:`relative`) is apart
            from its pool, on the last ``window`` values: ``|median x|`` beyond
            ``change_tolerance`` and, unless it was apart (``kept``), beyond ``z`` standard
            errors (``1.2533 σ / √n``, ``σ`` the pool's :func:`scale`) and with its
            quartile nearer 0 beyond ``change_tolerance`` too (descheduled episodes slow a
            rank's steps on one side only: a run of them moves a window's median, not its
            lower quartile; a lasting slow-down moves both). With fewer than ``window // 2
            + 1`` values (an idle device) only a ``kept`` group whose estimate over the
            pool's (``gap()``) is beyond ``change_tolerance``."""
            logs = x[: self.window]
            if len(logs) < least:
                return kept and abs(math.log(gap())) > tolerance
            m = _median(logs)
            if abs(m) <= tolerance:
                return False
            if kept:
                return True
            near = float(np.quantile(logs, 0.25)) if m > 0 else -float(np.quantile(logs, 0.75))
            se = 1.2533 * sigma / math.sqrt(len(logs))
            return near > tolerance and abs(m) > self.z * se

        def median_of(devices: list[str]) -> float:
            return _median([own[d] for d in devices])

        def split(
            groups: dict[str, list[str]], kept: set[str]
        ) -> tuple[set[str], dict[str, float]]:
            """The keys of ``groups`` (devices each) apart from the pool of all of them:
            first against the pool of those not ``kept`` apart at the last step, then
            against the pool of those not apart by that first pass (a slow group does not
            pull its peers' pool, and so their relative series, towards it: the median of
            four with one 3x slow is the mean of two of them); and for each group apart
            with ``window // 2 + 1`` steps measured beside that pool, its slow-down
            relative to the pool: ``exp(median x)`` over its last ``window`` such steps, the
            pool's devices alone in the pool."""
            out = set(kept) & set(groups)
            for _ in range(2):
                members = [d for g, ds in groups.items() if g not in out for d in ds]
                if not members:
                    members = [d for ds in groups.values() for d in ds]
                everyone = median_of(members)
                pool = step_medians(members)
                inside = set(members)
                series = {
                    g: relative(ds, pool if set(ds) <= inside else step_medians(members + ds))
                    for g, ds in groups.items()
                }
                sigma = scale(list(series.values()))
                out = set()
                for g, ds in groups.items():
                    gap = lambda ds=ds, e=everyone: median_of(ds) / e  # noqa: E731
                    if apart(series[g], sigma, g in kept, gap):
                        out.add(g)
            factor = {}
            for g in out:
                x = relative(groups[g], pool, inside=False)[: self.window]
                if len(x) >= least:
                    factor[g] = math.exp(_median(x))
            return out, factor

        # per kind: its devices apart from its pool, then the kind's ratio (the median of
        # the others' own estimates)
        devices_apart: set[str] = set()
        device_factor: dict[str, float] = {}
        kind_value: dict[str, float] = {}
        kind_members: dict[str, list[str]] = {}
        for k, peers in by_kind.items():
            if len(peers) > 1:
                out_k, factor_k = split({d: [d] for d in peers}, self.distinct)
                devices_apart |= out_k
                device_factor.update(factor_k)
            rest = [d for d in peers if d not in devices_apart] or peers
            kind_members[k] = rest
            kind_value[k] = median_of(rest)
        # per run: kinds apart from the run's pool (the devices of every kind, those apart
        # from their kinds left out), then the run's ratio (the median of the others' own
        # estimates): ratios relative to each device's start-up calibration
        pooled = [d for k in kind_members for d in kind_members[k]]
        kinds_apart: set[str] = set()
        kind_factor: dict[str, float] = {}
        if len(kind_members) > 1:
            kinds_apart, kind_factor = split(kind_members, self.distinct_kinds)
        rest = [d for d in pooled if self.kinds[d] not in kinds_apart] or pooled
        run_value = median_of(rest)
        # a group apart: its pool's ratio times its slow-down relative to that pool at the
        # same steps (a load common to the ranks, which moves its pool's ratio, moves it
        # too, also while it is idle), or its own estimate without such steps
        kind_out = {k: run_value for k in kind_members}
        for k in kinds_apart:
            kind_out[k] = run_value * kind_factor[k] if k in kind_factor else kind_value[k]
        out: dict[str, float] = {}
        for d in self.ids:
            k = self.kinds[d]
            if d in devices_apart:
                out[d] = kind_out[k] * device_factor[d] if d in device_factor else own[d]
            else:
                out[d] = kind_out.get(k, run_value)  # a kind without measurements: the run's
        return out, devices_apart, kinds_apart

    def __setstate__(self, state: dict) -> None:
        state.setdefault("long_window", state.get("window", 13))
        state.setdefault("change_tolerance", 0.1)
        state.setdefault("kinds", {d: d for d in state.get("ids", ())})
        state.setdefault("z", 3.0)
        state.setdefault("distinct", set())
        state.setdefault("distinct_kinds", set())
        state.setdefault(
            "_steps", {d: list(range(-len(v), 0)) for d, v in state.get("_samples", {}).items()}
        )
        state.setdefault("_step", 0)
        state.setdefault("_closed", None)
        state.setdefault("fixed_s", {})
        self.__dict__.update(state)

    def speeds_flops(self) -> dict[str, float]:
        """Current speed estimates ``s_d / r̂_d`` (FLOP/s; devices with at least one
        measurement)."""
        return {d: self.speed_flops[d] / r for d, r in self.slowdowns().items()}

    def apply(self, state: ClusterState, profile: ProfileArrays | None = None) -> ClusterState:
        """``state`` with the measured slow-downs and fixed costs (devices with
        measurements): speeds divided by ``r̂_d``, ``κ_d`` replaced by ``(κ_d + φ_k) r̂_d`` and
        ``λ_d`` multiplied by ``r̂_d``; a device whose kind has measured times in ``profile``
        gets ``φ_k r̂_d`` as its ``measured_extra_s`` instead of the ``φ_k`` in ``κ`` (its
        measured times, scaled by ``r̂_d`` through its speed, stand for ``κ`` and ``λ``)."""
        idx = state.index()
        measured = np.zeros(state.num_devices, dtype=bool)
        if profile is not None and profile.measured:
            measured = profile_prefix(profile).kind_index(state) >= 0
        speed = state.speed_flops.astype(float).copy()
        kappa = state.kappa_s.astype(float).copy()
        lam = state.layer_overhead_s.astype(float).copy()
        extra = np.asarray(state.measured_extra_s, dtype=float).copy()
        for d, r in self.slowdowns().items():
            if d in idx and r > 0 and math.isfinite(r):
                i = idx[d]
                phi = self.fixed_s.get(self.kinds[d], 0.0)
                speed[i] = self.speed_flops[d] / r
                lam[i] = self.layer_overhead_s[d] * r
                if measured[i]:
                    kappa[i] = self.kappa_s[d] * r
                    extra[i] = phi * r
                else:
                    kappa[i] = (self.kappa_s[d] + phi) * r
        return state.with_changes(
            speed_flops=speed, kappa_s=kappa, layer_overhead_s=lam, measured_extra_s=extra
        )


def startup_stage_time_s(
    state: ClusterState,
    profile: ProfileArrays,
    device: str,
    start: int,
    end: int,
    batch: int,
    microbatch_size: int,
) -> float | None:
    """Seconds the cost model gives ``device`` in ``state`` (the start-up state) for layers
    ``[start, end)`` over ``batch`` samples in micro-batches of ``microbatch_size`` (the last
    one holds the rest) when the device's kind has measured times in ``profile``
    (:func:`hetrain.costmodel.stage_compute_s`, docs/model.md §3), else None (the FLOP model:
    :meth:`SpeedEstimates.observe` computes it). Also None for an empty stage or batch."""
    if not profile.measured or end <= start or batch <= 0:
        return None
    i = state.index().get(device)
    if i is None:
        return None
    prefix = profile_prefix(profile)
    if prefix.kind_index(state)[i] < 0:
        return None
    mu = max(1, min(int(microbatch_size), int(batch)))
    full, rest = divmod(int(batch), mu)
    sizes = np.array([mu, max(rest, 1)])
    per = stage_compute_s(state, prefix, np.array([i, i]), np.array([start] * 2),
                          np.array([end] * 2), sizes)  # fmt: skip
    return float(full * per[0] + (per[1] if rest else 0.0))
