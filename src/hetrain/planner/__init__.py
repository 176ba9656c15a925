"""The planner (docs/model.md §4 "tentative searching + linear solving"): the best plan for one
slot.

* :mod:`hetrain.planner.partition` — stages of one group (envelope of ``T_g`` lines, DP);
* :mod:`hetrain.planner.shares` — exact integer shares for a fixed structure, LP bound;
* :mod:`hetrain.planner.search` — structures (exhaustive when small, pruned beyond);
* :mod:`hetrain.planner.baselines` — docs/model.md §6 static plans.

See docs/planner.md for the algorithm, its complexity and what is exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.costmodel import TrainingConfig
from hetrain.errors import NoFeasiblePlanError
from hetrain.plan import Plan
from hetrain.planner.norm_block import per_norm_block
from hetrain.planner.search import (
    Candidate,
    SearchContext,
    candidate_to_plan,
    exhaustive_is_small,
    exhaustive_search,
    local_search,
    plan_objective,
    polish_splits,
    pruned_search,
    solve_structure,
    structure_count,
    structure_search,
    whole_cluster_pipelines,
)
from hetrain.profile import ProfileArrays

__all__ = ["best_plan", "fewest_microbatches", "warm_structure"]

STRUCTURES_EXACT_MAX = 1100  # solve every structure when there are at most this many (<= 5 devices;
# exact over structures, not over split combinations and μ: see exhaustive_is_small)
# local-search polish (more than STRUCTURES_EXACT_MAX structures): at most this many
# structure solves per device, within this fraction of the candidate family's CPU time, or
# POLISH_SMALL_CPU_S on clusters of at most POLISH_SMALL_DEVICES devices
POLISH_MAX_SOLVES_PER_DEVICE = 40
POLISH_TIME_FRACTION = 0.25
POLISH_SMALL_DEVICES = 12
POLISH_SMALL_CPU_S = 1.0
POLISH_REPRODUCIBLE_SOLVES_PER_DEVICE = 4  # the polish of a reproducible search: solves only


def oversized_layer(ctx: SearchContext) -> tuple[int, float, int, float] | None:
    """The first layer that fits on no available device by itself, as ``(layer, bytes it
    needs, device with the most memory, that memory in bytes)``, or None. A layer's least
    need is docs/model.md §3's memory of a one-layer stage with one micro-batch of the smallest size
    alive: ``θ'_l (2 + o) + φ_l + m_l`` (bytes; shared tensors it uses included; with a norm
    block the caller's profile is per block). Any stage holding the layer needs at least
    that, so the model then fits on no arrangement."""
    pre = ctx.prefix
    idx = np.arange(pre.num_layers)
    need = pre.fixed_memory_bytes(idx, idx + 1, ctx.config.optimizer_state_factor) + (
        pre.act_mem_bytes[idx + 1] - pre.act_mem_bytes[idx]
    )
    memory = ctx.state.memory_bytes[ctx.available]
    device = int(ctx.available[int(np.argmax(memory))])
    limit = float(ctx.state.memory_bytes[device])
    over = np.flatnonzero(need > limit)
    if not len(over):
        return None
    layer = int(over[0])
    return layer, float(need[layer]), device, limit


def warm_structure(
    plan: Plan, state: ClusterState
) -> tuple[list[tuple[int, ...]], list[np.ndarray | None]]:
    """The groups of ``plan`` as ordered device-index tuples, keeping only devices that are
    known and available in ``state`` (empty groups dropped), and per group its stage bounds
    (shape ``(K + 1,)``) when all its devices are still there, else None (to re-split)."""
    index = state.index()
    groups, bounds = [], []
    for g in plan.groups:
        devs = tuple(index[d] for d in g.devices if d in index and state.available[index[d]])
        if not devs:
            continue
        groups.append(devs)
        if len(devs) == len(g.devices):
            bounds.append(np.array([s for s, _ in g.stages] + [g.stages[-1][1]], dtype=np.int64))
        else:
            bounds.append(None)
    return groups, bounds


@per_norm_block
def best_plan(
    state: ClusterState,
    profile: ProfileArrays,
    config: TrainingConfig,
    *,
    v: float = 1.0,
    queues: Mapping[str, float] | None = None,
    warm_start: Plan | None = None,
    time_budget_s: float | None = None,
    include_baselines: bool = True,
    reproducible: bool = False,
) -> Plan:
    """The plan minimising ``v·T + Σ_j queues[j]·y_j`` (plain ``T`` without queues) over the
    available devices (docs/model.md §4), with ``iteration_time_s``, ``lower_bound_s`` and ``cost``
    filled in by the cost model. Idle groups are left out of the plan.

    Search: the structure family (and the warm start); then every structure when there are at
    most :data:`STRUCTURES_EXACT_MAX` (≤ 5 devices, any number of layers), else a local-search
    polish (skipped where the exhaustive search runs); the exhaustive search (exact) at ≤ 4
    devices with ≤ 8 layers and ``B ≤ 64`` or 5-6 devices with ≤ 6 layers and ``B ≤ 16``;
    a final re-choice of each group's stages by the iteration time (:func:`polish_splits`);
    the docs/model.md §6 baselines (docs/planner.md).

    Args:
        v: weight ``V > 0`` of the iteration time.
        queues: virtual queue backlogs ``Q_j`` for ``"money"`` and/or ``"energy"`` (seconds
            per unit of resource).
        warm_start: a previous plan. Its structure (groups and order, minus devices that are
            gone) is re-solved first with its stages kept (μ and shares re-solved; groups that
            lost a device re-split), which is cheap; then with its stages re-split. With a
            ``time_budget_s`` the rest of the search stops when the budget is spent, so a
            per-slot re-plan costs about one share solve of the previous structure.
        time_budget_s: soft wall-clock budget for the search (candidate family, structure
            enumeration, polish; the warm structure and the first candidate are always
            solved). ``None``: no limit (the polish still has its own CPU-time budget).
        include_baselines: also evaluate the docs/model.md §6 static plans and keep one if it is
            better (guarantees the result is never worse than them, also when
            ``time_budget_s`` cut the search short).
        reproducible: bound the polish by its solve count only, not by CPU time, so that the
            same inputs give the same plan whatever the machine's load (with
            ``time_budget_s=None``; the online controller's choice up to 16 devices).

    With ``config.norm_block = G`` every share and μ is a multiple of ``G`` (the problem is
    solved in blocks of ``G`` samples, exactly: :mod:`hetrain.planner.norm_block`).

    Raises:
        NoFeasiblePlanError: no device is available, or the model fits no arrangement of the
            available devices.
        ValueError: ``v`` not a finite positive number, unknown queue name or bad backlog.
    """
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"v: expected a finite number > 0, got {v!r}")
    queues = dict(queues or {})
    for name, q in queues.items():
        if name not in ("money", "energy"):
            raise ValueError(f"queues: unknown resource {name!r} (expected money or energy)")
        if not (math.isfinite(q) and q >= 0):
            raise ValueError(f"queues[{name}]: expected a finite number >= 0, got {q!r}")
    start = time.perf_counter()
    deadline = None if time_budget_s is None else start + time_budget_s
    ctx = SearchContext(state, profile, config, v=v, queues=queues)
    if len(ctx.available) == 0:
        raise NoFeasiblePlanError("no device is available")
    best: Candidate | None = None
    if warm_start is not None:
        groups, bounds = warm_structure(warm_start, state)
        if groups:
            index = state.index()
            mus = [
                g.microbatch_size
                for g in warm_start.groups
                if any(d in index and state.available[index[d]] for d in g.devices)
            ]
            best = solve_structure(ctx, groups, fixed_bounds=bounds, extra_mus=mus)
            if deadline is None or time.perf_counter() < deadline:
                best = solve_structure(ctx, groups, best)
    family_cpu = time.process_time()
    best = pruned_search(ctx, best, deadline=deadline)
    family_cpu = time.process_time() - family_cpu
    num_structures = structure_count(len(ctx.available), profile.num_layers, config.batch)
    exhaustive = exhaustive_is_small(ctx)
    if (deadline is None or time.perf_counter() < deadline) and not (
        exhaustive and num_structures > STRUCTURES_EXACT_MAX
    ):  # (the exhaustive search below covers what the polish would try)
        if num_structures <= STRUCTURES_EXACT_MAX:
            best = structure_search(ctx, best, deadline=deadline)
        else:
            # polish: a CPU-time budget proportional to what the candidate family took (CPU
            # time, so that a loaded machine gives the same plan), more on small clusters
            # (a warm re-plan, the controller's per-slot call, gets only the fraction)
            budget = POLISH_TIME_FRACTION * family_cpu
            if warm_start is None and len(ctx.available) <= POLISH_SMALL_DEVICES:
                budget = max(budget, POLISH_SMALL_CPU_S)
            solves = POLISH_MAX_SOLVES_PER_DEVICE * len(ctx.available)
            if reproducible:
                budget, solves = None, POLISH_REPRODUCIBLE_SOLVES_PER_DEVICE * len(ctx.available)

            def starts() -> list[Candidate]:
                """The best whole-cluster pipeline (splits cached: cheap)."""
                found = [solve_structure(ctx, [order]) for order in whole_cluster_pipelines(ctx)]
                found = [c for c in found if c is not None]
                return [min(found, key=lambda c: c.objective)] if found else []

            best = local_search(
                ctx, best, max_solves=solves,
                deadline=deadline, cpu_budget_s=budget, starts=starts,
            )  # fmt: skip
    if exhaustive and (deadline is None or time.perf_counter() < deadline):
        best = exhaustive_search(ctx, best, deadline=deadline)
    # stages re-chosen by the iteration time, sync included (one bounded pass; skipped on
    # large structures and once the time budget is spent)
    if deadline is None or time.perf_counter() < deadline:
        best = polish_splits(ctx, best)
    plan = candidate_to_plan(ctx, best) if best is not None else None
    objective = np.inf
    if plan is not None:
        # the search's objective is the cost model's (an upper bound when the exhaustive
        # search idled a group); re-evaluate exactly where that is cheap. The search charges
        # docs/model.md §3's no-overlap T_sync; with config.sync_overlap the plan is re-scored with
        # the
        # overlap (evaluate_plan) before it is compared with the baselines, whatever the size
        exact = len(ctx.available) <= 64 or config.sync_overlap
        objective = plan_objective(ctx, plan)[0] if exact else best.objective
    if include_baselines:
        # always, even past the time budget: three plans of O(D) cost each, and the guarantee
        # "never worse than the docs/model.md §6 baselines" must not depend on how loaded the
        # machine is
        from hetrain.planner import baselines

        for make in (
            baselines.dp_proportional_plan,
            baselines.dp_even_plan,
            baselines.pipeline_plan,
        ):
            other = make(state, profile, config)
            if other is None:
                continue
            obj, fits = plan_objective(ctx, other)
            if fits and obj < objective * (1 - 1e-12):
                plan, objective = other, obj
    if plan is None:
        too_big = oversized_layer(ctx)
        if too_big is not None:
            layer, need, device, limit = too_big
            raise NoFeasiblePlanError(
                f"layer {layer} ({profile.names[layer][:60]!r}) alone needs {need:.6g} bytes "
                f"({need / 2**30:.4g} GiB: weights with gradients and optimizer state, and one "
                f"micro-batch's activations) but the largest available device, "
                f"{state.ids[device][:60]!r}, has {limit:.6g} bytes ({limit / 2**30:.4g} GiB)",
                layer=layer,
            )
        raise NoFeasiblePlanError(
            f"no arrangement of the {len(ctx.available)} available devices holds the "
            f"{profile.num_layers}-layer model's parameters, gradients, optimizer state and "
            f"{config.schedule} activations for B = {config.batch}"
        )
    return plan


def fewest_microbatches(
    plan: Plan, state: ClusterState, profile: ProfileArrays, config: TrainingConfig
) -> Plan:
    """``plan`` with every one-device group running its share in as few micro-batches as the
    device's memory allows: ``μ`` raised to the largest size in ``[μ, b]`` whose activations fit
    beside the stage's fixed memory (docs/model.md §3's ``θ' (2 + o) + φ + μ Σ m_l``, one
    micro-batch alive), figures re-filled by the cost model; ``plan`` itself when nothing
    changes or the result is predicted slower (a profile measured at some micro-batch sizes
    need not scale linearly in ``μ``).

    With one stage nothing overlaps, so splitting a share only adds ``κ`` per extra
    micro-batch: the predicted time ``⌈b/μ⌉ (κ + μ t)`` never rises with ``μ``, and at
    ``κ = 0`` (a fixed cost measured as nothing) every ``μ`` ties, so the search may return
    any; a runtime runs ``⌈b/μ⌉`` micro-batches of a plan as written. This is what the
    runtime's controller runs too (``hetrain.runtime.ctldecision.runtime_plan``). The search
    itself keeps its own ``μ`` (its warm starts and pools explore around it).
    """
    from hetrain.costmodel import evaluate_plan, profile_prefix, stage_memory_bytes

    pre = profile_prefix(profile)
    index = state.index()
    groups = []
    for g in plan.groups:
        mu, b = int(g.microbatch_size), int(g.batch)
        if g.num_stages == 1 and b > mu:
            # the stage's memory is linear in μ (one micro-batch alive): fixed + μ · per sample
            fixed, one = (
                float(stage_memory_bytes(pre, g.stages[0], size, 1,
                                         config.optimizer_state_factor, config.schedule)[0])
                for size in (0, 1)
            )  # fmt: skip
            per_sample = one - fixed
            room = float(state.memory_bytes[index[g.devices[0]]]) - fixed
            most = b if per_sample <= 0 else int(room // per_sample)
            mu = max(mu, min(b, most))
        groups.append(
            g if mu == g.microbatch_size else g.model_copy(update={"microbatch_size": mu})
        )
    if all(a is b for a, b in zip(groups, plan.groups, strict=True)):
        return plan
    merged = plan.model_copy(update={"groups": tuple(groups)})
    ev = evaluate_plan(merged, state, profile, config)
    if not ev.fits or (
        plan.iteration_time_s is not None
        and ev.iteration_time_s > plan.iteration_time_s * (1 + 1e-9)
    ):
        return plan
    return merged.model_copy(
        update={
            "iteration_time_s": ev.iteration_time_s,
            "lower_bound_s": ev.lower_bound_s,
            "cost": dict(ev.cost),
        }  # fmt: skip
    )
