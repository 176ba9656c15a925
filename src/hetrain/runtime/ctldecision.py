"""The controller's plain-data pieces (docs/model.md §3-§5): predicted iteration and migration
times of a plan, the runtime's tuning of :class:`~hetrain.control.lyapunov.LyapunovController`
(:func:`policy_options`), the :class:`Decision` record a plan change travels as (to rank 0,
:func:`~hetrain.runtime.ctlwire.encode_decision`), the one call into ``hetrain.control``
(:func:`controller_decide`) and the plan forms the runtime runs (:func:`even_dp_plan`, the
start plan; :func:`runtime_plan`, idle groups left out).

Used by :class:`~hetrain.runtime.ctlcontroller.PlanController` in the controller's process and
by the ranks. Imports the planning modules only; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetrain.cluster import ClusterState
from hetrain.control.migration import migration_time_s
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.plan import GroupPlan, Plan
from hetrain.profile import ProfileArrays

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
        kappa_s, measured_extra_s: the fixed costs per micro-batch (s per device) of the
            same estimates (``ClusterState.kappa_s``, ``ClusterState.measured_extra_s``:
            :meth:`hetrain.control.estimates.SpeedEstimates.apply`).
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
    kappa_s: dict[str, float] = field(default_factory=dict)
    measured_extra_s: dict[str, float] = field(default_factory=dict)
    shares_before: dict[str, int] = field(default_factory=dict)
    shares_after: dict[str, int] = field(default_factory=dict)

    def console_line(self, applied_step: int, previous: Plan | None = None) -> str:
        """One line for the console: step, why, shares before -> after, predicted ``T``. The
        devices of a pipeline are joined by ``+`` and their group's share given once
        (``w0+w1:32 w2:0``) where the plan is known: the new plan always, the plan in force
        before it when ``previous`` is given."""
        before = shares_text(self.shares_before, previous)
        after = shares_text(self.shares_after, self.plan)
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
            "kappa_s": self.kappa_s,
            "measured_extra_s": self.measured_extra_s,
            "shares_before": self.shares_before,
            "shares_after": self.shares_after,
        }


def shares_text(shares: Mapping[str, int], plan: Plan | None) -> str:
    """``shares`` (``{device: samples}``, a pipeline's share under each of its devices) as
    ``"w0+w1:32 w2:0"``: with ``plan``, the devices of each of its groups joined by ``+`` with
    the group's share once, then the devices it does not name; without it, ``"w0:32 w1:32"``."""
    parts, done = [], set()
    for g in plan.groups if plan is not None else ():
        names = [d for d in g.devices if d in shares]
        if names:
            parts.append(f"{'+'.join(names)}:{shares[names[0]]}")
            done.update(names)
    parts += [f"{d}:{b}" for d, b in shares.items() if d not in done]
    return " ".join(parts)


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
