"""Two references that bound what an online controller can reach on a trace (docs/controller.md,
"References"):

* **hindsight** — knowing every slot's true state in advance and paying no migration, the dual
  bound ``max_{η ≥ 0} mean_t min_p [T_t(p) + Σ_j η_j (y_{j,t}(p) − ȳ_j)]`` (money and energy
  jointly). By weak duality no policy whose mean spend meets the budgets has a lower mean
  iteration time (Boyd & Vandenberghe, *Convex Optimization*, 2004, §5.1.3). With no budget it
  is ``mean_t min_p T_t(p)``.
* **stale** — each slot's plan is the one minimising ``T + Σ_j η_j y_j`` on the *previous*
  slot's measured state (what a controller that does not predict knows), evaluated on the
  slot's true state, no migration charged, with ``η`` bisected so that the mean true spend
  meets the budgets (:func:`hetrain.control.dual.bisect_multipliers`).

``min_p`` is taken over a pool of plan structures, each with shares re-solved for the slot's
state (:func:`hetrain.control.incremental.rebalance_shares`): the planner's
:func:`hetrain.planner.best_plan` every ``search_every`` slots on the slot's true and measured
states at each multiplier of a grid, plus any plans the caller adds (e.g. those the policies
ran); the stale reference uses only the structures found on measured states and the added
ones. The bound is therefore as tight as that search (the planner is exact only up to a few
devices). Multipliers are named ``η`` (docs/model.md's ``λ`` is the per-layer overhead).

The measured states and time noise are drawn exactly as :func:`hetrain.sim.simulator.simulate`
draws them for the same seed, so references and policies see the same slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.control.dual import bisect_multipliers
from hetrain.control.incremental import (
    StructureArrays,
    evaluate_fast,
    rebalance_shares,
    structure_key,
)
from hetrain.costmodel import TrainingConfig
from hetrain.errors import NoFeasiblePlanError
from hetrain.plan import Plan
from hetrain.profile import ProfileArrays
from hetrain.sim.simulator import observed_state
from hetrain.trace import TraceTimeline

RESOURCES = ("money", "energy")


@dataclass
class ReferenceResult:
    """One reference on one trace.

    Attributes:
        name: ``hindsight`` or ``stale``.
        mean_iteration_time_s: mean over slots of the chosen plans' time (true state, time
            noise included, no migration).
        mean_cost: ``{"money", "energy"}`` mean per iteration of those plans.
        eta: the multipliers ``η_j`` (seconds per unit of resource j).
        bound_s: hindsight only: the dual bound ``g(η)`` (seconds); None for ``stale``.
        slots: slots with at least one available device (the means' denominator).
    """

    name: str
    mean_iteration_time_s: float
    mean_cost: dict[str, float]
    eta: dict[str, float]
    bound_s: float | None = None
    slots: int = 0
    per_slot_time_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    per_slot_plan: list[Plan | None] = field(default_factory=list, repr=False)


def slot_states(
    timeline: TraceTimeline,
    slots: int,
    *,
    measurement_noise: float = 0.0,
    time_noise: float = 0.0,
    seed: int = 0,
) -> tuple[list[ClusterState], list[ClusterState], np.ndarray]:
    """The true state, the observed state (previous slot's measurement plus this slot's
    availability) and the time-noise factor of every slot, drawn like the simulator.

    Returns:
        ``(actual, observed, eps_time)``; lists of length ``slots``, array shape ``(slots,)``.
    """
    rng = np.random.default_rng(seed)
    actual_all: list[ClusterState] = []
    observed_all: list[ClusterState] = []
    eps = np.ones(slots)
    measured: ClusterState | None = None
    for t in range(slots):
        actual = timeline.state_at(t)
        observed_all.append(observed_state(measured, actual, timeline.base))
        actual_all.append(actual)
        if time_noise > 0:
            eps[t] = float(np.exp(rng.normal(0.0, time_noise)))
        if measurement_noise > 0:
            noise = np.exp(rng.normal(0.0, measurement_noise, size=actual.num_devices))
            measured = actual.with_changes(speed_flops=actual.speed_flops * noise)
        else:
            measured = actual
    return actual_all, observed_all, eps


class _Pool:
    """Distinct plan structures and their per-slot figures after re-solving shares."""

    def __init__(self, ids: tuple[str, ...], profile: ProfileArrays, config: TrainingConfig):
        self.ids = ids
        self.profile = profile
        self.config = config
        self.plans: list[Plan] = []
        self.arrays: list[StructureArrays] = []
        self._keys: set[tuple] = set()

    def add(self, plan: Plan) -> None:
        key = structure_key(plan)
        if key in self._keys:
            return
        self._keys.add(key)
        self.plans.append(plan)
        self.arrays.append(StructureArrays.build(plan, self.ids, self.profile))

    def figures(
        self, state: ClusterState, judge: ClusterState | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per structure: shares re-solved on ``state`` (the planner's own shares too), then
        ``(T, money, energy)`` evaluated on ``judge`` (default ``state``); ``inf`` where a
        structure uses an unavailable device or does not fit. Shape ``(K,)`` each (K =
        2 × structures: re-solved and as found)."""
        judge = state if judge is None else judge
        o = float(self.config.optimizer_state_factor)
        avail = np.asarray(state.available, dtype=bool)
        out = np.full((3, 2 * len(self.plans)), np.inf)
        for k, (plan, arrays) in enumerate(zip(self.plans, self.arrays, strict=True)):
            if not np.all(avail[arrays.stage_device]) or not np.all(
                judge.available[arrays.stage_device]
            ):
                continue
            for m, cand in enumerate(
                (
                    rebalance_shares(
                        plan, state, arrays, self.config.batch, o, self.config.norm_block
                    ),
                    plan,
                )
            ):
                if cand.global_batch != self.config.batch:
                    continue
                pick = evaluate_fast(cand, arrays, state, o)
                if not pick.fits:
                    continue
                ev = pick if judge is state else evaluate_fast(cand, arrays, judge, o)
                out[:, 2 * k + m] = (ev.iteration_time_s, ev.cost["money"], ev.cost["energy"])
        return out[0], out[1], out[2]


def compute_references(
    timeline: TraceTimeline,
    profile: ProfileArrays,
    config: TrainingConfig,
    *,
    slots: int,
    budgets: Mapping[str, float] | None = None,
    measurement_noise: float = 0.0,
    time_noise: float = 0.0,
    seed: int = 0,
    extra_plans: Iterable[Plan | None] = (),
    search_every: int = 5,
    search_time_budget_s: float | None = None,
    eta_grid: tuple[float, ...] = (0.3, 1.0, 3.0),
) -> dict[str, ReferenceResult]:
    """The ``hindsight`` bound and the ``stale`` reference (module docstring) at ``budgets``
    (and, with budgets, the stale reference without them as ``stale-unbudgeted``).

    Args:
        timeline, profile, config: the trace, model and training configuration (docs/model.md §3
        cost
            model defaults: the vectorised evaluation).
        slots: number of slots.
        budgets: ``{"money": ȳ, "energy": ȳ}`` per iteration; None: no budget.
        measurement_noise, time_noise, seed: as given to the simulator.
        extra_plans: more structures for the pool (e.g. every plan a policy ran).
        search_every: run the planner every this many slots (and at slot 0 and whenever the
            set of available devices changes).
        search_time_budget_s: the planner's soft time budget per search (seconds); None
            (default): none, and the search is the controller's reproducible one (bounded by
            solve counts, not by CPU time), so the references do not depend on the machine's
            load and search exactly as the controller may.
        eta_grid: with budgets, multipliers searched besides 0, in units of
            ``T_ref / ȳ_j`` (``T_ref``: the first slot's fastest plan time).

    Raises:
        NoFeasiblePlanError: no slot has a plan.
    """
    from hetrain.planner import best_plan

    budgets = {j: float(b) for j, b in (budgets or {}).items()}
    actual, observed, eps = slot_states(
        timeline,
        slots,
        measurement_noise=measurement_noise,
        time_noise=time_noise,
        seed=seed,
    )
    # hindsight may use structures found on true states; the stale reference only those found
    # on measured states (and the policies' own plans, which were found on measured states)
    pool = _Pool(timeline.base.ids, profile, config)
    stale_pool = _Pool(timeline.base.ids, profile, config)
    for plan in extra_plans:
        if plan is not None:
            pool.add(plan)
            stale_pool.add(plan)
    t_ref = None
    warm: dict[tuple, Plan | None] = {}
    every = max(int(search_every), 1)
    for t in range(slots):
        moved = t > 0 and not np.array_equal(actual[t].available, actual[t - 1].available)
        if t % every and not moved:
            continue
        for which, state in (("true", actual[t]), ("measured", observed[t])):
            if not np.asarray(state.available).any():
                continue
            etas: list[dict[str, float]] = [{}]
            if budgets and t_ref is not None:
                etas += [{j: u * t_ref / b for j, b in budgets.items()} for u in eta_grid]
            for eta in etas:
                key = (which, *sorted(eta.items()))
                try:
                    found = best_plan(
                        state,
                        profile,
                        config,
                        queues=eta or None,
                        warm_start=warm.get(key),
                        time_budget_s=search_time_budget_s,
                        reproducible=search_time_budget_s is None,
                    )
                except NoFeasiblePlanError:
                    continue
                warm[key] = found
                pool.add(found)
                if which == "measured":
                    stale_pool.add(found)
                if t_ref is None and found.iteration_time_s:
                    t_ref = float(found.iteration_time_s)
    if not pool.plans:
        raise NoFeasiblePlanError("no slot of the trace has a feasible plan")
    live = [t for t in range(slots) if np.asarray(actual[t].available).any()]
    true_f = np.array([np.stack(pool.figures(actual[t])) for t in live])  # (S, 3, K)
    # chosen on the measured state, judged on the true one
    stale_f = np.array([np.stack(stale_pool.figures(observed[t])) for t in live])
    judged = np.array([np.stack(stale_pool.figures(observed[t], actual[t])) for t in live])
    scale = eps[live][:, None]
    for f in (true_f, judged):
        f *= scale[:, :, None]
    spend_rows = {"money": 1, "energy": 2}

    def pick(figs: np.ndarray, eta: Mapping[str, float]) -> np.ndarray:
        obj = figs[:, 0, :].copy()
        for j, x in eta.items():
            obj = obj + x * figs[:, spend_rows[j], :]
        obj = np.where(np.isfinite(obj), obj, np.inf)
        return np.argmin(obj, axis=1)

    def means(figs: np.ndarray, choice: np.ndarray) -> tuple[float, dict[str, float]]:
        rows = np.arange(len(choice))
        chosen = figs[rows, :, choice]
        return float(np.mean(chosen[:, 0])), {
            "money": float(np.mean(chosen[:, 1])),
            "energy": float(np.mean(chosen[:, 2])),
        }

    def dual_value(eta: Mapping[str, float]) -> float:
        obj = true_f[:, 0, :].copy()
        for j, x in eta.items():
            obj = obj + x * (true_f[:, spend_rows[j], :] - budgets[j])
        return float(np.mean(np.min(obj, axis=1)))

    t_scale = t_ref or 1.0
    scales = {j: t_scale / b for j, b in budgets.items()}
    out: dict[str, ReferenceResult] = {}
    # hindsight
    eta_h = bisect_multipliers(
        lambda e: means(true_f, pick(true_f, e))[1], budgets, scales, iterations=30
    )
    bound = max(
        dual_value({j: x * f for j, x in eta_h.items()}) for f in (0.0, 0.5, 0.8, 1.0, 1.25, 2.0)
    )
    t_h, c_h = means(true_f, pick(true_f, eta_h))
    out["hindsight"] = ReferenceResult("hindsight", t_h, c_h, eta_h, bound, len(live))
    # stale: chosen on the measured state, judged on the true one
    eta_s = bisect_multipliers(
        lambda e: means(judged, pick(stale_f, e))[1], budgets, scales, iterations=30
    )
    choice = pick(stale_f, eta_s)
    t_s, c_s = means(judged, choice)
    per_slot = judged[np.arange(len(choice)), 0, choice]
    chosen = [stale_pool.plans[int(k) // 2] for k in choice]
    out["stale"] = ReferenceResult("stale", t_s, c_s, eta_s, None, len(live), per_slot, chosen)
    if budgets:
        choice0 = pick(stale_f, {})
        t0, c0 = means(judged, choice0)
        out["stale-unbudgeted"] = ReferenceResult("stale-unbudgeted", t0, c0, {}, None, len(live))
    return out
