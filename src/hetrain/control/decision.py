"""What a controller decision records, and how long a measured state is expected to persist.

:class:`Decision` is what :meth:`hetrain.control.lyapunov.LyapunovController.decide` returns:
the plan to run, why, and the figures that justified it, all computed on the
:class:`Estimates` that chose it (docs/controller.md, "Decisions that hold").

:class:`PersistenceEstimator` learns online how many slots the observed state of a set of
devices lasts, so that a plan change is weighed against its migration time over the slots the
devices it involves are expected to keep their state (docs/controller.md, "Persistence").

Pure python and numpy (never torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.plan import Plan

REASONS = ("initial", "device-lost", "keep", "rebalance", "faster", "budget")
"""Values of :attr:`Decision.reason`:

* ``initial``: no current plan (first decision); applied unconditionally;
* ``device-lost``: the current plan names a device that is gone; applied unconditionally;
* ``keep``: the current plan stays (shares included);
* ``rebalance``: same groups and stages, new shares, predicted faster (no migration);
* ``faster``: a new structure whose predicted gain over the expected persistence pays its
  migration time;
* ``budget``: a change that time alone does not justify, driven by the budgets' virtual queues
  (``budget_driven`` is True and ``cost_before``/``cost_after``/``queue_weights`` say why).
"""


def state_to_dict(state: ClusterState) -> dict[str, Any]:
    """A JSON-able copy of a :class:`~hetrain.cluster.ClusterState` (lists of floats)."""
    out: dict[str, Any] = {"ids": list(state.ids)}
    for name in (
        "node",
        "speed_flops",
        "memory_bytes",
        "nic_bytes_per_s",
        "power_w",
        "price_per_s",
        "kappa_s",
        "available",
    ):
        arr = np.asarray(getattr(state, name))
        out[name] = [bool(x) for x in arr] if arr.dtype == bool else arr.tolist()
    lam = getattr(state, "layer_overhead_s", None)
    if lam is not None:
        out["layer_overhead_s"] = np.asarray(lam, dtype=float).tolist()
    out["intra_node_bytes_per_s"] = float(state.intra_node_bytes_per_s)
    out["latency_s"] = float(state.latency_s)
    # device kinds and nominal speeds (measured per-layer times, docs/model.md §3)
    out["kinds"] = list(state.kinds)
    out["nominal_speed_flops"] = np.asarray(state.nominal_speed_flops, dtype=float).tolist()
    extra = np.asarray(state.measured_extra_s, dtype=float)
    if np.any(extra):
        out["measured_extra_s"] = extra.tolist()
    return out


def state_from_dict(data: dict[str, Any]) -> ClusterState:
    """Inverse of :func:`state_to_dict`.

    Raises:
        KeyError / ValueError: a field is missing or malformed.
    """
    kwargs: dict[str, Any] = {"ids": tuple(data["ids"])}
    kwargs["node"] = np.asarray(data["node"], dtype=np.int64)
    for name in ("speed_flops", "memory_bytes", "nic_bytes_per_s", "power_w", "price_per_s"):
        kwargs[name] = np.asarray(data[name], dtype=float)
    kwargs["kappa_s"] = np.asarray(data["kappa_s"], dtype=float)
    kwargs["available"] = np.asarray(data["available"], dtype=bool)
    kwargs["intra_node_bytes_per_s"] = float(data["intra_node_bytes_per_s"])
    kwargs["latency_s"] = float(data["latency_s"])
    if "layer_overhead_s" in data and "layer_overhead_s" in ClusterState.__dataclass_fields__:
        kwargs["layer_overhead_s"] = np.asarray(data["layer_overhead_s"], dtype=float)
    if "kinds" in data:
        kwargs["kinds"] = tuple(str(k) for k in data["kinds"])
    if "nominal_speed_flops" in data:
        kwargs["nominal_speed_flops"] = np.asarray(data["nominal_speed_flops"], dtype=float)
    if "measured_extra_s" in data:
        kwargs["measured_extra_s"] = np.asarray(data["measured_extra_s"], dtype=float)
    return ClusterState(**kwargs)


@dataclass(frozen=True)
class Estimates:
    """What the controller believed when it decided (every figure of a :class:`Decision` is
    computed on these).

    Attributes:
        state: the observed cluster state (measured speeds, NICs, prices, availability).
        queue_weights: planner weights ``Q̂_j`` (seconds per unit of resource j) used in the
            objective ``V·T + Σ_j Q̂_j y_j``; empty without budgets.
        backlog: virtual queue backlogs ``Q_j`` (resource units) before the decision.
        reference_time_s: ``T_ref`` of the queue normalisation (seconds).
        persistence_slots: expected number of slots the observed state still holds once the
            decision applies (the payback horizon of a migration).
        v: the controller's ``V`` as used in the objective.
    """

    state: ClusterState
    queue_weights: dict[str, float]
    backlog: dict[str, float]
    reference_time_s: float
    persistence_slots: float
    v: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the state as lists)."""
        return {
            "state": state_to_dict(self.state),
            "queue_weights": dict(self.queue_weights),
            "backlog": dict(self.backlog),
            "reference_time_s": self.reference_time_s,
            "persistence_slots": self.persistence_slots,
            "v": self.v,
        }


@dataclass(frozen=True)
class Decision:
    """One decision of the controller (docs/controller.md, "Decisions that hold").

    Attributes:
        step: the step (slot) the decision was taken at; measurements up to ``step − 1``.
        plan: the plan to run (``plan_id`` set; equal to the current plan when ``reason`` is
            ``keep``).
        reason: one of :data:`REASONS`.
        changed: whether ``plan`` differs from the current plan (structure or shares).
        structure_changed: whether groups or stages differ (a migration is due).
        predicted_time_s_before: docs/model.md §3 ``T`` of the current plan on ``estimates`` (None
            when there is no usable current plan).
        predicted_time_s_after: ``T`` of ``plan`` on ``estimates``.
        migration_time_s: migration time of current → ``plan`` on ``estimates`` (0 when
            nothing moves or there is no current plan).
        budget_driven: the change is justified by the budgets, not by time (see ``reason``).
        cost_before / cost_after: ``{"money", "energy"}`` per iteration on ``estimates``.
        objective_before / objective_after: ``V·T + Σ_j Q̂_j y_j`` on ``estimates``.
        persistence_slots: the payback horizon used (slots).
        note: one human-readable line (what was proposed and why it was or was not applied).
        estimates: what chose the decision.
    """

    step: int
    plan: Plan
    reason: str
    changed: bool
    structure_changed: bool
    predicted_time_s_before: float | None
    predicted_time_s_after: float
    migration_time_s: float
    budget_driven: bool
    cost_before: dict[str, float] | None
    cost_after: dict[str, float]
    objective_before: float | None
    objective_after: float
    persistence_slots: float
    note: str
    estimates: Estimates = field(repr=False)

    @property
    def forced(self) -> bool:
        """Applied without the gain rule (no usable current plan)."""
        return self.reason in ("initial", "device-lost")

    def to_dict(self, with_state: bool = False) -> dict[str, Any]:
        """JSON-able summary for logs (``with_state``: include the estimated state)."""
        out = {
            "step": self.step,
            "plan_id": self.plan.plan_id,
            "reason": self.reason,
            "changed": self.changed,
            "structure_changed": self.structure_changed,
            "predicted_time_s_before": self.predicted_time_s_before,
            "predicted_time_s_after": self.predicted_time_s_after,
            "migration_time_s": self.migration_time_s,
            "budget_driven": self.budget_driven,
            "cost_before": self.cost_before,
            "cost_after": self.cost_after,
            "objective_before": self.objective_before,
            "objective_after": self.objective_after,
            "persistence_slots": self.persistence_slots,
            "note": self.note,
            "shares": [g.batch for g in self.plan.groups],
            "plan": self.plan.to_json_dict(),
            "queue_weights": dict(self.estimates.queue_weights),
        }
        if with_state:
            out["estimates"] = self.estimates.to_dict()
        return out


class PersistenceEstimator:
    """How long the observed state of a set of devices lasts, learned online (slots).

    Device ``d`` has an *event* at a step where it came or went, or one of its watched values
    ``x`` (speed and NIC bandwidth; with ``watch_prices`` also price and power) moved by more
    than ``threshold`` relative to its value at the start of its current run (the move
    ``|Δx|`` is kept). A set ``S`` of devices changes state at an aggregate rule restricted to
    ``S``: a step with events of members counts as
    ``min(1, Σ_e |Δx_e| / (threshold · Σ_{d ∈ S} x_d))`` changes of ``S`` (1 where a member
    came or went; ``x`` per watched value), so a member halving its speed is a change of a pair
    and a twentieth of one for a set of a thousand. With ``c_S`` such changes in ``n`` steps,
    runs of ``S`` are geometric with mean
    ``m_S = (n + prior_weight · prior_slots) / (c_S + prior_weight · |S| / D)`` (the maximum
    likelihood estimate of a geometric mean with censored last run, plus a prior of
    ``prior_weight`` runs of ``prior_slots`` for the whole cluster of ``D`` devices, spread
    evenly over them). A plan change gains only while the devices of the two plans keep their
    states, so the payback horizon of a switch is that set's (:meth:`benefit_slots`):
    availability flapping or stragglers elsewhere in the cluster do not shorten it. The whole
    cluster's figure is the set of all ``D`` devices.

    The expected number of slots that a state seen at decision time still holds once a decision
    applies ``delay`` slots later is ``Σ_{i ≥ delay+1} p^i = m_S p^{delay+1}`` with
    ``p = 1 − 1/m_S`` (:meth:`benefit_slots`).

    Args:
        threshold: relative move that counts as an event (default 0.1: above measurement
            noise of a few percent).
        prior_slots, prior_weight: the prior (default one run of 10 slots).
        window_slots: the estimates count the last this many steps (``n`` and ``c_S``),
            which bounds the events kept (and the checkpointed state) on a long run.

    Raises:
        ValueError: ``threshold`` not > 0, ``prior_slots`` < 1, ``prior_weight`` < 0 or
            ``window_slots`` < 1.
    """

    def __init__(
        self,
        threshold: float = 0.1,
        prior_slots: float = 10.0,
        prior_weight: float = 1.0,
        window_slots: int = 1000,
    ) -> None:
        if int(window_slots) < 1:
            raise ValueError(f"persistence window_slots: expected >= 1, got {window_slots!r}")
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"persistence threshold: expected a number > 0, got {threshold!r}")
        if not (math.isfinite(prior_slots) and prior_slots >= 1):
            raise ValueError(f"persistence prior_slots: expected >= 1, got {prior_slots!r}")
        if not (math.isfinite(prior_weight) and prior_weight >= 0):
            raise ValueError(f"persistence prior_weight: expected >= 0, got {prior_weight!r}")
        self.threshold = float(threshold)
        self.prior_slots = float(prior_slots)
        self.prior_weight = float(prior_weight)
        self.last_step: int | None = None
        self.device_slots = 0
        self.window_slots = int(window_slots)
        self.device_count = 0
        # (step, device, watched value or "available", |Δx|) of every event in the window
        self.device_events: list[tuple[int, int, str, float]] = []
        self._event_arrays: tuple[np.ndarray, ...] | None = None
        self._device_ref: dict[str, np.ndarray] | None = None

    def update(self, step: int, state: ClusterState, watch_prices: bool = False) -> None:
        """Account for the state observed before ``step`` (its devices' events). Calling
        twice for the same step counts it once. A state with another number of devices than
        the last starts the count afresh."""
        if self.last_step is not None and step <= self.last_step:
            return
        self.last_step = int(step)
        snap = {
            "available": np.asarray(state.available, dtype=bool).copy(),
            "speed": np.asarray(state.speed_flops, dtype=float).copy(),
            "nic": np.asarray(state.nic_bytes_per_s, dtype=float).copy(),
        }
        if watch_prices:
            snap["price"] = np.asarray(state.price_per_s, dtype=float).copy()
            snap["power"] = np.asarray(state.power_w, dtype=float).copy()
        ref = self._device_ref
        n = len(snap["speed"])
        self._event_arrays = None
        if ref is None or len(ref["speed"]) != n or set(ref) != set(snap):
            self._device_ref = snap
            self.device_slots = 1
            self.device_count = n
            self.device_events = []
            return
        self.device_slots += 1
        now = self.device_slots
        if now % self.window_slots == 0:  # drop events older than the window
            self.device_events = [e for e in self.device_events if e[0] > now - self.window_slots]
        up = snap["available"]
        came_or_went = up != ref["available"]
        both = up & ref["available"]
        moved = came_or_went.copy()
        for d in np.flatnonzero(came_or_went):
            self.device_events.append((now, int(d), "available", 0.0))
        for key, new in snap.items():
            if key == "available":
                continue
            delta = np.abs(new - ref[key])
            over = both & (delta > self.threshold * np.abs(ref[key]))
            moved |= over
            for d in np.flatnonzero(over):
                self.device_events.append((now, int(d), key, float(delta[d])))
        for key, new in snap.items():
            ref[key][moved] = new[moved]

    def set_changes(self, devices: Sequence[int]) -> float:
        """``c_S``: the changes of the set ``devices`` (positions in the observed state) in the
        window (class docstring)."""
        ref = self._device_ref
        if ref is None or not self.device_events:
            return 0.0
        if self._event_arrays is None:
            steps, devs, keys, deltas = zip(*self.device_events, strict=True)
            self._event_arrays = (
                np.asarray(steps, dtype=np.int64),
                np.asarray(devs, dtype=np.int64),
                np.asarray(keys),
                np.asarray(deltas, dtype=float),
            )
        steps, devs, keys, deltas = self._event_arrays
        idx = np.asarray(list(devices), dtype=np.int64)
        member = np.zeros(self.device_count, dtype=bool)
        member[idx] = True
        sel = member[devs] & (steps > self.device_slots - self.window_slots)
        if not sel.any():
            return 0.0
        steps, keys, deltas = steps[sel], keys[sel], deltas[sel]
        part = np.ones(len(steps))
        for key, values in ref.items():
            if key == "available":
                continue
            total = self.threshold * float(np.sum(np.abs(values[idx])))
            mine = keys == key
            if total > 0 and mine.any():
                part[mine] = deltas[mine] / total
        _, where = np.unique(steps, return_inverse=True)
        return float(np.sum(np.minimum(np.bincount(where, weights=part), 1.0)))

    def mean_run_slots(self, devices: Sequence[int]) -> float:
        """``m_S >= 1``: the estimated mean number of slots the state of the set ``devices``
        (positions in the observed state) lasts; ``math.inf`` for an empty set. Before any
        observation, the prior mean ``prior_slots`` whatever the set (``math.inf`` with
        ``prior_weight`` 0)."""
        if self._device_ref is None:
            return self.prior_slots if self.prior_weight > 0 else math.inf
        idx = sorted({int(d) for d in devices})
        if not idx:
            return math.inf
        seen = min(self.device_slots, self.window_slots)
        exposure = seen + self.prior_weight * self.prior_slots
        rate = self.set_changes(idx) + self.prior_weight * len(idx) / self.device_count
        if rate <= 0:
            return math.inf
        return max(exposure / rate, 1.0)

    def benefit_slots(self, delay_slots: int, devices: Sequence[int]) -> float:
        """Expected slots the state of the set ``devices`` seen at decision time still holds
        once a decision applies ``delay_slots`` slots after the next one: ``m_S p^{delay+1}``,
        ``p = 1 − 1/m_S`` (:meth:`mean_run_slots`)."""
        m = self.mean_run_slots(devices)
        if math.isinf(m):
            return math.inf
        return m * (1.0 - 1.0 / m) ** (int(delay_slots) + 1)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (settings, last step, the window's events and the devices'
        reference values)."""
        return {
            "threshold": self.threshold,
            "prior_slots": self.prior_slots,
            "prior_weight": self.prior_weight,
            "last_step": self.last_step,
            "window_slots": self.window_slots,
            "device_slots": self.device_slots,
            "device_count": self.device_count,
            "device_events": [list(e) for e in self.device_events],
            "device_reference": None
            if self._device_ref is None
            else {k: v.tolist() for k, v in self._device_ref.items()},
        }

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output. Fields of other estimates that an older state
        carries (``slots``, ``changes``, ``reference``: a cluster-wide count no decision reads)
        are ignored; a state without the device fields restores no events (the count starts
        at the next :meth:`update`)."""
        self.threshold = float(data["threshold"])
        self.prior_slots = float(data["prior_slots"])
        self.prior_weight = float(data["prior_weight"])
        self.last_step = None if data["last_step"] is None else int(data["last_step"])
        self.window_slots = int(data.get("window_slots", self.window_slots))
        self.device_slots = int(data.get("device_slots", 0))
        self.device_count = int(data.get("device_count", 0))
        self.device_events = [
            (int(step), int(d), str(key), float(delta))
            for step, d, key, delta in data.get("device_events", [])
        ]
        self._event_arrays = None
        ref = data.get("device_reference")
        self._device_ref = None
        if ref is not None:
            self._device_ref = {
                k: np.asarray(v, dtype=bool if k == "available" else float) for k, v in ref.items()
            }


class UptimeEstimator:
    """How long a device stays up once up, learned online per device kind (slots).

    Each :meth:`update` sees which devices are up for a step. Per kind ``k`` it counts the
    device-slots up ``u_k`` and the up-to-down transitions ``e_k`` (a device that was up in the
    previous update and is not now); the mean up-run of a device of kind ``k`` is
    ``m_k = (u_k + prior_slots · prior_weight) / (e_k + prior_weight)`` (the censored
    maximum-likelihood mean of a geometric run length with a prior of ``prior_weight`` runs of
    ``prior_slots``; devices of a kind share one estimate because spot outages hit a kind's
    instances alike). A device of kind ``k`` that is up stays up the next slot with probability
    ``p_k = 1 − 1/m_k``; a set ``S`` of devices, taken as independent, with
    ``p_S = Π_{d ∈ S} p_{k(d)}``. The expected number of slots that ``S`` still holds once a
    decision applies ``delay`` slots after the next one is
    ``Σ_{i ≥ delay+1} p_S^i = p_S^{delay+1} / (1 − p_S)`` (:meth:`set_benefit_slots`): the
    longest a migration onto ``S`` can be paid back over.

    Args:
        prior_slots, prior_weight: the prior (default one run of 50 slots: a kind not yet
            seen to go down does not hold back switches onto a few devices, and a kind pooled
            over many device-slots soon outweighs it).

    Raises:
        ValueError: ``prior_slots`` < 1 or ``prior_weight`` <= 0.
    """

    def __init__(self, prior_slots: float = 50.0, prior_weight: float = 1.0) -> None:
        if not (math.isfinite(prior_slots) and prior_slots >= 1):
            raise ValueError(f"uptime prior_slots: expected >= 1, got {prior_slots!r}")
        if not (math.isfinite(prior_weight) and prior_weight > 0):
            raise ValueError(f"uptime prior_weight: expected > 0, got {prior_weight!r}")
        self.prior_slots = float(prior_slots)
        self.prior_weight = float(prior_weight)
        self.up_slots: dict[str, float] = {}
        self.downs: dict[str, float] = {}
        self.last_step: int | None = None
        self._last: np.ndarray | None = None

    def update(self, step: int, state: ClusterState) -> None:
        """Account for the availability of ``step`` (``state.available``); calling twice for
        the same step counts it once."""
        if self.last_step is not None and step <= self.last_step:
            return
        self.last_step = int(step)
        up = np.asarray(state.available, dtype=bool)
        kinds = state.kinds
        went_down = (
            self._last & ~up
            if self._last is not None and len(self._last) == len(up)
            else np.zeros_like(up)
        )
        for kind, is_up, down in zip(kinds, up, went_down, strict=True):
            if is_up:
                self.up_slots[kind] = self.up_slots.get(kind, 0.0) + 1.0
            if down:
                self.downs[kind] = self.downs.get(kind, 0.0) + 1.0
        self._last = up.copy()

    def mean_up_slots(self, kind: str) -> float:
        """``m_k >= 1``: estimated mean number of slots a device of ``kind`` stays up."""
        num = self.up_slots.get(kind, 0.0) + self.prior_slots * self.prior_weight
        return max(num / (self.downs.get(kind, 0.0) + self.prior_weight), 1.0)

    def set_benefit_slots(self, state: ClusterState, devices: list[int], delay_slots: int) -> float:
        """``p_S^{delay+1} / (1 − p_S)`` for the device positions ``devices`` of ``state``
        (``math.inf`` for an empty set)."""
        kinds = state.kinds
        p = 1.0
        for i in devices:
            p *= 1.0 - 1.0 / self.mean_up_slots(kinds[i])
        if p >= 1.0:
            return math.inf
        return p ** (int(delay_slots) + 1) / (1.0 - p)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (counts per kind, last step and availability)."""
        return {
            "prior_slots": self.prior_slots,
            "prior_weight": self.prior_weight,
            "up_slots": dict(self.up_slots),
            "downs": dict(self.downs),
            "last_step": self.last_step,
            "last": None if self._last is None else [bool(x) for x in self._last],
        }

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.prior_slots = float(data["prior_slots"])
        self.prior_weight = float(data["prior_weight"])
        self.up_slots = {k: float(x) for k, x in data["up_slots"].items()}
        self.downs = {k: float(x) for k, x in data["downs"].items()}
        self.last_step = None if data["last_step"] is None else int(data["last_step"])
        self._last = None if data["last"] is None else np.asarray(data["last"], dtype=bool)
