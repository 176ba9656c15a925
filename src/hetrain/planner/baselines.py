"""docs/model.md §6 static baseline plans for one cluster state: ``dp-even``, ``dp-proportional``,
``pipeline`` and ``static-hybrid`` (``greedy`` is :func:`hetrain.planner.best_plan` without
queues). Each uses only available devices on which its layers fit and returns ``None`` when
none fits ("infeasible").

Choices where docs/model.md §6 is silent (docs/planner.md): data-parallel devices process their
share
as one micro-batch (``μ = b_g``) when it fits, otherwise the largest ``μ`` that fits (gradient
accumulation); a device that cannot hold the model with ``μ = 1`` is left out. Equal and
proportional shares are rounded by largest remainder (ties to cluster-file order); with
``B`` smaller than the number of devices only ``B`` devices get a sample. The pipeline splits
layers to minimise the largest per-stage FLOPs (equal devices), with ``μ = ceil(B / 4K)``.
"""

from __future__ import annotations

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.costmodel import (
    TrainingConfig,
    effective_speed_flops,
    profile_prefix,
    stage_memory_bytes,
)
from hetrain.plan import GroupPlan, Plan
from hetrain.planner.norm_block import per_norm_block
from hetrain.planner.search import (
    SearchContext,
    _order_in_node,
    candidate_to_plan,
    fill_figures,
    solve_structure,
)
from hetrain.profile import ProfileArrays


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    quota = weights / weights.sum() * total
    base = np.floor(quota).astype(np.int64)
    rest = total - int(base.sum())
    order = np.argsort(-(quota - base), kind="stable")
    base[order[:rest]] += 1
    return base


def _fitting_mu(
    state: ClusterState,
    profile: ProfileArrays,
    config: TrainingConfig,
    devices: np.ndarray,
    shares: np.ndarray,
) -> np.ndarray:
    """Largest ``μ ≤ share`` per device with which the whole model fits on it (0 if none),
    shape ``(D,)``: memory ``P' (2 + o) + Φ + h μ Σm ≤ M`` (all trainable and frozen bytes,
    shared tensors once, docs/model.md (v3)) with ``h = 1`` under 1F1B (one stage)
    and ``h = ceil(share / μ)`` under GPipe (docs/model.md §3)."""
    prefix = profile_prefix(profile)
    o = config.optimizer_state_factor
    params = prefix.total_fixed_memory_bytes(o)
    act = prefix.act_mem_bytes[-1]
    limit = state.memory_bytes[devices]
    free = limit - params
    shares = np.asarray(shares, dtype=np.int64)
    candidate = (free >= 0) & (shares >= 1)
    if config.schedule == "gpipe":
        # h μ = ceil(share/μ) μ >= share: fits iff share * act <= room (any μ; take share)
        mu = np.where(shares * act <= free, shares, 0)
    elif act <= 0:
        mu = shares.copy()
    else:
        mu = np.minimum(shares, np.floor_divide(np.where(candidate, free, 0.0), act))
    mu = np.where(candidate, mu, 0).astype(np.int64)
    # confirm with the cost model's own expression (stage_memory_bytes of the whole model,
    # rounding): step μ down where it does not fit
    whole = prefix.fixed_memory_bytes(np.array([0]), np.array([profile.num_layers]), o)[0]
    while True:
        n = -(-shares // np.maximum(mu, 1))
        alive = n if config.schedule == "gpipe" else np.minimum(n, 1)
        over = (mu >= 1) & ~(whole + (alive * mu) * act <= limit)
        if not np.any(over):
            return mu
        mu = np.where(over, mu - 1, mu)


def _dp_plan(
    state: ClusterState,
    profile: ProfileArrays,
    config: TrainingConfig,
    weights_of: str,
) -> Plan | None:
    avail = np.flatnonzero(state.available)
    fits = _fitting_mu(state, profile, config, avail, np.ones(len(avail), dtype=np.int64))
    devs = avail[fits >= 1]
    if not len(devs):
        return None
    speed = effective_speed_flops(state, profile_prefix(profile), config.batch)
    while True:
        w = np.ones(len(devs)) if weights_of == "even" else speed[devs].astype(float)
        shares = _largest_remainder(w, config.batch)
        mus = _fitting_mu(state, profile, config, devs, shares)
        # (GPipe: a share's activations may not fit even when one sample does; drop those)
        bad = (shares > 0) & (mus < 1)
        if not np.any(bad):
            break
        devs = devs[~bad]
        if not len(devs):
            return None
    groups = []
    for d, b, mu in zip(devs, shares, mus, strict=True):
        if b <= 0:
            continue
        groups.append(
            GroupPlan(devices=(state.ids[d],), stages=((0, profile.num_layers),),
                      microbatch_size=int(mu), batch=int(b))
        )  # fmt: skip
    ctx = SearchContext(state, profile, config)
    return fill_figures(ctx, Plan(schedule=config.schedule, groups=tuple(groups)))


@per_norm_block
def dp_even_plan(
    state: ClusterState, profile: ProfileArrays, config: TrainingConfig
) -> Plan | None:
    """``dp-even``: one device per group, equal shares (PyTorch DDP); None if the model fits
    no available device."""
    return _dp_plan(state, profile, config, "even")


@per_norm_block
def dp_proportional_plan(
    state: ClusterState, profile: ProfileArrays, config: TrainingConfig
) -> Plan | None:
    """``dp-proportional``: one device per group, shares proportional to speed (LB-BSP);
    None if the model fits no available device."""
    return _dp_plan(state, profile, config, "speed")


def flops_balanced_bounds(profile: ProfileArrays, num_stages: int) -> np.ndarray:
    """Contiguous split into ``num_stages`` non-empty stages minimising the largest stage's
    FLOPs (min-max DP, ``O(K L²)``), shape ``(K + 1,)``."""
    flops = np.concatenate(([0.0], np.cumsum(profile.train_flops)))
    num_layers = profile.num_layers
    idx = np.arange(num_layers + 1)
    cost = np.where(idx[None, :] > idx[:, None], flops[None, :] - flops[:, None], np.inf)
    best = np.full(num_layers + 1, np.inf)
    best[0] = 0.0
    args = []
    for _ in range(num_stages):
        cand = np.maximum(best[:, None], cost)
        arg = np.argmin(cand, axis=0)
        best = cand[arg, idx]
        args.append(arg)
    bounds = [num_layers]
    for arg in reversed(args):
        bounds.append(int(arg[bounds[-1]]))
    return np.asarray(bounds[::-1], dtype=np.int64)


@per_norm_block
def pipeline_plan(
    state: ClusterState, profile: ProfileArrays, config: TrainingConfig
) -> Plan | None:
    """``pipeline``: one group of the available devices in cluster-file order (the first
    ``L``), layers split to balance FLOPs as if devices were equal, 1F1B, ``4K`` equal
    micro-batches (``μ = ceil(B / 4K)``); None when a stage does not fit its device."""
    avail = [int(d) for d in np.flatnonzero(state.available)][: profile.num_layers]
    if not avail:
        return None
    k = len(avail)
    bounds = flops_balanced_bounds(profile, k)
    mu = max(1, -(-config.batch // (4 * k)))
    n = -(-config.batch // mu)
    mem = stage_memory_bytes(
        profile_prefix(profile), bounds, mu, n, config.optimizer_state_factor, config.schedule
    )
    if np.any(mem > state.memory_bytes[np.asarray(avail)]):
        return None
    group = GroupPlan(
        devices=tuple(state.ids[d] for d in avail),
        stages=tuple((int(bounds[i]), int(bounds[i + 1])) for i in range(k)),
        microbatch_size=mu,
        batch=config.batch,
    )
    ctx = SearchContext(state, profile, config)
    return fill_figures(ctx, Plan(schedule=config.schedule, groups=(group,)))


@per_norm_block
def static_hybrid_plan(
    state: ClusterState, profile: ProfileArrays, config: TrainingConfig
) -> Plan | None:
    """``static-hybrid`` (HetPipe-style): groups = nodes (available devices ordered by memory
    then speed, as the planner orders a node, at most ``L`` per node), stages and shares
    solved by the planner for that fixed structure; None when no node can hold the model."""
    ctx = SearchContext(state, profile, config)
    by_node: dict[int, list[int]] = {}
    for d in np.flatnonzero(state.available):
        by_node.setdefault(int(state.node[d]), []).append(int(d))
    groups = [tuple(_order_in_node(ctx, v)[: profile.num_layers]) for v in by_node.values()]
    if not groups:
        return None
    cand = solve_structure(ctx, groups)
    if cand is None:
        return None
    return candidate_to_plan(ctx, cand)
