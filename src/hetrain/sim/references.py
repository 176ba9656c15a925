"""Two references that bound what an online controller can reach on a trace (docs/controller.md,
"References"):

* **hindsight** — knowing every slot's true state in advance and paying no migration, the dual
  bound ``max_{η ≥ 0} mean_t min_p [T_t(p) + Σ_j η_j (y_{j,t}(p) − ȳ_j)]`` (money and energy
  jointly). By weak duality no policy whose mean spend meets the budgets has a lower mean
  iteration time (Boyd & Vandenberghe, *Convex Optimization*, 2004, §5.1.3). With no budget it
  is ``mean_t min_p T_t(p)``.
* **stale** — what stale information allows when plans must be moved: each slot's plan is
  chosen on the *previous* slot's measured state (what a controller that does not predict
  knows, with no decision delay), evaluated on the slot's true state, and each change of the
  plan's active structure is charged like a policy's in :func:`hetrain.sim.simulator.simulate`
  (the migration time of :func:`hetrain.control.migration.migration_time_s` on the slot's true
  state added to the slot's time and billed to the new plan's devices). The plan sequence
  minimises ``Σ_t [T + Σ_j η_j y_j](p_t) + t_mig(p_{t−1}, p_t)(1 + Σ_j η_j r_j(p_t))`` on the
  stale figures by dynamic programming over each slot's ``top_candidates`` best candidates
  and those of the slot before that still run:
  every stale state is known in advance, so it never buys a plan it will leave soon and never
  flips on noise. ``η`` is bisected so that the mean true spend (migration included) meets the
  budgets (:func:`hetrain.control.dual.bisect_multipliers`). ``charge_migration=False`` gives
  the former figure: the best candidate of each slot, no migration charged; with
  ``charge_migration`` it is also returned as ``stale-no-migration``, and the myopic re-planner
  (the best candidate each slot, kept within ``switch_margin``, migration charged) as
  ``stale-myopic``.

Why this choice (docs/controller.md, "References"): the hindsight reference is a *bound* —
leaving out a cost that is never negative keeps it a valid lower bound, so it stays
migration-free. The stale reference is the figure a controller is asked to match: one that
re-plans for free on every outage cannot be matched by any policy that has to move layers (on
clusters with spot outages the migration-free figure is out of reach by construction); and a
myopic re-planner that pays migration is a straw man (on 1 Gbit/s links it buys a 13 s
migration for a gain of 1 s a slot and flips between near-equal plans on measurement noise:
greedy was 0.43 of it over ``family-00``'s first 20 slots). The dynamic programme over stale
states is the best a controller with one-slot-old measurements can do with the same plans and
the same migration cost, given perfect foresight of those measurements: a policy that matches
it has lost nothing to its switching rule.

``min_p`` is taken over a pool of plan structures, each with shares re-solved for the slot's
state (:func:`hetrain.control.incremental.rebalance_shares`): the planner's
:func:`hetrain.planner.best_plan` every ``search_every`` slots on the slot's true and measured
states at each multiplier of a grid, plus any plans the caller adds (e.g. those the policies
ran); the stale reference uses only the structures found on measured states and the added
ones. The bound is therefore as tight as that search (the planner is exact only up to a few
devices). Multipliers are named ``η`` (docs/model.md's ``λ`` is the per-layer overhead).

Searches are the cost of the references (a reproducible planner search per state, eta and
search slot: 0.1-3 s at 8-64 devices). ``search_cache`` (a dict shared between calls on the
same timeline, profile and config) re-uses a search whose inputs (state, multipliers, warm
start) are identical, e.g. the ``η = 0`` searches of two budget settings; ``hindsight=False``
skips the true-state searches that only the hindsight reference uses. Neither changes any
figure of the references it computes (tested).

The measured states and time noise are drawn exactly as :func:`hetrain.sim.simulator.simulate`
draws them for the same seed, so references and policies see the same slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from hetrain.cluster import ClusterState, state_digest
from hetrain.control.dual import bisect_multipliers
from hetrain.control.incremental import (
    StructureArrays,
    evaluate_fast,
    rebalance_shares,
    structure_key,
)
from hetrain.control.migration import migration_time_s
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
            noise included; migration included for ``stale`` unless ``charge_migration`` was
            False, never for ``hindsight``).
        mean_cost: ``{"money", "energy"}`` mean per iteration of those plans (migration
            billed likewise).
        eta: the multipliers ``η_j`` (seconds per unit of resource j).
        bound_s: hindsight only: the dual bound ``g(η)`` (seconds); None for ``stale``.
        slots: slots with at least one available device (the means' denominator).
        mean_migration_time_s: mean over those slots of the migration time charged (seconds).
        plan_changes: slots whose structure differs from the previous live slot's.
        per_slot_time_s: ``stale``: each live slot's time without migration, shape ``(S,)``.
        per_slot_migration_s: ``stale``: each live slot's migration time, shape ``(S,)``.
        per_slot_plan: ``stale``: each live slot's plan as it runs (shares as chosen).
    """

    name: str
    mean_iteration_time_s: float
    mean_cost: dict[str, float]
    eta: dict[str, float]
    bound_s: float | None = None
    slots: int = 0
    mean_migration_time_s: float = 0.0
    plan_changes: int = 0
    per_slot_time_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    per_slot_plan: list[Plan | None] = field(default_factory=list, repr=False)
    per_slot_migration_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)


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
    hindsight: bool = True,
    charge_migration: bool = True,
    search_cache: dict | None = None,
    search_known_availability: bool = True,
    switch_margin: float = 0.01,
    top_candidates: int = 8,
) -> dict[str, ReferenceResult]:
    """The ``hindsight`` bound and the ``stale`` reference (module docstring) at ``budgets``
    (and, with budgets, the stale reference without them as ``stale-unbudgeted``); with
    ``charge_migration`` also the migration-free stale figures as ``stale-no-migration`` (and
    ``stale-unbudgeted-no-migration``).

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
        hindsight: False: skip the hindsight reference and its true-state searches (but the
            first one, which sets ``T_ref``); the stale figures are unchanged.
        charge_migration: charge the stale reference's structure changes their migration
            (module docstring); False: the migration-free figure.
        switch_margin: with ``charge_migration``, the stale reference keeps its running
            structure (shares re-solved) while the best candidate's objective on the observed
            state is less than this fraction below it (the controller's default hysteresis
            against measurement noise; 0: the best candidate every slot).
        top_candidates: with ``charge_migration``, the stale reference's plan sequence is
            chosen among each slot's this many best candidates (module docstring).
        search_cache: a dict shared by calls on the same timeline, profile and config: a
            search with identical inputs (state, multipliers, warm start) is looked up, not
            re-run (only searches without ``search_time_budget_s``, which are deterministic).
        search_known_availability: False: a slot that is searched only because availability
            changed (not a multiple of ``search_every``) is skipped when its set of available
            devices was already searched at that multiplier (outages that flap between a few
            sets); True: searched every time.

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
    seen: set[tuple] = set()
    every = max(int(search_every), 1)
    cacheable = search_cache is not None and search_time_budget_s is None

    def search(state: ClusterState, eta: dict[str, float], warm_start: Plan | None) -> Plan:
        key = None
        if cacheable:
            key = (
                "best_plan", state_digest(state), tuple(sorted(eta.items())),
                None if warm_start is None else warm_start.model_dump_json(),
                id(profile), repr(config),
            )  # fmt: skip
            if key in search_cache:
                hit = search_cache[key]
                if isinstance(hit, NoFeasiblePlanError):
                    raise hit
                return hit
        try:
            found = best_plan(
                state,
                profile,
                config,
                queues=eta or None,
                warm_start=warm_start,
                time_budget_s=search_time_budget_s,
                reproducible=search_time_budget_s is None,
            )
        except NoFeasiblePlanError as exc:
            if key is not None:
                search_cache[key] = exc
            raise
        if key is not None:
            search_cache[key] = found
        return found

    for t in range(slots):
        moved = t > 0 and not np.array_equal(actual[t].available, actual[t - 1].available)
        if t % every and not moved:
            continue
        for which, state in (("true", actual[t]), ("measured", observed[t])):
            if which == "true" and not hindsight and t_ref is not None:
                continue
            if not np.asarray(state.available).any():
                continue
            etas: list[dict[str, float]] = [{}]
            if budgets and t_ref is not None:
                etas += [{j: u * t_ref / b for j, b in budgets.items()} for u in eta_grid]
            for eta in etas:
                key = (which, *sorted(eta.items()))
                sig = (key, np.asarray(state.available, dtype=bool).tobytes())
                if t % every and not search_known_availability and sig in seen:
                    continue
                seen.add(sig)
                try:
                    found = search(state, eta, warm.get(key))
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
    scale = eps[live][:, None]
    if hindsight:
        true_f = np.array([np.stack(pool.figures(actual[t])) for t in live])  # (S, 3, K)
        true_f *= scale[:, :, None]
    # chosen on the measured state, judged on the true one
    stale_f = np.array([np.stack(stale_pool.figures(observed[t])) for t in live])
    judged = np.array([np.stack(stale_pool.figures(observed[t], actual[t])) for t in live])
    judged *= scale[:, :, None]
    spend_rows = {"money": 1, "energy": 2}

    def pick(figs: np.ndarray, eta: Mapping[str, float]) -> np.ndarray:
        obj = figs[:, 0, :].copy()
        for j, x in eta.items():
            obj = obj + x * figs[:, spend_rows[j], :]
        obj = np.where(np.isfinite(obj), obj, np.inf)
        return np.argmin(obj, axis=1)

    def pick_held(figs: np.ndarray, eta: Mapping[str, float]) -> np.ndarray:
        """:func:`pick` with the hysteresis of a policy that pays migration: the running
        structure (its better share variant) is kept while the best candidate's objective is
        not below ``(1 − switch_margin)`` times its own."""
        best = pick(figs, eta)
        if not charge_migration or switch_margin <= 0:
            return best
        obj = figs[:, 0, :].copy()
        for j, x in eta.items():
            obj = obj + x * figs[:, spend_rows[j], :]
        obj = np.where(np.isfinite(obj), obj, np.inf)
        choice = best.copy()
        cur = -1
        for i in range(len(best)):
            b = int(best[i])
            if cur >= 0:
                even = 2 * (cur // 2)
                keep = even if obj[i, even] <= obj[i, even + 1] else even + 1
                if np.isfinite(obj[i, keep]) and obj[i, b] >= obj[i, keep] * (1 - switch_margin):
                    b = keep
            choice[i] = b
            if np.isfinite(obj[i, b]):
                cur = b
        return choice

    def means(figs: np.ndarray, choice: np.ndarray) -> tuple[float, dict[str, float]]:
        rows = np.arange(len(choice))
        chosen = figs[rows, :, choice]
        return float(np.mean(chosen[:, 0])), {
            "money": float(np.mean(chosen[:, 1])),
            "energy": float(np.mean(chosen[:, 2])),
        }

    o = float(config.optimizer_state_factor)
    run_plans: dict[tuple[int, int], Plan] = {}
    run_arrays: dict[tuple, StructureArrays] = {}
    moves: dict[tuple[int, int, int], float] = {}

    def run_plan(i: int, k: int) -> Plan:
        """The plan candidate ``k`` of the stale pool runs in live slot ``i`` (shares
        re-solved on the observed state for even ``k``, as found for odd ``k``)."""
        plan = run_plans.get((i, k))
        if plan is None:
            plan = stale_pool.plans[k // 2]
            if k % 2 == 0:
                plan = rebalance_shares(
                    plan, observed[live[i]], stale_pool.arrays[k // 2], config.batch, o,
                    config.norm_block,
                )  # fmt: skip
            run_plans[(i, k)] = plan
        return plan

    def migrations(choice: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Per live slot: migration time, its money and energy (billed to the new plan's
        devices on the true state, as the simulator bills it), and the structure changes."""
        mig, money, energy = (np.zeros(len(choice)) for _ in range(3))
        changes = 0
        if not charge_migration:
            return mig, money, energy, changes
        prev, prev_k, prev_key = None, -1, None
        for i, k in enumerate(int(x) for x in choice):
            if not np.isfinite(judged[i, 0, k]):
                continue
            plan = run_plan(i, k)
            key = structure_key(plan)
            if prev is not None and key != prev_key:
                changes += 1
                state = actual[live[i]]
                seconds = moves.get((i, prev_k, k))
                if seconds is None:
                    seconds = migration_time_s(prev, plan, state, profile, o)
                    moves[(i, prev_k, k)] = seconds
                arrays = run_arrays.get(key)
                if arrays is None:
                    arrays = run_arrays[key] = StructureArrays.build(plan, stale_pool.ids, profile)
                used = arrays.stage_device
                mig[i] = seconds
                money[i] = seconds * float(np.sum(state.price_per_s[used]))
                energy[i] = seconds * float(np.sum(state.power_w[used]))
            prev, prev_k, prev_key = plan, k, key
        return mig, money, energy, changes

    active_ids: dict[tuple, int] = {}
    active_of: dict[tuple[int, int], int] = {}
    nic_ids: dict[bytes, int] = {}
    nic_of: dict[int, int] = {}
    pair_moves: dict[tuple[int, int, int], float] = {}

    def active_id(i: int, k: int) -> int:
        """An integer naming the active structure (devices and stages of the groups that run)
        of candidate ``k`` in live slot ``i``: migration depends on nothing else of a plan."""
        got = active_of.get((i, k))
        if got is None:
            plan = run_plan(i, k)
            key = tuple((g.devices, tuple(g.stages)) for g in plan.groups if g.batch > 0)
            got = active_of[(i, k)] = active_ids.setdefault(key, len(active_ids))
        return got

    def move_s(i: int, a: int, b: int) -> float:
        """Migration seconds from candidate ``a`` of live slot ``i − 1`` to candidate ``b`` of
        slot ``i`` on slot ``i``'s observed state (what the choice may know; memoised by
        active structures and NICs)."""
        ka, kb = active_id(i - 1, a), active_id(i, b)
        if ka == kb:
            return 0.0
        nic = nic_of.get(i)
        if nic is None:
            raw = np.asarray(observed[live[i]].nic_bytes_per_s).tobytes()
            nic = nic_of[i] = nic_ids.setdefault(raw, len(nic_ids))
        seconds = pair_moves.get((ka, kb, nic))
        if seconds is None:
            state = observed[live[i]]
            seconds = migration_time_s(run_plan(i - 1, a), run_plan(i, b), state, profile, o)
            pair_moves[(ka, kb, nic)] = seconds
        return seconds

    mig_memo: dict[tuple, np.ndarray] = {}

    def pick_planned(figs: np.ndarray, eta: Mapping[str, float]) -> np.ndarray:
        """The plan sequence minimising ``Σ_t [T + Σ_j η_j y_j](p_t) + t_mig(p_{t−1}, p_t)
        (1 + Σ_j η_j r_j(p_t))`` over the stale figures (``r_j``: the plan's spend rate per
        second), by dynamic programming: the stale states of every slot known in advance,
        migration weighed exactly. Each slot's candidates are its ``top_candidates`` best by
        that slot's objective plus those of the slot before that still run (so that keeping
        the running plan is always an option), at most ``3 · top_candidates``, the carried
        ones by their path value."""
        obj = figs[:, 0, :].copy()
        rate = np.ones_like(obj)
        with np.errstate(invalid="ignore", divide="ignore"):
            for j, x in eta.items():
                obj = obj + x * figs[:, spend_rows[j], :]
                rate = rate + x * figs[:, spend_rows[j], :] / figs[:, 0, :]
        obj = np.where(np.isfinite(obj), obj, np.inf)
        n = len(obj)
        width = min(int(top_candidates), obj.shape[1])
        cap = 3 * width

        def best_of(i: int) -> np.ndarray:
            top = np.argsort(obj[i], kind="stable")[:width]
            finite = top[np.isfinite(obj[i, top])]
            return finite if len(finite) else top[:1]

        cands: list[np.ndarray] = [best_of(0)]
        value = obj[0, cands[0]].copy()
        back: list[np.ndarray] = [np.full(len(cands[0]), -1, dtype=np.int64)]
        for i in range(1, n):
            prev = cands[-1]
            fresh = best_of(i)
            if not np.isfinite(obj[i, fresh[0]]) or not np.isfinite(value).any():
                # a slot with no plan (or none before): the path restarts here
                cands.append(fresh)
                value = obj[i, fresh].copy()
                back.append(np.full(len(fresh), -1, dtype=np.int64))
                continue
            new = set(fresh.tolist())
            carried = [int(k) for k in prev[np.argsort(value, kind="stable")]
                       if np.isfinite(obj[i, k]) and int(k) not in new]  # fmt: skip
            cur = np.array([*fresh.tolist(), *carried][:cap], dtype=np.int64)
            key = (i, prev.tobytes(), cur.tobytes())
            mig = mig_memo.get(key)
            if mig is None:
                mig = np.array([[move_s(i, int(a), int(b)) for b in cur] for a in prev])
                mig_memo[key] = mig
            total = value[:, None] + mig * rate[i, cur][None, :]
            arg = np.argmin(total, axis=0)
            value = total[arg, np.arange(len(cur))] + obj[i, cur]
            cands.append(cur)
            back.append(arg)
        choice = np.zeros(n, dtype=np.int64)
        pos = int(np.argmin(value))
        for i in range(n - 1, -1, -1):
            choice[i] = cands[i][pos]
            pos = int(back[i][pos]) if back[i][pos] >= 0 else 0
        return choice

    def run_means(choice: np.ndarray) -> tuple[float, dict[str, float]]:
        """:func:`means` of the judged figures plus the migrations of that plan sequence."""
        t, cost = means(judged, choice)
        if not charge_migration:
            return t, cost
        mig, money, energy, _ = migrations(choice)
        return t + float(np.mean(mig)), {
            "money": cost["money"] + float(np.mean(money)),
            "energy": cost["energy"] + float(np.mean(energy)),
        }

    def stale_result(name: str, eta: Mapping[str, float], choice: np.ndarray) -> ReferenceResult:
        t, cost = run_means(choice)
        mig, _, _, changes = migrations(choice)
        per_slot = judged[np.arange(len(choice)), 0, choice]
        chosen = [run_plan(i, int(k)) for i, k in enumerate(choice)]
        return ReferenceResult(
            name, t, cost, dict(eta), None, len(live), float(np.mean(mig)) if len(mig) else 0.0,
            changes, per_slot, chosen, mig,
        )  # fmt: skip

    def dual_value(eta: Mapping[str, float]) -> float:
        obj = true_f[:, 0, :].copy()
        for j, x in eta.items():
            obj = obj + x * (true_f[:, spend_rows[j], :] - budgets[j])
        return float(np.mean(np.min(obj, axis=1)))

    t_scale = t_ref or 1.0
    scales = {j: t_scale / b for j, b in budgets.items()}
    out: dict[str, ReferenceResult] = {}
    if hindsight:
        eta_h = bisect_multipliers(
            lambda e: means(true_f, pick(true_f, e))[1], budgets, scales, iterations=30
        )
        bound = max(
            dual_value({j: x * f for j, x in eta_h.items()})
            for f in (0.0, 0.5, 0.8, 1.0, 1.25, 2.0)
        )
        t_h, c_h = means(true_f, pick(true_f, eta_h))
        out["hindsight"] = ReferenceResult("hindsight", t_h, c_h, eta_h, bound, len(live))
    # stale: chosen on the measured states, judged on the true ones, migrations charged
    choose = pick_planned if charge_migration else pick
    eta_s = bisect_multipliers(
        lambda e: run_means(choose(stale_f, e))[1], budgets, scales, iterations=30
    )
    out["stale"] = stale_result("stale", eta_s, choose(stale_f, eta_s))
    if budgets:
        out["stale-unbudgeted"] = stale_result("stale-unbudgeted", {}, choose(stale_f, {}))
    if charge_migration:
        # the myopic re-planner (the best candidate each slot, 1 % hysteresis), for comparison
        eta_m = bisect_multipliers(
            lambda e: run_means(pick_held(stale_f, e))[1], budgets, scales, iterations=30
        )
        out["stale-myopic"] = stale_result("stale-myopic", eta_m, pick_held(stale_f, eta_m))
        if budgets:
            out["stale-myopic-unbudgeted"] = stale_result(
                "stale-myopic-unbudgeted", {}, pick_held(stale_f, {})
            )
    if charge_migration:
        # the former, migration-free figure, for comparison
        eta_f = bisect_multipliers(
            lambda e: means(judged, pick(stale_f, e))[1], budgets, scales, iterations=30
        )
        for name, eta in (("stale-no-migration", eta_f), ("stale-unbudgeted-no-migration", {})):
            if name == "stale-unbudgeted-no-migration" and not budgets:
                continue
            t_f, c_f = means(judged, pick(stale_f, eta))
            out[name] = ReferenceResult(name, t_f, c_f, dict(eta), None, len(live))
    return out
