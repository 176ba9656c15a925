"""The one speed estimator of the controller: per-device slow-downs from measured compute
times (docs/model.md §3), used by the runtime's controller process
(``hetrain.runtime.ctlcontroller.PlanController``) and by replays of its measurements.

Imports numpy and the cluster state only (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.costmodel import profile_prefix, stage_compute_s
from hetrain.profile import ProfileArrays


class SpeedEstimates:
    """Per-device slow-down estimates from per-iteration compute measurements, and the speeds
    and fixed costs they give.

    Each iteration of device ``d`` gives the ratio ``r = time_s / t0`` of its measured stage
    compute time to what its start-up calibration predicts for the same work, ``t0 = flops /
    s_d + n (κ_d + λ_d Σν_l)`` (docs/model.md §3: each micro-batch of a stage costs ``μ c + κ +
    λ Σν_l``), or the stage's measured per-layer times when the device's kind has them
    (``expected_s`` of :meth:`observe`; the cost model then scales those times by ``r̂_d``
    through ``nominal / speed``, docs/model.md §3); the estimate ``r̂_d`` is the median of the
    last ``long_window`` ratios while the median of the last ``window`` ratios is within
    ``change_tolerance`` of it (a steady device: the longer median is the more precise, so
    that identical ranks look identical), else the median of the last ``window`` (a lasting
    change, followed after ``window // 2 + 1`` steps); and the device's speed, per-micro-batch
    overhead and per-layer overhead are ``s_d / r̂_d``, ``κ_d r̂_d`` and ``λ_d r̂_d``: a device
    that slows down (thermal throttling, a shared or emulated device) is slower at all of its
    work. Putting the whole change on the
    speed instead, ``flops / (time_s - n (κ + λ Σν))`` with start-up overheads, makes a device
    with a small share, whose step is mostly overhead, look ever slower the less it is given.

    A median, not an EWMA: on a shared machine one step of a rank can take 5-10x its usual
    time (descheduled) for several steps in a row, which an EWMA carries into the next
    decisions; the median of 13 ignores up to 6 such steps and follows a lasting change after 7
    (docs/training.md).

    **Pooled per kind.** Devices of one kind (``kinds``: the start-up calibration's hardware
    kind) are the same hardware, so what their ratios differ by is, unless shown otherwise,
    contention noise (ranks sharing cores are descheduled at random; two equal ranks'
    7-step medians measured 2x apart on a loaded 2-core machine), and estimates that follow
    it give identical ranks unequal shares. A device's estimate is its kind's pooled ratio,
    the median over the kind's measured devices of their own estimates, unless its own
    estimate differs from it *significantly*: by more than ``change_tolerance`` (relative)
    and by more than ``z`` standard errors of the difference of the two medians in log space
    (the standard error of a median of ``n`` samples is ``1.2533 · 1.4826 · MAD / √n``,
    the normal-consistent MAD and the median's asymptotic efficiency, e.g. Wilcox,
    *Introduction to Robust Estimation and Hypothesis Testing*, 4th ed., §3.3-3.4; the
    pooled median's is the kind's median standard error over ``√k`` devices). A
    device with no measurement (idle since start-up) takes its kind's pooled ratio: a
    slow-down common to the kind (contention of the ranks timing together during training,
    not during calibration) applies to it too, so an idle device does not look faster than
    its busy peers by that common factor.

    **Hysteresis.** A device found distinct stays distinct (keeps its own estimate) until its
    own estimate comes back within ``change_tolerance`` of the pooled one; the significance
    test decides only whether it leaves the pool. A device given little work after it was
    found slow (a share of one sample: its step is mostly scheduling noise, so the standard
    error of its ratios is large) or none (idle: no new ratios) would otherwise fall back to
    its kind's ratio, be given an equal share again, be found slow again, and so on
    (``tests/control/test_estimates_pooled.py``). The set of distinct devices is updated by
    :meth:`close_step`, once per step after that step's :meth:`observe` calls, so that
    :meth:`slowdowns` depends only on the measurements fed and not on how often it is asked.

    Args:
        ids: device ids.
        speed_flops: start-up speeds ``s_d`` (FLOP/s, > 0), aligned with ``ids``.
        kappa_s: start-up ``κ_d`` (s, default 0); layer_overhead_s: start-up ``λ_d`` (s per
            layer unit, default 0).
        window: the short window (measurements): its median follows a lasting change.
        long_window: the long window (default ``3 * window``): its median is the estimate of
            a steady device.
        change_tolerance: relative gap between the two medians above which the short one is
            used; also the least relative gap from its kind's pooled ratio at which a device
            keeps its own estimate.
        kinds: the kind of each device, aligned with ``ids`` (default: every device its own
            kind, no pooling).
        z: standard errors of the gap from the pooled ratio at which a device's own estimate
            is significant (default 3).
    """

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
        self._samples: dict[str, list[float]] = {d: [] for d in self.ids}
        self.distinct: set[str] = set()  # devices out of their kind's pool (hysteresis)
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
        self._closed = None
        recent.append(time_s / expected_s)
        del recent[: -self.long_window]

    def own_slowdowns(self) -> dict[str, float]:
        """Each measured device's own ``r̂_d`` (no pooling): the long window's median, or the
        short window's when they differ by more than ``change_tolerance``."""
        return {d: est for d, (est, _) in self._own().items()}

    def _own(self) -> dict[str, tuple[float, float]]:
        """``{device: (own estimate, standard error of its log)}`` of measured devices."""
        out = {}
        for d, v in self._samples.items():
            if not v:
                continue
            short = float(np.median(v[-self.window :]))
            long = float(np.median(v))
            steady = abs(short - long) <= self.change_tolerance * abs(long)
            used = np.log(np.asarray(v if steady else v[-self.window :], dtype=float))
            mad = float(np.median(np.abs(used - np.median(used))))
            out[d] = (long if steady else short, 1.2533 * 1.4826 * mad / math.sqrt(len(used)))
        return out

    def slowdowns(self) -> dict[str, float]:
        """``r̂_d``: measured over start-up time for the same work (2.0 = twice as slow as at
        start-up) for every device whose kind has a measured device: its kind's pooled ratio,
        or its own estimate (:meth:`own_slowdowns`) where that differs significantly from
        the pooled one, or where the device was distinct at the last :meth:`close_step` and
        its own estimate is still more than ``change_tolerance`` from the pooled one (class
        docstring). Kept from :meth:`close_step` until the next measurement."""
        if self._closed is not None:
            return dict(self._closed)
        return self._pooled()[0]

    def close_step(self) -> None:
        """End of one step's measurements: the devices that keep their own estimate from now
        on (:attr:`distinct`) are those :meth:`slowdowns` gives their own estimate now (the
        same slow-downs with the new set: a device enters it only with a gap above
        ``change_tolerance``, and leaves it only with a gap within it)."""
        out, self.distinct = self._pooled()
        self._closed = out

    def restore(self, samples: dict[str, list[float]], distinct: set[str]) -> None:
        """Set the ratios per device (``samples``, at most ``long_window`` each, newest last)
        and the devices out of their kind's pool (a saved state's)."""
        self._samples = samples
        self.distinct = set(distinct)
        self._closed = None

    def _pooled(self) -> tuple[dict[str, float], set[str]]:
        """``(slowdowns, devices given their own estimate)``."""
        own = self._own()
        by_kind: dict[str, list[str]] = {}
        for d in own:
            by_kind.setdefault(self.kinds[d], []).append(d)
        out: dict[str, float] = {}
        apart: set[str] = set()
        tolerance = math.log1p(self.change_tolerance)
        for d in self.ids:
            peers = by_kind.get(self.kinds[d])
            if not peers:
                continue
            if len(peers) == 1 and d in own:
                out[d] = own[d][0]
                continue
            pooled = float(np.median([own[p][0] for p in peers]))
            if d not in own:
                out[d] = pooled
                continue
            estimate, se = own[d]
            se_pooled = float(np.median([own[p][1] for p in peers])) / math.sqrt(len(peers))
            gap = abs(math.log(estimate / pooled))
            if d in self.distinct:
                distinct = gap > tolerance
            else:
                distinct = gap > tolerance and gap > self.z * math.hypot(se, se_pooled)
            out[d] = estimate if distinct else pooled
            if distinct:
                apart.add(d)
        return out, apart

    def __setstate__(self, state: dict) -> None:
        state.setdefault("long_window", state.get("window", 13))
        state.setdefault("change_tolerance", 0.1)
        state.setdefault("kinds", {d: d for d in state.get("ids", ())})
        state.setdefault("z", 3.0)
        state.setdefault("distinct", set())
        state.setdefault("_closed", None)
        self.__dict__.update(state)

    def speeds_flops(self) -> dict[str, float]:
        """Current speed estimates ``s_d / r̂_d`` (FLOP/s; devices with at least one
        measurement)."""
        return {d: self.speed_flops[d] / r for d, r in self.slowdowns().items()}

    def apply(self, state: ClusterState) -> ClusterState:
        """``state`` with the measured slow-downs: speeds divided by ``r̂_d``, ``κ_d`` and
        ``λ_d`` multiplied by it (devices with measurements)."""
        idx = state.index()
        speed = state.speed_flops.astype(float).copy()
        kappa = state.kappa_s.astype(float).copy()
        lam = state.layer_overhead_s.astype(float).copy()
        for d, r in self.slowdowns().items():
            if d in idx and r > 0 and math.isfinite(r):
                i = idx[d]
                speed[i] = self.speed_flops[d] / r
                kappa[i] = self.kappa_s[d] * r
                lam[i] = self.layer_overhead_s[d] * r
        return state.with_changes(speed_flops=speed, kappa_s=kappa, layer_overhead_s=lam)


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
