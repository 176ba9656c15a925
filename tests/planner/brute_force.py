"""An independent brute-force planner for tiny instances (tests only).

Enumerates every plan: every non-empty subset of devices, every way to cut it into groups
(restricted-growth labels), every order inside each group, every split of the layers per group,
every micro-batch size 1..B per group and every share vector (b_g >= 1; a plan with an idle
group has the same objective as the plan without it). With a norm block G only multiples of G
are allowed for shares and micro-batch sizes. It shares no code with hetrain's cost model or
planner: docs/model.md §3 (v3: per-layer overhead λ, frozen parameters, shared tensors;
measured per-layer times per device kind) is
re-implemented here from the text, on plain dicts, floats and Python sets.

The min over shares uses the exact decomposition min_b max_g T_g(b_g) (each T_g depends only
on its own b_g), computed over all compositions by a min-max convolution.

Two prunings, both exact (they skip only plans that cannot beat the best found so far):
* a subset of devices is skipped when (a device with measured times counts with the speed
  ``max_l (f_l + w_l) / min_{μ=1..B} t_l(μ)/μ``, so that its stage times are at least
  ``μ F / s`` too) ``w · B Σ_l (f_l + w_l) / Σ_{d in subset} s_d`` already
  reaches the best objective (``w = V + Σ_j Q_j rate_j``): every group needs at least
  ``n μ max_k c_k ≥ b_g F / Σ_{k in g} s_k`` (``max_k F_k/s_k ≥ Σ F_k / Σ s_k``), so
  ``max_g T_g ≥ B F / Σ s``;
* a plan's sync time is computed only when its group time alone does not reach the best
  (sync ≥ 0).
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def device_kind(device: dict) -> str:
    """docs/model.md §7: the explicit ``kind``, else the id without a trailing ``-<digits>``."""
    if "kind" in device:
        return device["kind"]
    head, sep, tail = device["id"].rpartition("-")
    return head if sep and head and tail.isdigit() else device["id"]


def _measured_time(table: dict, layer: int, mu: float) -> float:
    """docs/model.md §3: a layer's forward + backward seconds per micro-batch of ``mu`` from a
    profile's measured table: linear between measured sizes, along the line through the two
    nearest sizes outside them, proportional to ``mu`` with one size; at least 0."""
    sizes = table["microbatch_sizes"]
    times = [f[layer] + b[layer] for f, b in zip(table["fwd_s"], table["bwd_s"], strict=True)]
    if len(sizes) == 1:
        return max(0.0, times[0] * mu / sizes[0])
    lo = 0
    while lo + 2 < len(sizes) and sizes[lo + 1] <= mu:
        lo += 1
    x0, x1, y0, y1 = sizes[lo], sizes[lo + 1], times[lo], times[lo + 1]
    return max(0.0, y0 + (mu - x0) * (y1 - y0) / (x1 - x0))


def _devices(cluster: dict, profile: dict | None = None) -> list[dict]:
    measured = (profile or {}).get("measured_times", {})
    out = []
    for d in cluster["devices"]:
        out.append(
            {
                "table": measured.get(device_kind(d)),
                "id": d["id"],
                "node": d.get("node", d["id"]),
                "speed": d["tflops"] * 1e12,
                "mem": d["memory_gib"] * 2.0**30,
                "nic": d["nic_gbps"] * 1e9 / 8,
                "watts": d.get("power_w", 0.0),
                "price": d.get("price_per_hour", 0.0) / 3600.0,
                "kappa": d.get("microbatch_overhead_ms", 0.0) / 1000.0,
                "lam": d.get("layer_overhead_ms", 0.0) / 1000.0,
            }
        )
    return out


def _layers(profile: dict) -> list[dict]:
    out = []
    for ly in profile["layers"]:
        f = ly["fwd_flops"]
        out.append(
            {
                "fw": f + ly.get("bwd_flops", 2 * f),
                "a": ly["activation_bytes"],
                "m": ly.get("activation_memory_bytes", ly["activation_bytes"]),
                "p": ly.get("param_bytes", 0.0),
                "p0": ly.get("frozen_param_bytes", 0.0),
                "nu": ly.get("overhead_weight", 1.0),
            }
        )
    return out


def _shared(profile: dict) -> list[dict]:
    return [
        {"bytes": t["bytes"], "layers": set(t["layers"]), "frozen": t.get("frozen", False)}
        for t in profile.get("shared", [])
    ]


def _fixed_memory(stage, layers, shared, o) -> float:
    """theta' (2 + o) + phi of one stage: its layers' trainable and frozen bytes, plus every
    shared tensor one of its layers uses (trainable: 2 + o times; frozen: once)."""
    mem = sum(layers[i]["p"] * (2 + o) + layers[i]["p0"] for i in stage)
    for t in shared:
        if t["layers"] & set(stage):
            mem += t["bytes"] * (1 if t["frozen"] else 2 + o)
    return mem


def _group_table(devs, order, cuts, layers, shared, links, batch, o, schedule, block):
    """T_g(b) for b = 0..B (inf where nothing fits or b is not a multiple of the norm block),
    min over mu = block, 2 block, ..., B."""
    k_count = len(order)
    stages = [range(cuts[k], cuts[k + 1]) for k in range(k_count)]
    best = np.full(batch + 1, np.inf)
    for mu in range(block, batch + 1, block):
        c = []
        for k, st in enumerate(stages):
            d = devs[order[k]]
            if d["table"] is not None:  # measured times: no κ, no λ
                c.append(sum(_measured_time(d["table"], i, mu) for i in st))
                continue
            c.append(
                mu * sum(layers[i]["fw"] for i in st) / d["speed"] + d["kappa"]
                + d["lam"] * sum(layers[i]["nu"] for i in st)
            )  # fmt: skip
        e = []
        for k in range(k_count - 1):
            d1, d2 = devs[order[k]], devs[order[k + 1]]
            bw = links["intra"] if d1["node"] == d2["node"] else min(d1["nic"], d2["nic"])
            last = stages[k][-1]
            e.append(mu * 2 * layers[last]["a"] / bw + 2 * links["lat"])
        fill = sum(c) + sum(e)
        worst = max(c + e)
        for b in range(block, batch + 1, block):
            n = math.ceil(b / mu)
            ok = True
            for k, st in enumerate(stages):
                act = sum(layers[i]["m"] for i in st)
                h = n if schedule == "gpipe" else min(n, k_count - k)
                if _fixed_memory(st, layers, shared, o) + h * mu * act > devs[order[k]]["mem"]:
                    ok = False
                    break
            if ok:
                best[b] = min(best[b], fill + (n - 1) * worst)
    return best


class _MinMax:
    """min over b_g >= 1 with sum B of max_g T_g(b_g), by a min-max convolution."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        total = np.arange(batch + 1)[:, None]
        x = np.arange(batch + 1)[None, :]
        self.valid = (x >= 1) & (x <= total - 1)  # the new group gets x, the others total - x
        self.rest = np.clip(total - x, 0, batch)
        self.x = np.broadcast_to(x, self.rest.shape)

    def __call__(self, tables: list[np.ndarray]) -> float:
        cur = tables[0].copy()
        cur[0] = np.inf
        for t in tables[1:]:
            pair = np.maximum(cur[self.rest], t[self.x])
            cur = np.where(self.valid, pair, np.inf).min(axis=1)
        return float(cur[self.batch])


def _sync(devs, holders, g_count, layers, shared, links) -> float:
    """T_sync of docs/model.md §3 (v3) with all groups active. ``holders``: per device of the plan
    (group index, device index, set of its layers). Per device: the ring all-reduce of its
    layers' trainable bytes among the G' groups (intra-node bandwidth iff every device of
    another group holding one of its layers is on its node, else its NIC), plus per trainable
    shared tensor it holds the ring all-reduce among all n_s holders (same rule over them)."""
    lat = links["lat"]
    worst = 0.0
    for gi, dev, mine in holders:
        node = devs[dev]["node"]
        t = 0.0
        if g_count > 1:
            local = all(
                devs[d2]["node"] == node for gj, d2, theirs in holders if gj != gi and mine & theirs
            )
            beta = links["intra"] if local else devs[dev]["nic"]
            theta = sum(layers[i]["p"] for i in mine)
            t += 2 * (g_count - 1) * lat + 2 * (g_count - 1) / g_count * theta / beta
        for tensor in shared:
            if tensor["frozen"] or not tensor["layers"] & mine:
                continue
            others = [d2 for _, d2, theirs in holders if d2 != dev and tensor["layers"] & theirs]
            n_s = len(others) + 1
            if n_s < 2:
                continue
            local = all(devs[d2]["node"] == node for d2 in others)
            beta = links["intra"] if local else devs[dev]["nic"]
            t += 2 * (n_s - 1) * lat + 2 * (n_s - 1) / n_s * tensor["bytes"] / beta
        worst = max(worst, t)
    return worst


def _labelings(n: int):
    """Restricted growth strings: every partition of n items into unordered blocks."""

    def rec(prefix, top):
        if len(prefix) == n:
            yield list(prefix)
            return
        for lab in range(top + 2):
            yield from rec(prefix + [lab], max(top, lab))

    yield from rec([], -1)


def brute_force_objective(
    cluster: dict,
    profile: dict,
    batch: int,
    *,
    v: float = 1.0,
    queue_money: float = 0.0,
    queue_energy: float = 0.0,
    o: float = 2.0,
    schedule: str = "1f1b",
    norm_block: int | None = None,
) -> float:
    """Least V*T + Q_money * y_money + Q_energy * y_energy over every plan (inf if nothing
    fits)."""
    devs = _devices(cluster, profile)
    layers = _layers(profile)
    shared = _shared(profile)
    num_layers = len(layers)
    block = norm_block or 1
    links = {
        "intra": cluster.get("links", {}).get("intra_node_gbps", 800.0) * 1e9 / 8,
        "lat": cluster.get("links", {}).get("latency_us", 20.0) * 1e-6,
    }
    total_flops = sum(ly["fw"] for ly in layers)
    for d in devs:
        if d["table"] is not None:
            # a speed with mu F_l / speed <= t_l(mu) for every layer and mu = 1..B, so the
            # subset pruning below stays exact
            speed = 0.0
            for i, ly in enumerate(layers):
                per_sample = min(_measured_time(d["table"], i, mu) / mu
                                 for mu in range(1, batch + 1))  # fmt: skip
                if ly["fw"] > 0:
                    speed = max(speed, ly["fw"] / per_sample if per_sample > 0 else math.inf)
            d["speed"] = speed
    minmax = _MinMax(batch)
    cands_cache: dict = {}

    def candidates(block_devs: tuple[int, ...]) -> list:
        """Every (order, cuts) of a group of these devices: its T_g table and its holders."""
        if block_devs not in cands_cache:
            out = []
            if len(block_devs) <= num_layers:
                for order in itertools.permutations(block_devs):
                    for c in itertools.combinations(range(1, num_layers), len(order) - 1):
                        cuts = (0, *c, num_layers)
                        table = _group_table(devs, order, cuts, layers, shared, links, batch,
                                             o, schedule, block)  # fmt: skip
                        if np.isfinite(table[1:]).any():
                            stages = [set(range(cuts[k], cuts[k + 1])) for k in range(len(order))]
                            out.append((table, list(zip(order, stages, strict=True))))
            cands_cache[block_devs] = out
        return cands_cache[block_devs]

    best = math.inf
    for size in range(len(devs), 0, -1):
        for subset in itertools.combinations(range(len(devs)), size):
            w = v + sum(
                queue_money * devs[d]["price"] + queue_energy * devs[d]["watts"] for d in subset
            )
            speed = sum(devs[d]["speed"] for d in subset)
            if w * batch * total_flops / speed >= best:
                continue
            for labels in _labelings(size):
                blocks = [
                    tuple(subset[i] for i in range(size) if labels[i] == lab)
                    for lab in range(max(labels) + 1)
                ]
                if len(blocks) * block > batch:
                    continue
                per_block = [candidates(b) for b in blocks]
                for combo in itertools.product(*per_block):
                    t_groups = minmax([table for table, _ in combo])
                    if not math.isfinite(t_groups) or w * t_groups >= best:
                        continue
                    holders = [
                        (gi, dev, stage)
                        for gi, (_, devices) in enumerate(combo)
                        for dev, stage in devices
                    ]
                    t = t_groups + _sync(devs, holders, len(combo), layers, shared, links)
                    best = min(best, w * t)
    return best
