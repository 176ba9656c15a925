"""Calibration of docs/model.md §3's device parameters from measured times (pure numpy, no torch).

Two tools:

* :func:`fit_speed_kappa` — offline least-squares fit of a device's effective speed ``s_d``
  (FLOP/s) and fixed per-micro-batch cost ``κ_d`` (s) from times of several micro-batch sizes,
  following docs/model.md §3's stage time ``C = μ · Σ(f_l + w_l) / s + κ``.
* :func:`fit_stage_overheads` — the same with docs/model.md (v3)'s per-layer cost ``λ_d`` (s per
  layer
  and micro-batch) beside ``κ_d``, from stages (chains of layers) of different lengths:
  ``C = μ · Σ(f_l + w_l) / s + κ + λ · |S|``.
* :func:`fit_update_time` and :func:`relative_jitter` — the two numbers of the refinement
  ``TrainingConfig.update_time_s_per_param_byte`` / ``group_time_jitter`` (not in docs/model.md §3;
  :func:`hetrain.costmodel.refined_iteration_time_s`): the time of the weight update per
  trainable parameter byte a device holds, and how much a device's time per iteration
  jitters from one iteration to the next.
* :class:`EwmaEstimator` / :class:`ClusterEstimator` — online estimates fed with per-iteration
  measurements (the prediction-error benchmark and the controller replays of tests/control; the
  runtime's controller uses :class:`hetrain.control.estimates.SpeedEstimates`): an
  exponentially weighted moving average with outlier rejection (robust to one-off stalls, but
  following a lasting change of level after a few consistent samples).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hetrain.cluster import ClusterState


@dataclass(frozen=True)
class SpeedFit:
    """Result of :func:`fit_speed_kappa`.

    Attributes:
        speed_flops: effective speed ``s`` (FLOP/s).
        kappa_s: fixed cost ``κ`` per micro-batch (s), ``>= 0``.
        rms_rel_error: root mean square of ``(predicted - measured) / measured``.
        max_abs_rel_error: largest ``|predicted - measured| / measured``.
        predicted_s: the fitted times, same order as the input, seconds.
        num_points: number of measurements used.
    """

    speed_flops: float
    kappa_s: float
    rms_rel_error: float
    max_abs_rel_error: float
    predicted_s: tuple[float, ...]
    num_points: int

    def predict_s(self, microbatch_size: float, flops_per_sample: float) -> float:
        """docs/model.md §3 stage time ``μ · F / s + κ`` in seconds."""
        return microbatch_size * flops_per_sample / self.speed_flops + self.kappa_s


def fit_speed_kappa(
    microbatch_sizes: Sequence[float] | np.ndarray,
    flops_per_sample: Sequence[float] | np.ndarray | float,
    times_s: Sequence[float] | np.ndarray,
    *,
    fit_kappa: bool = True,
) -> SpeedFit:
    """Least-squares fit of ``t_i = μ_i · F_i / s + κ`` (docs/model.md §3, ``C_k = μ c_k + κ``).

    The fit minimises the *relative* squared error ``Σ_i ((μ_i F_i / s + κ − t_i) / t_i)^2``
    (times of different micro-batch sizes span orders of magnitude; an absolute fit would
    ignore the small ones, where ``κ`` shows) and is linear in ``(1/s, κ)``. If the
    unconstrained optimum has ``κ < 0``, ``κ`` is clamped to 0 and ``1/s`` refitted (the exact
    solution of the problem with ``κ >= 0``, since it is a 2-variable convex quadratic).

    Args:
        microbatch_sizes: ``μ_i`` (samples), shape ``(n,)``.
        flops_per_sample: ``F_i`` = ``Σ (f_l + w_l)`` of the timed layers (FLOP per sample),
            scalar or shape ``(n,)`` (points may mix layers/stages).
        times_s: measured ``t_i`` (s), shape ``(n,)``, all ``> 0``.
        fit_kappa: ``False`` fits ``s`` alone with ``κ = 0``.

    Raises:
        ValueError: fewer than 2 points (1 without ``fit_kappa``), shapes differ, a value is
            not finite, a time or work ``μ F`` is not ``> 0``, or the data imply no positive
            speed (time does not grow with work).
    """
    mu = np.asarray(microbatch_sizes, dtype=float).ravel()
    t = np.asarray(times_s, dtype=float).ravel()
    flops = np.broadcast_to(np.asarray(flops_per_sample, dtype=float), mu.shape).astype(float)
    if mu.shape != t.shape:
        raise ValueError(f"fit_speed_kappa: {mu.size} micro-batch sizes but {t.size} times")
    need = 2 if fit_kappa else 1
    if mu.size < need:
        raise ValueError(f"fit_speed_kappa: need at least {need} measurements, got {mu.size}")
    for label, arr in (("micro-batch sizes", mu), ("flops", flops), ("times", t)):
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"fit_speed_kappa: {label} must be finite")
    x = mu * flops
    if np.any(t <= 0) or np.any(x <= 0):
        raise ValueError("fit_speed_kappa: times and work (micro-batch size x FLOPs) must be > 0")
    w = 1.0 / t
    inv_s, kappa = _solve(x * w, w, fit_kappa)
    if inv_s <= 0:
        raise ValueError(
            "fit_speed_kappa: measured time does not grow with work; cannot fit a positive speed"
        )
    pred = x * inv_s + kappa
    rel = (pred - t) / t
    return SpeedFit(
        speed_flops=float(1.0 / inv_s),
        kappa_s=float(kappa),
        **_relative_errors(rel),
        predicted_s=tuple(float(p) for p in pred),
        num_points=int(mu.size),
    )


def _relative_errors(rel: np.ndarray) -> dict[str, float]:
    """``rms_rel_error`` and ``max_abs_rel_error`` of the relative residuals ``rel`` (shape
    ``(n,)``, dimensionless) of a fit."""
    return {
        "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
        "max_abs_rel_error": float(np.max(np.abs(rel))),
    }


@dataclass(frozen=True)
class StageOverheadFit:
    """Result of :func:`fit_stage_overheads`.

    Attributes:
        speed_flops: effective speed ``s`` (FLOP/s), ``> 0``.
        kappa_s: fixed cost ``κ`` per micro-batch and stage (s), ``>= 0``.
        layer_overhead_s: fixed cost ``λ`` per micro-batch and layer of the stage (s), ``>= 0``.
        rms_rel_error: root mean square of ``(predicted - measured) / measured``.
        max_abs_rel_error: largest ``|predicted - measured| / measured``.
        predicted_s: the fitted times, same order as the input, seconds.
        num_points: number of measurements used.
    """

    speed_flops: float
    kappa_s: float
    layer_overhead_s: float
    rms_rel_error: float
    max_abs_rel_error: float
    predicted_s: tuple[float, ...]
    num_points: int

    def predict_s(
        self, microbatch_size: float, flops_per_sample: float, num_layers: float
    ) -> float:
        """docs/model.md §3 stage time ``μ · F / s + κ + λ · |S|`` in seconds (``num_layers``:
        ``|S|``, or the stage's layer units ``Σ ν_l``)."""
        return (
            microbatch_size * flops_per_sample / self.speed_flops
            + self.kappa_s
            + self.layer_overhead_s * num_layers
        )


def fit_stage_overheads(
    microbatch_sizes: Sequence[float] | np.ndarray,
    flops_per_sample: Sequence[float] | np.ndarray | float,
    num_layers: Sequence[int] | np.ndarray,
    times_s: Sequence[float] | np.ndarray,
) -> StageOverheadFit:
    """Least-squares fit of ``t_i = μ_i · F_i / s + κ + λ · n_i`` (docs/model.md §3,
    ``C_k = μ c_k + κ + λ |S_k|``) to measured stage times.

    Each point is one stage (a chain of ``n_i`` consecutive layers with ``F_i = Σ (f_l + w_l)``
    FLOP per sample) timed per micro-batch of ``μ_i`` samples. ``κ`` and ``λ`` are told apart
    only by chains of different lengths: at least two distinct ``n_i`` are needed. As
    :func:`fit_speed_kappa`, the fit minimises the *relative* squared error
    ``Σ_i ((μ_i F_i / s + κ + λ n_i − t_i) / t_i)²``, linear in ``(1/s, κ, λ)``, with all three
    ``>= 0`` (non-negative least squares, Lawson & Hanson 1974, ``scipy.optimize.nnls``: the
    exact optimum of this convex problem with the bounds).

    Args:
        microbatch_sizes: ``μ_i`` (samples), shape ``(n,)``.
        flops_per_sample: ``F_i`` (FLOP per sample) of the stage, scalar or shape ``(n,)``;
            a stage of layers without FLOPs (``F_i = 0``) is allowed: it measures ``κ + λ n``.
        num_layers: ``n_i = |S|`` layers of the stage, shape ``(n,)``, ``> 0``; or its layer
            units ``Σ_{l∈S} ν_l`` with the profile's per-layer overhead weights
            (:meth:`hetrain.profile.ProfileArrays.layer_units`, docs/model.md §3).
        times_s: measured ``t_i`` (s per micro-batch), shape ``(n,)``, all ``> 0``.

    Raises:
        ValueError: fewer than 3 points, shapes differ, a value is not finite, a time is not
            ``> 0``, a layer count is not ``> 0``, fewer than 2 distinct layer counts, no
            point with work ``μ F > 0``, or the data imply no positive speed (time does not
            grow with work).
    """
    from scipy.optimize import nnls

    mu = np.asarray(microbatch_sizes, dtype=float).ravel()
    t = np.asarray(times_s, dtype=float).ravel()
    n = np.asarray(num_layers, dtype=float).ravel()
    flops = np.broadcast_to(np.asarray(flops_per_sample, dtype=float), mu.shape).astype(float)
    if not (mu.shape == t.shape == n.shape):
        raise ValueError(
            f"fit_stage_overheads: {mu.size} micro-batch sizes, {n.size} layer counts and "
            f"{t.size} times; expected the same number"
        )
    if mu.size < 3:
        raise ValueError(f"fit_stage_overheads: need at least 3 measurements, got {mu.size}")
    for label, arr in (("micro-batch sizes", mu), ("flops", flops), ("layer counts", n)):
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"fit_stage_overheads: {label} must be finite")
    if not np.all(np.isfinite(t)):
        raise ValueError("fit_stage_overheads: times must be finite")
    if np.any(t <= 0) or np.any(mu <= 0) or np.any(flops < 0):
        raise ValueError("fit_stage_overheads: times and micro-batch sizes must be > 0, FLOPs >= 0")
    if np.any(n <= 0):
        raise ValueError("fit_stage_overheads: layer counts (or layer units Σ ν_l) must be > 0")
    if len(np.unique(n)) < 2:
        raise ValueError(
            "fit_stage_overheads: need chains of at least 2 different lengths to tell the "
            f"per-layer cost from the per-stage cost, got only {n[0]:g} layer(s)"
        )
    x = mu * flops
    if not np.any(x > 0):
        raise ValueError("fit_stage_overheads: no measurement with work (μ x FLOPs) > 0")
    w = 1.0 / t
    a = np.stack([x * w, w, n * w], axis=1)
    scale = a.max(axis=0)  # columns of very different magnitude: scale for nnls
    sol, _ = nnls(a / scale, np.ones_like(t))
    inv_s, kappa, lam = sol / scale
    if inv_s <= 0:
        raise ValueError(
            "fit_stage_overheads: measured time does not grow with work; cannot fit a "
            "positive speed"
        )
    pred = x * inv_s + kappa + lam * n
    rel = (pred - t) / t
    return StageOverheadFit(
        speed_flops=float(1.0 / inv_s),
        kappa_s=float(kappa),
        layer_overhead_s=float(lam),
        **_relative_errors(rel),
        predicted_s=tuple(float(p) for p in pred),
        num_points=int(mu.size),
    )


@dataclass(frozen=True)
class UpdateTimeFit:
    """Result of :func:`fit_update_time`: ``time_s_per_param_byte`` (``ω``, s/byte) and the
    fit's RMS and max relative error over ``num_points`` measurements."""

    time_s_per_param_byte: float
    rms_rel_error: float
    max_abs_rel_error: float
    num_points: int


def _paired(
    fn: str, a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, names: tuple
) -> tuple[np.ndarray, np.ndarray]:
    """``a`` and ``b`` as flat float arrays of the same size ``>= 1`` with finite values.

    Raises:
        ValueError: sizes differ or are 0 (names ``fn`` and ``names``), a value not finite.
    """
    x = np.asarray(a, dtype=float).ravel()
    y = np.asarray(b, dtype=float).ravel()
    if x.shape != y.shape or x.size == 0:
        raise ValueError(
            f"{fn}: expected as many {names[0]} as {names[1]} (>= 1), got {x.size} and {y.size}"
        )
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError(f"{fn}: {names[0]} and {names[1]} must be finite")
    return x, y


def fit_update_time(
    param_bytes: Sequence[float] | np.ndarray, times_s: Sequence[float] | np.ndarray
) -> UpdateTimeFit:
    """Least-squares fit of ``u_i = ω · θ_i``: weight-update times ``u_i`` (s; optimizer step,
    gradient norm and copies after the sync) of devices holding ``θ_i`` trainable parameter
    bytes, minimising the relative squared error ``Σ ((ω θ_i − u_i)/u_i)²`` (closed form
    ``ω = Σ (θ_i/u_i) / Σ (θ_i/u_i)²``). The ``ω`` of
    :attr:`hetrain.costmodel.TrainingConfig.update_time_s_per_param_byte`.

    Raises:
        ValueError: no point, shapes differ, a value not finite, a byte count or time not
            ``> 0``.
    """
    theta, u = _paired("fit_update_time", param_bytes, times_s, ("byte counts", "times"))
    if np.any(theta <= 0) or np.any(u <= 0):
        raise ValueError("fit_update_time: bytes and times must be > 0")
    a = theta / u
    omega = float(a.sum() / (a @ a))
    rel = omega * a - 1.0
    return UpdateTimeFit(
        time_s_per_param_byte=omega,
        **_relative_errors(rel),
        num_points=int(theta.size),
    )


def relative_jitter(series: Iterable[Sequence[float]]) -> float:
    """Relative standard deviation ``σ`` of per-iteration times, robustly: each series (times
    of the same work that would be equal without jitter: one device over several iterations,
    or the devices of one data-parallel iteration; seconds, all ``> 0``) is divided by its
    median, the deviations ``x / median − 1`` of all series are pooled, and
    ``σ = 1.4826 · median |deviation|`` (the normal-consistent median absolute deviation,
    Rousseeuw & Croux, JASA 1993: a one-off stall does not inflate it). The
    ``group_time_jitter`` of :class:`hetrain.costmodel.TrainingConfig`.

    Raises:
        ValueError: no series with at least 2 samples, a sample not finite or not ``> 0``.
    """
    devs: list[np.ndarray] = []
    for xs in series:
        x = np.asarray(xs, dtype=float).ravel()
        if x.size < 2:
            continue
        if not np.all(np.isfinite(x)) or np.any(x <= 0):
            raise ValueError("relative_jitter: times must be finite and > 0")
        devs.append(x / np.median(x) - 1.0)
    if not devs:
        raise ValueError("relative_jitter: need a series of at least 2 times")
    return float(1.4826 * np.median(np.abs(np.concatenate(devs))))


def fit_step_overhead(
    measured_s: Sequence[float] | np.ndarray, predicted_s: Sequence[float] | np.ndarray
) -> float:
    """``F`` of :attr:`hetrain.costmodel.TrainingConfig.step_overhead_s` (s per iteration):
    the median of ``measured_i − predicted_i`` over iterations (measured: the slowest rank's
    iteration time; predicted: the cost model's ``T`` of the same plan with ``F = 0``), floored
    at 0 (a model that over-predicts is not corrected by a negative fixed time). The median
    keeps one stalled iteration from moving it (docs/profiling.md §6).

    Raises:
        ValueError: no pair, shapes differ, or a value not finite.
    """
    m, p = _paired("fit_step_overhead", measured_s, predicted_s, ("measured", "predicted times"))
    return max(0.0, float(np.median(m - p)))


def _solve(a1: np.ndarray, a2: np.ndarray, fit_kappa: bool) -> tuple[float, float]:
    """min ||a1·u + a2·k − 1||² over u, k (k >= 0; k = 0 unless fit_kappa)."""
    ones = np.ones_like(a1)
    if fit_kappa:
        sol, *_ = np.linalg.lstsq(np.stack([a1, a2], axis=1), ones, rcond=None)
        if sol[1] >= 0:
            return float(sol[0]), float(sol[1])
    return float(a1 @ ones / (a1 @ a1)), 0.0


# ---------------------------------------------------------------------------------------------
# online estimates
# ---------------------------------------------------------------------------------------------


class EwmaEstimator:
    """Exponentially weighted moving average with outlier rejection, for one quantity.

    Keeps a level ``m`` and a spread ``v`` (EWMA of ``|x − m|``). A new sample ``x`` is an
    outlier when ``|x − m| > threshold · max(v, rel_floor · |m|)``; outliers are ignored,
    unless ``max_consecutive_outliers`` of them in a row lie on the same side of ``m`` — a
    lasting change (a device that really slowed down), after which the level restarts from the
    median of those samples. The first ``warmup`` samples are all accepted.

    Args:
        alpha: EWMA weight of a new sample, ``0 < alpha <= 1``.
        threshold: outlier distance in spreads, ``> 0``.
        rel_floor: the spread never counts as less than ``rel_floor · |m|`` (avoids rejecting
            everything after a run of identical samples), ``>= 0``.
        max_consecutive_outliers: same-side outliers in a row that are taken as a new level,
            ``>= 1``.
        warmup: samples accepted unconditionally at the start, ``>= 1``.

    Raises:
        ValueError: a parameter out of range, or a non-finite sample.
    """

    def __init__(
        self,
        alpha: float = 0.3,
        threshold: float = 4.0,
        rel_floor: float = 0.05,
        max_consecutive_outliers: int = 3,
        warmup: int = 2,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha: expected 0 < alpha <= 1, got {alpha}")
        if not threshold > 0:
            raise ValueError(f"threshold: expected > 0, got {threshold}")
        if not rel_floor >= 0:
            raise ValueError(f"rel_floor: expected >= 0, got {rel_floor}")
        if max_consecutive_outliers < 1 or warmup < 1:
            raise ValueError("max_consecutive_outliers and warmup: expected >= 1")
        self.alpha = float(alpha)
        self.threshold = float(threshold)
        self.rel_floor = float(rel_floor)
        self.max_consecutive_outliers = int(max_consecutive_outliers)
        self.warmup = int(warmup)
        self._level: float | None = None
        self._spread = 0.0
        self._count = 0
        self._pending: list[float] = []
        self.rejected = 0

    @property
    def value(self) -> float | None:
        """The current estimate (``None`` before the first sample)."""
        return self._level

    @property
    def count(self) -> int:
        """Samples accepted so far (including level restarts)."""
        return self._count

    def update(self, x: float) -> bool:
        """Feed one sample; returns ``True`` if it was accepted, ``False`` if rejected."""
        x = float(x)
        if not math.isfinite(x):
            raise ValueError(f"EwmaEstimator.update: expected a finite sample, got {x}")
        if self._level is None:
            self._level, self._spread, self._count = x, 0.0, 1
            return True
        dev = x - self._level
        scale = max(self._spread, self.rel_floor * abs(self._level))
        if self._count >= self.warmup and abs(dev) > self.threshold * scale:
            if self._pending and (self._pending[-1] - self._level) * dev < 0:
                self._pending = []
            self._pending.append(x)
            if len(self._pending) < self.max_consecutive_outliers:
                self.rejected += 1
                return False
            # a lasting change of level: restart from the outliers seen in a row
            new = float(np.median(self._pending))
            self._spread = float(np.median(np.abs(np.array(self._pending) - new)))
            self._level = new
            self._pending = []
            self._count += 1
            return True
        self._pending = []
        self._level += self.alpha * dev
        self._spread += self.alpha * (abs(dev) - self._spread)
        self._count += 1
        return True


class ClusterEstimator:
    """Online per-device estimates of speed ``s_d`` and NIC bandwidth ``nic_d`` (docs/model.md §2),
    refreshed from the runtime's per-iteration measurements and read by the controller.

    A compute sample ``(flops, time_s, num_microbatches, num_layers)`` gives the speed
    ``flops / (time_s − num_microbatches · (κ_d + λ_d · num_layers))`` (docs/model.md §3: each
    micro-batch of a stage of ``|S|`` layers costs ``μ c + κ + λ |S|``); a transfer sample
    ``(bytes, time_s)`` gives the bandwidth
    ``bytes / (time_s − 2 · lat)`` (docs/model.md §3: ``E = μ·2a/bw + 2 lat``, both directions).
    Each
    series goes through its own :class:`EwmaEstimator`.

    Args:
        ids: device ids (cluster-file order).
        kappa_s: ``κ_d`` per device (s), mapping or sequence in ``ids`` order; default 0.
        layer_overhead_s: ``λ_d`` per device (s per layer and micro-batch), as ``kappa_s``.
        latency_s: link latency ``lat`` (s).
        **ewma: keyword arguments for every :class:`EwmaEstimator`.

    Raises:
        KeyError: a measurement names an unknown device.
        ValueError: a measurement with non-positive FLOPs/bytes or time.
    """

    def __init__(
        self,
        ids: Iterable[str],
        *,
        kappa_s: Mapping[str, float] | Sequence[float] | None = None,
        latency_s: float = 0.0,
        layer_overhead_s: Mapping[str, float] | Sequence[float] | None = None,
        **ewma: float,
    ) -> None:
        self.ids = tuple(ids)
        self.kappa_s = self._per_device(kappa_s)
        self.layer_overhead_s = self._per_device(layer_overhead_s)
        self.latency_s = float(latency_s)
        self._speed = {d: EwmaEstimator(**ewma) for d in self.ids}
        self._nic = {d: EwmaEstimator(**ewma) for d in self.ids}
        # residual of whole iterations: absolute seconds, so no relative floor around 0
        self._step = EwmaEstimator(**{**ewma, "rel_floor": 0.0})

    def _per_device(self, values: Mapping[str, float] | Sequence[float] | None) -> dict:
        if values is None:
            return dict.fromkeys(self.ids, 0.0)
        if isinstance(values, Mapping):
            return {d: float(values.get(d, 0.0)) for d in self.ids}
        return dict(zip(self.ids, (float(k) for k in values), strict=True))

    @classmethod
    def for_state(cls, state: ClusterState, **ewma: float) -> ClusterEstimator:
        """An estimator for the devices of ``state`` with its ``κ_d``, ``λ_d`` and latency."""
        return cls(
            state.ids,
            kappa_s=list(state.kappa_s),
            latency_s=state.latency_s,
            layer_overhead_s=list(state.layer_overhead_s),
            **ewma,
        )

    def observe_compute(
        self,
        device_id: str,
        flops: float,
        time_s: float,
        num_microbatches: int = 1,
        num_layers: float = 0,
    ) -> bool:
        """Feed one iteration's compute of a device: ``flops`` done in ``time_s`` over
        ``num_microbatches`` micro-batches of a stage of ``num_layers`` layers, or its layer
        units ``Σ ν_l`` (docs/model.md §3; 0 = do not subtract ``λ``). Returns whether the
        sample was accepted."""
        if flops <= 0 or time_s <= 0:
            raise ValueError(f"observe_compute({device_id!r}): flops and time_s must be > 0")
        per_mb = self.kappa_s[device_id] + self.layer_overhead_s[device_id] * num_layers
        busy = time_s - num_microbatches * per_mb
        busy = max(busy, 0.05 * time_s)  # κ estimate too large: do not divide by ~0
        return self._speed[device_id].update(flops / busy)

    def observe_transfer(self, device_id: str, num_bytes: float, time_s: float) -> bool:
        """Feed one point-to-point transfer through a device's NIC (or its slowest link)."""
        if num_bytes <= 0 or time_s <= 0:
            raise ValueError(f"observe_transfer({device_id!r}): bytes and time_s must be > 0")
        busy = max(time_s - 2.0 * self.latency_s, 0.05 * time_s)
        return self._nic[device_id].update(num_bytes / busy)

    def observe_iteration(self, measured_s: float, predicted_s: float) -> bool:
        """Feed one iteration: ``measured_s`` the slowest rank's iteration time (s) and
        ``predicted_s`` the cost model's ``T`` of the same plan on this estimator's current
        estimates with ``step_overhead_s = 0``, made before this iteration's compute was fed.
        The residual's EWMA (outliers rejected) is :meth:`step_overhead_s`. Returns whether
        the sample was accepted.

        Raises:
            ValueError: a time not finite or ``measured_s <= 0``.
        """
        if not (math.isfinite(measured_s) and math.isfinite(predicted_s)) or measured_s <= 0:
            raise ValueError(
                f"observe_iteration: expected finite times, measured > 0; got {measured_s!r}, "
                f"{predicted_s!r}"
            )
        return self._step.update(float(measured_s) - float(predicted_s))

    def step_overhead_s(self) -> float | None:
        """Current estimate of :attr:`hetrain.costmodel.TrainingConfig.step_overhead_s`: the
        EWMA of :meth:`observe_iteration`'s residuals floored at 0 (``None`` before any)."""
        v = self._step.value
        return None if v is None else max(0.0, v)

    def speed_flops(self) -> dict[str, float]:
        """Current speed estimates (FLOP/s) of the devices that have any."""
        return {d: e.value for d, e in self._speed.items() if e.value is not None}

    def nic_bytes_per_s(self) -> dict[str, float]:
        """Current NIC bandwidth estimates (bytes/s) of the devices that have any."""
        return {d: e.value for d, e in self._nic.items() if e.value is not None}

    def apply(self, state: ClusterState) -> ClusterState:
        """``state`` with ``speed_flops`` and ``nic_bytes_per_s`` replaced by the estimates
        where there are any (other devices keep their values)."""
        idx = state.index()
        speed = state.speed_flops.astype(float).copy()
        nic = state.nic_bytes_per_s.astype(float).copy()
        for d, v in self.speed_flops().items():
            if d in idx:
                speed[idx[d]] = v
        for d, v in self.nic_bytes_per_s().items():
            if d in idx:
                nic[idx[d]] = v
        return state.with_changes(speed_flops=speed, nic_bytes_per_s=nic)
