"""The controller's decisions (docs/model.md §4-§5), :class:`PlanController`: measured step
times -> speed estimates -> :class:`~hetrain.control.lyapunov.LyapunovController` -> plan changes
that hold.

The measured compute times go to the one speed estimator
(:class:`hetrain.control.estimates.SpeedEstimates`) and every step asks the one decision path,
:class:`hetrain.control.lyapunov.LyapunovController` (what ``hetrain simulate`` runs), with the
runtime's options (:func:`~hetrain.runtime.ctldecision.policy_options`); its one gate decides (a
change is applied only when, on the *same* estimates, it is predicted faster than the plan in
force by ``rebalance_margin`` for shares only or ``switch_margin`` for a new structure, and its
gain over the payback horizon ``min(steps left, horizon_steps)`` pays its migration time). With
``async_search`` (the service, :class:`hetrain.runtime.adapt.ControllerService`) planner searches
run in a thread and every step gets the cheap keep-or-rebalance decision on time. The
controller's state (estimates, policy with its queues, plan ids) is a versioned JSON
:meth:`PlanController.state_dict`, staged by the service
(:func:`hetrain.runtime.adapt.controller_state_path`) and copied by rank 0 into the checkpoint of
that step (``controller.json``, checksummed in its manifest); it is restored on resume from the
checkpoint the ranks resume from; the ranks keep their plan meanwhile.

Imports numpy and the planning modules only; no torch.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from hetrain.cluster import ClusterState, state_digest
from hetrain.control import make_policy
from hetrain.control.estimates import SpeedEstimates, startup_stage_time_s
from hetrain.costmodel import TrainingConfig, lower_bound_s, profile_prefix, stage_compute_s
from hetrain.plan import Plan
from hetrain.profile import ProfileArrays
from hetrain.runtime.ctldecision import (
    Decision,
    controller_decide,
    device_shares,
    even_dp_plan,
    policy_options,
    predict_iteration_time_s,
    runtime_plan,
)
from hetrain.runtime.ctlwire import profile_to_json, state_to_json

_SEARCH_EXECUTOR: Any = None

CALIBRATED_CONFIG = ("group_time_jitter", "update_time_s_per_param_byte")
"""The :class:`~hetrain.costmodel.TrainingConfig` fields a round's start-up calibration measures
(:func:`hetrain.runtime.worker_main.startup_measurements`): saved with the controller's state
and restored with its estimates (:meth:`PlanController.load_state_dict`)."""


def _search_executor():
    """One thread of the controller's process for policy calls (created on first use), below
    the ranks' CPU priority (:data:`hetrain.runtime.adapt.CONTROLLER_NICE`)."""
    global _SEARCH_EXECUTOR
    if _SEARCH_EXECUTOR is None:
        from concurrent.futures import ThreadPoolExecutor

        from hetrain.runtime.adapt import lower_thread_priority

        _SEARCH_EXECUTOR = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hetrain-policy", initializer=lower_thread_priority
        )
    return _SEARCH_EXECUTOR


def shutdown_search_executor() -> None:
    """End the policy thread of :func:`_search_executor` (a search in progress finishes,
    queued ones are dropped; the next use starts a new thread). Called when the controller
    service stops, so that the process's exit does not wait for an idle thread."""
    global _SEARCH_EXECUTOR
    if _SEARCH_EXECUTOR is not None:
        _SEARCH_EXECUTOR.shutdown(wait=False, cancel_futures=True)
        _SEARCH_EXECUTOR = None


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
        self._policy_options = {**policy_options(), **options}
        self.policy = make_policy("lyapunov", profile, config, **self._policy_options)
        self.estimates = SpeedEstimates(
            base_state.ids,
            [float(v) for v in base_state.speed_flops],
            [float(k) for k in base_state.kappa_s],
            layer_overhead_s=[float(lam) for lam in base_state.layer_overhead_s],
            kinds=[str(k).lower() for k in base_state.kinds],
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
        # the speed estimates (FLOP/s per device) on which the plan in force was chosen: the
        # start-up calibration's for the round's first plan (the start-up decision's state)
        self._chosen_speeds: dict[str, float] = dict(
            zip(base_state.ids, (float(s) for s in base_state.speed_flops), strict=True)
        )
        self.last_check: dict[str, Any] = {}
        self._step_residuals_s: list[float] = []
        self._observed: ClusterState | None = None  # observed_state()'s, until estimates move
        self._last_observed: ClusterState | None = None  # the last one made (reused if equal)
        # its state_digest (None: not taken, reuse was off); states are not changed once made
        self._last_digest: bytes | None = None
        # observed_state() returns the last state object while the estimates did not move, so
        # that the policy's figures on it (LyapunovController.evaluation) are not recomputed;
        # False: a new object every time (the same values: tests compare both)
        self.reuse_unchanged_state = True
        self._bare_cache: tuple[Plan, ClusterState, float] | None = None  # _bare_time_s's last
        self._even_plan: Plan | None = None
        # startup_stage_time_s per (device, start, end, batch, μ): base state and profile fixed
        self._startup_times_s: dict[tuple, float | None] = {}
        # load_state_dict's comparison of this round's start-up benchmark with the restored
        # estimates (one line), None when it named no device or nothing was restored
        self.startup_check: str | None = None

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
                key = (d, start, end, group.batch, mu)
                expected = self._startup_times_s.get(key)
                if key not in self._startup_times_s:  # the same for every step of a plan
                    expected = startup_stage_time_s(self.base_state, self.profile, d, start, end,
                                                    group.batch, mu)  # fmt: skip
                    self._startup_times_s[key] = expected
                self.estimates.observe(
                    d, work, t, group.num_microbatches, units, expected_s=expected
                )
        self.estimates.close_step()
        self._observed = None
        self.observed_steps += 1

    def _observe_step_residual(self, iteration_time_s: float) -> None:
        """Residual of one step of the plan in force against its prediction with ``F = 0``
        on the estimates before the step's compute is fed; ``F`` = the median of the last
        ``estimates.window`` residuals, floored at 0 (a median like the speeds: one stalled
        step does not move it; docs/profiling.md §6). Used by :meth:`predictions` (the logged
        predicted time, the report's predicted-vs-measured plot); decisions compare plans on
        :attr:`config`, where a time common to every plan changes no ranking."""
        predicted = self._bare_time_s(self.current, self.observed_state())
        recent = self._step_residuals_s
        recent.append(iteration_time_s - predicted)
        del recent[: -self.estimates.window]

    def step_overhead_s(self) -> float:
        """The learned fixed time per iteration ``F`` (s, ``TrainingConfig.step_overhead_s``):
        median of the recent residuals of the plan in force, ``>= 0``; 0 before any."""
        recent = self._step_residuals_s
        return max(0.0, float(np.median(recent))) if recent else 0.0

    def observed_state(self) -> ClusterState:
        """The base state with the measured speeds (computed after each :meth:`observe` and
        :meth:`load_state_dict`). When every field equals, bit for bit, that of the state
        made before (equal :func:`hetrain.cluster.state_digest`), that same object is returned
        (with :attr:`reuse_unchanged_state`): the policy then finds its figures of the plans
        on it already computed (a step whose measurements moved no estimate costs no
        cost-model evaluation)."""
        if self._observed is None:
            state = self.estimates.apply(self.base_state, self.profile)
            digest = state_digest(state) if self.reuse_unchanged_state else None
            if digest is not None and digest == self._last_digest:
                state = self._last_observed
            self._observed = self._last_observed = state
            self._last_digest = digest
        return self._observed

    def predictions(self) -> dict[str, float]:
        """Predicted ``T`` (s) of the plan in force and of even data parallelism (dp-even,
        docs/model.md §6) on the current estimates, both with the learned fixed step time
        ``F`` (:meth:`step_overhead_s`, also returned)."""
        return self.predictions_of(self.prediction_inputs())

    def prediction_inputs(self) -> tuple[Plan, ClusterState, float]:
        """What :meth:`predictions` depends on, taken now (cheap: the plan in force, the
        observed state, ``F``); :meth:`predictions_of` evaluates it later (the service posts
        a decision before it computes the log's predictions, about a third of its CPU per
        step). The state is not changed afterwards (:meth:`observe` makes a new one)."""
        return self.current, self.observed_state(), self.step_overhead_s()

    def predictions_of(self, inputs: tuple[Plan, ClusterState, float]) -> dict[str, float]:
        """:meth:`predictions` of a :meth:`prediction_inputs` snapshot, with ``lower_bound_s``:
        ``T_LB + F`` on the same estimates (:func:`hetrain.costmodel.lower_bound_s`, perfect
        balance without communication; every plan's predicted time is at least it). Each
        time is the plan's
        time with ``F = 0`` plus ``F`` (:func:`hetrain.costmodel.evaluate_plan` adds
        ``step_overhead_s`` last to a plan with an active group: the same float); the plan in
        force's is kept for the next step's residual (:meth:`_observe_step_residual`, the same
        plan and state while no decision intervenes). Evaluations come from the policy's memo
        of the state (:meth:`_bare_evaluation_s`): the plan in force's is the decision's own,
        so the log adds one cost-model evaluation per step (dp-even's), none on a reused
        state."""
        plan, state, overhead_s = inputs
        if self._even_plan is None:
            self._even_plan = even_dp_plan(
                self.base_state.ids,
                self.profile.num_layers,
                self.config.batch,
                1,
                norm_block=self.config.norm_block,
            )
        return {
            "predicted_time_s": self._bare_time_s(plan, state) + overhead_s,
            # T_LB + F: no plan's predicted time on these estimates is below it
            "lower_bound_s": lower_bound_s(state, self.profile, self.config.batch) + overhead_s,
            "dp_even_time_s": self._bare_evaluation_s(self._even_plan, state) + overhead_s,
            "step_overhead_s": float(overhead_s),
        }

    def _bare_time_s(self, plan: Plan, state: ClusterState) -> float:
        """Predicted ``T`` (s) of ``plan`` on ``state`` with ``F = 0``; the last answer is kept
        for the same two objects (neither is changed once made)."""
        cached = self._bare_cache
        if cached is not None and cached[0] is plan and cached[1] is state:
            return cached[2]
        value = self._bare_evaluation_s(plan, state)
        self._bare_cache = (plan, state, value)
        return value

    def _bare_evaluation_s(self, plan: Plan, state: ClusterState) -> float:
        """``T`` (s) of ``plan`` on ``state`` with ``F = 0``
        (:func:`~hetrain.runtime.ctldecision.predict_iteration_time_s`); the policy's
        evaluation on the same state when the policy evaluates with that configuration (the
        plan in force was evaluated by the decision on these estimates:
        :meth:`hetrain.control.lyapunov.LyapunovController.evaluation`)."""
        bare = dataclasses.replace(self.config, step_overhead_s=0.0)
        evaluation = getattr(self.policy, "evaluation", None)
        if evaluation is not None and getattr(self.policy, "config", None) == bare:
            return float(evaluation(plan, state).iteration_time_s)
        return predict_iteration_time_s(plan, state, self.profile, bare)

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
            kappa_s=dict(zip(state.ids, (float(k) for k in state.kappa_s), strict=True)),
            measured_extra_s=dict(
                zip(state.ids, (float(x) for x in state.measured_extra_s), strict=True)
            ),
            shares_before=device_shares(self.current, self.base_state.ids),
            shares_after=device_shares(plan, self.base_state.ids),
        )
        self.plans[int(plan.plan_id)] = plan
        self.next_plan_id = int(plan.plan_id) + 1
        self.current = plan
        self._chosen_speeds = dict(decision.speeds_flops)
        self.decisions += 1
        return decision

    def number_first_plan(self, first: Plan, plan_id: int) -> None:
        """The ranks start with ``first`` (this controller's decision before step 0, as the
        runtime runs it) under ``plan_id``, the id of the plan it replaced: the controller's
        records name it by that id, it is the only known plan, and the next plan is
        ``plan_id + 1`` (plan ids consecutive)."""
        self._policy_plan = self._policy_plan.model_copy(update={"plan_id": plan_id})
        self.current = first.model_copy(update={"plan_id": plan_id})
        self.plans = {plan_id: self.current}
        self.next_plan_id = plan_id + 1
        self.policy.number_current(plan_id)

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
        """The re-plan line's reason: the kind of change, the controller's reason and the
        devices whose speed estimates moved relative to the others since the plan in force
        was chosen (:func:`relative_moves`: a move common to every device, such as the
        start-up benchmark's bias, names none)."""
        kind = "re-plan (new groups/stages)" if d.structure_changed else "rebalance (shares only)"
        kind += f" [controller: {d.reason}]"
        now = dict(zip(state.ids, (float(s) for s in state.speed_flops), strict=True))
        moved = relative_moves(self._chosen_speeds, now)
        if not moved:
            return kind
        since = f"plan {int(self.current.plan_id or 0)}"
        return f"{kind}: {moved} than when {since} was chosen, relative to the other devices"

    # ---- checkpoints ----
    STATE_FORMAT = "hetrain.controller"
    STATE_VERSION = 2

    def state_dict(self) -> dict[str, Any]:
        """What the controller learned, as plain JSON data (``json.dumps`` works on it): the
        speed estimates (start-up speeds, ``κ``, ``λ``, both windows, the recent measurements
        per device as ``[time_s, start-up expected_s, micro-batches]`` and the fixed cost per
        kind, the kinds apart from the run's pool and each measurement's step index), the
        plans by id and the next id, the step counters, the learned
        step overhead residuals, the steps at which searches joined, the policy's own
        ``state_dict`` (queues, candidate pool) and ``startup``: the start-up calibration the
        estimates are relative to (the cluster state, the measured layer times per kind and the
        calibrated ``group_time_jitter`` and ``update_time_s_per_param_byte``), which a
        resumed round keeps for its unchanged devices instead of its own start-up benchmark
        (:meth:`load_state_dict`). Versioned (``format``, ``version``); restored by
        :meth:`load_state_dict`."""
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
                "samples": {d: [list(x) for x in v] for d, v in est._samples.items()},
                "distinct": sorted(est.distinct),
                "distinct_kinds": sorted(est.distinct_kinds),
                "steps": {d: list(v) for d, v in est._steps.items()},
                "fixed_s": {k: float(v) for k, v in sorted(est.fixed_s.items())},
            },
            "plans": {str(k): p.to_json_dict() for k, p in self.plans.items()},
            "current_plan_id": int(self.current.plan_id or 0),
            "next_plan_id": self.next_plan_id,
            "observed_steps": self.observed_steps,
            "decisions": self.decisions,
            "chosen_speeds": dict(self._chosen_speeds),
            "step_residuals_s": list(self._step_residuals_s),
            "searches_applied": list(self.searches_applied),
            "policy": policy,
            "startup": {
                "base_state": state_to_json(self.base_state),
                "measured": profile_to_json(self.profile)["measured"],
                "config": {k: float(getattr(self.config, k)) for k in CALIBRATED_CONFIG},
            },
        }

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into this controller (built for the resumed
        round). The plan in force and the run's steps stay this controller's (the round's plan
        joins the known plans); the next plan id is the larger of both.

        The restored estimates are ratios of measured steps over the start-up calibration of
        the round that measured them, so that calibration (the state's ``startup``) stays
        the reference of every device whose kind is this round's (an unchanged device): its
        start-up speed, ``κ``, ``λ`` and nominal speed, its kind's measured layer times and
        the calibrated configuration fields replace this round's, and this round's own
        start-up benchmark of it moves no estimate (a benchmark taken while the machine was
        loaded made every restored device look 2-10x faster, and the controller changed the
        plan every few steps). A device measured at start-up more than 1.5x away from its
        restored estimate is named in :attr:`startup_check`; only its measured steps move its
        estimate, after ``window // 2 + 1`` of them as any lasting change. A device whose kind
        changed keeps this round's calibration and starts without restored measurements. A
        state without ``startup`` keeps this round's calibration for every device.

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
            samples = {}
            for d in ids:
                rows = [tuple(float(x) for x in v) for v in est["samples"][d]][-long_window:]
                if not all(len(r) == 3 and all(math.isfinite(x) and x > 0 for x in r)
                           for r in rows):  # fmt: skip
                    raise ValueError(f"samples of {d}: expected [time_s, expected_s, n] > 0")
                samples[d] = rows
            fixed = {str(k): float(v) for k, v in dict(est.get("fixed_s") or {}).items()}
            if not all(math.isfinite(v) and v >= 0 for v in fixed.values()):
                raise ValueError("fixed_s: expected finite numbers >= 0")
            distinct = {str(d) for d in est.get("distinct", ())} & set(ids)
            distinct_kinds = {str(k) for k in est.get("distinct_kinds", ())}
            steps = {str(d): [int(t) for t in v] for d, v in dict(est.get("steps") or {}).items()}
            plans = {
                int(k): plan_from_dict(v, f"controller state: plans.{k}")
                for k, v in dict(data["plans"]).items()
            }
            counters = [int(data[k]) for k in ("next_plan_id", "observed_steps", "decisions")]
            chosen = data.get("chosen_speeds")  # absent in older states
            chosen = None if chosen is None else per_device(chosen)
            residuals = [float(v) for v in data["step_residuals_s"]]
            searches = [int(v) for v in data["searches_applied"]]
            policy = data["policy"]
            reference = self._restored_reference(data.get("startup"))
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError) as exc:
            why = " ".join(str(exc).split())[:200]
            raise ValueError(f"controller state: malformed ({type(exc).__name__}: {why})") from None
        new_state, new_profile = self.base_state, self.profile
        changed: set[str] = set()
        target = self.policy
        if reference is not None:
            base, profile, config, changed = reference
            target = make_policy("lyapunov", profile, config, **self._policy_options)
            for i, d in enumerate(ids):
                if d in changed:  # measured against another calibration: this round's
                    speed[d] = float(base.speed_flops[i])
                    kappa[d] = float(base.kappa_s[i])
                    lam[d] = float(base.layer_overhead_s[i])
                    samples[d], steps[d] = [], []
            distinct -= changed
        if policy is not None and hasattr(target, "load_state_dict"):
            target.load_state_dict(policy)
        self.policy = target
        if reference is not None:
            self.base_state, self.profile, self.config = base, profile, config
        self.estimates.window, self.estimates.long_window = window, long_window
        self.estimates.speed_flops, self.estimates.kappa_s = speed, kappa
        self.estimates.layer_overhead_s = lam
        self.estimates.restore(samples, distinct, fixed, distinct_kinds, steps)
        self._observed = None
        self._startup_times_s = {}
        self._even_plan = None
        self._bare_cache = None
        plans[int(self.current.plan_id or 0)] = self.current
        self.plans = plans
        self.next_plan_id = max(counters[0], self.next_plan_id)
        self.observed_steps, self.decisions = counters[1:]
        self._chosen_speeds = chosen or dict(
            zip(ids, (float(v) for v in self.base_state.speed_flops), strict=True)
        )
        self._step_residuals_s = residuals
        self.searches_applied = searches
        # the plan in force is the round's (the ranks kept theirs): the policy answers from it
        self._policy_plan = self.current
        self.startup_check = None
        if reference is not None:
            self.startup_check = self._check_startup(new_state, new_profile, changed)

    def _restored_reference(
        self, startup: Any
    ) -> tuple[ClusterState, ProfileArrays, TrainingConfig, set[str]] | None:
        """The calibration this controller plans and estimates with after restoring a state
        whose start-up calibration is ``startup`` (:meth:`state_dict`'s): ``(state, profile,
        config, changed)``, each device's start-up rows (speed, ``κ``, ``λ``, nominal speed)
        and its kind's measured layer times from ``startup`` when its kind is this round's,
        else this round's (those devices are ``changed``); the calibrated configuration fields
        from ``startup``. None when ``startup`` is None (a state without it).

        Raises:
            ValueError: (``WireError`` too) ``startup`` malformed or of other devices or layers.
        """
        from hetrain.runtime.ctlwire import profile_from_json, state_from_json

        if startup is None:
            return None
        saved = state_from_json(startup["base_state"], "startup.base_state")
        new = self.base_state
        if list(saved.ids) != list(new.ids):
            raise ValueError(f"startup.base_state: devices {list(saved.ids)}")
        measured = profile_from_json(
            {**profile_to_json(self.profile), "measured": startup["measured"]}, "startup"
        ).measured
        calibrated = {k: float(startup["config"][k]) for k in CALIBRATED_CONFIG}
        if not all(math.isfinite(v) and v >= 0 for v in calibrated.values()):
            raise ValueError("startup.config: expected finite numbers >= 0")
        same = np.array([a.lower() == b.lower() for a, b in zip(saved.kinds, new.kinds,
                                                                strict=True)])  # fmt: skip
        changed = {d for d, s in zip(new.ids, same, strict=True) if not s}
        rows = {
            key: np.where(same, getattr(saved, key), getattr(new, key)).astype(float)
            for key in ("speed_flops", "kappa_s", "layer_overhead_s", "nominal_speed_flops")
        }
        kept = {k.lower() for k, s in zip(saved.kinds, same, strict=True) if s}
        profile = dataclasses.replace(
            self.profile,
            measured=tuple(m for m in measured if m.kind.lower() in kept)
            + tuple(m for m in self.profile.measured if m.kind.lower() not in kept),
        )
        return (
            new.with_changes(**rows),
            profile,
            dataclasses.replace(self.config, **calibrated),
            changed,
        )

    def _check_startup(
        self, state: ClusterState, profile: ProfileArrays, changed: set[str]
    ) -> str | None:
        """This round's start-up benchmark (``state``, ``profile``) against the restored
        estimates: one line naming each unchanged device whose start-up time for the whole
        model on a micro-batch of the batch is more than 1.5x its restored estimate's (the
        reference's start-up time times its measured slow-down ``r̂``), or None."""
        slowdowns = self.estimates.slowdowns()
        batch = int(self.config.batch)
        named = []
        for d in self.base_state.ids:
            if d in changed or d not in slowdowns:
                continue
            now = _whole_model_s(state, profile, d, batch)
            restored = _whole_model_s(self.base_state, self.profile, d, batch) * slowdowns[d]
            if not (now > 0 and restored > 0):
                continue
            ratio = now / restored
            if ratio > 1.5:
                named.append(f"{d} {ratio:.1f}x slower")
            elif ratio < 1 / 1.5:
                named.append(f"{d} {1 / ratio:.1f}x faster")
        if not named:
            return None
        return (
            f"the start-up benchmark measured {', '.join(named)} than the restored estimates; "
            "the restored estimates stand until measured steps show a change"
        )


def relative_moves(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    """The devices whose speed moved relative to the others between two sets of estimates
    (FLOP/s per device), as ``"w1 3.0x slower, w2 1.6x faster"`` (empty: none). Each device's
    move ``after / before`` is divided by the move common to the devices (the middle move;
    of the two middle ones of an even count the one nearer 1, so that with two devices the
    one that moved is named), and a device is named when that relative move is beyond 1.5x
    either way. A factor common to every device (a start-up benchmark that measured all of
    them 2.5x slow) names none: only relative speeds change a plan's shares."""
    moves = {
        d: after[d] / before[d]
        for d in after
        if before.get(d, 0) > 0 and after[d] > 0 and math.isfinite(after[d] / before[d])
    }
    if len(moves) < 2:
        return ""
    ordered = sorted(moves.values())
    n = len(ordered)
    middle = ordered[(n - 1) // 2 : n // 2 + 1]
    common = min(middle, key=lambda m: abs(math.log(m)))
    named = []
    for d, m in moves.items():
        r = m / common
        if r > 1.5:
            named.append(f"{d} {r:.1f}x faster")
        elif r < 1 / 1.5:
            named.append(f"{d} {1 / r:.1f}x slower")
    return ", ".join(named)


def _whole_model_s(state: ClusterState, profile: ProfileArrays, device: str, batch: int) -> float:
    """Start-up seconds of ``device`` in ``state`` for the whole model on one micro-batch of
    ``batch`` samples (:func:`hetrain.costmodel.stage_compute_s`: its kind's measured times,
    else the FLOP model); NaN for a device of speed 0."""
    i = state.index()[device]
    if not float(state.speed_flops[i]) > 0:
        return math.nan
    layers = profile.num_layers
    return float(stage_compute_s(state, profile_prefix(profile), np.array([i]), np.array([0]),
                                 np.array([layers]), batch)[0])  # fmt: skip


def startup_decision(
    base_state: ClusterState,
    profile: ProfileArrays,
    config: TrainingConfig,
    plan: Plan,
    steps: int,
) -> tuple[Plan, dict[str, Any]]:
    """The plan an adaptive run starts with: the controller's decision on its start-up
    calibration (``base_state``: every device's measured speed and fixed costs, the emulated
    slow-downs included), against ``plan`` (even data parallelism) as the plan in force. The
    same decision path as every later step (:meth:`PlanController.decide`, its search run
    inline, its gate: a new structure must be predicted faster by ``switch_margin`` and pay
    its migration), taken before the first step instead of after the measured warm-up, so
    that the ranks do not run the even plan through the warm-up and the first search (a
    search took 14-23 steps to come back on a loaded 2-core machine, issue 19).

    Returns:
        ``(first_plan, controller_state)``: the plan as the ranks run it (single-stage groups
        one micro-batch, :func:`runtime_plan`) with ``plan``'s id (the controller state
        records the decided plan under that id, and its next plan id is the one after it),
        naming every device of ``plan`` (a device the decision leaves out gets an idle group,
        :meth:`~hetrain.plan.Plan.with_idle_groups`: a round's first plan names every
        rank), or ``plan`` when the decision keeps it; and the deciding controller's
        :meth:`PlanController.state_dict` (JSON data), which the round's controller starts
        from (:func:`round_controller`), so that it knows the searched plans and does not
        search again for the same state.

    Raises:
        NoFeasiblePlanError: (from the planner) no plan fits the devices.
    """
    ctl = PlanController(base_state, profile, config, plan, steps, warmup_steps=0)
    first = plan
    if ctl.decide(0) is not None:
        groups = tuple(
            g.model_copy(update={"microbatch_size": g.batch})
            if g.num_stages == 1 and g.batch
            else g
            for g in ctl._policy_plan.groups
        )
        first = ctl._policy_plan.model_copy(update={"groups": groups, "plan_id": plan.plan_id})
        first = first.with_idle_groups(plan.devices)  # a new structure may leave devices out
        ctl.number_first_plan(first, int(plan.plan_id or 0))
    return first, ctl.state_dict()


def round_controller(init: Mapping[str, Any], *, async_search: bool = True) -> PlanController:
    """The controller of a round from its start message (``init``,
    :func:`hetrain.runtime.ctlwire.decode_init`): the service's and a replay's
    (:func:`hetrain.sim.replay.replay_run`) alike. A round that starts at step 0 with the
    state of its start-up decision (``controller_state``, :func:`startup_decision`) starts
    from that state."""
    ctl = PlanController(
        init["base_state"],
        init["profile"],
        init["config"],
        init["plan"],
        init["steps"],
        optimizer_state_factor=init.get("optimizer_state_factor", 2.0),
        async_search=async_search,
    )
    if init.get("controller_state") is not None and int(init.get("start_step", 0)) == 0:
        try:
            ctl.load_state_dict(init["controller_state"])
        except ValueError as exc:  # one line; the round's controller starts fresh
            print(f"hetrain: warning: start-up controller state not used: {exc}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return ctl
