"""The controller of a training run (docs/model.md §4-§5), in its own process: measured step times
->
speed estimates -> :class:`~hetrain.control.lyapunov.LyapunovController` -> plan changes that hold.

Where it runs. The process that launches the ranks (``hetrain train``: the elastic launcher's
parent) runs :class:`ControllerService` in a thread, beside a ``torch.distributed.TCPStore`` it
hosts (``TrainJob.controller_endpoint``); under ``torchrun`` rank 0 starts it as a separate
process (``python -m hetrain.runtime.adapt --port P``). No search ever runs in a rank's
process, so a search neither holds a rank's GIL nor delays its step.

Protocol (keys of that store, :class:`ControllerLink` on every rank; every value is JSON
data, :mod:`hetrain.runtime.ctlwire`, never a pickle):

- ``init`` (+ ``init_id``, the round's id): the model profile, the start-up cluster state
  (measured speeds and ``κ``), the training configuration, the current plan, the number of
  ranks and the first step of this round (rank 0);
- ``m/{step}/{rank}``: after every step, each rank writes its own compute, iteration,
  send/recv and exposed sync seconds and the plan id it ran under (no collective gathers
  them); the controller observes a step once every rank's record is there; never waited for;
- ``plan``: ``{"round", "decision"}``: the newest decision (plan with its id, the estimates
  that chose it, the predicted before/after figures) and the round it was made for (a
  decision of a round whose rank 0 died is ignored by the next round's). A thread of rank 0
  reads it (rank 0's step never waits on the store) and the step's own combination of sums
  (the gradient all-reduce of a data-parallel step, :meth:`hetrain.runtime.engine.Worker.step`'s
  ``report``) carries whether there is one, so all ranks switch at the same step;
- ``error``: the controller's failure (rank 0 raises it: adaptation never turns off silently);
  ``done``: rank 0 finished.

Decisions (:class:`PlanController`, a thin caller): the measured compute times go to the one
speed estimator (:class:`hetrain.control.estimates.SpeedEstimates`) and every step asks the one
decision path, :class:`hetrain.control.lyapunov.LyapunovController` (what ``hetrain simulate``
runs), with the runtime's options (:func:`policy_options`); its one gate decides (a change is
applied only when, on the *same* estimates, it is predicted faster than the plan in force by
``rebalance_margin`` for shares only or ``switch_margin`` for a new structure, and its gain
over the payback horizon ``min(steps left, horizon_steps)`` pays its migration time). With
``async_search`` (the service) planner searches run in a thread and every step gets the cheap
keep-or-rebalance decision on time. The controller's state (estimates, policy with its queues,
plan ids) is a versioned JSON :meth:`PlanController.state_dict`, staged by the controller
(:func:`controller_state_path`) and copied by rank 0 into the checkpoint of that step
(``controller.json``, checksummed in its manifest); it is restored on resume from the
checkpoint the ranks resume from; the ranks keep their plan meanwhile.

Imports numpy and the planning modules only; torch only for the store, lazily.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.control import make_policy
from hetrain.control.estimates import SpeedEstimates, startup_stage_time_s
from hetrain.control.migration import migration_time_s
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.plan import GroupPlan, Plan
from hetrain.profile import ProfileArrays
from hetrain.runtime.ctlwire import (
    WireError,
    decode_decision,
    decode_init,
    decode_record,
    encode_decision,
    encode_init,
    encode_record,
    merge_records,
)

# --------------------------------------------------------------------------------------------
# predictions
# --------------------------------------------------------------------------------------------


def predict_iteration_time_s(
    plan: Plan, state: ClusterState, profile: ProfileArrays, config: TrainingConfig
) -> float:
    """Predicted iteration time ``T`` of ``plan`` on ``state`` (seconds, docs/model.md §3,
    :func:`hetrain.costmodel.evaluate_plan`)."""
    return float(evaluate_plan(plan, state, profile, config).iteration_time_s)


def migration_time_estimate_s(
    old: Plan, new: Plan, profile: ProfileArrays, state: ClusterState, optimizer_state_factor: float
) -> float:
    """Migration time of ``old -> new`` (seconds; docs/model.md §4, v3: a group that goes from idle
    to
    active receives weights and optimizer state too), by
    :func:`hetrain.control.migration.migration_time_s`. 0 when the active structure is equal."""
    if old.structure() == new.structure():
        return 0.0
    return float(migration_time_s(old, new, state, profile, optimizer_state_factor))


def policy_options() -> dict[str, Any]:
    """Tuning of the runtime's :class:`~hetrain.control.lyapunov.LyapunovController`: measured
    speeds are noisy (shared CPUs, ±20 % from step to step, smoothed by the median of 13), so a
    structure switch must win by 20 % and pay its migration within at most 20 steps, and a
    shares-only change must win by 3 % (it migrates nothing, so the controller keeps
    re-balancing until the shares are within 3 % of the best on its estimates); a new search
    runs when the current plan's predicted ``T/T_LB`` drifted by 25 %, or every 50 steps;
    decisions apply one step after the measurements they use (``decision_delay_slots=1``);
    single-stage groups run their share as one micro-batch (the engine's convention,
    :func:`runtime_plan`); no wall-clock budget on searches (reproducible)."""
    return dict(
        switch_margin=0.2,
        rebalance_margin=0.03,
        horizon_slots=20.0,
        replan_every=50,
        drift_tolerance=0.25,
        decision_delay_slots=1,
        single_stage_one_microbatch=True,
    )


# --------------------------------------------------------------------------------------------
# decisions
# --------------------------------------------------------------------------------------------


@dataclass
class Decision:
    """A plan change and the figures that chose it (all on the same estimates).

    Attributes:
        plan: the new plan (its ``plan_id`` set by the controller).
        reason: why (``"rebalance"``: shares only; ``"re-plan"``: new groups/stages; plus the
            slow-down that moved the estimates, when one did).
        decided_after_step: the last step whose measurements the decision saw.
        current_time_s, predicted_time_s: docs/model.md §3 iteration time of the current and the new
            plan on ``speeds_flops`` (seconds).
        migration_time_s: predicted migration time of the change (seconds).
        horizon_steps: steps over which the gain was required to pay the migration.
        structure_changed: groups/stages (or the set of active groups) changed.
        speeds_flops: the speed estimates (FLOP/s per device) that chose the plan.
        shares_before, shares_after: ``{device: samples}`` (a pipeline's share under each of
            its devices).
    """

    plan: Plan
    reason: str
    decided_after_step: int
    current_time_s: float
    predicted_time_s: float
    migration_time_s: float
    horizon_steps: float
    structure_changed: bool
    speeds_flops: dict[str, float] = field(default_factory=dict)
    shares_before: dict[str, int] = field(default_factory=dict)
    shares_after: dict[str, int] = field(default_factory=dict)

    def console_line(self, applied_step: int) -> str:
        """One line for the console: step, why, shares before -> after, predicted ``T``."""
        before = " ".join(f"{d}:{b}" for d, b in self.shares_before.items())
        after = " ".join(f"{d}:{b}" for d, b in self.shares_after.items())
        return (
            f"re-plan at step {applied_step} (plan {self.plan.plan_id}): {self.reason}; "
            f"shares {before} -> {after}; predicted {self.current_time_s * 1e3:.1f} ms -> "
            f"{self.predicted_time_s * 1e3:.1f} ms per iteration "
            f"(migration {self.migration_time_s * 1e3:.1f} ms)"
        )

    def to_json_dict(self) -> dict[str, Any]:
        """The metrics record (without the plan body)."""
        return {
            "plan_id": self.plan.plan_id,
            "reason": self.reason,
            "decided_after_step": self.decided_after_step,
            "current_time_s": self.current_time_s,
            "predicted_time_s": self.predicted_time_s,
            "migration_estimate_s": self.migration_time_s,
            "horizon_steps": self.horizon_steps,
            "structure_changed": self.structure_changed,
            "speed_flops": self.speeds_flops,
            "shares_before": self.shares_before,
            "shares_after": self.shares_after,
        }


def device_shares(plan: Plan, devices: Sequence[str] = ()) -> dict[str, int]:
    """``{device: share of its group}`` for ``devices`` (0 for a device the plan leaves idle)
    and every device the plan names."""
    out = {d: 0 for d in devices}
    out.update({d: int(g.batch) for g in plan.groups for d in g.devices})
    return out


def controller_decide(
    policy: Any, slot: int, state: ClusterState, current: Plan, **options: Any
) -> Any:
    """The one integration point with ``hetrain.control``:
    :meth:`LyapunovController.decide(slot, state, current, **options)
    <hetrain.control.lyapunov.LyapunovController.decide>`, which returns a
    :class:`hetrain.control.decision.Decision` (plan, reason, figures on the estimates that chose
    it; its one gate: no change predicted slower, shares-only changes gain ``rebalance_margin``,
    structure changes ``switch_margin`` and pay their migration over the expected
    persistence)."""
    return policy.decide(slot, state, current, **options)


class PlanController:
    """The controller of a training run in its process: it feeds the measured step times to
    the one speed estimator (:class:`hetrain.control.estimates.SpeedEstimates`) and asks the
    one decision path (:class:`hetrain.control.lyapunov.LyapunovController`, the class
    ``hetrain simulate`` runs) for a decision each step; it applies what that answers as the
    runtime runs it (:func:`runtime_plan`). No gate, share solver or estimator of its own.

    Args:
        base_state: start-up cluster state (ids = the ranks' devices; measured speeds, ``κ``).
        profile: the model profile; config: the training configuration.
        plan: the plan the ranks run now (with its id); steps: the run's total steps.
        optimizer_state_factor: ``o`` of the migration bytes (kept for the caller; the
            controller uses ``config.optimizer_state_factor``).
        horizon_steps: cap on the payback horizon of a change (steps; also capped by the
            steps left).
        warmup_steps: measured steps before the first decision (7: the short window's median
            of 13 is then robust to as many stalled steps as it has normal ones).
        async_search: planner searches run in a thread of the controller's process while
            every step gets the cheap decision (the current and the known structures
            re-balanced, through the gate) on time; a search's plan joins the controller's
            pool at the first decision after it finished. False: searches run inside the
            decision (replays: decisions are a function of the measurements).
        options: :class:`~hetrain.control.lyapunov.LyapunovController` keywords over
            :func:`policy_options`.
    """

    def __init__(
        self,
        base_state: ClusterState,
        profile: ProfileArrays,
        config: TrainingConfig,
        plan: Plan,
        steps: int,
        *,
        optimizer_state_factor: float = 2.0,
        horizon_steps: int = 20,
        warmup_steps: int = 7,
        async_search: bool = False,
        **options: Any,
    ) -> None:
        self.async_search = bool(async_search)
        self._pending: Any = None
        self.base_state = base_state
        self.profile = profile
        self.config = config
        self.current = plan
        self.steps = int(steps)
        self.optimizer_state_factor = float(optimizer_state_factor)
        self.horizon_steps = int(horizon_steps)
        self.warmup_steps = int(warmup_steps)
        self.policy = make_policy("lyapunov", profile, config, **{**policy_options(), **options})
        self.estimates = SpeedEstimates(
            base_state.ids,
            [float(v) for v in base_state.speed_flops],
            [float(k) for k in base_state.kappa_s],
            layer_overhead_s=[float(lam) for lam in base_state.layer_overhead_s],
        )
        self.plans: dict[int, Plan] = {int(plan.plan_id or 0): plan}
        self.next_plan_id = int(plan.plan_id or 0) + 1
        self._policy_plan: Plan = plan  # the controller's form (idle groups kept)
        self.observed_steps = 0
        self.decisions = 0
        self.searches_applied: list[int] = []  # steps at which a thread's search joined
        # the last decision's search events, for the log: the step whose decision started a
        # search, and (asked, joined) when a finished search joined the pool at this decision
        self.search_started: int | None = None
        self.search_joined: tuple[int, int] | None = None
        # replays: {asked step: joined step} of the recorded run (searches then run at once
        # and join at the recorded step instead of when a thread finishes)
        self.replay_joins: dict[int, int] | None = None
        self._first_speeds: dict[str, float] | None = None
        self.last_check: dict[str, Any] = {}
        self._step_residuals_s: list[float] = []

    # ---- measurements ----
    def observe(
        self,
        step: int,
        plan_id: int,
        compute_time_s: Mapping[str, float],
        iteration_time_s: float | None = None,
    ) -> None:
        """Step ``step`` ran under plan ``plan_id``; ``compute_time_s[device]`` = the measured
        compute seconds of its stage (emulated slow-down included); ``iteration_time_s`` the
        step's measured time (fed to the controller's ``record``: ``T_ref``, queues; and,
        for the plan in force, the fixed step time ``F`` of :meth:`step_overhead_s`)."""
        if (
            iteration_time_s is not None
            and math.isfinite(iteration_time_s)
            and int(plan_id) == int(self.current.plan_id or 0)
            and self.observed_steps > 0
        ):
            self._observe_step_residual(float(iteration_time_s))
        if iteration_time_s is not None and math.isfinite(iteration_time_s):
            self.policy.record(step, float(iteration_time_s), {})
        plan = self.plans.get(int(plan_id), self.current)
        flops = self.profile.train_flops
        for group in plan.groups:
            if group.batch <= 0:
                continue
            for d, (start, end) in zip(group.devices, group.stages, strict=True):
                t = compute_time_s.get(d)
                if t is None:
                    continue
                work = float(flops[start:end].sum()) * group.batch
                units = self.profile.layer_units(start, end)
                # a device with measured layer times: r = time / those times (not the FLOP model's)
                mu = group.microbatch_size
                expected = startup_stage_time_s(self.base_state, self.profile, d, start, end,
                                                group.batch, mu)  # fmt: skip
                self.estimates.observe(
                    d, work, t, group.num_microbatches, units, expected_s=expected
                )
        self.observed_steps += 1
        if self._first_speeds is None and self.observed_steps >= self.estimates.window:
            self._first_speeds = self.estimates.speeds_flops()

    def _observe_step_residual(self, iteration_time_s: float) -> None:
        """Residual of one step of the plan in force against its prediction with ``F = 0``
        on the estimates before the step's compute is fed; ``F`` = the median of the last
        ``estimates.window`` residuals, floored at 0 (a median like the speeds: one stalled
        step does not move it; docs/profiling.md §6). Used by :meth:`predictions` (the logged
        predicted time, the report's predicted-vs-measured plot); decisions compare plans on
        :attr:`config`, where a time common to every plan changes no ranking."""
        bare = dataclasses.replace(self.config, step_overhead_s=0.0)
        state = self.observed_state()
        predicted = predict_iteration_time_s(self.current, state, self.profile, bare)
        recent = self._step_residuals_s
        recent.append(iteration_time_s - predicted)
        del recent[: -self.estimates.window]

    def step_overhead_s(self) -> float:
        """The learned fixed time per iteration ``F`` (s, ``TrainingConfig.step_overhead_s``):
        median of the recent residuals of the plan in force, ``>= 0``; 0 before any."""
        recent = self._step_residuals_s
        return max(0.0, float(np.median(recent))) if recent else 0.0

    def observed_state(self) -> ClusterState:
        """The base state with the measured speeds."""
        return self.estimates.apply(self.base_state)

    def predictions(self) -> dict[str, float]:
        """Predicted ``T`` (s) of the plan in force and of even data parallelism (dp-even,
        docs/model.md §6) on the current estimates, both with the learned fixed step time
        ``F`` (:meth:`step_overhead_s`, also returned)."""
        state = self.observed_state()
        even = even_dp_plan(
            self.base_state.ids,
            self.profile.num_layers,
            self.config.batch,
            1,
            norm_block=self.config.norm_block,
        )
        config = dataclasses.replace(self.config, step_overhead_s=self.step_overhead_s())
        return {
            "predicted_time_s": predict_iteration_time_s(self.current, state, self.profile, config),
            "dp_even_time_s": predict_iteration_time_s(even, state, self.profile, config),
            "step_overhead_s": config.step_overhead_s,
        }

    # ---- decisions ----
    def decide(self, step: int) -> Decision | None:
        """The controller's decision for ``step`` (measurements up to ``step - 1`` seen): a
        :class:`Decision` when it changes the plan, else None. With ``async_search`` a
        finished search's plan is handed to the controller first, and a search the decision
        wants is started in the controller's search thread."""
        if self.observed_steps < self.warmup_steps or step >= self.steps:
            return None
        state = self.observed_state()
        self.search_started = None
        self.search_joined = None
        if self.async_search:
            self._collect_search(step)
        policy = self.policy
        policy.horizon_slots = float(max(min(self.steps - step, self.horizon_steps), 1))
        in_force = self._policy_plan
        d = controller_decide(policy, step, state, in_force, search=not self.async_search)
        if self.async_search and policy.search_wanted is not None and self._pending is None:
            # (warm-started from the plan in force at this decision: the same search whatever
            # the thread's timing, so a replay reproduces it)
            observed, weights = policy.search_wanted
            if self.replay_joins is None:
                future = _search_executor().submit(policy.search_plan, observed, weights, in_force)
            else:
                from concurrent.futures import Future

                future = Future()
                try:
                    future.set_result(policy.search_plan(observed, weights, in_force))
                except Exception as exc:  # raised where the thread's would be
                    future.set_exception(exc)
            self._pending = (step, observed, weights, future)
            self.search_started = int(step)
        self._policy_plan = d.plan
        self.last_check = {
            "reason": d.reason,
            "current_time_s": d.predicted_time_s_before,
            "predicted_time_s": d.predicted_time_s_after,
            "migration_time_s": d.migration_time_s,
            "note": d.note,
        }
        if not d.changed:
            return None
        plan = runtime_plan(d.plan)
        decision = Decision(
            plan=plan,
            reason=self._why(d, state),
            decided_after_step=step - 1,
            current_time_s=float(d.predicted_time_s_before or math.nan),
            predicted_time_s=float(d.predicted_time_s_after),
            migration_time_s=float(d.migration_time_s),
            horizon_steps=float(d.persistence_slots),
            structure_changed=bool(d.structure_changed),
            speeds_flops=dict(zip(state.ids, (float(s) for s in state.speed_flops), strict=True)),
            shares_before=device_shares(self.current, self.base_state.ids),
            shares_after=device_shares(plan, self.base_state.ids),
        )
        self.plans[int(plan.plan_id)] = plan
        self.next_plan_id = int(plan.plan_id) + 1
        self.current = plan
        self.decisions += 1
        return decision

    def _collect_search(self, step: int) -> None:
        """Hand a finished search's plan to the controller (its failure is raised here)."""
        if self._pending is None:
            return
        searched_at, observed, weights, future = self._pending
        if self.replay_joins is not None:
            if step < self.replay_joins.get(int(searched_at), math.inf):
                return
        elif not future.done():
            return
        self._pending = None
        self.policy.add_searched(searched_at, future.result(), observed, weights)
        self.searches_applied.append(int(step))
        self.search_joined = (int(searched_at), int(step))

    def wait_for_search(self) -> None:
        """Block until the search in flight (if any) has finished (tests, replays)."""
        if self._pending is not None:
            self._pending[3].result()

    def _why(self, d: Any, state: ClusterState) -> str:
        kind = "re-plan (new groups/stages)" if d.structure_changed else "rebalance (shares only)"
        kind += f" [controller: {d.reason}]"
        ref = self._first_speeds or {}
        moved = []
        for dev, s in zip(state.ids, state.speed_flops, strict=True):
            s0 = ref.get(dev)
            if s0 and s > 0 and (s0 / s > 1.5 or s / s0 > 1.5):
                moved.append(
                    f"{dev} {s0 / s:.1f}x slower" if s < s0 else f"{dev} {s / s0:.1f}x faster"
                )
        return kind + (f": {', '.join(moved)} than at start" if moved else "")

    # ---- checkpoints ----
    STATE_FORMAT = "hetrain.controller"
    STATE_VERSION = 1

    def state_dict(self) -> dict[str, Any]:
        """What the controller learned, as plain JSON data (``json.dumps`` works on it): the
        speed estimates (start-up speeds, ``κ``, ``λ``, both windows and the recent slow-down
        ratios per device), the plans by id and the next id, the step counters, the learned
        step overhead residuals, the steps at which searches joined and the policy's own
        ``state_dict`` (queues, candidate pool).
        Versioned (``format``, ``version``); restored by :meth:`load_state_dict`. The start-up
        cluster state, profile and configuration are not in it: a resumed round builds its
        controller from its own."""
        est = self.estimates
        policy = self.policy.state_dict() if hasattr(self.policy, "state_dict") else None
        return {
            "format": self.STATE_FORMAT,
            "version": self.STATE_VERSION,
            "devices": list(self.base_state.ids),
            "estimates": {
                "window": est.window,
                "long_window": est.long_window,
                "speed_flops": dict(est.speed_flops),
                "kappa_s": {d: float(v) for d, v in est.kappa_s.items()},
                "layer_overhead_s": {d: float(v) for d, v in est.layer_overhead_s.items()},
                "samples": {d: list(v) for d, v in est._samples.items()},
            },
            "plans": {str(k): p.to_json_dict() for k, p in self.plans.items()},
            "current_plan_id": int(self.current.plan_id or 0),
            "next_plan_id": self.next_plan_id,
            "observed_steps": self.observed_steps,
            "decisions": self.decisions,
            "first_speeds": self._first_speeds,
            "step_residuals_s": list(self._step_residuals_s),
            "searches_applied": list(self.searches_applied),
            "policy": policy,
        }

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into this controller (built for the resumed
        round). The plan in force and the run's steps stay this controller's (the round's plan
        joins the known plans); the next plan id is the larger of both.

        Raises:
            ValueError: one line: not a controller state, another version, other devices than
                this controller's, or a malformed field (nothing is changed then).
        """
        from hetrain.plan import plan_from_dict

        if not isinstance(data, Mapping) or data.get("format") != self.STATE_FORMAT:
            raise ValueError("controller state: not a hetrain controller state")
        if data.get("version") != self.STATE_VERSION:
            raise ValueError(
                f"controller state: expected version {self.STATE_VERSION}, got "
                f"{data.get('version')!r}"
            )
        if list(data.get("devices") or []) != list(self.base_state.ids):
            raise ValueError(
                f"controller state: devices {data.get('devices')!r} differ from this round's "
                f"{list(self.base_state.ids)}"
            )
        try:
            ids = list(self.base_state.ids)
            est = data["estimates"]

            def per_device(raw: Any) -> dict[str, float]:
                out = {d: float(raw[d]) for d in ids}
                if not all(math.isfinite(v) and v >= 0 for v in out.values()):
                    raise ValueError("expected finite numbers >= 0")
                return out

            speed, kappa, lam = (
                per_device(est[k]) for k in ("speed_flops", "kappa_s", "layer_overhead_s")
            )
            window, long_window = int(est["window"]), int(est["long_window"])
            if not 1 <= window <= long_window:
                raise ValueError(f"windows {window}, {long_window}")
            samples = {d: [float(v) for v in est["samples"][d]][-long_window:] for d in ids}
            plans = {
                int(k): plan_from_dict(v, f"controller state: plans.{k}")
                for k, v in dict(data["plans"]).items()
            }
            counters = [int(data[k]) for k in ("next_plan_id", "observed_steps", "decisions")]
            first = data["first_speeds"]
            first_speeds = None if first is None else {str(d): float(v) for d, v in first.items()}
            residuals = [float(v) for v in data["step_residuals_s"]]
            searches = [int(v) for v in data["searches_applied"]]
            policy = data["policy"]
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError) as exc:
            why = " ".join(str(exc).split())[:200]
            raise ValueError(f"controller state: malformed ({type(exc).__name__}: {why})") from None
        if policy is not None and hasattr(self.policy, "load_state_dict"):
            self.policy.load_state_dict(policy)
        self.estimates.window, self.estimates.long_window = window, long_window
        self.estimates.speed_flops, self.estimates.kappa_s = speed, kappa
        self.estimates.layer_overhead_s = lam
        self.estimates._samples = samples
        plans[int(self.current.plan_id or 0)] = self.current
        self.plans = plans
        self.next_plan_id = max(counters[0], self.next_plan_id)
        self.observed_steps, self.decisions = counters[1:]
        self._first_speeds = first_speeds
        self._step_residuals_s = residuals
        self.searches_applied = searches
        # the plan in force is the round's (the ranks kept theirs): the policy answers from it
        self._policy_plan = self.current


# --------------------------------------------------------------------------------------------
# the service (controller process) and the link (rank 0)
# --------------------------------------------------------------------------------------------

PREFIX = "hetrain/ctl/"
DECIDE_BACKLOG_STEPS = 3
"""When the controller is behind the ranks, it decides only for the newest this-many steps."""


_FORK_LOCK = threading.Lock()
"""Held around every call into a controller store; a fork (the elastic agent forking the ranks
in the launching process, where the controller thread runs) waits for it. A store call holds
native mutexes of torch (c10's wait counters): a child forked while another thread is inside
one inherits the mutex locked and hangs at its first collective (seen: a rank of
bench/runtime_vs_ddp.py stuck in ``init_process_group``, ``WaitCounterHandle``)."""


def _after_fork_in_child() -> None:
    if _FORK_LOCK.locked():
        _FORK_LOCK.release()


os.register_at_fork(
    before=_FORK_LOCK.acquire,
    after_in_parent=_FORK_LOCK.release,
    after_in_child=_after_fork_in_child,
)


class _ForkSafeStore:
    """A ``TCPStore`` whose calls hold :data:`_FORK_LOCK`."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with _FORK_LOCK:
                return attr(*args, **kwargs)

        return call


def _store(host: str, port: int, *, master: bool, timeout_s: float = 300.0):
    """A ``TCPStore`` client, or (``master``) the server listening on ``host`` only: torch's
    own server listens on every interface whatever ``host`` says, so the listening socket is
    bound here (``127.0.0.1`` for a local run) and handed over (``master_listen_fd``)."""
    import datetime
    import socket

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if not master:  # connecting may wait for the server: a fork must not wait for it
        return _ForkSafeStore(dist.TCPStore(host, port, is_master=False, timeout=timeout))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    port = int(sock.getsockname()[1])
    with _FORK_LOCK:
        return _ForkSafeStore(
            dist.TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timeout,
                master_listen_fd=sock.detach(),  # the store's server owns the descriptor now
            )
        )


def replay_init_path(log_path: str | Path) -> Path:
    """Where the start of a round's controller log is kept for replays: the model profile,
    the start-up state, the configuration, the first plan and the run's steps, as the round's
    JSON start message (:func:`~hetrain.runtime.ctlwire.encode_init`; ``controller_init.json``
    beside ``controller.jsonl``)."""
    return Path(log_path).with_name("controller_init.json")


def controller_state_path(checkpoint_dir: str | Path, step: int) -> Path:
    """Where the controller stages its state (:meth:`PlanController.state_dict`, JSON) for the
    checkpoint of ``step``: rank 0 copies it into that checkpoint (``controller.json``, listed
    with its checksum in the manifest, pruned with it; :mod:`hetrain.runtime.checkpoint`)."""
    return Path(checkpoint_dir) / ".controller" / f"state-{int(step):08d}.json"


class ControllerService:
    """The controller loop over a store (see the module docstring for the keys)."""

    ROUND_CHECK_S = 0.1
    """Seconds between two checks for a new round while records keep arriving."""

    def __init__(self, store: Any, poll_s: float = 0.005) -> None:
        self.store = store
        self.poll_s = poll_s
        self._round_checked = -math.inf
        self._world = 1
        self.rejected_init_id: bytes | None = None  # the last malformed init's id
        self.stop = threading.Event()
        self.controller: PlanController | None = None
        self._init_id: bytes | None = None
        self._last = -1
        self._init: dict[str, Any] = {}
        self._log: Any = None

    def _has(self, key: str) -> bool:
        return bool(self.store.check([PREFIX + key]))

    def _get(self, key: str) -> bytes:
        return self.store.get(PREFIX + key)

    def run(self) -> None:
        """Serve until :attr:`stop` is set; a failure is posted as ``error`` and re-raised."""
        try:
            while not self.stop.is_set():
                if not self._tick():
                    time.sleep(self.poll_s)
        except Exception:
            self.store.set(PREFIX + "error", traceback.format_exc())
            raise
        finally:
            if self._log is not None:
                self._log.close()

    def _start_round(self) -> None:
        init_id = self._get("init_id")
        try:
            init = decode_init(self._get("init"))
            if init["round"].encode() != init_id:
                raise WireError("controller init: its round is not init_id")
        except WireError as exc:
            # one line, nothing changed (the round in progress goes on): the round's rank 0
            # writes a valid one
            print(f"hetrain: controller: ignored {exc}", file=sys.stderr, flush=True)
            self.rejected_init_id = init_id
            return
        self._init_id = init_id
        self._world = int(init["world_size"])
        self._init = init
        ctl = PlanController(
            init["base_state"],
            init["profile"],
            init["config"],
            init["plan"],
            init["steps"],
            optimizer_state_factor=init["optimizer_state_factor"],
            async_search=True,
        )
        start = int(init["start_step"])
        if init.get("checkpoint_dir"):
            # states staged by an earlier round are stale: this round starts from the state in
            # the checkpoint it resumes from
            for staged in controller_state_path(init["checkpoint_dir"], 0).parent.glob("*.json"):
                with contextlib.suppress(OSError):
                    staged.unlink()
        if init.get("checkpoint_dir") and start > 0:
            # the state in the checkpoint the ranks resume from (checksum verified, plain
            # JSON): used when it is this round's devices, else the round starts fresh
            from hetrain.runtime.checkpoint import read_controller_state

            try:
                saved = read_controller_state(init["checkpoint_dir"], start)
                if saved is not None and list(saved.get("devices") or []) == list(
                    ctl.base_state.ids
                ):
                    ctl.load_state_dict(saved)
            except ValueError as exc:  # CheckpointError too: one line, the round goes on
                print(f"hetrain: warning: controller state not restored: {exc}", file=sys.stderr)
        self.controller = ctl
        self._last = start - 1
        if self._log is not None:
            self._log.close()
        self._log = None
        if init.get("log_path"):
            Path(init["log_path"]).parent.mkdir(parents=True, exist_ok=True)
            mode = "a" if start > 0 else "w"  # a resumed run appends
            self._log = open(init["log_path"], mode, encoding="utf-8")  # noqa: SIM115
            if start == 0:  # what a replay rebuilds the controller from (hetrain.sim.replay)
                blob = encode_init(init)  # JSON (the replay validates it as a round's start)
                init_path = replay_init_path(init["log_path"])
                init_path.with_suffix(".tmp").write_bytes(blob)
                os.replace(init_path.with_suffix(".tmp"), init_path)

    def _tick(self) -> bool:
        """One pass; False when there was nothing to do. Costs one store request while no
        step is complete (and one more every :attr:`ROUND_CHECK_S`)."""
        now = time.monotonic()
        if now - self._round_checked >= self.ROUND_CHECK_S:
            self._round_checked = now
            if self._has("init_id") and self._get("init_id") not in (
                self._init_id,
                self.rejected_init_id,
            ):
                self._start_round()
        ctl = self.controller
        if ctl is None or self._init.get("round", "").encode() != self._init_id:
            return False
        records: dict[int, dict[str, Any]] = {}
        k = self._last + 1
        while True:  # every step whose records every rank has written
            rec = self._step_record(k)
            if rec is None:
                break
            records[k] = rec
            k += 1
        if not records:
            return False
        newest = k - 1
        every = int(self._init.get("checkpoint_every") or 0)
        decision = None
        for k in range(self._last + 1, newest + 1):
            rec = records[k]
            ctl.observe(k, rec["plan_id"], rec["compute_time_s"], rec.get("iteration_time_s"))
            row = {"step": k, "plan_id": rec["plan_id"], **ctl.predictions()}
            if every > 0 and (k + 1) % every == 0 and self._init.get("checkpoint_dir"):
                path = controller_state_path(self._init["checkpoint_dir"], k + 1)
                tmp = path.with_suffix(".tmp")
                try:  # staged for rank 0's checkpoint of step k + 1 (plain JSON, no pickle)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with open(tmp, "w", encoding="utf-8") as fh:
                        json.dump(ctl.state_dict(), fh)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(tmp, path)
                except OSError:  # a full disk: that checkpoint goes without controller state
                    with contextlib.suppress(OSError):
                        tmp.unlink()
            decided = newest - k < DECIDE_BACKLOG_STEPS
            made = None
            if decided:
                # one decision per measured step (decisions are a function of the log, the
                # same on replay), except when behind: then only for the newest steps
                started = time.perf_counter()
                made = ctl.decide(k + 1)
                decide_time_s = time.perf_counter() - started
                decision = made or decision
            if self._log is not None:
                # what a replay feeds (hetrain.sim.replay): the raw measurements, whether this
                # step was decided on, the search events and the decision made
                row["compute_time_s"] = dict(rec["compute_time_s"])
                row["decided"] = decided
                if decided:  # the controller's answer time for this step (wall seconds)
                    row["decide_time_s"] = decide_time_s
                if decided and ctl.search_started is not None:
                    row["search_started"] = ctl.search_started
                if decided and ctl.search_joined is not None:
                    row["search_joined"] = list(ctl.search_joined)
                if made is not None:
                    row["decision"] = {
                        "plan_id": int(made.plan.plan_id),
                        "shares_after": made.shares_after,
                        "structure_changed": made.structure_changed,
                    }
                row["measured_time_s"] = rec.get("iteration_time_s")
                row["speed_flops"] = ctl.estimates.speeds_flops()
                row["check"] = ctl.last_check
                row["logged_at_s"] = time.time()
                self._log.write(json.dumps(row) + "\n")
        self._last = newest
        if self._log is not None:
            self._log.flush()
        if decision is not None:
            # tagged with its round: a decision of a round that ended while it was computed
            # (its rank 0 died) must not reach the next round's rank 0
            self.store.set(PREFIX + "plan", encode_decision(self._init_id.decode(), decision))
        return True

    def _step_record(self, step: int) -> dict[str, Any] | None:
        """Step ``step``'s record (:func:`~hetrain.runtime.ctlwire.merge_records`) once every
        rank of this round wrote its own (keys deleted), else None. A malformed record is
        reported in one line and deleted; a record of another round is left for this
        round's rank to overwrite."""
        keys = [PREFIX + f"m/{step}/{r}" for r in range(self._world)]
        if not self.store.check(keys):
            return None
        records = []
        for rank, key in enumerate(keys):
            try:
                rec = decode_record(self.store.get(key))
                if rec["rank"] != rank:
                    raise WireError(f"measurement record: rank {rec['rank']} under rank {rank}")
            except WireError as exc:
                print(f"hetrain: controller: ignored {exc}", file=sys.stderr, flush=True)
                self.store.delete_key(key)
                return None
            if rec["round"].encode() != self._init_id:
                return None
            records.append(rec)
        for key in keys:
            self.store.delete_key(key)
        return merge_records(records)


_SEARCH_EXECUTOR: Any = None


def _search_executor():
    """One thread of the controller's process for policy calls (created on first use)."""
    global _SEARCH_EXECUTOR
    if _SEARCH_EXECUTOR is None:
        from concurrent.futures import ThreadPoolExecutor

        _SEARCH_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetrain-policy")
    return _SEARCH_EXECUTOR


class ControllerThread:
    """A :class:`ControllerService` in a daemon thread of this process, beside a store it
    hosts on ``127.0.0.1`` (a free port); :attr:`endpoint` is ``"host:port"``."""

    def __init__(self) -> None:
        self.store = _store("127.0.0.1", 0, master=True)
        self.endpoint = f"127.0.0.1:{self.store.port}"
        self.service = ControllerService(self.store)
        self.thread = threading.Thread(target=self._run, name="hetrain-controller", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.service.run()
        except BaseException as exc:  # posted to the store for rank 0; kept for the launcher
            self.error = exc

    def start(self) -> ControllerThread:
        self.thread.start()
        return self

    def close(self) -> None:
        self.service.stop.set()
        self.thread.join(timeout=10.0)


class ControllerLink:
    """Rank 0's side of the protocol; never blocks rank 0's step: one background thread makes
    the store connection (a controller process started under ``torchrun`` may take seconds to
    come up on a busy machine), sends the round's start and the measurements in order, and
    keeps the newest decision (and any controller failure) in memory; :meth:`post` and
    :meth:`poll` only touch that memory (no socket round trip on the step's path, which every
    other rank would wait for at the step's collective)."""

    REFRESH_S = 0.2
    """Seconds between two reads of the controller's newest decision when nothing is posted
    (it is also read after every post, once per step; reading every 20 ms instead delayed the
    main job's first re-plan by 10 steps on a loaded 2-core machine: 150 store requests a
    second from rank 0's process and the controller's host)."""

    def __init__(
        self, endpoint: str, timeout_s: float = 120.0, *, rank: int = 0, round_id: str = ""
    ) -> None:
        self.endpoint = endpoint
        self.rank = int(rank)
        self.round_id = round_id or uuid.uuid4().hex
        self.store: Any = None
        self._queue: list[tuple[str, Any]] = []
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._failure: str | None = None
        self._decision: Decision | None = None
        self._decision_raw: bytes | None = None
        self._round_id: bytes | None = None  # the init_id of this link's round
        self._stop = False
        self._thread = threading.Thread(
            target=self._run, args=(timeout_s,), name="hetrain-controller-link", daemon=True
        )
        self._thread.start()

    def _run(self, timeout_s: float) -> None:
        host, port = self.endpoint.rsplit(":", 1)
        try:
            store = _store(host.strip("[]"), int(port), master=False, timeout_s=timeout_s)
        except BaseException as exc:  # reported by the next poll
            self._error = exc
            return
        self.store = store
        try:
            while True:
                with self._cond:
                    if not self._queue and not self._stop:
                        self._cond.wait(timeout=self.REFRESH_S)
                    items, self._queue = self._queue, []
                    stop = self._stop
                for kind, payload in items:
                    self._send(store, kind, payload)
                if stop:
                    return
                if self.rank == 0:
                    self._refresh(store)
        except BaseException as exc:  # reported by the next poll
            self._error = exc

    def _refresh(self, store: Any) -> None:
        if store.check([PREFIX + "error"]):
            text = store.get(PREFIX + "error").decode(errors="replace").strip()
            self._failure = text.splitlines()[-1] if text else "unknown error"
            return
        if not store.check([PREFIX + "plan"]):
            return
        raw = store.get(PREFIX + "plan")
        if raw != self._decision_raw:
            self._decision_raw = raw
            try:
                round_id, decision = decode_decision(raw, Decision)
            except WireError as exc:
                print(f"hetrain: ignored a {exc}", file=sys.stderr, flush=True)
                return
            if round_id.encode() == self._round_id:  # another round's decision is not this one's
                self._decision = decision

    def _send(self, store: Any, kind: str, payload: Any) -> None:
        if kind == "init":
            for key in ("plan", "done", "error"):
                if store.check([PREFIX + key]):
                    store.delete_key(PREFIX + key)
            store.set(PREFIX + "init", encode_init({**payload, "round": self.round_id}))
            self._round_id = self.round_id.encode()
            store.set(PREFIX + "init_id", self._round_id)
        elif kind == "m":
            step, record = payload
            body = {**record, "round": self.round_id, "rank": self.rank}
            store.set(PREFIX + f"m/{step}/{self.rank}", encode_record(body))
        elif kind == "done":
            store.set(PREFIX + "done", "1")

    def _submit(self, kind: str, payload: Any) -> None:
        with self._cond:
            if kind == "init":  # a new round: the previous round's decision is not this one's
                self._decision = None
                self._decision_raw = None
            self._queue.append((kind, payload))
            self._cond.notify()

    def start_round(self, init: dict[str, Any]) -> None:
        """Post this round's start (the previous round's keys are dropped)."""
        self._submit("init", init)

    def post(self, step: int, record: dict[str, Any]) -> None:
        """This rank's measurements of ``step`` (``device``, ``plan_id`` and the seconds of
        :func:`~hetrain.runtime.ctlwire.encode_record`); returns at once (the link's thread
        writes them)."""
        self._submit("m", (step, record))

    def poll(self, current_plan_id: int) -> Decision | None:
        """The newest decision read so far when it is newer than ``current_plan_id``, else
        None (also while the connection is not up yet). No I/O: the thread reads it.

        Raises:
            RuntimeError: the controller failed (its traceback's last line), or its store could
                not be reached.
        """
        if self._error is not None:
            raise RuntimeError(f"the controller is unreachable at {self.endpoint}: {self._error}")
        if self._failure is not None:
            raise RuntimeError(f"the controller failed: {self._failure}")
        with self._cond:
            pending = any(kind == "init" for kind, _ in self._queue)
            decision = None if pending else self._decision
        if decision is None or int(decision.plan.plan_id) <= int(current_plan_id):
            return None
        return decision

    def close(self, wait_s: float = 5.0) -> None:
        """Tell the controller the round is over (sends what is queued first; waits up to
        ``wait_s`` for the connection and the sends)."""
        with self._cond:
            if self.rank == 0:  # the round is over when rank 0 says so
                self._queue.append(("done", None))
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=wait_s)


def spawn_controller_process(timeout_s: float = 60.0, host: str = "127.0.0.1"):
    """Start the controller as a separate process (``python -m hetrain.runtime.adapt``) hosting
    its store on a free port of ``host`` (loopback unless ranks on other nodes must reach it);
    returns ``(process, endpoint)``. Used under ``torchrun``, where no launcher process of
    ours exists."""
    import socket
    import subprocess

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    # one BLAS/OpenMP thread: the controller's numpy shares the host's cores with the ranks
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetrain.runtime.adapt", "--port", str(port), "--host", host],
        stdin=subprocess.DEVNULL,
        env=env,
    )
    return proc, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetrain.runtime.adapt --port P``: serve until rank 0 posts ``done``."""
    parser = argparse.ArgumentParser(prog="hetrain.runtime.adapt")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    store = _store(args.host, args.port, master=True)
    service = ControllerService(store)

    parent = os.getppid()

    def watch() -> None:
        # rank 0 posts done at the end; if it dies instead (its round failed), so does this
        while not service.stop.is_set():
            if store.check([PREFIX + "done"]) or os.getppid() != parent:
                service.stop.set()
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()
    service.run()
    return 0


# --------------------------------------------------------------------------------------------
# plans
# --------------------------------------------------------------------------------------------


def even_dp_plan(
    devices: Sequence[str],
    num_layers: int,
    batch: int,
    microbatch_size: int,
    norm_block: int | None = None,
):
    """One device per group, shares as equal as possible (the first ``B mod D`` groups get one
    more sample), each share one micro-batch (``microbatch_size`` is kept for API symmetry: on
    a single device splitting the share only adds overhead).

    With ``norm_block = G`` (docs/model.md §5) the ``B / G`` blocks are split as equally as possible
    instead (the first ``(B/G) mod D`` groups get one more block), so every share and ``μ_g``
    is a multiple of ``G``; with fewer blocks than devices the last groups are idle (share 0).

    Raises:
        ValueError: ``batch`` is not a multiple of ``norm_block``.
    """
    del microbatch_size
    d = len(devices)
    g_size = int(norm_block or 1)
    if batch % g_size:
        raise ValueError(f"batch: expected a multiple of the norm block {g_size}, got {batch}")
    blocks = batch // g_size
    shares = [g_size * (blocks // d + (1 if i < blocks % d else 0)) for i in range(d)]
    return Plan(
        plan_id=0,
        groups=tuple(
            GroupPlan(
                devices=(dev,), stages=((0, num_layers),), microbatch_size=max(b, g_size), batch=b
            )
            for dev, b in zip(devices, shares, strict=True)
        ),
    )


def runtime_plan(plan: Plan) -> Plan:
    """The plan as the runtime runs it: idle groups (``b_g = 0``) left out, so their devices
    hold nothing and are sent nothing per step (the engine releases their layers; a later plan
    that makes them active moves weights and optimizer state to them, the migration docs/model.md §4
    charges); single-device groups run their share as one micro-batch (``μ_g = b_g``: with one
    stage, splitting only adds ``κ`` per micro-batch, docs/model.md §3)."""
    groups = tuple(
        g.model_copy(update={"microbatch_size": g.batch}) if g.num_stages == 1 else g
        for g in plan.groups
        if g.batch > 0
    )
    return plan.model_copy(update={"groups": groups})


def _same_plan(a: Plan, b: Plan) -> bool:
    return [(g.devices, g.stages, g.microbatch_size, g.batch) for g in a.groups] == [
        (g.devices, g.stages, g.microbatch_size, g.batch) for g in b.groups
    ]


if __name__ == "__main__":
    # run the importable module's copy (one PlanController/Decision class, not __main__'s)
    from hetrain.runtime.adapt import main as _main

    sys.exit(_main())
