"""The online controller of SPEC §4: Lyapunov drift-plus-penalty with virtual queues.

Per budgeted resource ``j`` (``money``: currency per iteration, ``energy``: joules per
iteration) a virtual queue ``Q_j(t+1) = max(Q_j(t) + y_j(t) − ȳ_j, 0)`` (Neely, *Stochastic
Network Optimization with Application to Communication and Queueing Systems*, 2010, ch. 4).
Before slot ``t`` the controller picks the plan that minimises the drift-plus-penalty bound
``V·T(t) + Σ_j Q̂_j(t) · y_j(t)`` where, so that ``V`` is dimensionless and one knob fits every
cluster, the queue and the penalty are normalised: ``Q̂_j = T_ref Q_j / ȳ_j²`` seconds per unit
of resource j (equivalently the constraint ``y_j/ȳ_j ≤ 1`` with backlog ``Q_j/ȳ_j`` "budgets"
and penalty ``T/T_ref``; ``T_ref`` is the running mean of the measured iteration time, the lower
bound ``T_LB`` before the first measurement). Positive
rescaling of a constraint keeps Neely's guarantees (average within ``O(1/V)`` of optimal, backlog
``O(V)``) under his assumptions; see docs/controller.md for what holds here.

What the controller sees (no peeking): the measured state of slot ``t−1`` (speeds, links, prices)
and which devices are up for slot ``t`` (a preemption is an event the cluster announces; a plan
must never use a device that is gone). The search is the planner's
:func:`hetrain.planner.best_plan`; between searches the controller re-uses the plan's structure and
re-solves only the shares (:mod:`hetrain.control.incremental`). It searches again only when the
state changed enough to matter: a device appeared or disappeared, the current plan's predicted
time drifted more than ``drift_tolerance`` relative to the lower bound, prices moved (with a money
budget), the queue weights moved, or ``replan_every`` slots passed.

Switching plans moves layers (:func:`hetrain.control.migration.migration_time_s`): a slot that
changes the structure lasts ``migration_s`` longer and is billed for it. A candidate replaces the
current plan only if its per-slot gain, summed over ``horizon_slots`` slots, pays for the
migration and beats the current objective by a relative ``switch_margin`` (hysteresis against
measurement noise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.control.incremental import (
    StructureArrays,
    evaluate_fast,
    rebalance_shares,
    structure_key,
)
from hetrain.control.migration import align_plan, migration_time_s
from hetrain.costmodel import PlanEvaluation, TrainingConfig, lower_bound_s
from hetrain.errors import NoFeasiblePlanError
from hetrain.plan import Plan
from hetrain.profile import ProfileArrays

RESOURCES = ("money", "energy")


@dataclass
class VirtualQueues:
    """Virtual queues ``Q_j`` of the long-run budgets ``ȳ_j`` (SPEC §4).

    Attributes:
        budgets: ``{resource: ȳ_j}`` per iteration (currency or joules), each ``> 0``.
        backlog: ``{resource: Q_j}`` in the resource's unit; starts at 0.

    Raises:
        ValueError: unknown resource or a budget that is not a finite number > 0.
    """

    budgets: dict[str, float]
    backlog: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in self.budgets.items():
            if name not in RESOURCES:
                raise ValueError(f"budgets: unknown resource {name!r}, expected one of {RESOURCES}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"budgets.{name}: expected a finite number > 0, got {value!r}")
        for name in self.budgets:
            self.backlog.setdefault(name, 0.0)

    def update(self, cost: Mapping[str, float]) -> None:
        """``Q_j ← max(Q_j + y_j − ȳ_j, 0)`` with ``y_j = cost[j]`` of the slot just run."""
        for name, budget in self.budgets.items():
            self.backlog[name] = max(self.backlog[name] + float(cost[name]) - budget, 0.0)

    def weights(self, reference_time_s: float) -> dict[str, float]:
        """Planner weights ``Q̂_j = T_ref Q_j / ȳ_j²`` (seconds per unit of resource j), the
        ``queues`` argument of :func:`hetrain.planner.best_plan`."""
        return {
            name: reference_time_s * self.backlog[name] / (budget * budget)
            for name, budget in self.budgets.items()
        }


@dataclass
class _Candidate:
    """A plan structure the controller knows, re-balanced for the current estimate."""

    plan: Plan
    arrays: StructureArrays


class LyapunovPolicy:
    """Drift-plus-penalty controller (SPEC §4) with incremental re-planning.

    Args:
        profile: the model's per-layer arrays.
        config: global batch, optimizer state factor, schedule.
        v: the weight ``V > 0`` of the iteration time (``math.inf``: ignore budgets, the
            ``greedy`` policy of SPEC §6).
        budgets: ``{"money": ȳ, "energy": ȳ}`` per iteration; ``None`` or empty: no budget.
        horizon_slots: slots over which a plan change must pay back its migration time.
        switch_margin: relative gain below which a candidate never replaces the current plan.
        drift_tolerance: relative change of the current plan's predicted ``T/T_LB`` (or of a
            price, with budgets) that triggers a new search.
        queue_tolerance: change of a queue weight ``Q̂_j Σ_d π_d / V`` (absolute, dimensionless)
            that triggers a new search.
        replan_every: search at least this often (slots).
        search_time_budget_s: passed to the planner as ``time_budget_s`` (soft, seconds).
        incremental_above: with more available devices than this, searches are rationed (one
            per ``D / search_devices_per_slot`` slots) and, between searches, a lost device is
            replaced by an interchangeable spare (else its group is dropped) and unused devices
            are added as data-parallel groups when that lowers the objective, re-solving only
            the shares.
        search_devices_per_slot: the ration above.
        name: the policy's name in reports.

    Raises:
        ValueError: ``v`` not > 0, a bad budget, or a bad tuning value.
    """

    def __init__(
        self,
        profile: ProfileArrays,
        config: TrainingConfig,
        *,
        v: float = 1.0,
        budgets: Mapping[str, float] | None = None,
        horizon_slots: float = 10.0,
        switch_margin: float = 0.01,
        drift_tolerance: float = 0.05,
        queue_tolerance: float = 0.05,
        replan_every: int = 50,
        search_time_budget_s: float | None = 1.0,
        incremental_above: int = 128,
        search_devices_per_slot: float = 4.0,
        name: str = "lyapunov",
    ) -> None:
        if not (v > 0) or (isinstance(v, float) and math.isnan(v)):
            raise ValueError(f"v: expected a number > 0, got {v!r}")
        for label, value in (
            ("horizon_slots", horizon_slots),
            ("switch_margin", switch_margin),
            ("drift_tolerance", drift_tolerance),
            ("queue_tolerance", queue_tolerance),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{label}: expected a finite number >= 0, got {value!r}")
        if int(replan_every) < 1:
            raise ValueError(f"replan_every: expected an integer >= 1, got {replan_every!r}")
        self.name = name
        self.profile = profile
        self.config = config
        self.v = float(v)
        budgets = dict(budgets or {})
        self.queues = VirtualQueues({} if math.isinf(self.v) else budgets)
        self.horizon_slots = float(horizon_slots)
        self.switch_margin = float(switch_margin)
        self.drift_tolerance = float(drift_tolerance)
        self.queue_tolerance = float(queue_tolerance)
        self.replan_every = int(replan_every)
        self.search_time_budget_s = search_time_budget_s
        if int(incremental_above) < 0 or not (search_devices_per_slot > 0):
            raise ValueError("incremental_above >= 0 and search_devices_per_slot > 0 expected")
        self.incremental_above = int(incremental_above)
        self.search_devices_per_slot = float(search_devices_per_slot)
        self._prev_available: np.ndarray | None = None
        self.reference_time_s: float | None = None
        self._time_sum_s = 0.0
        self._observed_slots = 0
        # state of the incremental layer
        self._current: Plan | None = None
        self._current_arrays: StructureArrays | None = None
        self._pool: list[_Candidate] = []
        self._ref_available: np.ndarray | None = None
        self._ref_price: np.ndarray | None = None
        self._ref_ratio: float = math.inf
        self._ref_weights: dict[str, float] = {}
        self._choice_weights: dict[str, float] = {}
        self._last_search_slot = -(10**9)
        self._arrays_cache: dict[tuple, StructureArrays] = {}
        self._ids: tuple[str, ...] = ()
        self._index: dict[str, int] = {}
        # counters for reports and tests
        self.searches = 0
        self.switches = 0

    # ------------------------------------------------------------------ Policy protocol
    @property
    def budgeted(self) -> bool:
        """Whether any budget is active (``greedy`` and budget-free runs: False)."""
        return bool(self.queues.budgets)

    @property
    def effective_v(self) -> float:
        """``V`` as used in the objective (1 for greedy: with no queue the scale is free)."""
        return 1.0 if math.isinf(self.v) else self.v

    def queue_weights(self) -> dict[str, float]:
        """Current planner weights ``Q̂_j`` (empty without budgets)."""
        if not self.budgeted or self.reference_time_s is None:
            return {}
        return self.queues.weights(self.reference_time_s)

    def decide(self, slot: int, observed: ClusterState) -> Plan:
        """The plan for ``slot`` from the state measured up to ``slot − 1`` (availability of
        ``slot`` included).

        Raises:
            NoFeasiblePlanError: no device is available or the model fits no arrangement.
        """
        if observed.ids != self._ids:
            self._ids = tuple(observed.ids)
            self._index = observed.index()
            self._arrays_cache.clear()
        available = np.asarray(observed.available, dtype=bool)
        if not available.any():
            raise NoFeasiblePlanError("no device is available")
        if self.reference_time_s is None:
            self.reference_time_s = lower_bound_s(observed, self.profile, self.config.batch)
        t_lb = lower_bound_s(observed, self.profile, self.config.batch)
        weights = self.queue_weights()

        current = None
        repaired = None
        predicted_ratio = math.inf
        if self._current is not None:
            if self._usable(self._current, available):
                current, t_pred = self._rebalance(self._current, observed)
                predicted_ratio = t_pred / t_lb if t_lb > 0 else math.inf
            else:
                repaired = self._repair(self._current, observed)
        self._pool = [c for c in self._pool if self._usable(c.plan, available)]

        wants = current is None or self._needs_search(slot, observed, predicted_ratio)
        # a new planner search when a queue weight left [w_ref/2, 2 w_ref] (and moved a lot)
        wants = wants or (
            self._queue_moved(observed, weights, self._ref_weights, 4.0)
            and any(
                not (
                    0.5 * self._ref_weights.get(j, 0.0) <= w <= 2.0 * self._ref_weights.get(j, 0.0)
                )
                for j, w in weights.items()
            )
        )
        forced = current is None and repaired is None
        extra: list[Plan] = []
        searched = False
        if wants and (forced or self._search_allowed(slot, int(available.sum()))):
            self._search(observed, weights)
            self._ref_available = available.copy()
            self._ref_price = np.asarray(observed.price_per_s, dtype=float).copy()
            self._ref_weights = dict(weights)
            self._last_search_slot = slot
            searched = True
        elif self._prev_available is not None and not np.array_equal(
            available, self._prev_available
        ):
            # large cluster between searches: repair (drop groups that lost a device) and
            # extend (returned devices as data-parallel groups), re-solving shares only
            base = current if current is not None else repaired
            grown = self._extend(base, observed) if base is not None else None
            extra = [p for p in (repaired, grown) if p is not None]
        if repaired is not None:
            extra.append(repaired)
        self._prev_available = available.copy()
        moved = self._queue_moved(observed, weights, self._choice_weights, 1.0)
        if searched or extra or moved or current is None:
            # re-weigh the known structures (cheap) whenever something changed
            self._choice_weights = dict(weights)
            choice = self._choose(current, observed, weights, extra)
            _, t_pred = self._rebalance(choice, observed)
            self._ref_ratio = t_pred / t_lb if t_lb > 0 else math.inf
        else:
            choice = current
        if self._current is not None and choice.structure() != self._current.structure():
            self.switches += 1
        self._current = choice
        return choice

    def _search_allowed(self, slot: int, num_available: int) -> bool:
        """Searches are free up to ``incremental_above`` available devices; above, at most one
        per ``ceil(D / search_devices_per_slot)`` slots (deterministic stand-in for a
        wall-clock budget: the planner's cost grows with ``D``)."""
        if num_available <= self.incremental_above:
            return True
        gap = math.ceil(num_available / self.search_devices_per_slot)
        return slot - self._last_search_slot >= gap

    def _repair(self, plan: Plan, observed: ClusterState) -> Plan | None:
        """``plan`` after losing devices, shares re-solved: a lost device is replaced by an
        unused available device of the same kind (memory and NIC equal, speed within 5%,
        same node preferred); a group where that is impossible is dropped. None if nothing is
        left or the rest cannot take the batch."""
        available = np.asarray(observed.available, dtype=bool)
        index = self._index
        used = {d for g in plan.groups if g.batch > 0 for d in g.devices}
        spare = [d for d, ok in zip(observed.ids, available, strict=True) if ok and d not in used]
        keep = []
        for g in plan.groups:
            if g.batch <= 0:
                continue
            devices = list(g.devices)
            for k, d in enumerate(devices):
                if available[index[d]]:
                    continue
                sub = self._substitute(d, spare, observed)
                if sub is None:
                    devices = []
                    break
                spare.remove(sub)
                devices[k] = sub
            if devices:
                keep.append(g.model_copy(update={"devices": tuple(devices), "batch": 1}))
        if not keep:
            return None
        trimmed = plan.model_copy(update={"groups": tuple(keep)})
        new, _ = self._rebalance(trimmed, observed)
        return new if new.global_batch == self.config.batch else None

    def _substitute(self, lost: str, spare: list[str], observed: ClusterState) -> str | None:
        """An unused device interchangeable with ``lost`` (same node first), or None."""
        i = self._index[lost]
        best = None
        for d in spare:
            j = self._index[d]
            if (
                observed.memory_bytes[j] == observed.memory_bytes[i]
                and observed.nic_bytes_per_s[j] == observed.nic_bytes_per_s[i]
                and abs(observed.speed_flops[j] / observed.speed_flops[i] - 1.0) < 0.05
            ):
                if observed.node[j] == observed.node[i]:
                    return d
                best = best or d
        return best

    def _extend(self, plan: Plan, observed: ClusterState) -> Plan | None:
        """``plan`` plus data-parallel groups of the fastest available devices it does not use
        (the best of adding 1, 2, 4, ... of them, by the objective), shares re-solved."""
        available = np.asarray(observed.available, dtype=bool)
        used = {d for g in plan.groups if g.batch > 0 for d in g.devices}
        fresh = [d for d, ok in zip(observed.ids, available, strict=True) if ok and d not in used]
        if not fresh:
            return None
        fresh.sort(key=lambda d: -float(observed.speed_flops[self._index[d]]))
        singles = [g.microbatch_size for g in plan.groups if g.batch > 0 and len(g.devices) == 1]
        mu = int(np.median(singles)) if singles else 1
        num_layers = self.profile.num_layers
        from hetrain.plan import GroupPlan

        active = tuple(g for g in plan.groups if g.batch > 0)
        weights = self.queue_weights()
        best, best_score = None, math.inf
        counts = sorted({min(2**k, len(fresh)) for k in range(len(fresh).bit_length() + 1)})
        for count in counts:
            added = tuple(
                GroupPlan(devices=(d,), stages=((0, num_layers),), microbatch_size=mu, batch=1)
                for d in fresh[:count]
            )
            grown = plan.model_copy(update={"groups": active + added})
            new, _ = self._rebalance(grown, observed)
            if new.global_batch != self.config.batch or new is grown:
                continue
            score = self._objective(new, observed, weights)
            if score < best_score:
                best, best_score = new, score
        return best

    def observe(self, slot: int, plan: Plan, evaluation: PlanEvaluation) -> None:
        """Feed the measured cost of ``slot`` (migration included) into the virtual queues and
        the measured time into ``T_ref`` (the running mean iteration time)."""
        if self.budgeted:
            self.queues.update(evaluation.cost)
        self._observed_slots += 1
        t = float(evaluation.iteration_time_s)
        if math.isfinite(t) and t > 0:
            self._time_sum_s += t
            self.reference_time_s = self._time_sum_s / self._observed_slots

    # ------------------------------------------------------------------ internals
    def _usable(self, plan: Plan, available: np.ndarray) -> bool:
        index = self._index
        return all(available[index[d]] for g in plan.groups if g.batch > 0 for d in g.devices)

    def _arrays(self, plan: Plan) -> StructureArrays:
        key = structure_key(plan)
        arrays = self._arrays_cache.get(key)
        if arrays is None:
            if len(self._arrays_cache) > 64:
                self._arrays_cache.clear()
            arrays = StructureArrays.build(plan, self._ids, self.profile)
            self._arrays_cache[key] = arrays
        return arrays

    def _rebalance(self, plan: Plan, state: ClusterState) -> tuple[Plan, float]:
        """Same structure, shares re-solved for ``state``; also the predicted ``max_g T_g``."""
        arrays = self._arrays(plan)
        new = rebalance_shares(
            plan, state, arrays, self.config.batch, self.config.optimizer_state_factor
        )
        a_g, m_g = arrays.group_timing(state)
        shares = np.array([new.groups[i].batch for i in arrays.group_index], dtype=float)
        n = np.ceil(shares / arrays.microbatch)
        t_g = np.where(n > 0, a_g + (n - 1.0) * m_g, 0.0)
        return new, float(t_g.max()) if len(t_g) else math.inf

    def _needs_search(
        self,
        slot: int,
        observed: ClusterState,
        predicted_ratio: float,
    ) -> bool:
        if self._ref_available is None:
            return True
        available = np.asarray(observed.available, dtype=bool)
        if not np.array_equal(available, self._ref_available):
            return True
        if slot - self._last_search_slot >= self.replan_every:
            return True
        if predicted_ratio > self._ref_ratio * (1.0 + self.drift_tolerance):
            return True
        if self.budgeted:
            price = np.asarray(observed.price_per_s, dtype=float)
            ref = self._ref_price
            if ref is not None:
                avail = np.asarray(observed.available, dtype=bool)
                total, ref_total = float(price[avail].sum()), float(ref[avail].sum())
                if abs(total - ref_total) > self.drift_tolerance * max(ref_total, 1e-300):
                    return True
                if np.any(np.abs(price - ref) > 4 * self.drift_tolerance * np.maximum(ref, 1e-300)):
                    return True
        return False

    def _queue_moved(
        self,
        observed: ClusterState,
        weights: dict[str, float],
        reference: dict[str, float],
        factor: float,
    ) -> bool:
        """Whether a queue weight moved by more than ``factor · queue_tolerance`` since
        ``reference``, measured as ``|ΔQ̂_j| Σ_{d available} r_{j,d} / V`` (dimensionless: the
        change of the resource's weight relative to time when every device is used)."""
        if not weights:
            return False
        available = np.asarray(observed.available, dtype=bool)
        scale = {
            "money": float(np.sum(observed.price_per_s[available])),
            "energy": float(np.sum(observed.power_w[available])),
        }
        v = self.effective_v
        for name, w in weights.items():
            old = reference.get(name, 0.0)
            if abs(w - old) * scale[name] / v > factor * self.queue_tolerance:
                return True
        return False

    def _search(self, observed: ClusterState, weights: dict[str, float]) -> None:
        from hetrain.planner import best_plan

        self.searches += 1
        found = best_plan(
            observed,
            self.profile,
            self.config,
            v=self.effective_v,
            queues=weights or None,
            warm_start=self._current,
            time_budget_s=self.search_time_budget_s,
        )
        key = found.structure()
        self._pool = [c for c in self._pool if c.plan.structure() != key]
        self._pool.insert(0, _Candidate(found, self._arrays(found)))
        del self._pool[4:]

    def _objective(self, plan: Plan, state: ClusterState, weights: dict[str, float]) -> float:
        ev = evaluate_fast(plan, self._arrays(plan), state, self.config.optimizer_state_factor)
        if not ev.fits:
            return math.inf
        return self.effective_v * ev.iteration_time_s + sum(
            w * ev.cost[name] for name, w in weights.items()
        )

    def _switch_penalty(
        self, old: Plan | None, new: Plan, state: ClusterState, weights: dict[str, float]
    ) -> float:
        """Drift-plus-penalty cost of the migration ``old -> new``, spread over the horizon:
        ``(V + Σ_j Q̂_j Σ_{d used} r_{j,d}) · t_mig / H`` (the slot lasts ``t_mig`` longer and
        every used device is billed for it)."""
        if old is None:
            return 0.0
        t_mig = migration_time_s(old, new, state, self.profile, self.config.optimizer_state_factor)
        if t_mig <= 0:
            return 0.0
        index = self._index
        used = np.array([index[d] for g in new.groups if g.batch > 0 for d in g.devices])
        rate = self.effective_v
        if "money" in weights:
            rate += weights["money"] * float(np.sum(state.price_per_s[used]))
        if "energy" in weights:
            rate += weights["energy"] * float(np.sum(state.power_w[used]))
        return rate * t_mig / max(self.horizon_slots, 1e-9)

    def _choose(
        self,
        current: Plan | None,
        observed: ClusterState,
        weights: dict[str, float],
        extra: list[Plan] | None = None,
    ) -> Plan:
        """Pick among the current plan (re-balanced), the known candidates (aligned to the
        current plan, re-balanced) and ``extra`` plans (repairs, extensions)."""
        options: list[tuple[float, Plan]] = []
        for cand_plan in [c.plan for c in self._pool] + list(extra or []):
            aligned = align_plan(cand_plan, self._current, observed)
            plan, _ = self._rebalance(aligned, observed)
            score = self._objective(plan, observed, weights)
            if not math.isfinite(score):
                # re-balancing broke memory; fall back to the planner's own shares
                plan = aligned
                score = self._objective(plan, observed, weights)
            if current is not None and plan.structure() == current.structure():
                continue
            if not math.isfinite(score):
                continue  # does not fit memory in the observed state
            penalty = self._switch_penalty(self._current, plan, observed, weights)
            options.append((score + penalty, plan))
        if current is None:
            if not options:
                raise NoFeasiblePlanError("no known plan fits the available devices")
            return min(options, key=lambda o: o[0])[1]
        current_score = self._objective(current, observed, weights)
        best = min(options, key=lambda o: o[0], default=None)
        if best is not None and best[0] < current_score * (1.0 - self.switch_margin):
            return best[1]
        return current
