"""Online adaptation (SPEC §4-§5): measured speeds -> estimates -> re-plan under hysteresis.

Every iteration each rank reports the compute time of its stage; :class:`Adapter` (on rank 0)
turns them into per-device speeds ``s_d = FLOPs done / compute time`` (FLOP/s, the FLOPs from
the model profile ``Σ_{l∈S_k} (f_l + w_l)`` times the samples the rank processed), smooths them
(:class:`hetrain.calibration.ClusterEstimator` when present: EWMA with outlier rejection; else a
median-of-3 + EWMA fallback here), builds the observed :class:`~hetrain.cluster.ClusterState`
and asks :func:`propose_plan` — **the one seam** where the policy lives:

1. ``hetrain.control.make_policy("lyapunov", ...)`` when the controller is on main (it weighs
   migration itself);
2. else ``hetrain.planner.best_plan`` (greedy minimum of ``T``), kept only when the predicted gain
   over the current plan pays for the migration (hysteresis below);
3. else :func:`rebalance_shares`: the current groups and stages with integer shares that
   minimise the predicted ``max_g T_g`` (water-filling; optimal for increasing separable
   costs).

Hysteresis (greedy paths): switch only when ``(T_cur - T_new) * horizon > migration_time_s``
and ``T_new < (1 - min_gain) * T_cur``, with ``horizon = min(steps left, horizon_steps)``, and
not within ``cooldown_steps`` of the last change. ``T`` is SPEC §3's iteration time
(``hetrain.costmodel.evaluate_plan`` when present, else the compute-only
``A_g + (n_g - 1) M_g`` of :func:`predict_iteration_time_s`).

No torch here: the runtime calls it with floats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.control import plan_of
from hetrain.plan import GroupPlan, Plan
from hetrain.profile import ProfileArrays

# --------------------------------------------------------------------------------------------
# speed estimates
# --------------------------------------------------------------------------------------------


class _Median3Ewma:
    """Fallback estimator: EWMA (weight ``alpha``) of the median of the last 3 samples, so a
    single spike is ignored and a lasting change is followed after 2 samples."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.recent: list[float] = []
        self.value: float | None = None

    def update(self, x: float) -> None:
        self.recent = (self.recent + [float(x)])[-5:]
        m = float(np.median(self.recent))
        self.value = m if self.value is None else self.value + self.alpha * (m - self.value)


class SpeedEstimates:
    """Per-device speed estimates (FLOP/s) from per-iteration compute measurements.

    Uses ``hetrain.calibration.ClusterEstimator`` when that module exists, else
    :class:`_Median3Ewma` per device.
    """

    def __init__(
        self,
        ids: Sequence[str],
        kappa_s: Sequence[float] | None = None,
        layer_overhead_s: Sequence[float] | None = None,
    ) -> None:
        self.ids = tuple(ids)
        try:
            from hetrain.calibration import ClusterEstimator

            self._cluster = ClusterEstimator(
                self.ids,
                kappa_s=kappa_s,
                layer_overhead_s=layer_overhead_s,
                alpha=0.3,
                threshold=4.0,
                max_consecutive_outliers=3,
            )
            self._fallback = None
        except ImportError:  # the calibration module is not on this branch yet
            self._cluster = None
            self._fallback = {d: _Median3Ewma() for d in self.ids}

    def observe(
        self, device: str, flops: float, time_s: float, num_microbatches: int, num_layers: int = 0
    ) -> None:
        """One iteration of ``device``: ``flops`` FLOPs computed in ``time_s`` seconds over
        ``num_microbatches`` micro-batches of a stage of ``num_layers`` layers (SPEC v3: κ and
        λ per layer are subtracted)."""
        if flops <= 0 or time_s <= 0 or not math.isfinite(time_s):
            return
        if self._cluster is not None:
            self._cluster.observe_compute(device, flops, time_s, num_microbatches, num_layers)
        else:
            self._fallback[device].update(flops / time_s)

    def speeds_flops(self) -> dict[str, float]:
        """Current estimates (devices with at least one measurement)."""
        if self._cluster is not None:
            return dict(self._cluster.speed_flops())
        return {d: e.value for d, e in self._fallback.items() if e.value is not None}

    def apply(self, state: ClusterState) -> ClusterState:
        """``state`` with measured speeds where there are any."""
        idx = state.index()
        speed = state.speed_flops.astype(float).copy()
        for d, v in self.speeds_flops().items():
            if d in idx and v > 0:
                speed[idx[d]] = v
        return state.with_changes(speed_flops=speed)


# --------------------------------------------------------------------------------------------
# prediction and re-balancing (fallbacks until the planner / cost model are on main)
# --------------------------------------------------------------------------------------------


def _stage_times(group: GroupPlan, state: ClusterState, profile: ProfileArrays) -> list[float]:
    """Per-sample compute seconds ``c_k`` of each stage of ``group`` (SPEC §3)."""
    idx = state.index()
    flops = profile.train_flops
    return [
        float(flops[start:end].sum()) / float(state.speed_flops[idx[d]])
        for d, (start, end) in zip(group.devices, group.stages, strict=True)
    ]


def group_time_s(group: GroupPlan, batch: int, state: ClusterState, profile: ProfileArrays):
    """Compute-only SPEC §3 group time ``A_g + (n_g - 1) M_g`` for share ``batch`` (seconds);
    0 when ``batch`` is 0. Communication and κ are ignored (fallback model)."""
    if batch <= 0:
        return 0.0
    c = _stage_times(group, state, profile)
    mu = group.microbatch_size
    per_mb = [
        mu * ck + float(state.kappa_s[state.index()[d]])
        for ck, d in zip(c, group.devices, strict=True)
    ]
    n = -(-batch // mu)
    return sum(per_mb) + (n - 1) * max(per_mb)


def predict_iteration_time_s(
    plan: Plan, state: ClusterState, profile: ProfileArrays, config: Any = None
) -> float:
    """Predicted iteration time ``T`` of ``plan`` on ``state`` (seconds): SPEC §3 via
    ``hetrain.costmodel.evaluate_plan`` when present, else the compute-only ``max_g T_g``."""
    try:
        from hetrain.costmodel import evaluate_plan

        if config is not None:
            return float(evaluate_plan(plan, state, profile, config).iteration_time_s)
    except ImportError:
        pass
    return max(group_time_s(g, g.batch, state, profile) for g in plan.groups)


def rebalance_shares(
    plan: Plan, state: ClusterState, profile: ProfileArrays, *, min_share: int = 0
) -> Plan:
    """Same groups and stages, integer shares (sum ``B``) minimising ``max_g T_g``: samples are
    handed out one micro-batch-aligned chunk at a time to the group whose time grows least
    (water-filling; exact for separable non-decreasing ``T_g``). Each group gets at least
    ``min_share`` samples (keeps measuring a slow group). A single-device group (pure data
    parallel) runs its share as one micro-batch (``μ_g = b_g``; the fastest on one device), so
    its shares move one sample at a time."""
    batch = plan.global_batch
    shares = [min(min_share, batch // len(plan.groups)) for _ in plan.groups]
    left = batch - sum(shares)
    single = [g.num_stages == 1 for g in plan.groups]

    def chunk(g: int) -> int:
        if single[g]:
            return 1
        mu = plan.groups[g].microbatch_size
        return min(left, mu - shares[g] % mu)

    def time_with(g: int, b: int) -> float:
        group = plan.groups[g]
        if single[g]:
            group = group.model_copy(update={"microbatch_size": max(b, 1)})
        return group_time_s(group, b, state, profile)

    while left > 0:
        best, best_t = 0, math.inf
        for g in range(len(plan.groups)):
            t = time_with(g, shares[g] + chunk(g))
            if t < best_t - 1e-15:
                best, best_t = g, t
        step = chunk(best)
        shares[best] += step
        left -= step
    groups = tuple(
        g.model_copy(
            update={"batch": b, "microbatch_size": max(b, 1) if one else g.microbatch_size}
        )
        for g, b, one in zip(plan.groups, shares, single, strict=True)
    )
    return plan.model_copy(update={"groups": groups, "plan_id": None})


def even_dp_plan(devices: Sequence[str], num_layers: int, batch: int, microbatch_size: int):
    """One device per group, shares as equal as possible (the first ``B mod D`` groups get one
    more sample), each share one micro-batch (``microbatch_size`` is kept for API symmetry: on
    a single device splitting the share only adds overhead)."""
    del microbatch_size
    d = len(devices)
    shares = [batch // d + (1 if i < batch % d else 0) for i in range(d)]
    return Plan(
        plan_id=0,
        groups=tuple(
            GroupPlan(devices=(dev,), stages=((0, num_layers),), microbatch_size=max(b, 1), batch=b)
            for dev, b in zip(devices, shares, strict=True)
        ),
    )


def migration_time_estimate_s(
    old: Plan, new: Plan, profile: ProfileArrays, state: ClusterState, optimizer_state_factor: float
) -> float:
    """Migration time of ``old -> new`` (seconds): ``hetrain.control.migration.migration_time_s``
    when present, else bytes of every layer that gets a new owner ``p_l (1 + o)`` over the
    slowest link (SPEC §4)."""
    if old.structure() == new.structure():
        return 0.0
    try:
        from hetrain.control.migration import migration_time_s

        return float(migration_time_s(old, new, state, profile, optimizer_state_factor))
    except ImportError:
        pass
    old_owned = {
        (d, ly)
        for g in old.groups
        for d, (s, e) in zip(g.devices, g.stages, strict=True)
        for ly in range(s, e)
        if g.batch > 0
    }
    moved = sum(
        float(profile.param_bytes[ly]) * (1 + optimizer_state_factor)
        for g in new.groups
        if g.batch > 0
        for d, (s, e) in zip(g.devices, g.stages, strict=True)
        for ly in range(s, e)
        if (d, ly) not in old_owned
    )
    bw = float(min(state.nic_bytes_per_s.min(), state.intra_node_bytes_per_s))
    return moved / bw


# --------------------------------------------------------------------------------------------
# the seam and the adapter
# --------------------------------------------------------------------------------------------


def propose_plan(
    observed: ClusterState,
    profile: ProfileArrays,
    current: Plan,
    *,
    config: Any = None,
    policy: Any = None,
    slot: int = 0,
) -> tuple[Plan, str]:
    """The one place where the next plan is chosen. Returns ``(plan, source)`` with source
    ``"policy"``, ``"planner"`` or ``"rebalance"``; see the module docstring for the order."""
    if policy is not None:
        return plan_of(policy.decide(slot, observed)), "policy"
    if config is not None:
        try:
            from hetrain.planner import best_plan

            return best_plan(observed, profile, config, warm_start=current), "planner"
        except ImportError:
            pass
    return rebalance_shares(current, observed, profile, min_share=0), "rebalance"


@dataclass
class Decision:
    """A plan change decided by :class:`Adapter`: the new plan and the figures behind it."""

    plan: Plan
    reason: str
    current_time_s: float
    predicted_time_s: float
    migration_time_s: float
    structure_changed: bool


@dataclass
class Adapter:
    """Rank-0 re-planner. Feed :meth:`observe` every step; :meth:`decide` returns a
    :class:`Decision` or None.

    Attributes:
        base_state: cluster state the estimates refine (ids = the devices of the ranks).
        profile: model profile (``f_l + w_l`` per sample, ``p_l``).
        steps: total steps of the run (for the horizon).
        config: ``hetrain.costmodel.TrainingConfig`` or None (fallback model).
        min_gain: relative gain required (0.05 = 5%).
        horizon_steps: steps over which a gain must pay back the migration.
        cooldown_steps: steps to wait after a change before the next one.
        confirm_steps: consecutive steps on which a change must look worth it (noise guard).
        replan_threshold: relative move of a speed estimate that triggers the planner.
        replan_every_steps: run the planner at least this often.
        min_share_gain: relative predicted gain a share-only change from the policy needs, on
            ``confirm_steps`` consecutive answers (the policy re-balances shares every slot;
            measured speeds are noisy).
        async_planning: run the planner / controller in a background thread of rank 0 (the
            exhaustive search takes ~0.1-1 s; training goes on meanwhile and the answer is
            applied at the first step after it arrives).
        warmup_steps: steps to measure before the first decision.
        optimizer_state_factor: ``o`` for the migration bytes.
    """

    base_state: ClusterState
    profile: ProfileArrays
    steps: int
    config: Any = None
    policy: Any = None
    min_gain: float = 0.2
    horizon_steps: int = 20
    cooldown_steps: int = 3
    warmup_steps: int = 2
    confirm_steps: int = 3
    replan_threshold: float = 0.3
    replan_every_steps: int = 100
    async_planning: bool = True
    min_share_gain: float = 0.15
    optimizer_state_factor: float = 2.0
    estimates: SpeedEstimates = field(init=False)
    _votes: int = field(default=0, init=False)
    _candidate: Plan | None = field(default=None, init=False)
    _source: str = field(default="", init=False)
    _planned_speeds: Any = field(default=None, init=False)
    _last_plan_step: int = field(default=-(10**9), init=False)
    _pending: Any = field(default=None, init=False)
    _last_change: int = field(default=-(10**9), init=False)
    _observed_steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.estimates = SpeedEstimates(
            self.base_state.ids,
            [float(k) for k in self.base_state.kappa_s],
            [float(lam) for lam in self.base_state.layer_overhead_s],
        )

    def observe(self, plan: Plan, compute_time_s: Mapping[str, float]) -> None:
        """Feed one iteration: ``compute_time_s[device]`` = measured compute seconds of that
        device's stage (emulated slow-down included) under ``plan``."""
        flops = self.profile.train_flops
        for group in plan.groups:
            if group.batch <= 0:
                continue
            for d, (start, end) in zip(group.devices, group.stages, strict=True):
                t = compute_time_s.get(d)
                if t is None:
                    continue
                work = float(flops[start:end].sum()) * group.batch
                self.estimates.observe(d, work, t, group.num_microbatches, end - start)
        self._observed_steps += 1

    def observed_state(self) -> ClusterState:
        """The base state with the measured speeds."""
        return self.estimates.apply(self.base_state)

    def _decide_policy(self, step: int, current: Plan, state: ClusterState) -> Decision | None:
        """The controller path: ``policy.decide`` every step (it re-balances shares, searches
        when the state drifted and weighs migration itself), in the background thread when
        ``async_planning``; its answer is applied at the first step after it arrives."""
        if self._pending is not None:
            if not self._pending.done():
                return None
            future, self._pending = self._pending, None
            candidate, source, policy = future.result()
            self.policy = policy  # the controller's state after that decision
        elif self.async_planning:
            self._pending = _executor().submit(_policy_decide, self.policy, step, state)
            return None
        else:
            candidate, source, self.policy = _policy_decide(self.policy, step, state)
        candidate = complete_plan(candidate, self.base_state.ids, self.profile.num_layers)
        if _same_plan(candidate, current):
            return None
        decision = _decision(self, step, current, candidate, state, source)
        if not decision.structure_changed:
            # noise guard: a share-only change must gain min_share_gain on confirm_steps
            # consecutive answers of the controller
            if decision.predicted_time_s >= (1 - self.min_share_gain) * decision.current_time_s:
                self._votes = 0
                return None
            self._votes += 1
            if self._votes < self.confirm_steps:
                return None
        self._votes = 0
        self._last_change = step
        return decision

    def _speeds_moved(self, state: ClusterState) -> bool:
        """Whether some speed estimate moved by more than ``replan_threshold`` (relative)
        since the last planner call (the planner costs ~0.1-0.2 s, too much for every step)."""
        if self._planned_speeds is None:
            return True
        rel = np.abs(state.speed_flops - self._planned_speeds) / self._planned_speeds
        return bool(np.any(rel > self.replan_threshold))

    def decide(self, step: int, current: Plan) -> Decision | None:
        """A new plan for ``step`` or None (keep ``current``).

        The planner runs when the speed estimates moved (see :meth:`_speeds_moved`) or every
        ``replan_every_steps``; a candidate it returns is kept and re-checked against fresh
        estimates (cheap cost-model evaluations) until it has looked worth it on
        ``confirm_steps`` consecutive steps, or stops looking so."""
        if (
            self._observed_steps < self.warmup_steps
            or step - self._last_change < self.cooldown_steps
        ):
            return None
        state = self.observed_state()
        if self.policy is not None:
            return self._decide_policy(step, current, state)
        if self._candidate is None:
            if self._pending is not None:
                if not self._pending.done():
                    return None
                future, self._pending = self._pending, None
                candidate, source = future.result()
            else:
                due = step - self._last_plan_step >= self.replan_every_steps
                if not (self._speeds_moved(state) or due):
                    return None
                self._planned_speeds = state.speed_flops.copy()
                self._last_plan_step = step
                if self.async_planning and self.policy is None:
                    self._pending = _executor().submit(
                        propose_plan, state, self.profile, current, config=self.config
                    )
                    return None
                candidate, source = propose_plan(
                    state,
                    self.profile,
                    current,
                    config=self.config,
                    policy=self.policy,
                    slot=step,
                )
            candidate = complete_plan(candidate, self.base_state.ids, self.profile.num_layers)
            if _same_plan(candidate, current):
                return None
            self._candidate, self._source, self._votes = candidate, source, 0
        decision = _decision(self, step, current, self._candidate, state, self._source)
        if self._source != "policy":
            t_cur, t_new = decision.current_time_s, decision.predicted_time_s
            horizon = max(min(self.steps - step, self.horizon_steps), 0)
            if not (
                t_new < (1 - self.min_gain) * t_cur
                and (t_cur - t_new) * horizon > decision.migration_time_s
            ):
                self._candidate = None
                return None
            self._votes += 1
            if self._votes < self.confirm_steps:
                return None
        self._candidate = None
        self._last_change = step
        return decision


_EXECUTOR = None


def _executor():
    """One background thread for planner/controller calls (created on first use). The search
    is Python + numpy: while it runs it competes with rank 0's training loop for the GIL, so
    rank 0's steps slow down for the ~0.1-1 s of a search (a forked helper process would
    avoid that; it hung with gloo in the parent and is not used)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        from concurrent.futures import ThreadPoolExecutor

        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetrain-planner")
    return _EXECUTOR


def _decision(
    adapter: Adapter, step: int, current: Plan, candidate: Plan, state: ClusterState, source: str
) -> Decision:
    t_cur = predict_iteration_time_s(current, state, adapter.profile, adapter.config)
    t_new = predict_iteration_time_s(candidate, state, adapter.profile, adapter.config)
    mig = migration_time_estimate_s(
        current, candidate, adapter.profile, state, adapter.optimizer_state_factor
    )
    return Decision(
        plan=candidate,
        reason=f"{source}: predicted {t_cur:.4g}s -> {t_new:.4g}s per iteration",
        current_time_s=t_cur,
        predicted_time_s=t_new,
        migration_time_s=mig,
        structure_changed=candidate.structure() != current.structure(),
    )


def complete_plan(plan: Plan, devices: Sequence[str], num_layers: int) -> Plan:
    """``plan`` with every device of ``devices`` it does not name added as an idle
    single-device group (``b_g = 0``), so that every rank is named (the engine's first plan
    must name all ranks; idle ranks keep a full replica's layout), and single-device groups
    running their share as one micro-batch (``μ_g = b_g``: with one stage, splitting only adds
    ``κ`` per micro-batch, SPEC §3)."""
    plan = plan.model_copy(
        update={
            "groups": tuple(
                g.model_copy(update={"microbatch_size": g.batch})
                if g.num_stages == 1 and g.batch > 0
                else g
                for g in plan.groups
            )
        }
    )
    named = set(plan.devices)
    extra = tuple(
        GroupPlan(devices=(d,), stages=((0, num_layers),), microbatch_size=1, batch=0)
        for d in devices
        if d not in named
    )
    if not extra:
        return plan
    return plan.model_copy(update={"groups": tuple(plan.groups) + extra})


def _policy_decide(policy: Any, slot: int, observed: ClusterState) -> tuple[Plan, str, Any]:
    """``policy.decide`` returning the policy too (it is stateful and, in the planner process,
    a copy: the caller keeps the returned one)."""
    return plan_of(policy.decide(slot, observed)), "policy", policy


def _same_plan(a: Plan, b: Plan) -> bool:
    return [(g.devices, g.stages, g.microbatch_size, g.batch) for g in a.groups] == [
        (g.devices, g.stages, g.microbatch_size, g.batch) for g in b.groups
    ]
