"""Tentative structure search (SPEC §4): which devices, how many groups, their members and
order, the micro-batch sizes; stages and shares are solved per structure.

Objective: ``V·T + Σ_j Q_j y_j``. Since ``y_money = T Σ_{used} π_d`` and
``y_energy = T Σ_{used} W_d``, it equals ``T · (V + Σ_{d used} c_d)`` with the per-device
weight ``c_d = Q_money π_d + Q_energy W_d`` (seconds of objective per second of iteration).

* **Exhaustive** (at most :data:`EXHAUSTIVE_MAX_DEVICES` available devices): every subset,
  every split of it into groups, every order inside each group; per group every split of the
  layers (or the exact envelope when there are too many), every ``μ ≤ B`` when ``B`` is small;
  for several groups every combination of splits (sync depends on them), each with exact
  integer shares. Pruned with the bound ``(B Σ(f+w) / Σ_{d∈subset} s_d + T_sync) · weight``.
  Exact (the tests compare it with an independent brute force).
* **Pruned** beyond: a family of topology- and speed-aware structures (pure data parallel;
  one group per node; nodes cut into pipelines of depth 2, 4, 8, ...; pipelines across nodes
  that line up device j of K nodes; kind-homogeneous pipelines; whole-cluster pipelines; the
  warm-start structure), splits from the envelope DP cached per group *signature* (speeds,
  κ, memory, links), shares solved with identical groups merged, idle groups chosen over
  prefixes of groups ranked by throughput per weight, then ``μ`` refined around the shares.
  Heuristic; the SPEC §6 baseline plans are evaluated too, so the result is never worse than
  the best feasible baseline.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.costmodel import (
    ProfilePrefix,
    TrainingConfig,
    evaluate_plan,
    link_bandwidths_bytes_per_s,
    profile_prefix,
    sync_times_s,
)
from hetrain.plan import GroupPlan, Plan
from hetrain.planner.partition import (
    SplitTable,
    count_splits,
    enumerate_splits,
    envelope_splits,
    split_table,
)
from hetrain.planner.shares import GroupOptions, ShareProblem, ShareSolution
from hetrain.profile import ProfileArrays

EXHAUSTIVE_MAX_DEVICES = 4
ALL_SPLITS_MAX = 64  # enumerate every split of a group when there are at most this many
COMBOS_MAX = 4096  # joint split combinations per structure in the exhaustive search
ALL_MU_MAX_BATCH = 32  # every micro-batch size 1..B when B is at most this


@dataclass
class Candidate:
    """A solved structure: groups (device index arrays), per group bounds, μ and share;
    its iteration time, sync time and objective."""

    objective: float
    iteration_time_s: float
    groups: list[np.ndarray]
    bounds: list[np.ndarray]
    microbatch_sizes: list[int]
    shares: list[int]


@dataclass
class SearchContext:
    """Everything the search reads, plus caches that a warm-started re-plan reuses."""

    state: ClusterState
    profile: ProfileArrays
    config: TrainingConfig
    v: float = 1.0
    queues: Mapping[str, float] = field(default_factory=dict)
    prefix: ProfilePrefix = field(init=False)
    weight_per_device: np.ndarray = field(init=False)
    available: np.ndarray = field(init=False)
    option_cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prefix = profile_prefix(self.profile)
        q = dict(self.queues or {})
        self.weight_per_device = q.get("money", 0.0) * self.state.price_per_s + q.get(
            "energy", 0.0
        ) * np.asarray(self.state.power_w, dtype=float)
        self.available = np.flatnonzero(np.asarray(self.state.available, dtype=bool))

    @property
    def batch(self) -> int:
        return self.config.batch

    @property
    def total_flops(self) -> float:
        return float(self.prefix.train_flops[-1])

    def weight(self, devices: np.ndarray) -> float:
        """``V + Σ_{d} c_d`` over ``devices``."""
        return self.v + float(np.sum(self.weight_per_device[devices]))

    def mu_candidates(self) -> list[int]:
        """Every ``μ ≤ B`` for small ``B``, else powers of two ``≤ B`` and ``B``."""
        b = self.batch
        if b <= ALL_MU_MAX_BATCH:
            return list(range(1, b + 1))
        out = {1 << i for i in range(int(math.log2(b)) + 1)}
        out.add(b)
        return sorted(out)

    def signature(self, devices: np.ndarray) -> tuple:
        """What a group's splits depend on: speed, κ and memory per device, link bandwidths."""
        s = self.state
        per = tuple(
            (float(s.speed_flops[d]), float(s.kappa_s[d]), float(s.memory_bytes[d]))
            for d in devices
        )
        links = (
            tuple(float(x) for x in link_bandwidths_bytes_per_s(s, devices))
            if len(devices) > 1
            else ()
        )
        return per, links

    def envelope_options(self, devices: np.ndarray, mus: Sequence[int]) -> GroupOptions:
        """Envelope splits of a group for each ``μ`` in ``mus`` (cached by signature)."""
        sig = self.signature(devices)
        tables = []
        for mu in mus:
            key = ("env", sig, int(mu))
            table = self.option_cache.get(key)
            if table is None:
                table = self._splits(devices, int(mu))
                self.option_cache[key] = table
            tables.append(table)
        return GroupOptions.from_tables(tables, len(devices))

    def _splits(self, devices: np.ndarray, mu: int) -> SplitTable:
        cfg = self.config
        n_design = -(-self.batch // mu)
        k = len(devices)
        if count_splits(self.prefix.num_layers, k) <= ALL_SPLITS_MAX:
            table = split_table(
                self.state, self.prefix, devices,
                enumerate_splits(self.prefix.num_layers, k), mu,
                cfg.optimizer_state_factor, cfg.schedule,
            )  # fmt: skip
            from hetrain.planner.partition import pareto

            keep = table.max_microbatches >= 1
            return pareto(
                SplitTable(
                    table.bounds[keep],
                    table.fill_s[keep],
                    table.bottleneck_s[keep],
                    np.minimum(table.max_microbatches[keep], n_design),
                    mu,
                )
            )
        return envelope_splits(
            self.state, self.prefix, devices, mu, cfg.optimizer_state_factor, cfg.schedule,
            n_design,
        )  # fmt: skip

    # -- turning solutions into candidates ---------------------------------------------------
    def sync_time_s(self, groups: Sequence[np.ndarray], bounds: Sequence[np.ndarray]) -> float:
        """``T_sync`` of the given active groups."""
        if len(groups) <= 1:
            return 0.0
        ts = sync_times_s(self.state, self.prefix, list(zip(groups, bounds, strict=True)))
        return float(max(float(np.max(t)) for t in ts))


# ---------------------------------------------------------------------------------------------
# Exhaustive search
# ---------------------------------------------------------------------------------------------


def set_partitions(items: Sequence[int]) -> Iterator[list[list[int]]]:
    """Every partition of ``items`` into non-empty unordered blocks."""
    items = list(items)
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def _all_split_options(ctx: SearchContext, devices: tuple[int, ...]) -> list[GroupOptions]:
    """Per split of the group (all splits, or the envelope when there are too many), its
    options over every ``μ`` candidate."""
    key = ("all", devices)
    cached = ctx.option_cache.get(key)
    if cached is not None:
        return cached
    devs = np.asarray(devices, dtype=np.int64)
    k = len(devs)
    num_layers = ctx.prefix.num_layers
    mus = ctx.mu_candidates()
    if count_splits(num_layers, k) <= ALL_SPLITS_MAX:
        bounds = enumerate_splits(num_layers, k)
    else:
        found = {}
        for mu in mus:
            env = envelope_splits(
                ctx.state, ctx.prefix, devs, mu, ctx.config.optimizer_state_factor,
                ctx.config.schedule, -(-ctx.batch // mu), exact=True,
            )  # fmt: skip
            for b in env.bounds:
                found[tuple(int(x) for x in b)] = None
        bounds = np.asarray(list(found), dtype=np.int64).reshape(-1, k + 1)
    per_split: list[GroupOptions] = []
    tables = [
        split_table(ctx.state, ctx.prefix, devs, bounds, mu, ctx.config.optimizer_state_factor,
                    ctx.config.schedule)
        for mu in mus
    ]  # fmt: skip
    for p in range(len(bounds)):
        rows = [
            SplitTable(t.bounds[p : p + 1], t.fill_s[p : p + 1], t.bottleneck_s[p : p + 1],
                       t.max_microbatches[p : p + 1], t.microbatch_size)
            for t in tables
            if t.max_microbatches[p] >= 1
        ]  # fmt: skip
        opts = GroupOptions.from_tables(rows, k)
        if len(opts):
            per_split.append(opts)
    ctx.option_cache[key] = per_split
    return per_split


def exhaustive_search(ctx: SearchContext, incumbent: Candidate | None = None) -> Candidate | None:
    """Exact search over every structure of the available devices (see module docstring)."""
    best = incumbent
    avail = [int(d) for d in ctx.available]
    batch = ctx.batch
    for size in range(len(avail), 0, -1):
        for subset in itertools.combinations(avail, size):
            sub = np.asarray(subset, dtype=np.int64)
            weight = ctx.weight(sub)
            t_floor = batch * ctx.total_flops / float(np.sum(ctx.state.speed_flops[sub]))
            if best is not None and t_floor * weight >= best.objective:
                continue
            for blocks in set_partitions(subset):
                if len(blocks) > batch:
                    continue
                for orders in itertools.product(*(itertools.permutations(b) for b in blocks)):
                    best = _solve_exhaustive_structure(ctx, orders, weight, t_floor, best)
    return best


def _solve_exhaustive_structure(
    ctx: SearchContext,
    orders: Sequence[tuple[int, ...]],
    weight: float,
    t_floor: float,
    best: Candidate | None,
) -> Candidate | None:
    per_group = [_all_split_options(ctx, tuple(o)) for o in orders]
    if any(not opts for opts in per_group):
        return best
    groups = [np.asarray(o, dtype=np.int64) for o in orders]
    if len(groups) == 1:
        t, p = _merge(per_group[0]).time_for(ctx.batch)
        if not np.isfinite(t):
            return best
        merged = _merge(per_group[0])
        obj = t * weight
        if best is None or obj < best.objective:
            best = Candidate(obj, t, groups, [merged.bounds[p]],
                             [int(merged.microbatch_size[p])], [ctx.batch])  # fmt: skip
        return best
    sizes = [len(opts) for opts in per_group]
    if math.prod(sizes) > COMBOS_MAX:
        # too many joint split combinations: let each group pick its split freely
        merged = [_merge(opts) for opts in per_group]
        return _solve_with_options(ctx, groups, merged, weight, best)
    for combo in itertools.product(*(range(s) for s in sizes)):
        opts = [per_group[g][p] for g, p in enumerate(combo)]
        bounds = [o.bounds[0] for o in opts]
        sync = ctx.sync_time_s(groups, bounds)
        if best is not None and (t_floor + sync) * weight >= best.objective:
            continue
        sol = ShareProblem(opts, ctx.batch).solve()
        if sol is None:
            continue
        t = sol.max_group_time_s + sync
        obj = t * weight
        if best is None or obj < best.objective:
            best = _candidate(obj, t, groups, opts, sol)
    return best


def _merge(options: Sequence[GroupOptions]) -> GroupOptions:
    return GroupOptions(
        np.concatenate([o.microbatch_size for o in options]),
        np.concatenate([o.fill_s for o in options]),
        np.concatenate([o.bottleneck_s for o in options]),
        np.concatenate([o.max_microbatches for o in options]),
        np.concatenate([o.bounds for o in options]),
    )


def _candidate(
    obj: float,
    t: float,
    groups: Sequence[np.ndarray],
    opts: Sequence[GroupOptions],
    sol: ShareSolution,
) -> Candidate:
    keep = [g for g in range(len(groups)) if sol.shares[g] > 0]
    return Candidate(
        obj,
        t,
        [groups[g] for g in keep],
        [opts[g].bounds[sol.option[g]] for g in keep],
        [int(opts[g].microbatch_size[sol.option[g]]) for g in keep],
        [int(sol.shares[g]) for g in keep],
    )


def _solve_with_options(
    ctx: SearchContext,
    groups: Sequence[np.ndarray],
    opts: Sequence[GroupOptions],
    weight: float,
    best: Candidate | None,
) -> Candidate | None:
    """Shares with every group active allowed to go idle; sync of the groups that stay
    active, objective from the actual active set."""
    sol = ShareProblem(opts, ctx.batch).solve()
    if sol is None:
        return best
    cand = _score(ctx, groups, opts, sol)
    if cand is not None and (best is None or cand.objective < best.objective):
        return cand
    return best


def _score(
    ctx: SearchContext,
    groups: Sequence[np.ndarray],
    opts: Sequence[GroupOptions],
    sol: ShareSolution,
) -> Candidate | None:
    active = [g for g in range(len(groups)) if sol.shares[g] > 0]
    if not active:
        return None
    act_groups = [groups[g] for g in active]
    act_bounds = [opts[g].bounds[sol.option[g]] for g in active]
    sync = ctx.sync_time_s(act_groups, act_bounds)
    t = float(np.max(sol.group_times_s)) + sync
    used = np.concatenate(act_groups)
    return _candidate(t * ctx.weight(used), t, groups, opts, sol)


# ---------------------------------------------------------------------------------------------
# Pruned search for larger instances
# ---------------------------------------------------------------------------------------------


def _order_in_node(ctx: SearchContext, devices: Sequence[int]) -> list[int]:
    """Pipeline order inside a node: memory, then speed, descending (first stages stash the
    most micro-batches under 1F1B), ties by cluster-file position."""
    s = ctx.state
    return sorted(devices, key=lambda d: (-s.memory_bytes[d], -s.speed_flops[d], d))


def candidate_structures(ctx: SearchContext) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Named candidate structures (lists of ordered device tuples) of the available devices."""
    s = ctx.state
    avail = [int(d) for d in ctx.available]
    num_layers = ctx.prefix.num_layers
    by_node: dict[int, list[int]] = {}
    for d in avail:
        by_node.setdefault(int(s.node[d]), []).append(d)
    nodes = [_order_in_node(ctx, devs) for devs in by_node.values()]
    out: list[tuple[str, list[tuple[int, ...]]]] = [("data-parallel", [(d,) for d in avail])]

    def chunks(seq: Sequence[int], k: int) -> list[tuple[int, ...]]:
        return [tuple(seq[i : i + k]) for i in range(0, len(seq), k)]

    def depths(limit: int) -> list[int]:
        ks, k = [], 2
        while k <= min(limit, num_layers):
            ks.append(k)
            k *= 2
        if min(limit, num_layers) >= 2 and min(limit, num_layers) not in ks:
            ks.append(min(limit, num_layers))
        return ks

    biggest = max(len(n) for n in nodes)
    if biggest > 1:
        out.append(("node-groups", [tuple(n[:num_layers]) for n in nodes]))
        for k in depths(biggest - 1):
            out.append((f"node-pipelines-{k}", [c for n in nodes for c in chunks(n, k)]))
    # pipelines across nodes: device j of K nodes of the same make-up
    kind = {d: ctx.signature(np.array([d]))[0] for d in avail}
    buckets: dict[tuple, list[list[int]]] = {}
    for n in nodes:
        buckets.setdefault(tuple(kind[d] for d in n), []).append(n)
    for k in depths(max(len(b) for b in buckets.values())):
        groups = []
        for same in buckets.values():
            for start in range(0, len(same), k):
                part = same[start : start + k]
                for j in range(len(part[0])):
                    groups.append(tuple(n[j] for n in part))
        out.append((f"cross-node-{k}", groups))
    # kind-homogeneous pipelines, nodes kept together
    by_kind: dict[tuple, list[int]] = {}
    for n in nodes:
        for d in n:
            by_kind.setdefault(kind[d], []).append(d)
    for k in depths(max(len(v) for v in by_kind.values())):
        out.append((f"kind-pipelines-{k}", [c for v in by_kind.values() for c in chunks(v, k)]))
    # whole-cluster pipelines
    if len(avail) > 1:
        out.append(("pipeline-file-order", [tuple(avail[:num_layers])]))
        fastest = sorted(avail, key=lambda d: (-s.speed_flops[d], d))[:num_layers]
        out.append(("pipeline-fastest", [tuple(fastest)]))
    seen, unique = set(), []
    for name, groups in out:
        key = tuple(sorted(groups))
        if key not in seen:
            seen.add(key)
            unique.append((name, groups))
    return unique


def solve_structure(
    ctx: SearchContext,
    groups: Sequence[tuple[int, ...]],
    best: Candidate | None = None,
    *,
    refine: bool = True,
) -> Candidate | None:
    """Solve one structure (pruned mode): envelope splits per group, shares with identical
    groups merged, idle groups over prefixes ranked by throughput per weight, ``μ`` refined."""
    garr = [np.asarray(g, dtype=np.int64) for g in groups]
    mus = ctx.mu_candidates()
    # merge groups with equal signature (identical options)
    entries: dict[tuple, list[int]] = {}
    for g, devs in enumerate(garr):
        entries.setdefault(ctx.signature(devs), []).append(g)
    keys = list(entries)
    opts = [ctx.envelope_options(garr[entries[k][0]], mus) for k in keys]
    feasible = [i for i, o in enumerate(opts) if len(o)]
    if not feasible:
        return best
    cand = _solve_entries(ctx, garr, entries, keys, opts, feasible, best)
    if cand is None or cand is best or not refine:
        return cand
    # refine μ around the shares found: ceil(b/n) for n near the chosen count
    extra: dict[int, set[int]] = {}
    for devs, mu, b in zip(cand.groups, cand.microbatch_sizes, cand.shares, strict=True):
        key = ctx.signature(devs)
        n = -(-b // mu)
        ns = {1, 2, 3, 4, n - 1, n, n + 1, 2 * n}
        extra.setdefault(keys.index(key), set()).update(-(-b // m) for m in ns if m >= 1)
    if not extra:
        return cand
    new_opts = list(opts)
    for i, more in extra.items():
        more = sorted(m for m in more if m not in mus and 1 <= m <= ctx.batch)
        if more:
            add = ctx.envelope_options(garr[entries[keys[i]][0]], more)
            new_opts[i] = _merge([opts[i], add])
    refined = _solve_entries(ctx, garr, entries, keys, new_opts, feasible, cand)
    return refined


def _solve_entries(
    ctx: SearchContext,
    garr: Sequence[np.ndarray],
    entries: dict[tuple, list[int]],
    keys: list[tuple],
    opts: Sequence[GroupOptions],
    feasible: Sequence[int],
    best: Candidate | None,
) -> Candidate | None:
    # rank entries by asymptotic throughput (samples/s) per unit of weight
    rate = np.array(
        [float(np.max(opts[i].microbatch_size / opts[i].bottleneck_s)) for i in feasible]
    )
    w = np.array([ctx.weight(garr[entries[keys[i]][0]]) - ctx.v for i in feasible])
    queues = bool(np.any(w > 0))
    score = rate / (w + ctx.v / max(len(garr), 1)) if queues else rate
    order = [feasible[i] for i in np.argsort(-score, kind="stable")]
    counts_in_order = [len(entries[keys[i]]) for i in order]
    total = sum(counts_in_order)
    if total <= 24:
        sizes = list(range(total, 0, -1))
    else:
        sizes = sorted({total, *[max(1, int(round(total * f))) for f in
                                 (0.9, 0.75, 0.6, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05)],
                        1, 2, 4, 8}, reverse=True)  # fmt: skip
    speeds = ctx.state.speed_flops
    for size in sizes:
        # the first `size` members in ranked order
        take, left = [], size
        for i, c in zip(order, counts_in_order, strict=True):
            if left <= 0:
                break
            m = min(c, left)
            take.append((i, m))
            left -= m
        members = [g for i, m in take for g in entries[keys[i]][:m]]
        used = np.concatenate([garr[g] for g in members])
        t_floor = ctx.batch * ctx.total_flops / float(np.sum(speeds[used]))
        if best is not None and t_floor * ctx.weight(used) >= best.objective:
            continue
        problem = ShareProblem([opts[i] for i, _ in take], ctx.batch, [m for _, m in take])
        if best is not None:
            lp = problem.lp_bound_s()
            if lp * ctx.v >= best.objective:
                continue
        sol = problem.solve()
        if sol is None:
            continue
        member_opts = [opts[i] for i, m in take for _ in range(m)]
        cand = _score(ctx, [garr[g] for g in members], member_opts, sol)
        if cand is not None and (best is None or cand.objective < best.objective):
            best = cand
    return best


def pruned_search(
    ctx: SearchContext,
    incumbent: Candidate | None = None,
    *,
    extra_structures: Sequence[Sequence[tuple[int, ...]]] = (),
    deadline: float | None = None,
) -> Candidate | None:
    """Solve every candidate structure (plus ``extra_structures``); stop early at
    ``deadline`` (``time.perf_counter()`` value) once one solution exists."""
    best = incumbent
    structures = [list(s) for s in extra_structures] + [g for _, g in candidate_structures(ctx)]
    for groups in structures:
        if deadline is not None and best is not None and time.perf_counter() > deadline:
            break
        best = solve_structure(ctx, groups, best)
    return best


def candidate_to_plan(ctx: SearchContext, cand: Candidate) -> Plan:
    """A :class:`Plan` of a candidate (idle groups dropped), figures filled by the cost
    model."""
    ids = ctx.state.ids
    groups = []
    for devs, bounds, mu, b in zip(
        cand.groups, cand.bounds, cand.microbatch_sizes, cand.shares, strict=True
    ):
        groups.append(
            GroupPlan(
                devices=tuple(ids[d] for d in devs),
                stages=tuple((int(bounds[k]), int(bounds[k + 1])) for k in range(len(devs))),
                microbatch_size=int(mu),
                batch=int(b),
            )
        )
    return fill_figures(ctx, Plan(schedule=ctx.config.schedule, groups=tuple(groups)))


def fill_figures(ctx: SearchContext, plan: Plan) -> Plan:
    """``plan`` with ``iteration_time_s``, ``lower_bound_s`` and ``cost`` from the cost
    model."""
    ev = evaluate_plan(plan, ctx.state, ctx.profile, ctx.config)
    return plan.model_copy(
        update={
            "iteration_time_s": ev.iteration_time_s,
            "lower_bound_s": ev.lower_bound_s,
            "cost": dict(ev.cost),
        }
    )


def plan_objective(ctx: SearchContext, plan: Plan) -> tuple[float, bool]:
    """``(V·T + Σ_j Q_j y_j, fits)`` of a plan by the cost model."""
    ev = evaluate_plan(plan, ctx.state, ctx.profile, ctx.config)
    return ev.objective(ctx.v, dict(ctx.queues or {})), ev.fits
