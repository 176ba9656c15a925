"""Lagrange multipliers of long-run budgets by bisection (the dual of docs/model.md §4's problem).

For multipliers ``η_j ≥ 0`` (seconds per unit of resource j) the per-slot plan minimising
``T + Σ_j η_j y_j`` spends less of j as ``η_j`` grows. :func:`bisect_multipliers` finds the
smallest ``η`` whose spend meets every budget: one budget by bisection on ``log η``; two by
coordinate-wise bisection repeated a few rounds (Boyd & Vandenberghe, *Convex Optimization*,
2004, §5: any ``η ≥ 0`` gives a lower bound ``g(η)`` of the constrained optimum; the
multiplier that makes the constraint tight maximises it for one budget).

Used by the controller's queue warm start and by the hindsight and stale-information references
(:mod:`hetrain.sim.references`). Pure python.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping


def bisect_multipliers(
    spend: Callable[[dict[str, float]], Mapping[str, float]],
    budgets: Mapping[str, float],
    scale: Mapping[str, float],
    *,
    iterations: int = 14,
    rounds: int | None = None,
    low: float = 1e-3,
    high: float = 1e3,
) -> dict[str, float]:
    """Smallest multipliers ``η`` (one per budget) with ``spend(η)[j] <= budgets[j]``.

    Args:
        spend: ``η -> {resource: mean spend per iteration}`` of the plans chosen with ``η``.
        budgets: ``{resource: ȳ_j}``.
        scale: natural size of ``η_j`` (e.g. ``T_ref / ȳ_j`` seconds per unit); the search runs
            over ``η_j / scale_j`` in ``[low, high]`` on a log scale.
        iterations: bisection steps per resource and round.
        rounds: coordinate rounds (default 1 for one budget, 3 for two).

    Returns:
        ``{resource: η_j}``; ``η_j = 0`` when the budget is met without it, and
        ``high · scale_j`` when even that does not meet it (the caller checks feasibility).

    Raises:
        ValueError: a scale that is not a finite number > 0.
    """
    for name in budgets:
        s = scale[name]
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"scale[{name}]: expected a finite number > 0, got {s!r}")
    eta = {name: 0.0 for name in budgets}
    if not budgets:
        return eta
    n_rounds = rounds if rounds is not None else (1 if len(budgets) == 1 else 3)
    for _ in range(n_rounds):
        for name, budget in budgets.items():
            trial = dict(eta)
            trial[name] = 0.0
            if spend(trial)[name] <= budget:
                eta[name] = 0.0
                continue
            trial[name] = scale[name] * high
            if spend(trial)[name] > budget:
                eta[name] = scale[name] * high
                continue
            a, b = math.log(low), math.log(high)
            for _ in range(iterations):
                mid = 0.5 * (a + b)
                trial[name] = scale[name] * math.exp(mid)
                if spend(trial)[name] <= budget:
                    b = mid
                else:
                    a = mid
            eta[name] = scale[name] * math.exp(b)
    return eta
