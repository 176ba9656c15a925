"""docs/model.md §6 baselines as online policies (same :class:`~hetrain.control.Policy` interface as
the
Lyapunov controller).

Each baseline's plan comes from :mod:`hetrain.planner.baselines` (``None`` = no plan fits, which
the policy reports as :class:`~hetrain.errors.NoFeasiblePlanError`, "infeasible"). What differs
is *when* a baseline re-plans:

* ``dp-even``, ``pipeline``: when the set of available devices changes (their plans depend on
  nothing else);
* ``dp-proportional``: every slot, with the measured speeds (LB-BSP-style re-balancing);
* ``static-hybrid``: once at the start, and again only when a device it uses disappears
  (HetPipe-style); devices that join later are ignored until then.

Like the controller they see the state measured up to the previous slot plus the availability of
the slot they plan for.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.costmodel import PlanEvaluation, TrainingConfig
from hetrain.errors import NoFeasiblePlanError
from hetrain.plan import Plan
from hetrain.profile import ProfileArrays

PlanFn = Callable[[ClusterState, ProfileArrays, TrainingConfig], Plan | None]

REPLAN_ON_AVAILABILITY = "availability"
REPLAN_EVERY_SLOT = "every-slot"
REPLAN_ON_LOSS = "on-loss"


class BaselinePolicy:
    """A docs/model.md §6 static plan re-computed according to ``replan``.

    Args:
        name: the policy's name (``dp-even``, ...).
        plan_fn: ``(state, profile, config) -> Plan | None`` from :mod:`hetrain.planner.baselines`.
        profile, config: model and training configuration.
        replan: ``"availability"``, ``"every-slot"`` or ``"on-loss"`` (see module docstring).

    Raises:
        ValueError: unknown ``replan``.
    """

    def __init__(
        self,
        name: str,
        plan_fn: PlanFn,
        profile: ProfileArrays,
        config: TrainingConfig,
        replan: str,
    ) -> None:
        if replan not in (REPLAN_ON_AVAILABILITY, REPLAN_EVERY_SLOT, REPLAN_ON_LOSS):
            raise ValueError(f"replan: unknown mode {replan!r}")
        self.name = name
        self.plan_fn = plan_fn
        self.profile = profile
        self.config = config
        self.replan = replan
        self._plan: Plan | None = None
        self._available: np.ndarray | None = None
        self.searches = 0

    def decide(self, slot: int, observed: ClusterState) -> Plan:
        """The baseline's plan for ``slot``.

        Raises:
            NoFeasiblePlanError: the baseline has no plan that fits (docs/model.md §6 "infeasible").
        """
        available = np.asarray(observed.available, dtype=bool)
        if self._plan is None or self._must_replan(available, observed):
            self.searches += 1
            plan = self.plan_fn(observed, self.profile, self.config) if available.any() else None
            if plan is None:
                self._plan = None
                raise NoFeasiblePlanError(f"{self.name}: no plan fits the available devices")
            self._plan = plan
            self._available = available.copy()
        return self._plan

    def observe(self, slot: int, plan: Plan, evaluation: PlanEvaluation) -> None:
        """Baselines keep no budget state."""

    def _must_replan(self, available: np.ndarray, observed: ClusterState) -> bool:
        if self.replan == REPLAN_EVERY_SLOT:
            return True
        if self.replan == REPLAN_ON_AVAILABILITY:
            return self._available is None or not np.array_equal(available, self._available)
        # on-loss: a device of an active group is gone (or no plan yet)
        if self._plan is None:
            return True
        index = observed.index()
        return any(
            not available[index[d]] for g in self._plan.groups if g.batch > 0 for d in g.devices
        )


class FixedPlanPolicy:
    """One given plan every slot (``hetrain simulate --plan``): what the simulator's per-slot
    time is compared with ``hetrain evaluate`` on.

    Raises (from :meth:`decide`):
        NoFeasiblePlanError: a device of an active group of the plan is unavailable.
    """

    def __init__(self, plan: Plan, name: str = "fixed") -> None:
        self.name = name
        self.plan = plan

    def decide(self, slot: int, observed: ClusterState) -> Plan:
        index = observed.index()
        for g in self.plan.groups:
            if g.batch > 0 and not all(observed.available[index[d]] for d in g.devices):
                raise NoFeasiblePlanError(f"{self.name}: a device of the plan is unavailable")
        return self.plan

    def observe(self, slot: int, plan: Plan, evaluation: PlanEvaluation) -> None:
        """A fixed plan ignores feedback."""
