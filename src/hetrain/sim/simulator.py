"""Trace-driven simulator (docs/model.md §4, §7): run any policy over a trace for N slots.

Slot ``t``:

1. the policy sees ``observed(t)``: the state measured in slot ``t − 1`` (speeds with optional
   multiplicative measurement noise, NIC bandwidths, prices) plus which devices are up in slot
   ``t``; in slot 0, the cluster file's nominal values. Every available device reports its speed
   (a heartbeat micro-benchmark), so an unused straggler that recovers is seen;
2. it returns a plan (or a :class:`~hetrain.control.decision.Decision`), which runs from slot
   ``t + decision_delay`` on (the runtime's controller decides asynchronously while the ranks
   train: ``decision_delay = 1``). Slot 0's plan, and a new plan when the running one names a
   device that is gone, are decided synchronously and run at once (the runtime plans before
   training starts and re-plans when a rank is lost); pending decisions are then dropped. The
   simulator checks that every device of an active group is available;
3. the iteration time is docs/model.md §3 under the *actual* state of slot ``t``
   (:func:`hetrain.control.incremental.evaluate_fast`, equal to
   :func:`hetrain.costmodel.evaluate_plan`), times optional multiplicative noise
   ``exp(N(0, σ²))``, plus the migration time of a structure change
   (:func:`hetrain.control.migration.migration_time_s`);
4. the used devices are billed for the whole slot: ``y_money = slot_time · Σ_{d used} π_d``,
   ``y_energy = slot_time · Σ_{d used} W_d``; the policy observes time and cost.

A slot where the policy has no feasible plan (:class:`~hetrain.errors.NoFeasiblePlanError`) is
recorded as infeasible and excluded from the means (docs/model.md §6 "infeasible").
"""

from __future__ import annotations

import contextlib
import csv
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.control import Policy, plan_of
from hetrain.control.incremental import StructureArrays, evaluate_fast, structure_key
from hetrain.control.migration import migration_time_s
from hetrain.costmodel import PlanEvaluation, TrainingConfig, lower_bound_s
from hetrain.errors import NoFeasiblePlanError
from hetrain.plan import Plan
from hetrain.profile import ProfileArrays
from hetrain.trace import TraceTimeline


@dataclass(frozen=True)
class SlotRecord:
    """One slot of a simulation (a row of the per-slot CSV).

    ``iteration_time_s`` includes ``migration_time_s``; ``compute_time_s`` is docs/model.md §3's
    ``T``
    of the actual state (before noise); costs are per iteration (currency, joules); queues are
    the controller's backlog after the slot (0 for baselines)."""

    slot: int
    feasible: bool
    iteration_time_s: float
    compute_time_s: float
    migration_time_s: float
    lower_bound_s: float
    cost_money: float
    cost_energy: float
    plan_changed: bool
    active_groups: int
    devices_used: int
    queue_money: float
    queue_energy: float


@dataclass
class SimulationResult:
    """Per-slot records and the docs/model.md §7 summary of one policy on one trace."""

    policy: str
    records: list[SlotRecord]
    budgets: dict[str, float] = field(default_factory=dict)
    wall_time_s: float = 0.0
    searches: int = 0
    plans: list[Plan | None] = field(default_factory=list)

    @property
    def feasible_records(self) -> list[SlotRecord]:
        return [r for r in self.records if r.feasible]

    @property
    def infeasible_slots(self) -> int:
        return sum(1 for r in self.records if not r.feasible)

    @property
    def plan_changes(self) -> int:
        """Changes of groups or stages between consecutive slots (share-only changes and the
        first plan are not counted, docs/model.md §7)."""
        return sum(1 for r in self.records if r.plan_changed)

    def mean(self, attribute: str) -> float | None:
        """Mean of a :class:`SlotRecord` attribute over feasible slots (None if none)."""
        values = [getattr(r, attribute) for r in self.feasible_records]
        return float(np.mean(values)) if values else None

    def summary(self) -> dict[str, Any]:
        """The ``hetrain simulate --json`` object (docs/model.md §7), means over feasible slots with
        migration time included; extra keys: ``infeasible_slots``, ``mean_migration_time_s``,
        ``budgets``, ``final_backlog`` (the virtual queues after the last slot; negative is the
        credit of an underspend, as the controller's queues are signed by default:
        docs/controller.md, "Budgets")."""
        last = self.records[-1] if self.records else None
        return {
            "policy": self.policy,
            "slots": len(self.records),
            "mean_iteration_time_s": self.mean("iteration_time_s"),
            "mean_lower_bound_s": self.mean("lower_bound_s"),
            "mean_cost": {"money": self.mean("cost_money"), "energy": self.mean("cost_energy")},
            "plan_changes": self.plan_changes,
            "infeasible_slots": self.infeasible_slots,
            "mean_migration_time_s": self.mean("migration_time_s"),
            "budgets": dict(self.budgets),
            "final_backlog": {
                "money": last.queue_money if last else 0.0,
                "energy": last.queue_energy if last else 0.0,
            },
        }

    def write_csv(self, path: str | Path) -> None:
        """Write the per-slot records (one row per slot, header = :class:`SlotRecord` fields)."""
        names = list(SlotRecord.__dataclass_fields__)
        with open(path, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["policy", *names])
            for r in self.records:
                row = asdict(r)
                w.writerow([self.policy, *(_fmt(row[n]) for n in names)])


def _fmt(x: Any) -> Any:
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, float):
        return f"{x:.9g}"
    return x


def observed_state(
    measured: ClusterState | None, actual: ClusterState, base: ClusterState
) -> ClusterState:
    """What a policy sees before a slot: the previous slot's measurement (``base``, the cluster
    file, before the first slot) with the availability of the slot itself."""
    source = base if measured is None else measured
    return source.with_changes(available=np.asarray(actual.available, dtype=bool).copy())


def simulate(
    policy: Policy,
    timeline: TraceTimeline,
    profile: ProfileArrays,
    config: TrainingConfig,
    *,
    slots: int | None = None,
    time_noise: float = 0.0,
    measurement_noise: float = 0.0,
    seed: int = 0,
    budgets: Mapping[str, float] | None = None,
    keep_plans: bool = False,
    decision_delay: int = 1,
    search_latency: int | None = None,
) -> SimulationResult:
    """Run ``policy`` for ``slots`` slots (default: the timeline's length).

    Args:
        policy: any :class:`~hetrain.control.Policy`.
        timeline: dense per-slot dynamics (:meth:`hetrain.trace.Trace.timeline`).
        profile, config: model and training configuration.
        time_noise: σ of the multiplicative log-normal noise on each slot's iteration time.
        measurement_noise: σ of the per-device log-normal noise on measured speeds.
        seed: seeds both noises (the run is deterministic for a seed).
        budgets: reported in the summary (the policy enforces its own).
        keep_plans: keep every slot's plan in ``result.plans`` (memory grows with slots).
        decision_delay: slots between a decision (taken before slot ``t`` on measurements up
            to ``t − 1``) and the slot it first runs in, ``t + decision_delay`` (default 1,
            the runtime's asynchronous controller; 0: docs/model.md §4's idealised timing).
        search_latency: None (default): a policy's planner searches run inside its decision.
            An integer ``L >= 0``: the runtime's controller with its search thread — each
            decision is the cheap one (``decide(..., search=False)``: the current and the
            known structures re-balanced, through the gate) and a search it wants joins the
            policy's pool ``L`` slots after the decision that asked for it (one search in
            flight at a time), as the search thread's plan joins at the first decision after
            the search finished. Policies without searches ignore it.

    Raises:
        ValueError: a policy emitted a plan that uses an unavailable device, names an unknown
            device or runs out of memory (a policy bug, never bad user input); bad noise values
            or a negative ``decision_delay``.
    """
    if int(decision_delay) < 0:
        raise ValueError(f"decision_delay: expected an integer >= 0, got {decision_delay!r}")
    if search_latency is not None and int(search_latency) < 0:
        raise ValueError(f"search_latency: expected an integer >= 0, got {search_latency!r}")
    threaded = search_latency is not None and hasattr(policy, "search_plan")
    in_flight: list[tuple[int, int, Plan, ClusterState, dict]] = []

    def decide(t: int, observed: ClusterState) -> Plan:
        while in_flight and in_flight[0][0] <= t:
            _, asked, found, state, weights = in_flight.pop(0)
            policy.add_searched(asked, found, state, weights)
        if not threaded:
            return plan_of(policy.decide(t, observed))
        answer = plan_of(policy.decide(t, observed, search=False))
        wanted = policy.search_wanted
        if wanted is not None and not in_flight:
            with contextlib.suppress(NoFeasiblePlanError):
                found = policy.search_plan(*wanted)
                in_flight.append((t + int(search_latency), t, found, wanted[0], wanted[1]))
        return answer

    delay = int(decision_delay)
    if not (math.isfinite(time_noise) and time_noise >= 0):
        raise ValueError(f"time_noise: expected a finite number >= 0, got {time_noise!r}")
    if not (math.isfinite(measurement_noise) and measurement_noise >= 0):
        raise ValueError(
            f"measurement_noise: expected a finite number >= 0, got {measurement_noise!r}"
        )
    n_slots = timeline.num_slots if slots is None else int(slots)
    rng = np.random.default_rng(seed)
    base = timeline.base
    o = float(config.optimizer_state_factor)
    arrays_cache: dict[tuple, StructureArrays] = {}
    records: list[SlotRecord] = []
    plans: list[Plan | None] = []
    measured: ClusterState | None = None
    prev_plan: Plan | None = None
    prev_key: tuple | None = None
    running: Plan | None = None
    pending: list[tuple[int, Plan]] = []
    index = base.index()
    started = time.perf_counter()
    for t in range(n_slots):
        actual = timeline.state_at(t)
        observed = observed_state(measured, actual, base)
        lb = lower_bound_s(actual, profile, config.batch) if actual.available.any() else math.nan
        eps_time = float(np.exp(rng.normal(0.0, time_noise))) if time_noise > 0 else 1.0
        if measurement_noise > 0:
            eps_speed = np.exp(rng.normal(0.0, measurement_noise, size=actual.num_devices))
            measured = actual.with_changes(speed_flops=actual.speed_flops * eps_speed)
        else:
            measured = actual
        while pending and pending[0][0] <= t:
            running = pending.pop(0)[1]
        try:
            if running is None or not _usable(running, actual.available, index):
                # synchronous decision: first slot, or the running plan lost a device
                pending.clear()
                running = None
                running = decide(t, observed)
            elif delay == 0:
                running = decide(t, observed)
            else:
                # no feasible answer: keep running the current plan
                with contextlib.suppress(NoFeasiblePlanError):
                    pending.append((t + delay, decide(t, observed)))
            plan = running
        except NoFeasiblePlanError:
            running = None
            records.append(
                SlotRecord(t, False, math.nan, math.nan, 0.0, lb, math.nan, math.nan, False, 0,
                           0, *_queues(policy))
            )  # fmt: skip
            if keep_plans:
                plans.append(None)
            continue
        key = structure_key(plan)
        arrays = arrays_cache.get(key)
        if arrays is None:
            if len(arrays_cache) > 32:
                arrays_cache.clear()
            try:
                arrays = StructureArrays.build(plan, base.ids, profile)
            except KeyError as exc:
                raise ValueError(f"{policy.name}: plan names unknown device {exc}") from None
            arrays_cache[key] = arrays
        used = arrays.stage_device
        if not np.all(actual.available[used]):
            gone = [base.ids[i] for i in used if not actual.available[i]]
            raise ValueError(f"{policy.name}: slot {t}: plan uses unavailable device {gone[0]!r}")
        if plan.global_batch != config.batch:
            raise ValueError(
                f"{policy.name}: slot {t}: shares sum to {plan.global_batch}, "
                f"expected {config.batch}"
            )
        ev = evaluate_fast(plan, arrays, actual, o)
        if not ev.fits:
            raise ValueError(f"{policy.name}: slot {t}: plan runs out of memory")
        changed = prev_plan is not None and plan.structure() != prev_plan.structure()
        mig = 0.0
        if prev_plan is not None and key != prev_key:
            mig = migration_time_s(prev_plan, plan, actual, profile, o)
        slot_time = ev.iteration_time_s * eps_time + mig
        money = slot_time * float(np.sum(actual.price_per_s[used]))
        energy = slot_time * float(np.sum(actual.power_w[used]))
        evaluation = PlanEvaluation(
            iteration_time_s=slot_time,
            lower_bound_s=lb,
            sync_time_s=ev.sync_time_s,
            group_times_s=tuple(float(x) for x in ev.group_times_s),
            cost={"money": money, "energy": energy},
            fits=True,
            memory_bytes={},
            memory_limit_bytes={},
        )
        policy.observe(t, plan, evaluation)
        records.append(
            SlotRecord(
                slot=t,
                feasible=True,
                iteration_time_s=slot_time,
                compute_time_s=ev.iteration_time_s,
                migration_time_s=mig,
                lower_bound_s=lb,
                cost_money=money,
                cost_energy=energy,
                plan_changed=changed,
                active_groups=arrays.num_groups,
                devices_used=len(used),
                queue_money=_queues(policy)[0],
                queue_energy=_queues(policy)[1],
            )
        )
        if keep_plans:
            plans.append(plan)
        prev_plan, prev_key = plan, key
    return SimulationResult(
        policy=policy.name,
        records=records,
        budgets=dict(budgets or {}),
        wall_time_s=time.perf_counter() - started,
        searches=int(getattr(policy, "searches", 0)),
        plans=plans,
    )


def _queues(policy: Policy) -> tuple[float, float]:
    queues = getattr(policy, "queues", None)
    backlog = getattr(queues, "backlog", {}) if queues is not None else {}
    return float(backlog.get("money", 0.0)), float(backlog.get("energy", 0.0))


def _usable(plan: Plan, available: np.ndarray, index: dict[str, int]) -> bool:
    """Whether every device of an active group of ``plan`` is available."""
    return all(available[index[d]] for g in plan.groups if g.batch > 0 for d in g.devices)
