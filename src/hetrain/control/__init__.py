"""Online policies (docs/model.md §4, §6): the Lyapunov drift-plus-penalty controller and the
baselines.

A policy decides the plan of slot ``t`` from what was measured up to slot ``t − 1``
(docs/ARCHITECTURE.md, "Controller and simulator")::

    class Policy(Protocol):
        name: str
        def decide(self, slot: int, observed: ClusterState) -> Plan | Decision
        def observe(self, slot: int, plan: Plan, evaluation: PlanEvaluation) -> None

:func:`make_policy` builds one by name; ``lyapunov`` and ``greedy`` are
:class:`~hetrain.control.lyapunov.LyapunovController` (whose ``decide`` returns a
:class:`~hetrain.control.decision.Decision`, see :func:`plan_of`). Importing this package
imports numpy and the cost model only (never torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hetrain.cluster import ClusterState
    from hetrain.control.decision import Decision
    from hetrain.costmodel import PlanEvaluation, TrainingConfig
    from hetrain.plan import Plan
    from hetrain.profile import ProfileArrays

POLICY_NAMES = ("lyapunov", "greedy", "dp-even", "dp-proportional", "pipeline", "static-hybrid")
BASELINE_NAMES = ("dp-even", "dp-proportional", "pipeline", "static-hybrid")


class Policy(Protocol):
    """What the simulator and the runtime drive (docs/ARCHITECTURE.md)."""

    name: str

    def decide(self, slot: int, observed: ClusterState) -> Plan | Decision:
        """The plan of ``slot`` given the state measured up to ``slot − 1`` (a plan, or a
        :class:`~hetrain.control.decision.Decision` that carries one)."""
        ...

    def observe(self, slot: int, plan: Plan, evaluation: PlanEvaluation) -> None:
        """The measured outcome of ``slot`` (time and cost, migration included)."""
        ...


def make_policy(
    name: str,
    profile: ProfileArrays,
    config: TrainingConfig,
    *,
    v: float = 10.0,
    budgets: Mapping[str, float] | None = None,
    **options: Any,
) -> Policy:
    """Build the policy ``name`` (one of :data:`POLICY_NAMES`).

    Args:
        name: ``lyapunov`` (docs/model.md §4), ``greedy`` (no budgets, ``V → ∞``) or a docs/model.md
        §6 baseline.
        profile, config: the model and the training configuration.
        v: the controller's ``V`` (``lyapunov`` only).
        budgets: ``{"money": ȳ, "energy": ȳ}`` per iteration (``lyapunov`` only; baselines and
            ``greedy`` ignore budgets, their cost is reported against them).
        options: tuning keywords of :class:`~hetrain.control.lyapunov.LyapunovController`
            (e.g. ``decision_delay_slots``); baselines ignore them.

    Raises:
        ValueError: unknown name or invalid ``v``/budgets/options.
    """
    if name == "lyapunov":
        from hetrain.control.lyapunov import LyapunovController

        return LyapunovController(profile, config, v=v, budgets=budgets, name=name, **options)
    if name == "greedy":
        from hetrain.control.lyapunov import LyapunovController

        return LyapunovController(profile, config, v=math.inf, budgets=None, name=name, **options)
    if name in BASELINE_NAMES:
        from hetrain.control.policies import (
            REPLAN_EVERY_SLOT,
            REPLAN_ON_AVAILABILITY,
            REPLAN_ON_LOSS,
            BaselinePolicy,
        )
        from hetrain.planner import baselines

        table = {
            "dp-even": (baselines.dp_even_plan, REPLAN_ON_AVAILABILITY),
            "dp-proportional": (baselines.dp_proportional_plan, REPLAN_EVERY_SLOT),
            "pipeline": (baselines.pipeline_plan, REPLAN_ON_AVAILABILITY),
            "static-hybrid": (baselines.static_hybrid_plan, REPLAN_ON_LOSS),
        }
        fn, replan = table[name]
        return BaselinePolicy(name, fn, profile, config, replan)
    raise ValueError(f"policy: expected one of {', '.join(POLICY_NAMES)}, got {name!r}")


def plan_of(choice: Plan | Decision) -> Plan:
    """The plan of a policy's ``decide`` answer (a plan, or a decision's ``plan``)."""
    plan = getattr(choice, "plan", None)
    return choice if plan is None else plan
