"""Tentative structure search (docs/model.md §4): which devices, how many groups, their members and
order, the micro-batch sizes; stages and shares are solved per structure.

Objective: ``V·T + Σ_j Q_j y_j``. Since ``y_money = T Σ_{used} π_d`` and
``y_energy = T Σ_{used} W_d``, it equals ``T · (V + Σ_{d used} c_d)`` with the per-device
weight ``c_d = Q_money π_d + Q_energy W_d`` (seconds of objective per second of iteration).

* **Exhaustive** (at most 4 available devices, 8 layers, ``B ≤ 64``; or 5-6 devices, 6
  layers, ``B ≤ 16``; :func:`exhaustive_is_small`): every subset,
  every split of it into groups, every order inside each group; per group every split of the
  layers (or the exact envelope when there are too many), every ``μ ≤ B`` when ``B`` is small;
  for several groups every combination of splits (sync depends on them), each with exact
  integer shares. Pruned with the bound ``(B Σ(f+w) / Σ_{d∈subset} s_d + T_sync) · weight``.
  Exact (the tests compare it with an independent brute force).
* **Structure enumeration** (:func:`structure_search`, when :func:`structure_count` is small,
  whatever the number of layers): every subset, grouping and order inside each group, each
  solved as the pruned search solves one structure; pruned by valid lower bounds
  (:func:`structure_bound`). Exact over the discrete structure; stages, ``μ`` candidates and
  the split/sync coupling are solved as below.
* **Pruned** beyond: a family of topology- and speed-aware structures (pure data parallel;
  one group per node; nodes cut into pipelines of depth 2, 4, 8, ...; pipelines across nodes
  that line up device j of K nodes; kind-homogeneous pipelines; whole-cluster pipelines in
  file, speed, memory, slowest-first and node order; the warm-start structure), splits from
  the envelope DP cached per group *signature* (speeds, κ, memory, links), shares solved with
  identical groups merged, idle groups chosen over prefixes of groups ranked by throughput per
  weight, then ``μ`` refined around the shares; then a local-search polish
  (:func:`local_search`). Heuristic; the docs/model.md §6 baseline plans are evaluated too, so the
  result is never worse than the best feasible baseline.

Sync: the search scores candidates with docs/model.md §3's ``T_sync`` (:func:`sync_times_s`, no
overlap) also when ``TrainingConfig.sync_overlap`` is set; the returned plan's figures
(:func:`fill_figures`) and its comparison with the baselines use :func:`evaluate_plan`, which
honours the flag. The overlap changes only the sync charge and mostly lowers it (not always:
per-bucket latencies, a collective waiting for its slowest owner), so the search ranks
structures by the no-overlap sync, a close over-estimate for sync-heavy plans.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.costmodel import (
    ProfilePrefix,
    TrainingConfig,
    bound_speed_flops,
    effective_speed_flops,
    evaluate_plan,
    flat_sync_times_s,
    link_bandwidths_bytes_per_s,
    profile_prefix,
    stage_compute_s,
)
from hetrain.plan import GroupPlan, Plan
from hetrain.planner.partition import (
    SplitTable,
    count_splits,
    empty_table,
    enumerate_splits,
    envelope_splits,
    envelope_splits_many,
    max_microbatches,
    pareto,
    split_rows,
    split_table,
)
from hetrain.planner.shares import GroupOptions, ShareChain, ShareProblem, ShareSolution
from hetrain.profile import ProfileArrays

EXHAUSTIVE_MAX_DEVICES = 4
EXHAUSTIVE_MAX_LAYERS = 8
EXHAUSTIVE_MAX_BATCH = 64
EXHAUSTIVE_WIDE_MAX_DEVICES = 6
EXHAUSTIVE_WIDE_MAX_LAYERS = 6
EXHAUSTIVE_WIDE_MAX_BATCH = 16
ALL_SPLITS_MAX = 64  # enumerate every split of a group when there are at most this many
MU_EVERY_MAX_BATCH = 16  # solve_structure tries every μ <= B (shares and μ jointly) up to this B
NEIGHBOUR_MU_MAX_SHARE = 32  # beyond, μ is refined for shares b ± 1 up to this share
POLISH_SPLITS_MAX_GROUPS = 16  # polish_splits re-chooses stages on plans of at most this many
COMBOS_MAX = 4096  # joint split combinations per structure in the exhaustive search
MIXED_DEPTH_MIN_DEVICES = 128  # per-kind pipeline depths are searched from this size on


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
    speed: np.ndarray = field(init=False)
    bound_speed: np.ndarray = field(init=False)
    kind_index: np.ndarray = field(init=False)
    time_scale: np.ndarray = field(init=False)
    weighted: bool = field(init=False)

    def __post_init__(self) -> None:
        self.prefix = profile_prefix(self.profile)
        # per device (D,): the FLOP/s for orderings (costmodel.effective_speed_flops), the
        # FLOP/s of the lower bounds that prune (costmodel.bound_speed_flops), and the index
        # of its kind's measured times (-1: the FLOP model); all = speed_flops, -1 without
        # measured times
        self.speed = effective_speed_flops(self.state, self.prefix, self.config.batch)
        self.bound_speed = bound_speed_flops(self.state, self.prefix, self.config.batch)
        self.kind_index = self.prefix.kind_index(self.state)
        self.time_scale = self.state.measured_time_scale()
        q = dict(self.queues or {})
        self.weight_per_device = q.get("money", 0.0) * self.state.price_per_s + q.get(
            "energy", 0.0
        ) * np.asarray(self.state.power_w, dtype=float)
        self.weighted = bool(np.any(self.weight_per_device != 0.0))
        self.available = np.flatnonzero(np.asarray(self.state.available, dtype=bool))

    @property
    def batch(self) -> int:
        return self.config.batch

    @property
    def total_flops(self) -> float:
        return float(self.prefix.train_flops[-1])

    def weight(self, devices: np.ndarray) -> float:
        """``V + Σ_{d} c_d`` over ``devices`` (``V`` itself without queues: every ``c_d`` is 0,
        and ``V + 0.0 = V``)."""
        if not self.weighted:
            return self.v
        return self.v + float(np.sum(self.weight_per_device[devices]))

    def mu_candidates(self, cap: int | None = None, *, every: bool = False) -> list[int]:
        """Micro-batch sizes tried first: every ``μ ≤ B`` with ``every`` (exhaustive search);
        else powers of two (``B ≤ 64``) or of four, at most ``cap``. The pruned search then
        refines ``μ`` around the shares it found."""
        b = self.batch if cap is None else max(1, min(self.batch, cap))
        if every:
            return list(range(1, b + 1))
        base = 2 if self.batch <= 64 else 4
        return [base**i for i in range(int(math.log(b, base) + 1e-9) + 1)]

    def signature(self, devices: np.ndarray) -> tuple:
        """What a group's splits depend on: speed, κ and memory per device, link bandwidths.
        Cached per device sequence."""
        devices = np.asarray(devices, dtype=np.int64)
        key = ("signature", devices.tobytes())
        out = self.option_cache.get(key)
        if out is None:
            keys = self.option_cache.get("device-keys")
            if keys is None:  # every device's exact key at once (the same tuples)
                keys = self.option_cache["device-keys"] = [
                    self._device_key(d, False) for d in range(self.state.num_devices)
                ]
            per = tuple(map(keys.__getitem__, devices.tolist()))
            links = (
                tuple(link_bandwidths_bytes_per_s(self.state, devices).tolist())
                if len(devices) > 1
                else ()
            )
            out = self.option_cache[key] = (per, links)
        return out

    def group_array_and_signature_id(self, devices: tuple[int, ...]) -> tuple[np.ndarray, int]:
        """The group's device array (read-only, shared by every structure holding the group)
        and :meth:`signature_id`, kept per device tuple (structures of 1024 devices repeat
        most of their groups: one dict lookup per group)."""
        known = self.option_cache.setdefault("group-array-signature", {})
        out = known.get(devices)
        if out is None:
            arr = np.array(devices, dtype=np.int64)
            arr.flags.writeable = False
            out = known[devices] = (arr, self.signature_id(arr))
        return out

    def signature_id(self, devices: np.ndarray) -> int:
        """A small integer per distinct :meth:`signature` (equal signatures, equal ids), for
        cache and dict keys (hashing an int instead of the nested tuple). Cached per device
        sequence."""
        devices = np.asarray(devices, dtype=np.int64)
        key = ("signature-id", devices.tobytes())
        out = self.option_cache.get(key)
        if out is None:
            ids = self.option_cache.setdefault("signature-ids", {})
            out = self.option_cache[key] = ids.setdefault(self.signature(devices), len(ids))
        return out

    def approx_signature(self, devices: np.ndarray) -> tuple:
        """:meth:`signature` with speeds in 10 % buckets (log scale) and the rest to three
        significant digits: groups that differ by measurement noise share their *splits*
        (their times are still computed exactly). Cached per device sequence."""
        key = ("approx-signature", np.asarray(devices, dtype=np.int64).tobytes())
        out = self.option_cache.get(key)
        if out is None:
            s = self.state
            per = tuple(self._device_key(int(d), True) for d in devices)
            links = (
                tuple(float(f"{x:.3g}") for x in link_bandwidths_bytes_per_s(s, devices))
                if len(devices) > 1
                else ()
            )
            out = self.option_cache[key] = (per, links)
        return out

    def _device_key(self, d: int, approx: bool) -> tuple:
        """One device's part of :meth:`signature` (``approx``: of :meth:`approx_signature`),
        cached per device."""
        key = ("device", d, approx)
        out = self.option_cache.get(key)
        if out is None:
            s = self.state
            # a device with measured times: its kind, time scale (speed / nominal speed) and
            # fixed extra per micro-batch stand for its speed, κ and λ (docs/model.md §3)
            kind = int(self.kind_index[d])
            scale = float(self.time_scale[d]) if kind >= 0 else 1.0
            if approx:
                out = (
                    int(round(math.log(float(s.speed_flops[d])) / math.log(1.1))),
                    float(f"{s.kappa_s[d]:.3g}"),
                    float(f"{s.memory_bytes[d]:.3g}"),
                    float(f"{s.layer_overhead_s[d]:.3g}"),
                    kind,
                    float(f"{scale:.3g}"),
                    float(f"{s.measured_extra_s[d]:.3g}"),
                )
            else:
                out = (float(s.speed_flops[d]), float(s.kappa_s[d]), float(s.memory_bytes[d]),
                       float(s.layer_overhead_s[d]), kind, scale,
                       float(s.measured_extra_s[d]))  # fmt: skip
            self.option_cache[key] = out
        return out

    def rate_bound(self, devices: tuple[int, ...]) -> float:
        """An upper bound on the samples per second of the ordered group ``devices`` over
        every ``μ``, split and share: ``1 / min over splits of max_k max(F_k / s_k, 2 a / bw_k)``
        (per-sample stage and boundary times; ``κ``, latency and activation memory dropped,
        ``T_g ≥ b_g`` times that bottleneck). 0 when no split holds the parameters.
        Cached per group."""
        key = ("rate", devices)
        cached = self.option_cache.get(key)
        if cached is not None:
            return cached
        st, pre = self.state, self.prefix
        devs = np.asarray(devices, dtype=np.int64)
        num_layers = pre.num_layers
        base = self.option_cache.get("rate-matrices")
        if base is None:
            idx = np.arange(num_layers + 1)
            valid = idx[None, :] > idx[:, None]
            flops = pre.train_flops[None, :] - pre.train_flops[:, None]
            theta = pre.fixed_memory_bytes(idx[:, None], idx[None, :],
                                           self.config.optimizer_state_factor)  # fmt: skip
            last = np.clip(idx - 1, 0, num_layers - 1)
            base = self.option_cache["rate-matrices"] = (valid, flops, theta, last)
        valid, flops, theta, last = base
        bws = link_bandwidths_bytes_per_s(st, devs) if len(devs) > 1 else np.zeros(0)
        last_stage = len(devs) - 1
        best = np.zeros(0)  # per layer j: the least bottleneck of the stages so far ending at j
        for k, d in enumerate(devs):
            # per-sample stage times where the stage's parameters fit d (per speed/memory)
            kind = int(self.kind_index[d])
            dkey = ("rate-device", float(st.speed_flops[d]), float(st.memory_bytes[d]), kind,
                    float(self.time_scale[d]) if kind >= 0 else 1.0)  # fmt: skip
            worst = self.option_cache.get(dkey)
            if worst is None:
                if kind >= 0:
                    # measured times: a lower bound on the seconds per sample over μ <= B
                    rate = self.prefix.measured_rate_prefix_s(self.batch)[kind]
                    per_sample = (rate[None, :] - rate[:, None]) * float(self.time_scale[d])
                else:
                    per_sample = flops / st.speed_flops[d]
                worst = np.where(valid & (theta <= st.memory_bytes[d]), per_sample, np.inf)
                self.option_cache[dkey] = worst
            # min-max DP over the stage's first layer i; the first stage starts at layer 0 and
            # the last ends at L (one row, one column); the boundary after a stage ending at j
            # does not depend on i, so it is charged after the minimum (max(min_i x_i, c) =
            # min_i max(x_i, c): the same values as charging it inside)
            if k == 0:
                best = worst[0]
            elif k == last_stage:
                best = np.min(np.maximum(best, worst[:, -1]), keepdims=True)
            else:
                best = np.maximum(best[:, None], worst).min(axis=0)
            if k < last_stage:
                best = np.maximum(best, pre.boundary_bytes[last] / bws[k])
        bottleneck = float(best[-1])
        rate = 0.0 if not np.isfinite(bottleneck) else 1.0 / max(bottleneck, 1e-300)
        self.option_cache[key] = rate
        return rate

    def envelope_options(
        self,
        devices: np.ndarray,
        mus: Sequence[int],
        fixed_bounds: np.ndarray | None = None,
    ) -> GroupOptions:
        """Options of a group for each ``μ`` in ``mus``: the envelope splits (found once per
        :meth:`approx_signature` and ``μ``, then timed exactly for these devices), or only
        ``fixed_bounds`` (a warm start that keeps its stages). Cached per exact signature; the same
        signature, μ list and fixed split give the same (never written) options object."""
        sig = self.signature_id(devices)
        fixed_key = None if fixed_bounds is None else tuple(int(x) for x in fixed_bounds)
        mus = [int(mu) for mu in mus]
        cache = self.option_cache
        # the same group (signature), μ list and fixed split: the same options object (its
        # tables never change once found; 3 of 4 requests at 1024 devices)
        whole_key = ("options", sig, tuple(mus), fixed_key)
        known = cache.get(whole_key)
        if known is not None:
            return known
        missing = [mu for mu in dict.fromkeys(mus) if ("env", sig, mu, fixed_key) not in cache]
        if missing:
            # all missing μ of the group at once (one numpy pass per stage for all of them)
            if self.rate_bound(tuple(int(d) for d in devices)) <= 0.0:
                # no split holds the parameters (with gradients and optimizer state): no
                # split fits one micro-batch of any μ either
                found = [empty_table(len(devices), mu) for mu in missing]
                if fixed_bounds is None:
                    asig = self.approx_signature(devices)
                    for mu in missing:
                        cache.setdefault(("bounds", asig, mu), found[0].bounds)
            elif fixed_bounds is not None:
                bounds = np.asarray(fixed_bounds, dtype=np.int64)[None, :]
                found = self._timed_many(devices, [bounds] * len(missing), missing)
            else:
                asig = self.approx_signature(devices)
                known = [mu for mu in missing if ("bounds", asig, mu) in cache]
                new = [mu for mu in missing if ("bounds", asig, mu) not in cache]
                found = self._timed_many(devices, [cache["bounds", asig, mu] for mu in known],
                                         known)  # fmt: skip
                # timed for these very devices
                for mu, table in zip(new, self._splits_many(devices, new), strict=True):
                    cache["bounds", asig, mu] = table.bounds
                    found.append(table)
                missing = known + new
            for mu, table in zip(missing, found, strict=True):
                cache["env", sig, mu, fixed_key] = table
        tables = [cache["env", sig, mu, fixed_key] for mu in mus]
        out = cache[whole_key] = GroupOptions.from_tables(tables, len(devices))
        return out

    def _timed_many(
        self, devices: np.ndarray, bounds: Sequence[np.ndarray], mus: Sequence[int]
    ) -> list[SplitTable]:
        """Exact times and memory limits of given splits (``bounds[u]``, shape
        ``(P_u, K + 1)``, for ``μ = mus[u]``) for these devices, in one pass; dominated and
        non-fitting splits dropped, splits in increasing :meth:`_sync_key`."""
        if not len(mus):
            return []
        cfg = self.config
        devices = np.asarray(devices, dtype=np.int64)
        stacked = np.concatenate([np.asarray(b, dtype=np.int64) for b in bounds])
        mu_rows = np.repeat(np.asarray(mus, dtype=np.int64), [len(b) for b in bounds])
        fill, bottleneck, nmax = split_rows(self.state, self.prefix, devices, stacked, mu_rows,
                                            cfg.optimizer_state_factor, cfg.schedule)  # fmt: skip
        key = self._sync_key(devices, stacked)
        out, start = [], 0
        for b, mu in zip(bounds, mus, strict=True):
            sl = slice(start, start + len(b))
            start += len(b)
            keep = key[sl].argsort(kind="stable")
            keep = keep[nmax[sl][keep] >= 1]
            n_cap = -(-self.batch // mu)
            out.append(pareto(SplitTable(
                stacked[sl][keep], fill[sl][keep], bottleneck[sl][keep],
                np.minimum(nmax[sl][keep], n_cap), int(mu),
            )))  # fmt: skip
        return out

    def _sync_key(self, devices: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """``max_k θ'_k / nic_{d_k}`` of each split ``bounds`` (shape ``(P, K + 1)``), shape
        ``(P,)``: trainable bytes a stage all-reduces over its NIC. Splits are stably sorted by
        it before :func:`pareto`, so that among splits with equal ``A``, ``M`` and memory —
        which :func:`pareto` keeps only the first of — the one with the least all-reduce
        survives (issue 12)."""
        pre = self.prefix
        bounds = np.asarray(bounds, dtype=np.int64)
        theta = pre.param_bytes[bounds[:, 1:]] - pre.param_bytes[bounds[:, :-1]]
        if pre.has_shared:
            trainable = np.where(pre.shared_frozen, 0.0, pre.shared_bytes)
            theta = theta + pre.shared_held(bounds[:, :-1], bounds[:, 1:]).astype(float) @ trainable
        return np.max(theta / self.state.nic_bytes_per_s[np.asarray(devices)], axis=1)

    def _splits_many(self, devices: np.ndarray, mus: Sequence[int]) -> list[SplitTable]:
        """The splits of the group for each ``μ`` of ``mus``: all of them when there are at
        most :data:`ALL_SPLITS_MAX`, else the envelope (:func:`envelope_splits_many`)."""
        if not len(mus):
            return []
        cfg = self.config
        k = len(devices)
        if k == 1 or count_splits(self.prefix.num_layers, k) <= ALL_SPLITS_MAX:
            bounds = enumerate_splits(self.prefix.num_layers, k)
            return self._timed_many(devices, [bounds] * len(mus), mus)
        # memory is checked at a design number of micro-batches: the most the group could
        # be given (every split found then fits any share; under 1F1B levels above K are
        # equivalent to K), lower levels when nothing fits (see envelope_splits)
        designs = [-(-self.batch // mu) for mu in mus]
        tops = [min(n, k) if cfg.schedule == "1f1b" else n for n in designs]
        return envelope_splits_many(
            self.state, self.prefix, devices, mus, cfg.optimizer_state_factor, cfg.schedule,
            tops, n_caps=designs, cache=self.option_cache,
        )  # fmt: skip

    def sync_bound_s(self, groups: Sequence[tuple[int, ...]]) -> float:
        """A lower bound on ``T_sync`` when all ``groups`` are active (any splits): a group's
        devices hold all ``P`` parameter bytes, so ``max_d θ_d/β_d ≥ P / Σ_d β_d``, with
        ``β_d`` the intra-node bandwidth only where every other group has a device on ``d``'s
        node, else ``nic_d``."""
        count = len(groups)
        if count <= 1:
            return 0.0
        st = self.state
        node_sets = [{int(st.node[d]) for d in g} for g in groups]
        worst = 0.0
        for g, devs in enumerate(groups):
            total = 0.0
            for d in devs:
                node = int(st.node[d])
                local = all(node in ns for h, ns in enumerate(node_sets) if h != g)
                total += st.intra_node_bytes_per_s if local else float(st.nic_bytes_per_s[d])
            worst = max(worst, float(self.prefix.param_bytes[-1]) / total)
        return 2.0 * (count - 1) * st.latency_s + 2.0 * (count - 1) / count * worst

    # -- turning solutions into candidates ---------------------------------------------------
    def sync_time_s(self, groups: Sequence[np.ndarray], bounds: Sequence[np.ndarray]) -> float:
        """``T_sync`` of the given active groups (shared tensors included, docs/model.md (v3): a
        single group may have a sync time when a shared tensor spans two of its stages)."""
        if len(groups) <= 1 and not self.prefix.has_shared:
            return 0.0
        bounds = [np.asarray(b, dtype=np.int64) for b in bounds]
        devices = np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])
        starts = np.concatenate([b[:-1] for b in bounds])
        ends = np.concatenate([b[1:] for b in bounds])
        return self.flat_sync_time_s(devices, starts, ends, len(groups))

    def flat_sync_time_s(
        self, devices: np.ndarray, starts: np.ndarray, ends: np.ndarray, num_active: int
    ) -> float:
        """:meth:`sync_time_s` on flat arrays (:func:`hetrain.costmodel.flat_sync_times_s`:
        every stage of the ``num_active`` active groups, group then stage order, shape
        ``(Σ_g K_g,)``): ``max_d t_d``, seconds."""
        if num_active <= 1 and not self.prefix.has_shared:
            return 0.0
        t = flat_sync_times_s(self.state, self.prefix, devices, starts, ends, num_active)
        return float(np.max(t))


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
    mus = ctx.mu_candidates(every=True)
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
    # every split × every μ at once ((P, U, K) arrays of docs/model.md §3's stage times and memory)
    per_split = [
        opts
        for opts in fixed_split_options(
            ctx, [devs] * len(bounds), list(bounds), [mus] * len(bounds)
        )  # fmt: skip
        if len(opts)
    ]
    ctx.option_cache[key] = per_split
    return per_split


def exhaustive_is_small(ctx: SearchContext) -> bool:
    """Whether the exact search runs: at most :data:`EXHAUSTIVE_MAX_DEVICES` available
    devices, :data:`EXHAUSTIVE_MAX_LAYERS` layers and a batch of at most
    :data:`EXHAUSTIVE_MAX_BATCH`; or at most :data:`EXHAUSTIVE_WIDE_MAX_DEVICES` devices with
    at most :data:`EXHAUSTIVE_WIDE_MAX_LAYERS` layers and ``B ≤``
    :data:`EXHAUSTIVE_WIDE_MAX_BATCH` (in norm blocks)."""
    devices = len(ctx.available)
    layers = ctx.prefix.num_layers
    if devices <= EXHAUSTIVE_MAX_DEVICES:
        return layers <= EXHAUSTIVE_MAX_LAYERS and ctx.batch <= EXHAUSTIVE_MAX_BATCH
    return (
        devices <= EXHAUSTIVE_WIDE_MAX_DEVICES
        and layers <= EXHAUSTIVE_WIDE_MAX_LAYERS
        and ctx.batch <= EXHAUSTIVE_WIDE_MAX_BATCH
    )


def exhaustive_search(
    ctx: SearchContext, incumbent: Candidate | None = None, *, deadline: float | None = None
) -> Candidate | None:
    """Exact search over every structure of the available devices (see module docstring);
    stops early at ``deadline`` (``time.perf_counter()`` value; then it is not exact).

    Subsets are visited by their lower bound ``(B Σ(f+w) / Σ s_d) · weight`` and skipped once
    it reaches the incumbent; a structure is skipped when :func:`structure_bound` (a valid
    lower bound with all its groups active; a structure with an idle group is the smaller
    structure without it, enumerated too) reaches the incumbent."""
    best = incumbent
    avail = [int(d) for d in ctx.available]
    batch = ctx.batch
    num_layers = ctx.prefix.num_layers
    speeds = ctx.bound_speed
    subsets = []
    for size in range(len(avail), 0, -1):
        for subset in itertools.combinations(avail, size):
            sub = np.asarray(subset, dtype=np.int64)
            weight = ctx.weight(sub)
            t_floor = batch * ctx.total_flops / float(np.sum(speeds[sub]))
            subsets.append((t_floor * weight, -size, subset, weight, t_floor))
    subsets.sort()
    for floor, _, subset, weight, t_floor in subsets:
        if best is not None and floor >= best.objective:
            break
        for blocks in set_partitions(subset):
            if len(blocks) > batch or max(len(b) for b in blocks) > num_layers:
                continue
            for orders in itertools.product(*(itertools.permutations(b) for b in blocks)):
                if deadline is not None and best is not None and time.perf_counter() > deadline:
                    return best
                if best is not None and structure_bound(ctx, orders, weight) >= best.objective:
                    continue
                best = _solve_exhaustive_structure(ctx, orders, weight, t_floor, best)
    return best


def structure_count(num_devices: int, num_layers: int, batch: int, cap: int = 10**9) -> int:
    """Number of structures of ``num_devices`` devices: a non-empty subset, split into at most
    ``batch`` unordered groups of at most ``num_layers`` devices, each group ordered
    (1, 3, 13, 73, 501 orderings of all of 1-5 devices; 147 structures of 4 devices, 1031 of
    5, 8463 of 6 when ``L`` and ``B`` do not limit). Returns ``cap`` when larger."""
    n = num_devices
    if n > 12:
        return cap
    # lists[m][g]: ways to split m labelled devices into g unordered ordered groups
    lists = [[0] * (n + 1) for _ in range(n + 1)]
    lists[0][0] = 1
    for m in range(1, n + 1):
        for g in range(1, m + 1):
            lists[m][g] = sum(
                math.comb(m - 1, k - 1) * math.factorial(k) * lists[m - k][g - 1]
                for k in range(1, min(num_layers, m) + 1)
            )
    total = sum(
        math.comb(n, m) * sum(lists[m][g] for g in range(1, min(m, batch) + 1))
        for m in range(1, n + 1)
    )
    return min(total, cap)


def structure_bound(
    ctx: SearchContext, groups: Sequence[tuple[int, ...]], weight: float | None = None
) -> float:
    """A lower bound on the objective of ``groups`` with all of them active:
    ``(B / Σ_g rate_g + T_sync bound) · weight`` (:meth:`SearchContext.rate_bound`,
    :meth:`SearchContext.sync_bound_s`); inf when a group holds no split."""
    rates = [ctx.rate_bound(tuple(g)) for g in groups]
    if min(rates) <= 0.0:
        return np.inf
    if weight is None:
        weight = ctx.weight(np.asarray([d for g in groups for d in g], dtype=np.int64))
    return (ctx.batch / sum(rates) + ctx.sync_bound_s(groups)) * weight


def structure_search(
    ctx: SearchContext, incumbent: Candidate | None = None, *, deadline: float | None = None
) -> Candidate | None:
    """Every structure of the available devices (subset, grouping, order inside each group),
    each solved like the pruned search solves one (stages from the envelope DP, exact shares,
    ``μ`` candidates refined around the shares), all groups active (a structure with an idle
    group is the smaller structure without it, enumerated too). Subsets are visited by their
    lower bound ``(B Σ(f+w) / Σ s_d) · weight`` and skipped once it reaches the incumbent."""
    best = incumbent
    avail = [int(d) for d in ctx.available]
    num_layers = ctx.prefix.num_layers
    speeds = ctx.bound_speed
    subsets = []
    for size in range(len(avail), 0, -1):
        for subset in itertools.combinations(avail, size):
            sub = np.asarray(subset, dtype=np.int64)
            weight = ctx.weight(sub)
            floor = ctx.batch * ctx.total_flops / float(np.sum(speeds[sub])) * weight
            subsets.append((floor, -size, subset, weight))
    subsets.sort()
    for floor, _, subset, weight in subsets:
        if best is not None and floor >= best.objective:
            break
        for blocks in set_partitions(subset):
            if len(blocks) > ctx.batch or max(len(b) for b in blocks) > num_layers:
                continue
            for orders in itertools.product(*(itertools.permutations(b) for b in blocks)):
                if deadline is not None and best is not None and time.perf_counter() > deadline:
                    return best
                if best is not None and structure_bound(ctx, orders, weight) >= best.objective:
                    continue  # (a group that holds no split: the smaller structure covers it)
                best = solve_structure(ctx, list(orders), best, all_active=True)
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
    if len(groups) == 1 and ctx.prefix.has_shared:
        # a shared tensor spanning two stages is synced inside the group: per split
        for opts in per_group[0]:
            t, p = opts.time_for(ctx.batch)
            if not np.isfinite(t):
                continue
            t += ctx.sync_time_s(groups, [opts.bounds[p]])
            if best is None or t * weight < best.objective:
                best = Candidate(t * weight, t, groups, [opts.bounds[p]],
                                 [int(opts.microbatch_size[p])], [ctx.batch])  # fmt: skip
        return best
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
    # lower bounds per combination, without solving it: the group time of the shares when
    # every group may pick any of its splits (a relaxation), and the layer all-reduce with
    # β_d = nic_d wherever some other group has no device on d's node (then some holder of
    # d's layers is off-node: every group holds every layer), the intra-node bandwidth else
    free = ShareProblem([_merge(opts) for opts in per_group], ctx.batch).solve()
    if free is None:
        return best
    t_free = max(free.max_group_time_s, t_floor)
    st = ctx.state
    node_sets = [{int(st.node[d]) for d in o} for o in orders]
    count = len(groups)
    scale = 2.0 * (count - 1) / count
    lat_s = 2.0 * (count - 1) * st.latency_s
    sync_floor = []
    for g, opts_g in enumerate(per_group):
        devs = groups[g]
        beta = np.array([
            st.intra_node_bytes_per_s
            if all(int(st.node[d]) in ns for h, ns in enumerate(node_sets) if h != g)
            else float(st.nic_bytes_per_s[d])
            for d in devs
        ])  # fmt: skip
        floors = []
        for o in opts_g:
            b = o.bounds[0]
            theta = ctx.prefix.param_bytes[b[1:]] - ctx.prefix.param_bytes[b[:-1]]
            floors.append(lat_s + scale * float(np.max(theta / beta)))
        sync_floor.append(floors)
    for combo in itertools.product(*(range(s) for s in sizes)):
        if best is not None:
            floor = t_free + max(sync_floor[g][p] for g, p in enumerate(combo))
            if floor * weight >= best.objective:
                continue
        opts = [per_group[g][p] for g, p in enumerate(combo)]
        bounds = [o.bounds[0] for o in opts]
        sync = ctx.sync_time_s(groups, bounds)
        if best is not None and (t_free + sync) * weight >= best.objective:
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
    entry_of: Sequence[int] | None = None,
) -> Candidate | None:
    """Candidate of a share solution: sync of the groups that stay active, objective from the
    actual active set. With ``entry_of`` (groups with equal options share an entry), also try
    giving every member of an entry the split and μ of its member with the largest share —
    no group gets slower (fewer micro-batches on the same split) and aligned splits can keep
    the all-reduce inside a node — and keep the better of the two."""
    cand = _score_one(ctx, groups, opts, sol)
    if entry_of is None or cand is None:
        return cand
    option = sol.option.copy()
    times = sol.group_times_s.copy()
    changed = False
    by_entry: dict[int, list[int]] = {}
    for g, e in enumerate(entry_of):
        if sol.shares[g] > 0:
            by_entry.setdefault(e, []).append(g)
    for members in by_entry.values():
        if len(members) < 2:
            continue
        lead = max(members, key=lambda g: sol.shares[g])
        p = option[lead]
        for g in members:
            if option[g] != p:
                o = opts[g]
                n = -(-int(sol.shares[g]) // int(o.microbatch_size[p]))
                option[g] = p
                times[g] = o.fill_s[p] + (n - 1) * o.bottleneck_s[p]
                changed = True
    if not changed:
        return cand
    aligned = ShareSolution(float(times.max()), sol.shares, option, times)
    other = _score_one(ctx, groups, opts, aligned)
    return other if other is not None and other.objective < cand.objective else cand


def _score_one(
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
    return sorted(devices, key=lambda d: (-s.memory_bytes[d], -ctx.speed[d], d))


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
    # pipelines across nodes: device j of each of K nodes (nodes ranked by make-up, fastest
    # first); groups of equal make-up get equal splits, so a layer's owners sit on one node
    # per chunk and the all-reduce stays inside it when there is one chunk
    kind = {d: ctx.signature(np.array([d]))[0] for d in avail}
    ranked = sorted(nodes, key=lambda n: (-len(n), [-ctx.speed[d] for d in n], n[0]))
    for k in depths(len(ranked)):
        groups = []
        for start in range(0, len(ranked), k):
            part = ranked[start : start + k]
            width = min(len(n) for n in part)
            for j in range(width):
                groups.append(tuple(n[j] for n in part))
            groups.extend((d,) for n in part for d in n[width:])
        out.append((f"cross-node-{k}", groups))
    # kind-homogeneous pipelines, nodes kept together
    by_kind: dict[tuple, list[int]] = {}
    for n in nodes:
        for d in n:
            by_kind.setdefault(kind[d], []).append(d)
    for k in depths(max(len(v) for v in by_kind.values())):
        out.append((f"kind-pipelines-{k}", [c for v in by_kind.values() for c in chunks(v, k)]))
    # one pipeline: the first L devices in file order (the docs/model.md §6 baseline's devices, here
    # with optimised stages, μ and share), and the fastest L devices
    if len(avail) > 1:
        out.append(("pipeline-file-order", [tuple(avail[:num_layers])]))
        fastest = sorted(avail, key=lambda d: (-ctx.speed[d], d))[:num_layers]
        out.append(("pipeline-fastest", [tuple(fastest)]))
        # whole-cluster pipelines in more orders: memory first (1F1B stashes most at the
        # front), slowest first, and node by node (ranked nodes, each ordered as above)
        by_memory = sorted(avail, key=lambda d: (-s.memory_bytes[d], -ctx.speed[d], d))
        out.append(("pipeline-memory", [tuple(by_memory[:num_layers])]))
        out.append(("pipeline-slowest", [tuple(fastest[::-1])]))
        by_node_order = [d for n in ranked for d in n]
        out.append(("pipeline-nodes", [tuple(by_node_order[:num_layers])]))
    seen, unique = set(), []
    for name, groups in out:
        key = tuple(sorted(groups))
        if key not in seen:
            seen.add(key)
            unique.append((name, groups))
    return unique


# solve_structure's refinement pass prunes active prefixes against the incumbent ``best``
# (the first pass against 1.5 × it, since its solution chooses the μ to refine): only a
# solution below ``best`` can be returned, so the plans are those without this pruning
REFINE_BOUND_IS_INCUMBENT = True
# _solve_entries takes each active prefix's devices (and their speeds) as a slice of those of
# every member in ranked order, found once per call, instead of concatenating the prefix's
# members' arrays: the same arrays, one concatenation per call instead of one per prefix (13
# prefixes of up to 1024 groups at 1024 devices)
PREFIX_DEVICES_SLICED = True


def solve_structure(
    ctx: SearchContext,
    groups: Sequence[tuple[int, ...]],
    best: Candidate | None = None,
    *,
    refine: bool = True,
    fixed_bounds: Sequence[np.ndarray | None] | None = None,
    extra_mus: Sequence[int | None] | None = None,
    all_active: bool = False,
) -> Candidate | None:
    """Solve one structure (pruned mode): envelope splits per group (or the given
    ``fixed_bounds`` per group, e.g. a warm start's stages; ``extra_mus``: a μ per group to
    try as well, e.g. the warm start's), shares with identical groups
    merged, idle groups over prefixes ranked by throughput per weight, then ``μ`` refined
    around the shares found. Returns the better of this structure's solution and ``best``.
    ``all_active``: do not try idling groups beyond what the share solver does (the structure
    enumeration covers the smaller structures)."""
    # each group's device array and signature id (SearchContext.group_array_and_signature_id)
    infos = [
        ctx.group_array_and_signature_id(g if type(g) is tuple else tuple(int(d) for d in g))
        for g in groups
    ]
    garr = [info[0] for info in infos]
    fixed = list(fixed_bounds) if fixed_bounds is not None else [None] * len(garr)
    # merge groups with equal signature (identical options)
    entries: dict[tuple, list[int]] = {}
    for g, info in enumerate(infos):
        fk = None if fixed[g] is None else tuple(int(x) for x in fixed[g])
        entries.setdefault((info[1], fk), []).append(g)
    keys = list(entries)
    if best is not None:
        # no μ, split or share of these groups (nor of any subset of them kept active) takes
        # B samples faster than B / Σ_g r_g (SearchContext.rate_bound; groups of one
        # signature have one rate), and the weight is at least V: skip hopeless structures
        total_rate = sum(
            ctx.rate_bound(tuple(int(x) for x in garr[entries[k][0]])) * len(entries[k])
            for k in keys
        )
        if total_rate <= 0.0 or ctx.v * ctx.batch / total_rate > best.objective * (1 + 1e-9):
            return best
    # a group rarely gets more than a few times the average share, and a pipeline of K
    # stages wants about K micro-batches or more: larger μ are left to the refinement
    quick = (
        fixed_bounds is not None
        and extra_mus is not None
        and all(fixed[entries[k][0]] is not None for k in keys)
    )
    mu_lists = []
    for k in keys:
        g0 = entries[k][0]
        cap = -(-4 * ctx.batch // (len(garr) * len(garr[g0])))
        old_mus = {int(extra_mus[g]) for g in entries[k] if extra_mus is not None
                   and extra_mus[g] is not None}  # fmt: skip
        if fixed[g0] is not None and old_mus:
            # warm start with its stages kept: the previous μ and its neighbours
            mus = {
                m for o in old_mus for m in (max(1, o // 2), o - 1, o, o + 1, 2 * o)
                if 1 <= m <= ctx.batch
            }  # fmt: skip
        elif ctx.batch <= MU_EVERY_MAX_BATCH:
            # small batches: every μ, so that shares and μ are solved jointly (a group's
            # options span every μ and the share solver picks, per share, the best)
            mus = set(ctx.mu_candidates(every=True))
        else:
            mus = set(ctx.mu_candidates(cap)) | old_mus
        mu_lists.append(sorted(mus))
    if quick:
        opts = fixed_split_options(
            ctx, [garr[entries[k][0]] for k in keys], [fixed[entries[k][0]] for k in keys],
            mu_lists,
        )  # fmt: skip
        refine = False
    else:
        opts = [
            ctx.envelope_options(garr[entries[k][0]], mus, fixed[entries[k][0]])
            for k, mus in zip(keys, mu_lists, strict=True)
        ]
    feasible = [i for i, o in enumerate(opts) if len(o)]
    if not feasible:
        return best
    # this structure's own solution (pruned only against a loose bound), then refined
    bound = None if best is None else best.objective * 1.5
    chain = ShareChain()  # (the refined pass keeps the time tables of unchanged entries)
    cand = _solve_entries(ctx, garr, entries, keys, opts, feasible, None, bound, quick,
                          all_active, chain)  # fmt: skip
    if cand is not None and refine:
        extra: dict[int, set[int]] = {}
        entry_of = {g: i for i, k in enumerate(keys) for g in entries[k]}
        # (cand's groups are garr's arrays themselves: found by identity, by bytes otherwise)
        same_object = dict(zip(map(id, garr), range(len(garr)), strict=True))
        index_of: dict[bytes, int] | None = None
        done: set[tuple[int, int, int]] = set()
        for devs, mu, b in zip(cand.groups, cand.microbatch_sizes, cand.shares, strict=True):
            g = same_object.get(id(devs))
            if g is None or garr[g] is not devs:
                if index_of is None:
                    index_of = {garr[h].tobytes(): h for h in range(len(garr))}
                g = index_of[np.asarray(devs, dtype=np.int64).tobytes()]
            i = entry_of[g]
            # the μ added below depend only on (entry, μ, share): the groups of one entry
            # (one signature, depth and fixed split) with the same μ and share add the same
            if (i, mu, b) in done:
                continue
            done.add((i, mu, b))
            n = -(-b // mu)
            ns = {n - 1, n, n + 1} if fixed[g] is not None \
                else {1, 2, 3, 4, n - 1, n, n + 1, 2 * n}  # fmt: skip
            extra.setdefault(i, set()).update(-(-b // m) for m in ns if m >= 1)
            # small shares: the neighbouring shares in one micro-batch or in n (the shares
            # were solved with the first μ candidates, and a share one sample larger may want
            # its own μ; for large shares one sample matters little). Pipelines only when
            # B <= 64: each μ costs them an envelope DP (planning time at 16 devices)
            if b <= NEIGHBOUR_MU_MAX_SHARE and (len(devs) == 1 or ctx.batch <= 64):
                extra[i].update(m for b2 in (b - 1, b + 1) if b2 >= 1 for m in (b2, -(-b2 // n)))
        new_opts = list(opts)
        for i, more in extra.items():
            have = set(opts[i].microbatch_size.tolist())
            more = sorted(m for m in more if m not in have and 1 <= m <= ctx.batch)
            if more:
                g0 = entries[keys[i]][0]
                add = ctx.envelope_options(garr[g0], more, fixed[g0])
                new_opts[i] = _merge([opts[i], add])
        # (pruned against the incumbent itself: only a solution below ``best`` is returned,
        # and the first pass's ``cand``, whose μ this pass refines, is already known)
        refine_bound = bound if best is None or not REFINE_BOUND_IS_INCUMBENT else best.objective
        cand = _solve_entries(ctx, garr, entries, keys, new_opts, feasible, cand, refine_bound,
                              quick, all_active, chain)  # fmt: skip
    if cand is not None and (best is None or cand.objective < best.objective):
        return cand
    return best


def fixed_split_options(
    ctx: SearchContext,
    groups: Sequence[np.ndarray],
    bounds: Sequence[np.ndarray],
    mus: Sequence[Sequence[int]],
) -> list[GroupOptions]:
    """Options of groups whose stages are fixed (a warm start), one per ``μ`` of each group's
    list, computed for all groups of one depth at once: ``(G, U, K)`` arrays of the docs/model.md §3
    stage and boundary times, memory limits from :func:`max_microbatches`."""
    st, pre, cfg = ctx.state, ctx.prefix, ctx.config
    out: list[GroupOptions | None] = [None] * len(groups)
    by_depth: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_depth.setdefault(len(g), []).append(i)
    for k, idx in by_depth.items():
        devs = np.stack([np.asarray(groups[i], dtype=np.int64) for i in idx])  # (G, K)
        bnd = np.stack([np.asarray(bounds[i], dtype=np.int64) for i in idx])  # (G, K+1)
        width = max(len(mus[i]) for i in idx)
        mu = np.array([list(mus[i]) + [mus[i][0]] * (width - len(mus[i])) for i in idx])
        mu3 = mu[:, :, None].astype(float)  # (G, U, 1)
        compute = stage_compute_s(
            st, pre, devs[:, None, :], bnd[:, None, :-1], bnd[:, None, 1:], mu3
        )  # (G, U, K)
        fill = compute.sum(axis=2)
        worst = compute.max(axis=2)
        if k > 1:
            a, b = devs[:, :-1], devs[:, 1:]
            bw = np.where(st.node[a] == st.node[b], st.intra_node_bytes_per_s,
                          np.minimum(st.nic_bytes_per_s[a], st.nic_bytes_per_s[b]))  # fmt: skip
            transfer = mu3 * pre.boundary_bytes[bnd[:, 1:-1] - 1][:, None, :] / bw[:, None, :]
            transfer = transfer + 2.0 * st.latency_s
            fill = fill + transfer.sum(axis=2)
            worst = np.maximum(worst, transfer.max(axis=2))
        fixed = pre.fixed_memory_bytes(bnd[:, :-1], bnd[:, 1:], cfg.optimizer_state_factor)
        act = pre.act_mem_bytes[bnd[:, 1:]] - pre.act_mem_bytes[bnd[:, :-1]]
        g_count, u_count = mu.shape
        rows = np.repeat(np.arange(g_count), u_count)
        nmax = max_microbatches(
            None, act[rows], st.memory_bytes[devs][rows],
            mu.reshape(-1, 1), cfg.optimizer_state_factor, cfg.schedule, fixed_bytes=fixed[rows],
        ).reshape(g_count, u_count)  # fmt: skip
        nmax = np.minimum(nmax, -(-ctx.batch // mu))
        for r, i in enumerate(idx):
            keep = nmax[r] >= 1
            out[i] = GroupOptions(
                mu[r][keep], fill[r][keep], worst[r][keep], nmax[r][keep],
                np.repeat(bnd[r][None, :], int(keep.sum()), axis=0),
            )  # fmt: skip
    return out  # type: ignore[return-value]


def _solve_entries(
    ctx: SearchContext,
    garr: Sequence[np.ndarray],
    entries: dict[tuple, list[int]],
    keys: list[tuple],
    opts: Sequence[GroupOptions],
    feasible: Sequence[int],
    best: Candidate | None,
    bound: float | None = None,
    quick: bool = False,
    all_active: bool = False,
    chain: ShareChain | None = None,
) -> Candidate | None:
    """Best solution over active prefixes (ranked entries) that beats ``best`` (returned
    otherwise); prefixes whose lower bounds reach ``bound`` (or ``best``) are skipped.
    ``all_active``: only the whole structure (the share solver may still idle groups; the
    structure search enumerates the smaller structures itself). ``chain``: the share DP's
    states and time tables (:class:`ShareChain`), shared with the caller's other calls."""
    # rank entries by asymptotic throughput (samples/s) per unit of weight
    rate = np.array(
        [
            float((opts[i].microbatch_size / np.maximum(opts[i].bottleneck_s, 1e-300)).max())
            for i in feasible
        ]
    )
    w = np.array([ctx.weight(garr[entries[keys[i]][0]]) - ctx.v for i in feasible])
    queues = bool(np.any(w > 0))
    score = rate / (w + ctx.v / max(len(garr), 1)) if queues else rate
    order = [feasible[i] for i in np.argsort(-score, kind="stable")]
    counts_in_order = [len(entries[keys[i]]) for i in order]
    total = sum(counts_in_order)
    if all_active:
        sizes = [total]
    elif total <= 24:
        sizes = list(range(total, 0, -1))
    else:
        # (a warm re-plan that keeps its stages only tries idling the slowest groups)
        fractions = (
            (0.95, 0.85, 0.7) if quick else (0.9, 0.75, 0.6, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05)
        )
        small = () if quick else (1, 2, 4, 8)
        sizes = sorted({total, *[max(1, int(round(total * f))) for f in fractions], *small},
                       reverse=True)  # fmt: skip
    speeds = ctx.bound_speed
    stacks: dict[int, np.ndarray] = {}
    chain = chain if chain is not None else ShareChain()  # (shared by the prefixes)
    # every member's devices in ranked order, once: the first `size` members' devices are a
    # prefix of them (PREFIX_DEVICES_SLICED; else concatenated per prefix, the same array)
    ranked = [g for i in order for g in entries[keys[i]]]
    all_used = np.concatenate([garr[g] for g in ranked])
    ends = np.cumsum([len(garr[g]) for g in ranked])
    all_speeds = speeds[all_used]
    for size in sizes:
        # the first `size` members in ranked order
        take, left = [], size
        for i, c in zip(order, counts_in_order, strict=True):
            if left <= 0:
                break
            m = min(c, left)
            take.append((i, m))
            left -= m
        if PREFIX_DEVICES_SLICED:
            count = int(ends[size - 1])
            used = all_used[:count]
            t_floor = ctx.batch * ctx.total_flops / float(all_speeds[:count].sum())
        else:
            members = [g for i, m in take for g in entries[keys[i]][:m]]
            used = np.concatenate([garr[g] for g in members])
            t_floor = ctx.batch * ctx.total_flops / float(speeds[used].sum())
        limit = min(
            best.objective if best is not None else np.inf, bound if bound is not None else np.inf
        )
        if t_floor * ctx.weight(used) >= limit:
            continue
        problem = ShareProblem([opts[i] for i, _ in take], ctx.batch, [m for _, m in take],
                               chain)  # fmt: skip
        if np.isfinite(limit) and problem.lp_bound_s() * ctx.weight(used) >= limit:
            continue
        sol = problem.solve()
        if sol is None:
            continue
        best = _score_entries(ctx, garr, [(i, entries[keys[i]][:m]) for i, m in take], opts,
                              stacks, sol, best)  # fmt: skip
    return best


def _score_entries(
    ctx: SearchContext,
    garr: Sequence[np.ndarray],
    blocks: Sequence[tuple[int, Sequence[int]]],
    opts: Sequence[GroupOptions],
    stacks: dict[int, np.ndarray],
    sol: ShareSolution,
    best: Candidate | None,
) -> Candidate | None:
    """:func:`_score` of a share solution of merged entries, entry by entry on flat arrays
    (no per-group Python work, which dominated at 1024 devices): ``blocks`` lists per entry
    ``(i, members)`` (``opts[i]`` its options, ``members`` indices into ``garr``, in the
    order of ``sol``'s members); ``stacks[i]`` caches the entry's device stack. Returns the
    better of ``best`` and the candidate (also with each entry aligned on the split/μ of its
    member with the largest share); the same values as :func:`_score`."""
    shares = sol.shares
    parts = []
    start = 0
    for i, members in blocks:
        devs = stacks.get(i)
        if devs is None or len(devs) < len(members):
            devs = stacks[i] = np.array([garr[g] for g in members])  # (equal lengths: a stack)
        parts.append((i, devs[: len(members)], slice(start, start + len(members))))
        start += len(members)

    def objective(option: np.ndarray, times: np.ndarray) -> tuple[float, float] | None:
        dev_parts, start_parts, end_parts = [], [], []
        num_active = 0
        for i, devs, sl in parts:
            act = shares[sl] > 0
            count = int(np.count_nonzero(act))
            if not count:
                continue
            b = opts[i].bounds[option[sl][act]]
            dev_parts.append(devs[act].ravel())
            start_parts.append(b[:, :-1].ravel())
            end_parts.append(b[:, 1:].ravel())
            num_active += count
        if not num_active:
            return None
        used = np.concatenate(dev_parts)
        sync = ctx.flat_sync_time_s(used, np.concatenate(start_parts),
                                    np.concatenate(end_parts), num_active)  # fmt: skip
        t = float(np.max(times)) + sync
        return t * ctx.weight(used), t

    first = objective(sol.option, sol.group_times_s)
    if first is None:
        return best
    option = sol.option
    aligned_option = sol.option.copy()
    aligned_times = sol.group_times_s.copy()
    changed = False
    for i, _, sl in parts:
        sh = shares[sl]
        act = (sh > 0).nonzero()[0]
        if len(act) < 2:
            continue
        block = aligned_option[sl]  # (a view)
        lead = act[int(np.argmax(sh[act]))]
        p = block[lead]
        move = act[block[act] != p]
        if len(move):
            o = opts[i]
            n = -(-sh[move] // o.microbatch_size[p])
            block[move] = p
            aligned_times[sl][move] = o.fill_s[p] + (n - 1) * o.bottleneck_s[p]
            changed = True
    if changed:
        other = objective(aligned_option, aligned_times)
        if other is not None and other[0] < first[0]:
            first, option = other, aligned_option
    obj, t = first
    if best is not None and not obj < best.objective:
        return best
    groups, bounds, mus = [], [], []
    for (i, members), (_, _, sl) in zip(blocks, parts, strict=True):
        o = opts[i]
        act = (shares[sl] > 0).nonzero()[0]
        chosen = option[sl][act]
        groups.extend([garr[members[k]] for k in act.tolist()])
        bounds.extend(o.bounds[chosen])
        mus.extend(o.microbatch_size[chosen].tolist())
    return Candidate(obj, t, groups, bounds, mus, shares[shares > 0].tolist())


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
    if deadline is not None and best is not None and time.perf_counter() > deadline:
        return best
    structures = [list(s) for s in extra_structures] + [g for _, g in candidate_structures(ctx)]
    for groups in structures:
        if deadline is not None and best is not None and time.perf_counter() > deadline:
            break
        best = solve_structure(ctx, groups, best)
    if len(ctx.available) >= MIXED_DEPTH_MIN_DEVICES:
        best = mixed_depth_search(ctx, best, deadline=deadline)
    return best


def _swapped(devs: tuple[int, ...], i: int, j: int) -> tuple[int, ...]:
    out = list(devs)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


def _moved(devs: tuple[int, ...], i: int, j: int) -> tuple[int, ...]:
    out = list(devs)
    out.insert(j, out.pop(i))
    return tuple(out)


def _structure_moves(
    ctx: SearchContext, groups: list[tuple[int, ...]], unused: list[int]
) -> Iterator[list[tuple[int, ...]]]:
    """Neighbouring structures of ``groups`` (cheap moves first). Groups of equal signature
    form a class and a move applies to every member of a class at once (a no-op on small
    clusters, where classes are single groups; on large ones it keeps identical groups
    identical, so the share solver still merges them): swap two adjacent devices, then any
    two, or move one to another position; move the last or first device of a pipeline to its
    own group, out of the structure, or onto the end of another class's pipelines; drop a
    class; add an unused device as its own group, at the end or the front of a pipeline;
    merge a class with another one (zipped, both orders); split pipelines at a cut."""
    num_layers = ctx.prefix.num_layers
    classes: dict[tuple, list[int]] = {}
    for g, devs in enumerate(groups):
        classes.setdefault(ctx.group_array_and_signature_id(devs)[1], []).append(g)
    members = list(classes.values())

    def rebuild(changed: dict[int, list[tuple[int, ...]]]) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for g, devs in enumerate(groups):
            out.extend(changed.get(g, [devs]))
        return [x for x in out if x]

    for cls in members:  # swap adjacent devices
        k = len(groups[cls[0]])
        for i in range(k - 1):
            yield rebuild({g: [groups[g][:i] + (groups[g][i + 1], groups[g][i])
                               + groups[g][i + 2 :]] for g in cls})  # fmt: skip
    for cls in members:  # swap any two devices; move one device to another position
        k = len(groups[cls[0]])
        for i in range(k):
            for j in range(i + 2, k):
                yield rebuild({g: [_swapped(groups[g], i, j)] for g in cls})
        for i in range(k):
            for j in range(k):
                if j not in (i, i + 1, i - 1):
                    yield rebuild({g: [_moved(groups[g], i, j)] for g in cls})
    for cls in members:  # the last or first device to its own group, or unused
        if len(groups[cls[0]]) < 2:
            continue
        yield rebuild({g: [groups[g][:-1], (groups[g][-1],)] for g in cls})
        yield rebuild({g: [groups[g][1:], (groups[g][0],)] for g in cls})
        yield rebuild({g: [groups[g][:-1]] for g in cls})
        yield rebuild({g: [groups[g][1:]] for g in cls})
    if len(members) > 1:
        for cls in members:  # a class of groups unused
            yield rebuild({g: [] for g in cls})
    for d in unused:  # an unused device: its own group, or the end/front of a pipeline
        yield [*groups, (d,)]
        for cls in members:
            if len(groups[cls[0]]) < num_layers:
                g = cls[0]
                yield rebuild({g: [groups[g] + (d,)]})
                yield rebuild({g: [(d,) + groups[g]]})
    for a, ca in enumerate(members):  # move a device between classes; merge classes
        for b, cb in enumerate(members):
            if a == b:
                continue
            pairs = list(zip(ca, cb, strict=False))
            if len(groups[ca[0]]) >= 2 and len(groups[cb[0]]) < num_layers:
                change = {}
                for ga, gb in pairs:
                    change[ga] = [groups[ga][:-1]]
                    change[gb] = [groups[gb] + (groups[ga][-1],)]
                yield rebuild(change)
            if a < b and len(groups[ca[0]]) + len(groups[cb[0]]) <= num_layers:
                for first, second in ((ca, cb), (cb, ca)):
                    yield rebuild(
                        {
                            **{
                                ga: [groups[ga] + groups[gb]]
                                for ga, gb in zip(first, second, strict=False)
                            },
                            **{gb: [] for _, gb in zip(first, second, strict=False)},
                        }
                    )
    for cls in members:  # split pipelines
        k = len(groups[cls[0]])
        for cut in range(1, k):
            yield rebuild({g: [groups[g][:cut], groups[g][cut:]] for g in cls})


def local_search(
    ctx: SearchContext,
    best: Candidate | None,
    *,
    max_solves: int,
    deadline: float | None = None,
    cpu_budget_s: float | None = None,
    starts: Callable[[], Sequence[Candidate]] | None = None,
) -> Candidate | None:
    """Polish by first-improvement local search over :func:`_structure_moves` (each
    neighbour re-solved by :func:`solve_structure`: stages, μ refined around the shares,
    exact shares), from ``best`` and then, once that descent converged, from each of
    ``starts()`` (e.g. the best whole-cluster pipeline, which a descent from a hybrid rarely
    reaches; computed only then), at most ``max_solves`` structure
    solves in all, until ``deadline`` (``time.perf_counter()``) and within ``cpu_budget_s``
    seconds of process CPU time. Returns the best found."""
    if best is None:
        return best
    cpu_stop = None if cpu_budget_s is None else time.process_time() + cpu_budget_s
    seen: set[tuple] = set()
    solves = 0
    queue = [best]
    while queue:
        current = queue.pop(0)
        improved = True
        while improved:
            improved = False
            groups = [tuple(int(x) for x in g) for g in current.groups]
            used = {d for g in groups for d in g}
            unused = [int(d) for d in ctx.available if int(d) not in used]
            # μ moves: the same structure with each group's μ ± 1 among its candidates
            for step in (-1, 1):
                # current's own groups: the μ - 1 move may have idled some (then the old
                # groups outnumbered current's μs: IndexError on 20000 devices)
                mu_groups = [tuple(int(x) for x in g) for g in current.groups]
                mus = [max(1, int(m) + step) for m in current.microbatch_sizes]
                solves += 1
                cand = solve_structure(ctx, mu_groups, current, extra_mus=mus)
                if cand is not current and cand.objective < current.objective * (1 - 1e-9):
                    current = cand
            for trial in _structure_moves(ctx, groups, unused):
                key = tuple(sorted(trial))
                if key in seen:
                    continue
                seen.add(key)
                if (
                    solves >= max_solves
                    or (deadline is not None and time.perf_counter() > deadline)
                    or (cpu_stop is not None and time.process_time() > cpu_stop)
                ):
                    return best if best.objective <= current.objective else current
                if structure_bound(ctx, trial) >= current.objective:
                    continue  # cannot beat the current structure with all its groups active
                solves += 1
                cand = solve_structure(ctx, trial, current)
                if cand is not current and cand.objective < current.objective * (1 - 1e-9):
                    current, improved = cand, True
                    break
        if current.objective < best.objective:
            best = current
        if starts is not None:
            queue.extend(starts())
            starts = None
    return best


def whole_cluster_pipelines(ctx: SearchContext) -> list[tuple[int, ...]]:
    """The single-pipeline structures of :func:`candidate_structures` (first ``L`` devices in
    file, speed, memory, slowest-first and node order)."""
    return [
        groups[0]
        for name, groups in candidate_structures(ctx)
        if name.startswith("pipeline-") and len(groups) == 1
    ]


def mixed_depth_search(
    ctx: SearchContext, best: Candidate | None, *, deadline: float | None = None
) -> Candidate | None:
    """Pipeline depth chosen per kind of node: nodes of equal make-up form a class; each
    class cuts its nodes into pipelines of depth ``K ∈ {1, 2, 4, …, node size}``. One pass of
    coordinate descent from "one group per node", class by class (fastest classes first),
    keeping a depth when the objective improves. Worth it when kinds differ in NIC or memory:
    slow-NIC devices want deep pipelines (less to all-reduce), fast ones shallow."""
    s = ctx.state
    num_layers = ctx.prefix.num_layers
    by_node: dict[int, list[int]] = {}
    for d in ctx.available:
        by_node.setdefault(int(s.node[d]), []).append(int(d))
    classes: dict[tuple, list[list[int]]] = {}
    for devs in by_node.values():
        devs = _order_in_node(ctx, devs)
        make_up = tuple(ctx.signature(np.array([d]))[0][0] + (float(s.nic_bytes_per_s[d]),)
                        for d in devs)  # fmt: skip
        classes.setdefault(make_up, []).append(devs)
    if len(classes) < 2:
        return best
    keys = sorted(classes, key=lambda c: -sum(x[0] for x in c) * len(classes[c]))

    def groups_for(choice: dict[tuple, int]) -> list[tuple[int, ...]]:
        out = []
        for c, nodes in classes.items():
            k = choice[c]
            for n in nodes:
                out.extend(tuple(n[i : i + k]) for i in range(0, len(n), k))
        return out

    choice = {c: min(len(c), num_layers) for c in keys}
    current = solve_structure(ctx, groups_for(choice))
    if current is None:
        return best
    for c in keys:
        size = min(len(c), num_layers)
        options = sorted({1, size, *[2**i for i in range(1, 8) if 2**i < size]})
        for k in options:
            if k == choice[c]:
                continue
            if deadline is not None and best is not None and time.perf_counter() > deadline:
                break
            trial = dict(choice)
            trial[c] = k
            cand = solve_structure(ctx, groups_for(trial))
            if cand is not None and cand.objective < current.objective:
                current, choice = cand, trial
    if best is None or current.objective < best.objective:
        return current
    return best


def polish_splits(
    ctx: SearchContext, cand: Candidate | None, *, max_evals: int = 256
) -> Candidate | None:
    """Re-choose each active group's stages by the **iteration time**, sync included, with
    its devices, ``μ`` and share fixed (issue 12: splits with the same group time can differ
    in the parameter bytes each device all-reduces; a split with a slightly longer group time
    can save more sync than it costs).

    One pass of coordinate descent over the groups: for group g every split (all of them
    when there are at most :data:`ALL_SPLITS_MAX`, else the envelope splits of its ``μ``)
    that fits its micro-batches, in increasing group time ``T_g``, is scored as
    ``max(max_{h≠g} T_h, T_g) + T_sync`` (docs/model.md §3, :func:`sync_times_s`) until that group
    time alone reaches the current iteration time (``T_sync ≥ 0``) or ``max_evals`` sync
    evaluations in all. Returns ``cand`` unchanged when nothing is better, and on structures
    of more than :data:`POLISH_SPLITS_MAX_GROUPS` groups (each sync evaluation costs
    ``O(L G')``); the objective is rescaled (the devices, hence the weight, are unchanged)."""
    if (
        cand is None
        or (len(cand.groups) < 2 and not ctx.prefix.has_shared)
        or len(cand.groups) > POLISH_SPLITS_MAX_GROUPS
    ):
        return cand
    st, pre, cfg = ctx.state, ctx.prefix, ctx.config
    groups = [np.asarray(g, dtype=np.int64) for g in cand.groups]
    bounds = [np.asarray(b, dtype=np.int64) for b in cand.bounds]
    times = []
    for devs, b, mu, share in zip(groups, bounds, cand.microbatch_sizes, cand.shares,
                                  strict=True):  # fmt: skip
        t = split_table(st, pre, devs, b[None, :], mu, cfg.optimizer_state_factor, cfg.schedule)
        times.append(float(t.fill_s[0] + (-(-share // mu) - 1) * t.bottleneck_s[0]))
    current = max(times) + ctx.sync_time_s(groups, bounds)
    evals = 0
    for g, devs in enumerate(groups):
        k = len(devs)
        mu, share = int(cand.microbatch_sizes[g]), int(cand.shares[g])
        n = -(-share // mu)
        if count_splits(pre.num_layers, k) <= ALL_SPLITS_MAX:
            options = enumerate_splits(pre.num_layers, k)
        else:
            options = ctx.envelope_options(devs, [mu]).bounds
        if len(options) <= 1:
            continue
        table = split_table(st, pre, devs, options, mu, cfg.optimizer_state_factor, cfg.schedule)
        t_g = np.where(table.max_microbatches >= n,
                       table.fill_s + (n - 1) * table.bottleneck_s, np.inf)  # fmt: skip
        others = max((times[h] for h in range(len(groups)) if h != g), default=0.0)
        for p in np.argsort(t_g, kind="stable"):
            t_groups = max(others, float(t_g[p]))
            if not np.isfinite(t_g[p]) or t_groups >= current or evals >= max_evals:
                break
            if np.array_equal(options[p], bounds[g]):
                continue
            evals += 1
            trial = [*bounds[:g], options[p], *bounds[g + 1 :]]
            total = t_groups + ctx.sync_time_s(groups, trial)
            if total < current * (1 - 1e-12):
                current, bounds, times[g] = total, trial, float(t_g[p])
    if current >= cand.iteration_time_s * (1 - 1e-12):
        return cand
    return Candidate(
        cand.objective * current / cand.iteration_time_s, current, list(groups), bounds,
        list(cand.microbatch_sizes), list(cand.shares),
    )  # fmt: skip


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
