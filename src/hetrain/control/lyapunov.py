"""The online controller of docs/model.md §4: Lyapunov drift-plus-penalty with virtual queues.

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
changes the structure lasts ``migration_s`` longer and is billed for it. Every decision goes
through one gate (:meth:`LyapunovController._gate`, docs/controller.md "Decisions that hold"):
on the estimates that chose it, a change is applied only if its predicted iteration time is
lower than the current plan's and that gain, summed over the expected persistence of the
observed state of the devices of both plans (:class:`hetrain.control.decision
.PersistenceEstimator`, learned online) and at
most the expected time the new plan's devices stay up (:class:`~hetrain.control.decision
.UptimeEstimator`, up-runs per device kind learned from the observed availability), pays for
its migration time; or, with budgets, if the same holds for the drift-plus-penalty
objective (then the decision is flagged ``budget_driven`` with the costs that drove it), over
the slots that gain lasts while the queues move (``budget_payback``). With ``credit`` (default)
the queues are signed, so money saved on a cheap plan is spent later on a fast one
(docs/controller.md, "Budgets: time-sharing in blocks").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.control.decision import Decision, Estimates, PersistenceEstimator, UptimeEstimator
from hetrain.control.dual import bisect_multipliers
from hetrain.control.incremental import (
    StructureArrays,
    evaluate_fast,
    rebalance_shares,
    structure_key,
)
from hetrain.control.migration import align_plan, migration_time_s
from hetrain.costmodel import PlanEvaluation, TrainingConfig, evaluate_plan, lower_bound_s
from hetrain.errors import NoFeasiblePlanError
from hetrain.plan import Plan
from hetrain.profile import ProfileArrays

RESOURCES = ("money", "energy")


@dataclass
class VirtualQueues:
    """Virtual queues ``Q_j`` of the long-run budgets ``ȳ_j`` (docs/model.md §4).

    Attributes:
        budgets: ``{resource: ȳ_j}`` per iteration (currency or joules), each ``> 0``.
        backlog: ``{resource: Q_j}`` in the resource's unit; starts at 0.

    Raises:
        ValueError: unknown resource or a budget that is not a finite number > 0.
    """

    budgets: dict[str, float]
    backlog: dict[str, float] = field(default_factory=dict)
    signed: bool = False

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
            q = self.backlog[name] + float(cost[name]) - budget
            self.backlog[name] = q if self.signed else max(q, 0.0)

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


def _active_key(plan: Plan) -> tuple:
    """Groups of ``plan`` that run (devices, stages, μ, share): equal keys = the same plan."""
    return tuple(
        (g.devices, tuple(tuple(s) for s in g.stages), g.microbatch_size, g.batch)
        for g in plan.groups
        if g.batch > 0
    )


@dataclass(frozen=True)
class _Figures:
    """Predicted figures of one plan on the estimates."""

    time_s: float
    cost: dict[str, float]
    fits: bool


class _StateMemo:
    """What the controller computed on one observed state, per plan: the cost model's
    evaluations (:func:`hetrain.costmodel.evaluate_plan`), the vectorised ones
    (:func:`~hetrain.control.incremental.evaluate_fast`) and the share re-solves
    (:func:`~hetrain.control.incremental.rebalance_shares`). Each is a pure function of the
    plan and the state (a ``ClusterState`` is not changed once made) and the controller's fixed
    profile and configuration, so one decision's proposal, pool, gate and audit, and a caller's
    predictions on the same state, compute each at most once; a state reused while nothing was
    measured to move (the runtime's :meth:`~hetrain.runtime.ctlcontroller.PlanController
    .observed_state`) costs no evaluation at all. Keys: the plan's ``(schedule, groups)``
    (what the evaluations read); for a re-solve its structure
    (:func:`~hetrain.control.incremental.structure_key`), schedule and ``revive`` (the new
    groups, which do not depend on the old shares)."""

    __slots__ = ("state", "evaluations", "fast", "rebalanced")

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.evaluations: dict[tuple, PlanEvaluation] = {}
        self.fast: dict[tuple, Any] = {}
        self.rebalanced: dict[tuple, tuple[tuple | None, float]] = {}


class LyapunovController:
    """Drift-plus-penalty controller (docs/model.md §4) with incremental re-planning and a single
    gate
    that every plan change passes (docs/controller.md). This is the class that ``hetrain
    simulate`` runs and that the runtime's controller process calls.

    API for a caller that measures (docs/ARCHITECTURE.md, "Controller")::

        decision = controller.decide(step, observed_state, current_plan)   # -> Decision
        ...run decision.plan from step + decision delay on...
        controller.record(step, iteration_time_s, {"money": y, "energy": y})
        blob = controller.state_dict(); controller.load_state_dict(blob)   # plain JSON data

    Args:
        profile: the model's per-layer arrays.
        config: global batch, optimizer state factor, schedule (and the cost-model options the
            decision figures are computed with, e.g. ``sync_overlap``).
        v: the weight ``V > 0`` of the iteration time (``math.inf``: ignore budgets, the
            ``greedy`` policy of docs/model.md §6).
        budgets: ``{"money": ȳ, "energy": ȳ}`` per iteration; ``None`` or empty: no budget.
        decision_delay_slots: slots between the last measurement a decision uses and the first
            slot it runs in, minus one (0: measured up to ``t − 1``, applied at ``t``; the
            runtime's asynchronous controller: 1). Shortens the expected payback horizon.
        horizon_slots: optional cap on the payback horizon (slots); ``None``: no cap.
        switch_margin: relative gain of the objective below which a *structure* change is
            never applied (hysteresis against measurement noise).
        drift_tolerance: relative change of the current plan's predicted ``T/T_LB`` (``T``
            with the gradient sync, :meth:`_predicted_time_s`; or of a price, with budgets)
            that triggers a new search.
        queue_tolerance: change of a queue weight ``Q̂_j Σ_d π_d / V`` (absolute, dimensionless)
            that triggers a new search.
        replan_every: search at least this often (slots).
        search_time_budget_s: passed to the planner as ``time_budget_s`` (soft, seconds).
            ``None`` (default): no wall-clock limit up to ``exact_search_devices`` available
            devices, so that decisions are reproducible from the same measurements (a budget
            makes the search depend on the machine's load), and 1 s above.
        exact_search_devices: see ``search_time_budget_s`` (default 128, the size up to which
            searches are not rationed: a search at 64 devices takes seconds, in the runtime's
            search thread or inline in a simulation).
        incremental_above: with more available devices than this, searches are rationed (one
            per ``D / search_devices_per_slot`` slots) and, between searches, a lost device is
            replaced by an interchangeable spare (else its group is dropped) and unused devices
            are added as data-parallel groups when that lowers the objective, re-solving only
            the shares; decision figures then use the vectorised cost model.
        search_devices_per_slot: the ration above.
        persistence_threshold: relative move of a device's measured speed, NIC (or price/power
            with budgets) that counts as an event of its state for the persistence estimate.
        persistence_prior_slots: prior mean persistence (slots, weight of one run).
        uptime_prior_slots: prior mean up-run of a device (slots, weight of one run) of the
            per-kind uptime estimate that caps the payback horizon of a switch by how long
            the new plan's devices are expected to stay up; ``None``: no cap.
        credit: with budgets, signed virtual queues ``Q_j ← Q_j + y_j − ȳ_j`` (a saved budget
            is spent later; the planner weight is floored at 0); False: the model's
            ``max(·, 0)``.
        budget_payback: with budgets, a budget-driven change must pay its migration within
            the slots its objective gain lasts once it runs (:meth:`_budget_horizon`: the
            queues it moves erode the gain), not within the state's persistence alone.
        queue_warm_start: with budgets, start each virtual queue at the backlog whose weight
            makes the first plan meet the budget (found by bisection on the first observed
            state), so that the spend does not overshoot while the queue fills.
        rebalance_margin: relative gain of the predicted iteration time below which a
            shares-only change is not applied (0: any predicted gain; the runtime uses a few
            percent against noise in measured speeds).
        single_stage_one_microbatch: a single-stage group runs its share as one micro-batch
            (the runtime's engine convention, ``hetrain.runtime.ctldecision.runtime_plan``): its
            shares are re-solved with ``μ_g = b_g``
            (:func:`~hetrain.control.incremental.rebalance_shares`) and every plan the
            controller emits has ``μ_g = b_g`` for such groups.
        name: the policy's name in reports.

    Raises:
        ValueError: ``v`` not > 0, a bad budget, or a bad tuning value.
    """

    def __init__(
        self,
        profile: ProfileArrays,
        config: TrainingConfig,
        *,
        v: float = 10.0,
        budgets: Mapping[str, float] | None = None,
        decision_delay_slots: int = 1,
        horizon_slots: float | None = None,
        switch_margin: float = 0.01,
        drift_tolerance: float = 0.05,
        queue_tolerance: float = 0.05,
        replan_every: int = 50,
        search_time_budget_s: float | None = None,
        exact_search_devices: int = 128,
        incremental_above: int = 128,
        search_devices_per_slot: float = 4.0,
        persistence_threshold: float = 0.1,
        persistence_prior_slots: float = 10.0,
        uptime_prior_slots: float | None = 50.0,
        queue_warm_start: bool = True,
        dual_learning: bool = True,
        budget_payback: bool = True,
        credit: bool = True,
        rebalance_margin: float = 0.0,
        single_stage_one_microbatch: bool = False,
        name: str = "lyapunov",
    ) -> None:
        if not (v > 0) or (isinstance(v, float) and math.isnan(v)):
            raise ValueError(f"v: expected a number > 0, got {v!r}")
        for label, value in (
            ("switch_margin", switch_margin),
            ("drift_tolerance", drift_tolerance),
            ("queue_tolerance", queue_tolerance),
            ("rebalance_margin", rebalance_margin),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{label}: expected a finite number >= 0, got {value!r}")
        if horizon_slots is not None and not (horizon_slots > 0):
            raise ValueError(f"horizon_slots: expected a number > 0 or None, got {horizon_slots!r}")
        if int(replan_every) < 1:
            raise ValueError(f"replan_every: expected an integer >= 1, got {replan_every!r}")
        if int(decision_delay_slots) < 0:
            raise ValueError(
                f"decision_delay_slots: expected an integer >= 0, got {decision_delay_slots!r}"
            )
        self.name = name
        self.profile = profile
        self.config = config
        self.v = float(v)
        budgets = dict(budgets or {})
        self.queues = VirtualQueues({} if math.isinf(self.v) else budgets, signed=bool(credit))
        self.budget_payback = bool(budget_payback)
        self.decision_delay_slots = int(decision_delay_slots)
        self.horizon_slots = None if horizon_slots is None else float(horizon_slots)
        self.switch_margin = float(switch_margin)
        self.rebalance_margin = float(rebalance_margin)
        self.single_stage_one_microbatch = bool(single_stage_one_microbatch)
        # a search the last decision wanted but did not run (decide(..., search=False)): the
        # (observed state, queue weights) to search at, for a caller that searches elsewhere
        self.search_wanted: tuple[ClusterState, dict[str, float]] | None = None
        self._search_inline = True
        self._pool_added = False
        self.drift_tolerance = float(drift_tolerance)
        self.queue_tolerance = float(queue_tolerance)
        self.replan_every = int(replan_every)
        self.search_time_budget_s = search_time_budget_s
        self.exact_search_devices = int(exact_search_devices)
        if int(incremental_above) < 0 or not (search_devices_per_slot > 0):
            raise ValueError("incremental_above >= 0 and search_devices_per_slot > 0 expected")
        self.incremental_above = int(incremental_above)
        self.search_devices_per_slot = float(search_devices_per_slot)
        self.persistence = PersistenceEstimator(
            threshold=persistence_threshold, prior_slots=persistence_prior_slots
        )
        self.uptime = None if uptime_prior_slots is None else UptimeEstimator(uptime_prior_slots)
        self.queue_warm_start = bool(queue_warm_start)
        self.dual_learning = bool(dual_learning)
        self.pool_size = 8
        self._warm_started = False
        self._reset_ref = False
        self._prev_available: np.ndarray | None = None
        self.reference_time_s: float | None = None
        self._time_sum_s = 0.0
        self._observed_slots = 0
        # state of the incremental layer
        self._current: Plan | None = None
        self._pool: list[_Candidate] = []
        self._ref_available: np.ndarray | None = None
        self._ref_price: np.ndarray | None = None
        self._ref_ratio: float = math.inf
        self._ref_weights: dict[str, float] = {}
        self._choice_weights: dict[str, float] = {}
        self._last_search_slot = -(10**9)
        self._arrays_cache: dict[tuple, StructureArrays] = {}
        # figures per plan on the newest observed state (_StateMemo); False: computed anew at
        # every use (the same values: tests compare both)
        self.memoize = True
        self._memo: _StateMemo | None = None
        self._ids: tuple[str, ...] = ()
        self._index: dict[str, int] = {}
        self._last_plan_id = -1
        # consecutive decisions that refused a structure change the objective asked for (the
        # age of the refused gain, docs/controller.md "Persistence"), and this decision's flag
        self._refused_slots = 0
        self._gain_refused = False
        # realised share ρ of the predicted gains of applied structure changes: the last change
        # under audit and the sums (seconds) of predicted and realised gains
        self._audit: dict[str, Any] | None = None
        self.predicted_gain_s = 0.0
        self.realized_gain_s = 0.0
        self.realized_prior_slots = 2.0
        self._audited_slots = 0
        # learned multipliers (docs/controller.md "Budgets"): per past slot, the figures
        # (T, money, energy) of the plans the controller weighed, and the multipliers η̂_j
        self.dual_window_slots = 1000
        self.dual_min_slots = 10
        self._slot_figures: list[tuple[float, float, float]] = []
        self._dual_history: list[np.ndarray] = []
        self.eta_hat: dict[str, float] = {}
        # counters for reports and tests
        self.searches = 0
        self.switches = 0
        self.last_decision: Decision | None = None

    # ------------------------------------------------------------------ public API
    @property
    def budgeted(self) -> bool:
        """Whether any budget is active (``greedy`` and budget-free runs: False)."""
        return bool(self.queues.budgets)

    @property
    def effective_v(self) -> float:
        """``V`` as used in the objective (1 for greedy: with no queue the scale is free)."""
        return 1.0 if math.isinf(self.v) else self.v

    @property
    def current_plan(self) -> Plan | None:
        """The plan of the last decision (what the controller believes runs next)."""
        return self._current

    def number_current(self, plan_id: int) -> None:
        """The plan of the last decision runs under id ``plan_id`` (an integer >= 0): it
        carries that id and the next changed plan gets ``plan_id + 1``."""
        self._last_plan_id = int(plan_id)
        if self._current is not None:
            self._current = self._current.model_copy(update={"plan_id": int(plan_id)})

    def queue_weights(self) -> dict[str, float]:
        """Current planner weights ``V·η̂_j + Q̂_j`` (seconds per unit of resource j; empty
        without budgets): the learned multiplier plus the normalised backlog
        (docs/controller.md "Budgets")."""
        if not self.budgeted or self.reference_time_s is None:
            return {}
        q = self.queues.weights(self.reference_time_s)
        return {j: max(self.effective_v * self.eta_hat.get(j, 0.0) + w, 0.0) for j, w in q.items()}

    def _learn_multipliers(self) -> None:
        """``η̂_j``: the smallest multipliers with which choosing, in every past slot of the
        window, the plan minimising ``T + Σ_j η_j y_j`` among the plans weighed in that slot
        (on the state observed then) would have met every budget
        (:func:`~hetrain.control.dual.bisect_multipliers`); the stale-information reference's
        multiplier, learned from past slots only. Before ``dual_min_slots`` slots are in the
        window, the warm start's multiplier stands (the plans weighed in one or two slots may
        all meet the budget, which says nothing of the multiplier)."""
        if len(self._dual_history) < self.dual_min_slots:
            return
        width = max(len(f) for f in self._dual_history)
        figs = np.zeros((len(self._dual_history), 3, width))
        figs[:, 0, :] = np.inf  # padding: never chosen
        for i, f in enumerate(self._dual_history):
            figs[i, :, : len(f)] = f.T
        rows = np.arange(figs.shape[0])
        col = {"money": 1, "energy": 2}
        budgets = self.queues.budgets

        def spend(eta: dict[str, float]) -> dict[str, float]:
            obj = figs[:, 0, :].copy()
            for j, x in eta.items():
                obj = obj + x * figs[:, col[j], :]
            pick = np.argmin(obj, axis=1)
            return {j: float(np.mean(figs[rows, col[j], pick])) for j in budgets}

        t_ref = float(self.reference_time_s or 1.0)
        learned = bisect_multipliers(
            spend, budgets, {j: t_ref / b for j, b in budgets.items()}, iterations=20
        )
        # 0 means the plans weighed in the window all meet the budget (no faster plan was
        # weighed), which says nothing of the price: the last estimate stands
        self.eta_hat = {j: x if x > 0 else self.eta_hat.get(j, 0.0) for j, x in learned.items()}

    def decide(
        self,
        step: int,
        observed: ClusterState,
        current_plan: Plan | None = None,
        *,
        search: bool = True,
    ) -> Decision:
        """Decide the plan that runs after ``step`` (measurements up to ``step − 1``).

        Args:
            step: the step (slot) index; increasing between calls.
            observed: the estimated cluster state (measured speeds, NICs, prices; the
                availability of the slot the decision is for).
            current_plan: the plan running now; ``None``: the controller's last decision.
            search: False: the cheap decision only (the current structure and the known
                ones re-balanced, through the gate; a few share solves): a planner search the
                decision wants is not run but left in :attr:`search_wanted` for the caller to
                run elsewhere (:meth:`search_plan`) and hand back (:meth:`add_searched`). A
                forced search (no usable current plan, no repair) runs anyway.

        Returns:
            a :class:`~hetrain.control.decision.Decision` whose figures are computed on
            ``observed`` and the queues as they were before the decision.

        Raises:
            NoFeasiblePlanError: no device is available or the model fits no arrangement.
        """
        if current_plan is not None:
            self._current = current_plan
            if current_plan.plan_id is not None:
                self._last_plan_id = max(self._last_plan_id, int(current_plan.plan_id))
        if observed.ids != self._ids:
            self._ids = tuple(observed.ids)
            self._index = observed.index()
            self._arrays_cache.clear()
        available = np.asarray(observed.available, dtype=bool)
        if not available.any():
            raise NoFeasiblePlanError("no device is available")
        self.persistence.update(step, observed, watch_prices=self.budgeted)
        if self.uptime is not None:
            self.uptime.update(step, observed)
        if self.reference_time_s is None:
            self.reference_time_s = lower_bound_s(observed, self.profile, self.config.batch)
        if self.budgeted and self.queue_warm_start and not self._warm_started:
            self._warm_start_queues(observed)
        self._warm_started = True
        if self.budgeted and self.dual_learning:
            self._learn_multipliers()
        weights = self.queue_weights()
        self._gain_refused = False
        self._slot_figures = []
        self._search_inline = bool(search)
        self.search_wanted = None
        if int(available.sum()) <= self.incremental_above:
            self._audit_gain(step, observed)
        proposal = self._propose(step, observed, weights)
        decision = self._gate(step, self._current, proposal, observed, weights)
        if self._slot_figures and self.budgeted and self.dual_learning:
            self._dual_history.append(np.asarray(self._slot_figures, dtype=float))
            del self._dual_history[: -self.dual_window_slots]
        self._slot_figures = []
        if decision.structure_changed or not self._gain_refused:
            self._refused_slots = 0
        else:
            self._refused_slots += 1
        if self._reset_ref or decision.structure_changed:
            t_lb = lower_bound_s(observed, self.profile, self.config.batch)
            t_pred = self._predicted_time_s(decision.plan, observed)
            self._ref_ratio = t_pred / t_lb if t_lb > 0 else math.inf
            self._reset_ref = False
        if decision.structure_changed and self._current is not None:
            self.switches += 1
            gain = (decision.predicted_time_s_before or math.inf) - decision.predicted_time_s_after
            if not decision.forced and not decision.budget_driven and math.isfinite(gain):
                start = step + self.decision_delay_slots  # the first slot it runs
                self._audit = {
                    "old": self._current,
                    "new": decision.plan,
                    "gain": gain,
                    "start": start,
                    "end": start + max(math.ceil(decision.persistence_slots), 1),
                }
        self._current = decision.plan
        self.last_decision = decision
        return decision

    def record(self, step: int, iteration_time_s: float, cost: Mapping[str, float]) -> None:
        """Feed the measured outcome of ``step``: its iteration time (seconds, migration
        included) into ``T_ref`` and its cost per iteration (``{"money", "energy"}``) into the
        virtual queues ``Q_j ← max(Q_j + y_j − ȳ_j, 0)``."""
        if self.budgeted:
            self.queues.update(cost)
        self._observed_slots += 1
        t = float(iteration_time_s)
        if math.isfinite(t) and t > 0:
            self._time_sum_s += t
            self.reference_time_s = self._time_sum_s / self._observed_slots

    def observe(self, slot: int, plan: Plan, evaluation: PlanEvaluation) -> None:
        """The simulator's hook (:class:`~hetrain.control.Policy`): :meth:`record` with the
        evaluation's time and cost."""
        self.record(slot, evaluation.iteration_time_s, evaluation.cost)

    def state_dict(self) -> dict[str, Any]:
        """Everything the controller learned, as plain JSON-able data (lists, floats, str):
        queues, ``T_ref``, the current plan and its id, the candidate pool, the search
        references and the persistence statistics. Restored by :meth:`load_state_dict` into a
        controller built with the same arguments, it takes the same decisions."""

        def arr(x: np.ndarray | None) -> list | None:
            return None if x is None else np.asarray(x).tolist()

        def finite(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else float(x)

        return {
            "version": 1,
            "name": self.name,
            "v": finite(self.v),
            "budgets": dict(self.queues.budgets),
            "backlog": dict(self.queues.backlog),
            "reference_time_s": finite(self.reference_time_s),
            "time_sum_s": self._time_sum_s,
            "observed_slots": self._observed_slots,
            "warm_started": self._warm_started,
            "current_plan": None if self._current is None else self._current.to_json_dict(),
            "last_plan_id": self._last_plan_id,
            "pool": [c.plan.to_json_dict() for c in self._pool],
            "ids": list(self._ids),
            "prev_available": arr(self._prev_available),
            "ref_available": arr(self._ref_available),
            "ref_price": arr(self._ref_price),
            "ref_ratio": finite(self._ref_ratio),
            "reset_ref": self._reset_ref,
            "ref_weights": dict(self._ref_weights),
            "choice_weights": dict(self._choice_weights),
            "last_search_slot": self._last_search_slot,
            "searches": self.searches,
            "switches": self.switches,
            "persistence": self.persistence.state_dict(),
            "uptime": None if self.uptime is None else self.uptime.state_dict(),
            "refused_slots": self._refused_slots,
            "realized_gain": [self.predicted_gain_s, self.realized_gain_s, self._audited_slots],
            "audit": None
            if self._audit is None
            else {
                **self._audit,
                "old": self._audit["old"].to_json_dict(),
                "new": self._audit["new"].to_json_dict(),
            },
        }

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: a different version or budgets than this controller's.
        """
        if data.get("version") != 1:
            raise ValueError(f"controller state: expected version 1, got {data.get('version')!r}")
        if dict(data["budgets"]) != dict(self.queues.budgets):
            raise ValueError(
                f"controller state: saved budgets {data['budgets']} differ from "
                f"{dict(self.queues.budgets)}"
            )
        self.queues.backlog = {k: float(x) for k, x in data["backlog"].items()}
        self.reference_time_s = data["reference_time_s"]
        self._time_sum_s = float(data["time_sum_s"])
        self._observed_slots = int(data["observed_slots"])
        self._warm_started = bool(data["warm_started"])
        cur = data["current_plan"]
        self._current = None if cur is None else Plan.model_validate(cur)
        self._last_plan_id = int(data["last_plan_id"])
        self._ids = tuple(data["ids"])
        self._index = {d: i for i, d in enumerate(self._ids)}
        self._arrays_cache.clear()
        self._memo = None
        self._pool = []
        for raw in data["pool"]:
            plan = Plan.model_validate(raw)
            self._pool.append(_Candidate(plan, self._arrays(plan)))

        def arr(x: list | None, dtype: type) -> np.ndarray | None:
            return None if x is None else np.asarray(x, dtype=dtype)

        self._prev_available = arr(data["prev_available"], bool)
        self._ref_available = arr(data["ref_available"], bool)
        self._ref_price = arr(data["ref_price"], float)
        ratio = data["ref_ratio"]
        self._ref_ratio = math.inf if ratio is None else float(ratio)
        self._reset_ref = bool(data.get("reset_ref", False))
        self._ref_weights = dict(data["ref_weights"])
        self._choice_weights = dict(data["choice_weights"])
        self._last_search_slot = int(data["last_search_slot"])
        self.searches = int(data["searches"])
        self.switches = int(data["switches"])
        self.persistence.load_state_dict(data["persistence"])
        if self.uptime is not None and data.get("uptime") is not None:
            self.uptime.load_state_dict(data["uptime"])
        self._refused_slots = int(data.get("refused_slots", 0))
        pred, real, audited = data.get("realized_gain", [0.0, 0.0, 0])
        self.predicted_gain_s, self.realized_gain_s = float(pred), float(real)
        self._audited_slots = int(audited)
        audit = data.get("audit")
        self._audit = (
            None
            if audit is None
            else {
                **audit,
                "old": Plan.model_validate(audit["old"]),
                "new": Plan.model_validate(audit["new"]),
            }
        )

    # ------------------------------------------------------------------ figures per state
    def _memo_of(self, state: ClusterState) -> _StateMemo | None:
        """The memo of ``state`` (a new one when ``state`` is another object than the last
        one's); None when :attr:`memoize` is off."""
        if not self.memoize:
            return None
        memo = self._memo
        if memo is None or memo.state is not state:
            memo = self._memo = _StateMemo(state)
        return memo

    def evaluation(self, plan: Plan, state: ClusterState) -> PlanEvaluation:
        """:func:`hetrain.costmodel.evaluate_plan` of ``plan`` on ``state`` with this
        controller's profile and configuration, computed once per state and plan
        (:class:`_StateMemo`; the result is shared: read it, do not change it).

        Raises:
            ValueError: as :func:`~hetrain.costmodel.evaluate_plan` (nothing is kept then)."""
        memo = self._memo_of(state)
        if memo is None:
            return evaluate_plan(plan, state, self.profile, self.config)
        key = (plan.schedule, plan.groups)
        ev = memo.evaluations.get(key)
        if ev is None:
            ev = memo.evaluations[key] = evaluate_plan(plan, state, self.profile, self.config)
        return ev

    def _evaluate_fast(self, plan: Plan, state: ClusterState) -> Any:
        """:func:`~hetrain.control.incremental.evaluate_fast` of ``plan`` on ``state``, once
        per state and plan (:class:`_StateMemo`)."""
        memo = self._memo_of(state)
        key = (plan.schedule, plan.groups)
        ev = None if memo is None else memo.fast.get(key)
        if ev is None:
            ev = evaluate_fast(plan, self._arrays(plan), state, self.config.optimizer_state_factor)
            if memo is not None:
                memo.fast[key] = ev
        return ev

    # ------------------------------------------------------------------ the gate
    def _predict(self, plan: Plan, state: ClusterState) -> _Figures:
        """docs/model.md §3 figures of ``plan`` on ``state`` with the configured cost model
        (:func:`hetrain.costmodel.evaluate_plan`; the vectorised equivalent above
        ``incremental_above`` devices)."""
        if int(np.sum(state.available)) > self.incremental_above:
            ev = self._evaluate_fast(plan, state)
            t, cost, fits = ev.iteration_time_s, dict(ev.cost), ev.fits
        else:
            full = self.evaluation(plan, state)
            t, cost, fits = full.iteration_time_s, dict(full.cost), full.fits
        if not fits:
            t = math.inf
        return _Figures(float(t), {k: float(x) for k, x in cost.items()}, bool(fits))

    def _objective_of(self, fig: _Figures, weights: Mapping[str, float]) -> float:
        return self.effective_v * fig.time_s + sum(w * fig.cost[j] for j, w in weights.items())

    def realized_share(self) -> float:
        """``ρ = (Σ realised + P) / (Σ predicted + P)`` clipped to [0.05, 1]: the share of
        the per-slot gains predicted for applied structure changes that the later measured
        states confirmed (each change audited over its payback horizon, from the first slot it
        ran); ``P`` is a prior of :attr:`realized_prior_slots` slots of the mean predicted gain
        fully realised."""
        if self.predicted_gain_s <= 0:
            return 1.0
        audited = max(self._audited_slots, 1)
        prior = self.realized_prior_slots * self.predicted_gain_s / audited
        rho = (self.realized_gain_s + prior) / (self.predicted_gain_s + prior)
        return min(max(rho, 0.05), 1.0)

    def _audit_gain(self, step: int, observed: ClusterState) -> None:
        """Account one slot of the audited change: on the newest observed state (measured in
        slot ``step − 1``), the gain ``T(old) − T(new)`` (shares re-solved for both) against
        the gain predicted when the change was decided."""
        audit = self._audit
        if audit is None or step - 1 < audit["start"]:
            return
        available = np.asarray(observed.available, dtype=bool)
        if step - 1 >= audit["end"] or not (
            self._usable(audit["old"], available) and self._usable(audit["new"], available)
        ):
            self._audit = None
            return
        old, _ = self._rebalance(audit["old"], observed)
        new, _ = self._rebalance(audit["new"], observed)
        t_old = self._predict(old, observed).time_s
        t_new = self._predict(new, observed).time_s
        if not (math.isfinite(t_old) and math.isfinite(t_new)):
            self._audit = None
            return
        self.predicted_gain_s += audit["gain"]
        self.realized_gain_s += t_old - t_new
        self._audited_slots += 1

    def _used_positions(self, plan: Plan) -> list[int]:
        """Positions in the observed state of the devices of ``plan``'s active groups (those
        with a share), group by group; a device the state does not name is left out."""
        index = self._index
        return [index[d] for g in plan.groups if g.batch > 0 for d in g.devices if d in index]

    def _payback_slots(self, plan: Plan, state: ClusterState) -> float:
        """The payback horizon ``H = min(ρ · max(m p^{delay+1}, a + 1), U(plan))`` (slots) of a
        change to ``plan`` on ``state``: the expected persistence of the observed state of the
        devices the change involves, those of the current plan's and ``plan``'s active groups
        (:meth:`PersistenceEstimator.benefit_slots`), or, when larger, the age ``a`` of a gain
        that was refused in each of the ``a`` slots before (a gain seen for ``a`` slots is
        expected to last as many more: the rent-or-buy rule, which switches once the gain
        forgone equals the migration time; Karlin et al., *Competitive snoopy caching*, 1988),
        times the realised share ``ρ``; at most ``U``, the expected slots every device of
        ``plan``'s active groups stays up once the decision runs
        (:meth:`UptimeEstimator.set_benefit_slots`: a gain on devices that leave is lost,
        whatever its age). Capped by ``horizon_slots``."""
        involved = self._used_positions(plan)
        if self._current is not None:
            involved = sorted(set(involved) | set(self._used_positions(self._current)))
        h = self.persistence.benefit_slots(self.decision_delay_slots, involved)
        h = max(h, self._refused_slots + 1.0) * self.realized_share()
        if self.uptime is not None:
            used = self._used_positions(plan)
            h = min(h, self.uptime.set_benefit_slots(state, used, self.decision_delay_slots))
        if self.horizon_slots is not None:
            h = min(h, self.horizon_slots)
        return h

    def _rule(
        self,
        before: _Figures,
        after: _Figures,
        t_mig: float,
        structure: bool,
        horizon: float,
        weights: Mapping[str, float],
        rate: float,
    ) -> tuple[bool, bool, str]:
        """Whether a change may be applied: ``(allowed, budget_driven, why)``.

        Time-driven: ``T_after < T_before``, ``(T_before − T_after) · H >= t_mig`` and, for a
        structure change, ``T_before − T_after > margin · T_before``. Budget-driven (queues
        non-zero): the same with ``J = V·T + Σ_j Q̂_j y_j`` and the migration's objective cost
        ``rate · t_mig`` (``rate = V + Σ_j Q̂_j Σ_{d used} r_{j,d}``), over the horizon
        ``min(H, H_J)`` where ``H_J`` (:meth:`_budget_horizon`) is how long the objective gain
        lasts while the queues move (``budget_payback``)."""
        t_b, t_a = before.time_s, after.time_s
        gain = t_b - t_a
        if not math.isfinite(t_a):
            return False, False, "the proposal does not fit"
        paid = gain * horizon >= t_mig if t_mig > 0 else True
        dearer = self.budget_payback and any(
            w > 0 and after.cost[j] > before.cost[j] for j, w in weights.items()
        )
        if (
            not (dearer and t_mig > 0)
            and gain > 1e-9 * t_b
            and paid
            and (gain > (self.switch_margin if structure else self.rebalance_margin) * t_b)
        ):
            return (
                True,
                False,
                (
                    f"predicted {t_b:.4g} s -> {t_a:.4g} s; gain x {horizon:.3g} slots "
                    f"= {gain * horizon:.3g} s >= migration {t_mig:.3g} s"
                ),
            )
        why = (
            f"predicted {t_b:.4g} s -> {t_a:.4g} s with migration {t_mig:.3g} s over "
            f"{horizon:.3g} slots"
        )
        if any(w > 0 for w in weights.values()):
            j_b = self._objective_of(before, weights)
            j_a = self._objective_of(after, weights)
            j_gain = j_b - j_a
            h_j = horizon
            if self.budget_payback and j_gain > 0:
                h_j = min(horizon, self._budget_horizon(before, after, j_gain))
            if self.queues.signed and any(
                self.queues.backlog[j] > 0 and after.cost[j] < before.cost[j]
                for j in self.queues.budgets
            ):
                h_j = math.inf  # in debt: a change that spends less is not held back
            j_paid = j_gain * h_j >= rate * t_mig if t_mig > 0 else True
            if (
                j_gain > 1e-9 * j_b
                and j_paid
                and (j_gain > (self.switch_margin if structure else self.rebalance_margin) * j_b)
            ):
                costs = ", ".join(
                    f"{j} {before.cost[j]:.4g} -> {after.cost[j]:.4g}/iter "
                    f"(budget {self.queues.budgets[j]:.4g}, backlog {self.queues.backlog[j]:.4g})"
                    for j in weights
                )
                return True, True, f"budget: {costs}; {why}"
        return False, False, why

    def _budget_horizon(self, before: _Figures, after: _Figures, j_gain: float) -> float:
        """Slots over which a budget-driven gain ``j_gain`` lasts: once the change runs, each
        queue moves by ``y_j(after) − ȳ_j`` a slot, which moves the weight by ``T_ref/ȳ_j²``
        per unit and the gain by that times ``y_j(after) − y_j(before)``; the gain falls
        linearly to 0 after ``j_gain / rate`` slots, its sum is ``j_gain² / (2 rate)``, i.e.
        ``j_gain · H`` with ``H = j_gain / (2 rate)``."""
        t_ref = float(self.reference_time_s or 0.0)
        rate = 0.0
        for j, budget in self.queues.budgets.items():
            dy = after.cost[j] - before.cost[j]
            drift = after.cost[j] - budget
            if dy * drift > 0:  # the queue moves against the change's gain
                rate += t_ref / budget**2 * abs(drift) * abs(dy)
        return math.inf if rate <= 0 else j_gain / (2.0 * rate)

    def _gate(
        self,
        step: int,
        current: Plan | None,
        proposal: Plan,
        observed: ClusterState,
        weights: dict[str, float],
    ) -> Decision:
        """The single place where a plan change is accepted or refused (see :meth:`_rule`)."""
        horizon = self._payback_slots(proposal, observed)
        est = Estimates(
            state=observed,
            queue_weights=dict(weights),
            backlog=dict(self.queues.backlog),
            reference_time_s=float(self.reference_time_s or 0.0),
            persistence_slots=float(horizon),
            v=self.effective_v,
        )
        after = self._predict(proposal, observed)
        if current is None or not self._usable(current, np.asarray(observed.available, bool)):
            reason = "initial" if current is None else "device-lost"
            t_mig = 0.0
            if current is not None:
                t_mig = migration_time_s(
                    current, proposal, observed, self.profile, self.config.optimizer_state_factor
                )
            return self._decision(
                step, est, current, proposal, reason, None, after, t_mig, False,
                f"{reason}: predicted {after.time_s:.4g} s",
            )  # fmt: skip
        before = self._predict(current, observed)
        if _active_key(proposal) == _active_key(current):
            return self._decision(
                step, est, current, current, "keep", before, before, 0.0, False, "no change"
            )
        structure = proposal.structure() != current.structure()
        t_mig = migration_time_s(
            current, proposal, observed, self.profile, self.config.optimizer_state_factor
        )
        rate = self._migration_rate(proposal, observed, weights)
        ok, budget, why = self._rule(before, after, t_mig, structure, horizon, weights, rate)
        if not ok and structure:
            j_b, j_a = self._objective_of(before, weights), self._objective_of(after, weights)
            self._gain_refused = self._gain_refused or j_a < j_b * (1.0 - self.switch_margin)
        if ok:
            reason = "budget" if budget else ("faster" if structure else "rebalance")
            return self._decision(
                step, est, current, proposal, reason, before, after, t_mig, budget, why
            )
        # refused: the current structure with re-solved shares, through the same rule
        note = f"kept: {why}"
        if structure:
            shares, _ = self._rebalance(current, observed, revive=False)
            if _active_key(shares) != _active_key(current):
                fig = self._predict(shares, observed)
                t0 = migration_time_s(
                    current, shares, observed, self.profile, self.config.optimizer_state_factor
                )
                ok, budget, why2 = self._rule(before, fig, t0, False, horizon, weights, rate)
                if ok:
                    reason = "budget" if budget else "rebalance"
                    return self._decision(
                        step, est, current, shares, reason, before, fig, t0, budget,
                        f"{why2}; structure change refused ({why})",
                    )  # fmt: skip
        return self._decision(step, est, current, current, "keep", before, before, 0.0, False, note)

    def _migration_rate(
        self, plan: Plan, state: ClusterState, weights: Mapping[str, float]
    ) -> float:
        """Objective cost per second of migration: ``V + Σ_j Q̂_j Σ_{d used} r_{j,d}``."""
        used = self._used_positions(plan)
        rate = self.effective_v
        if "money" in weights:
            rate += weights["money"] * float(np.sum(state.price_per_s[used]))
        if "energy" in weights:
            rate += weights["energy"] * float(np.sum(state.power_w[used]))
        return rate

    def _decision(
        self,
        step: int,
        est: Estimates,
        current: Plan | None,
        plan: Plan,
        reason: str,
        before: _Figures | None,
        after: _Figures,
        t_mig: float,
        budget_driven: bool,
        note: str,
    ) -> Decision:
        changed = current is None or _active_key(plan) != _active_key(current)
        if changed:
            self._last_plan_id += 1
            plan = plan.model_copy(update={"plan_id": self._last_plan_id})
        elif current is not None and plan.plan_id != current.plan_id:
            plan = plan.model_copy(update={"plan_id": current.plan_id})
        weights = est.queue_weights
        return Decision(
            step=int(step),
            plan=plan,
            reason=reason,
            changed=bool(changed),
            structure_changed=bool(current is None or plan.structure() != current.structure()),
            predicted_time_s_before=None if before is None else before.time_s,
            predicted_time_s_after=after.time_s,
            migration_time_s=float(t_mig),
            budget_driven=bool(budget_driven),
            cost_before=None if before is None else dict(before.cost),
            cost_after=dict(after.cost),
            objective_before=None if before is None else self._objective_of(before, weights),
            objective_after=self._objective_of(after, weights),
            persistence_slots=est.persistence_slots,
            note=note,
            estimates=est,
        )

    def _warm_start_queues(self, observed: ClusterState) -> None:
        """Start each queue at the backlog whose weight makes the plan of ``observed`` meet the
        budgets: ``η`` by :func:`~hetrain.control.dual.bisect_multipliers` on
        ``best_plan(observed, queues=η)`` (cost per iteration), then ``Q_j = η_j V ȳ_j² /
        T_ref`` with ``T_ref`` the fastest plan's predicted time. Skipped when a backlog is
        already non-zero (restored state)."""
        if any(q > 0 for q in self.queues.backlog.values()):
            return
        from hetrain.planner import best_plan

        def plan_for(eta: dict[str, float]) -> Plan:
            queues = {j: x for j, x in eta.items() if x > 0}
            return best_plan(
                observed,
                self.profile,
                self.config,
                v=1.0,
                queues=queues or None,
                time_budget_s=self._search_budget(observed),
                reproducible=self._search_budget(observed) is None,
            )

        fastest = plan_for({})
        t_ref = float(fastest.iteration_time_s or 0.0)
        if not (math.isfinite(t_ref) and t_ref > 0):
            return
        self.reference_time_s = t_ref
        budgets = self.queues.budgets
        eta = bisect_multipliers(
            lambda e: dict(plan_for(e).cost or {}),
            budgets,
            {j: t_ref / b for j, b in budgets.items()},
            iterations=10,
        )
        if self.dual_learning:
            self.eta_hat = dict(eta)  # the queues start empty; η̂ is learned from here on
            return
        for j, x in eta.items():
            self.queues.backlog[j] = x * self.effective_v * budgets[j] ** 2 / t_ref

    # ------------------------------------------------------------------ proposals
    def _propose(self, slot: int, observed: ClusterState, weights: dict[str, float]) -> Plan:
        """The candidate plan for the gate: the current structure re-balanced, or a known /
        newly searched structure when something changed enough (module docstring)."""
        available = np.asarray(observed.available, dtype=bool)
        t_lb = lower_bound_s(observed, self.profile, self.config.batch)
        current = None
        repaired = None
        predicted_ratio = math.inf
        if self._current is not None:
            if self._usable(self._current, available):
                current, _ = self._rebalance(self._current, observed)
                t_pred = self._predicted_time_s(self._current, observed)
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
        inline = forced or self._search_inline
        if wants and not inline and self._search_allowed(slot, int(available.sum())):
            self.search_wanted = (observed, dict(weights))
        if wants and inline and (forced or self._search_allowed(slot, int(available.sum()))):
            self._search(observed, weights)
            self._ref_available = available.copy()
            self._ref_price = np.asarray(observed.price_per_s, dtype=float).copy()
            self._ref_weights = dict(weights)
            self._last_search_slot = slot
            searched = True
        elif self._prev_available is not None and not np.array_equal(
            available, self._prev_available
        ):
            base = current if current is not None else repaired
            grown = self._extend(base, observed) if base is not None else None
            extra = [p for p in (repaired, grown) if p is not None]
        if repaired is not None:
            extra.append(repaired)
        self._prev_available = available.copy()
        moved = self._queue_moved(observed, weights, self._choice_weights, 1.0)
        # the known structures are re-weighed every slot on small clusters (a few share solves);
        # above ``incremental_above`` devices only when something changed
        cheap = int(available.sum()) <= self.incremental_above and len(self._pool) > 0
        changed = searched or bool(extra) or moved or current is None
        changed = changed or self._pool_added
        self._pool_added = False
        if changed or cheap:
            if changed:
                self._choice_weights = dict(weights)
            choice = self._choose(current, observed, weights, extra)
            # the drift reference moves only with a search or an applied new structure
            # (re-weighing the pool every slot must not hide a drift that calls for a search)
            self._reset_ref = self._reset_ref or changed
        else:
            choice = current
        return choice

    def _search_budget(self, observed: ClusterState) -> float | None:
        """The planner's soft time budget: ``search_time_budget_s``; when that is None, none
        up to ``exact_search_devices`` available devices and 1 s above."""
        if self.search_time_budget_s is None and int(np.sum(observed.available)) > (
            self.exact_search_devices
        ):
            return 1.0
        return self.search_time_budget_s

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

    def _rebalance(
        self, plan: Plan, state: ClusterState, *, revive: bool = True
    ) -> tuple[Plan, float]:
        """Same structure, shares re-solved for ``state``; also the predicted ``max_g T_g``.
        With ``single_stage_one_microbatch`` and ``revive`` the plan's idle single-stage groups
        may take work again (a structure change, which the gate judges as one). Computed once
        per state and structure (:class:`_StateMemo`): ``plan`` itself when no assignment
        fits, else a new plan (``plan`` with the re-solved groups, its figures cleared)."""
        memo = self._memo_of(state)
        # the shares and μ a re-solve gives depend on the structure (devices, stages, μ, which
        # groups run), not on the shares it had (rebalance_shares); its other fields are copied
        key = (structure_key(plan), plan.schedule, bool(revive))
        hit = None if memo is None else memo.rebalanced.get(key)
        if hit is not None:
            groups, t_max = hit
            if groups is None:  # no assignment fits: rebalance_shares returns the plan itself
                return plan, t_max
            cleared = {"iteration_time_s": None, "lower_bound_s": None, "cost": None}
            return plan.model_copy(update={"groups": groups, **cleared}), t_max
        new, t_max = self._rebalance_once(plan, state, revive=revive)
        if memo is not None:
            memo.rebalanced[key] = (None if new is plan else new.groups, t_max)
        return new, t_max

    def _predicted_time_s(self, plan: Plan, state: ClusterState) -> float:
        """The predicted iteration time ``T`` (docs/model.md §3: the slowest group and the
        gradient sync; seconds) of ``plan``'s structure with shares re-solved for ``state``: what
        the drift trigger of :meth:`_needs_search` watches, so that a link that slows the sync
        (a degraded NIC under the all-reduce) calls for a search as a slow device does."""
        rebalanced, t_max = self._rebalance(plan, state)
        t = float(self._evaluate_fast(rebalanced, state).iteration_time_s)
        return t if math.isfinite(t) else t_max

    def _rebalance_once(
        self, plan: Plan, state: ClusterState, *, revive: bool
    ) -> tuple[Plan, float]:
        """:meth:`_rebalance` computed."""
        arrays = self._arrays(plan)
        new = rebalance_shares(
            plan,
            state,
            arrays,
            self.config.batch,
            self.config.optimizer_state_factor,
            norm_block=self.config.norm_block,
            one_microbatch_single_stage=self.single_stage_one_microbatch,
            profile=self.profile if revive else None,
        )
        if structure_key(new) != structure_key(plan):
            # μ rounded down to a multiple of the norm block, μ_g = b_g of a single stage, or
            # an idle single-stage group given work
            arrays = self._arrays(new)
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
        """A planner search at ``weights``; the plan found joins the pool (replacing a pooled
        plan of the same structure)."""
        self.searches += 1
        self._add_to_pool(self.search_plan(observed, weights))

    def search_plan(
        self,
        observed: ClusterState,
        weights: Mapping[str, float],
        warm_start: Plan | None = None,
    ) -> Plan:
        """The planner's best plan for ``observed`` at the queue ``weights``
        (:func:`hetrain.planner.best_plan`, warm-started from ``warm_start``, default the
        current plan; reproducible up to ``exact_search_devices``). Reads the controller,
        never changes it: it may run in another thread while :meth:`decide` and
        :meth:`record` go on.

        Raises:
            NoFeasiblePlanError: the model fits no arrangement of the available devices."""
        from hetrain.planner import best_plan

        budget = self._search_budget(observed)
        return best_plan(
            observed,
            self.profile,
            self.config,
            v=self.effective_v,
            queues=dict(weights) or None,
            warm_start=self._current if warm_start is None else warm_start,
            time_budget_s=budget,
            reproducible=budget is None,
        )

    def add_searched(
        self, step: int, plan: Plan, observed: ClusterState, weights: Mapping[str, float]
    ) -> None:
        """Hand back the plan of a search run outside :meth:`decide` (:meth:`search_plan` on
        :attr:`search_wanted`'s state and weights): it joins the pool and the search
        references (availability, prices, weights, the drift reference) move to that state, as
        after an inline search; the next :meth:`decide` weighs it."""
        self.searches += 1
        self._add_to_pool(plan)
        self._ref_available = np.asarray(observed.available, dtype=bool).copy()
        self._ref_price = np.asarray(observed.price_per_s, dtype=float).copy()
        self._ref_weights = dict(weights)
        self._last_search_slot = int(step)
        self._pool_added = True

    def _add_to_pool(self, found: Plan) -> None:
        key = found.structure()
        self._pool = [c for c in self._pool if c.plan.structure() != key]
        self._pool.insert(0, _Candidate(found, self._arrays(found)))
        del self._pool[self.pool_size :]

    def _objective(self, plan: Plan, state: ClusterState, weights: dict[str, float]) -> float:
        ev = self._evaluate_fast(plan, state)
        if not ev.fits:
            return math.inf
        if self.budgeted and math.isfinite(ev.iteration_time_s):
            self._slot_figures.append(
                (ev.iteration_time_s, float(ev.cost["money"]), float(ev.cost["energy"]))
            )
        return self.effective_v * ev.iteration_time_s + sum(
            w * ev.cost[name] for name, w in weights.items()
        )

    def _switch_penalty(
        self, old: Plan | None, new: Plan, state: ClusterState, weights: dict[str, float]
    ) -> float:
        """Drift-plus-penalty cost of the migration ``old -> new``, spread over the payback
        horizon ``H`` (the expected persistence of the observed state):
        ``(V + Σ_j Q̂_j Σ_{d used} r_{j,d}) · t_mig / H`` (the slot lasts ``t_mig`` longer and
        every used device is billed for it); infinite when ``H`` is 0."""
        if old is None:
            return 0.0
        t_mig = migration_time_s(old, new, state, self.profile, self.config.optimizer_state_factor)
        if t_mig <= 0:
            return 0.0
        horizon = self._payback_slots(new, state)
        if horizon <= 0:
            return math.inf
        return self._migration_rate(new, state, weights) * t_mig / horizon

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
            if current is None and not math.isfinite(penalty):
                # the current plan is gone: some change is forced, weigh migrations over 1 slot
                penalty = self._migration_rate(plan, observed, weights) * migration_time_s(
                    self._current, plan, observed, self.profile, self.config.optimizer_state_factor
                )
            options.append((score + penalty, plan, score))
        if current is None:
            if not options:
                raise NoFeasiblePlanError("no known plan fits the available devices")
            return min(options, key=lambda o: o[0])[1]
        current_score = self._objective(current, observed, weights)
        best = min(options, key=lambda o: o[0], default=None)
        if best is not None and best[0] < current_score * (1.0 - self.switch_margin):
            return best[1]
        # a structure that beats the current one before its migration is paid (the age rule)
        self._gain_refused = any(
            raw < current_score * (1.0 - self.switch_margin) for _, _, raw in options
        )
        return current


LyapunovPolicy = LyapunovController
"""Former name of :class:`LyapunovController` (kept for callers of the old name)."""
