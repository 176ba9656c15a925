"""Plans with a norm block ``G`` (docs/model.md §5): every share ``b_g`` and micro-batch size
``μ_g`` a multiple of ``G``.

Planning in *blocks* of ``G`` samples is exact: with per-block FLOPs and activation bytes
(``G`` times the per-sample ones) and the batch ``B / G`` blocks, docs/model.md §3 gives every plan
the
same stage times (``μ c = (μ/G)(G c)``; measured times are looked up at ``(μ/G) G``),
boundary times, micro-batch counts
(``ceil(b/μ) = ceil((b/G)/(μ/G))``), memory, sync, costs and lower bound as the plan in
samples with ``b`` and ``μ`` multiplied by ``G``. So the planner and the baselines solve the
blocked problem and multiply back (docs/planner.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

from hetrain.costmodel import TrainingConfig
from hetrain.plan import Plan
from hetrain.profile import ProfileArrays

__all__ = ["block_config", "block_plan", "block_profile", "per_norm_block", "unblock_plan"]


def block_profile(profile: ProfileArrays, norm_block: int) -> ProfileArrays:
    """The profile per block of ``norm_block`` samples: per-sample FLOPs and activation bytes
    times ``G`` (parameters, frozen and shared tensors unchanged); measured times keep their
    rows with the micro-batch sizes in blocks (``μ / G``, possibly fractional: a block
    micro-batch of ``u`` runs the measured time of ``u G`` samples)."""
    g = float(norm_block)
    return dataclasses.replace(
        profile,
        measured=tuple(
            dataclasses.replace(m, microbatch_sizes=m.microbatch_sizes / g)
            for m in profile.measured
        ),
        fwd_flops=profile.fwd_flops * g,
        bwd_flops=profile.bwd_flops * g,
        activation_bytes=profile.activation_bytes * g,
        activation_memory_bytes=profile.activation_memory_bytes * g,
    )


def block_config(config: TrainingConfig) -> TrainingConfig:
    """``config`` with the batch in blocks (``B / G``) and no norm block."""
    g = int(config.norm_block or 1)
    return dataclasses.replace(config, batch=config.batch // g, norm_block=None)


def unblock_plan(plan: Plan, norm_block: int) -> Plan:
    """A plan in blocks turned into samples: shares and μ times ``G`` (figures dropped)."""
    g = int(norm_block)
    groups = tuple(
        grp.model_copy(update={"batch": grp.batch * g, "microbatch_size": grp.microbatch_size * g})
        for grp in plan.groups
    )
    return plan.model_copy(
        update={"groups": groups, "iteration_time_s": None, "lower_bound_s": None, "cost": None}
    )


def block_plan(plan: Plan, norm_block: int) -> Plan:
    """A plan in samples turned into blocks (a warm start): shares and μ divided by ``G``,
    rounded down, μ at least 1 (only the structure and μ of a warm start are used)."""
    g = int(norm_block)
    groups = tuple(
        grp.model_copy(
            update={"batch": grp.batch // g, "microbatch_size": max(1, grp.microbatch_size // g)}
        )
        for grp in plan.groups
    )
    return plan.model_copy(update={"groups": groups})


F = TypeVar("F", bound=Callable[..., Plan | None])


def per_norm_block(make: F) -> F:
    """Decorate a ``make(state, profile, config, ...) -> Plan | None`` planner so that with
    ``config.norm_block = G`` it solves the blocked problem and returns the plan in samples
    (figures filled by the cost model with the original profile and config)."""

    @wraps(make)
    def wrapper(state, profile, config, *args, **kwargs):  # type: ignore[no-untyped-def]
        g = config.norm_block
        if g is None:
            return make(state, profile, config, *args, **kwargs)
        if "warm_start" in kwargs and kwargs["warm_start"] is not None:
            kwargs["warm_start"] = block_plan(kwargs["warm_start"], g)
        plan = make(state, block_profile(profile, g), block_config(config), *args, **kwargs)
        if plan is None:
            return None
        from hetrain.planner.search import SearchContext, fill_figures

        return fill_figures(SearchContext(state, profile, config), unblock_plan(plan, g))

    return wrapper  # type: ignore[return-value]
