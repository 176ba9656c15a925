"""An independent brute-force planner for tiny instances (tests only).

Enumerates every plan: every non-empty subset of devices, every way to cut it into groups
(restricted-growth labels), every order inside each group, every split of the layers per group,
every micro-batch size 1..B per group and every share vector (b_g >= 1; a plan with an idle
group has the same objective as the plan without it). It shares no code with hetrain's cost
model or planner: SPEC §3 is re-implemented here from the text, on plain dicts and floats.
The min over shares uses the exact decomposition min_b max_g T_g(b_g) (each T_g depends only
on its own b_g), computed over all compositions by a min-max convolution.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def _devices(cluster: dict) -> list[dict]:
    out = []
    for d in cluster["devices"]:
        out.append(
            {
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


def _group_table(devs, order, cuts, layers, shared, links, batch, o, schedule) -> np.ndarray:
    """T_g(b) for b = 0..B (inf where nothing fits), min over mu = 1..B."""
    k_count = len(order)
    stages = [range(cuts[k], cuts[k + 1]) for k in range(k_count)]
    best = np.full(batch + 1, np.inf)
    for mu in range(1, batch + 1):
        c = []
        for k, st in enumerate(stages):
            d = devs[order[k]]
            c.append(
                mu * sum(layers[i]["fw"] for i in st) / d["speed"] + d["kappa"]
                + d["lam"] * len(st)
            )  # fmt: skip
        e = []
        for k in range(k_count - 1):
            d1, d2 = devs[order[k]], devs[order[k + 1]]
            bw = links["intra"] if d1["node"] == d2["node"] else min(d1["nic"], d2["nic"])
            last = stages[k][-1]
            e.append(mu * 2 * layers[last]["a"] / bw + 2 * links["lat"])
        fill = sum(c) + sum(e)
        worst = max(c + e)
        for b in range(1, batch + 1):
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


def _min_max_shares(tables: list[np.ndarray], batch: int) -> float:
    """min over b_g >= 1 with sum B of max_g T_g(b_g)."""
    cur = tables[0].copy()
    cur[0] = np.inf
    for t in tables[1:]:
        nxt = np.full(batch + 1, np.inf)
        for total in range(batch + 1):
            for x in range(1, total):
                nxt[total] = min(nxt[total], max(cur[total - x], t[x]))
        cur = nxt
    return float(cur[batch])


def _sync(devs, groups, layers, shared, links) -> float:
    """groups: list of (order, cuts); T_sync of SPEC §3 (v3) with all groups active: per
    device the ring all-reduce of its layers' trainable bytes among the G' groups, plus per
    trainable shared tensor it holds the ring all-reduce among all n_s holders."""
    g_count = len(groups)
    holders = []  # (device, set of layers)
    for order, cuts in groups:
        for k, dev in enumerate(order):
            holders.append((dev, set(range(cuts[k], cuts[k + 1]))))
    worst = 0.0
    for gi, (order, cuts) in enumerate(groups):
        for k, dev in enumerate(order):
            mine = set(range(cuts[k], cuts[k + 1]))
            t = 0.0
            if g_count > 1:
                local = True
                for gj, (order2, cuts2) in enumerate(groups):
                    if gj == gi:
                        continue
                    for k2, dev2 in enumerate(order2):
                        if mine & set(range(cuts2[k2], cuts2[k2 + 1])) and (
                            devs[dev2]["node"] != devs[dev]["node"]
                        ):
                            local = False
                beta = links["intra"] if local else devs[dev]["nic"]
                theta = sum(layers[i]["p"] for i in mine)
                t += 2 * (g_count - 1) * links["lat"] + 2 * (g_count - 1) / g_count * theta / beta
            for tensor in shared:
                if tensor["frozen"] or not tensor["layers"] & mine:
                    continue
                others = [d2 for d2, ls in holders if d2 != dev and tensor["layers"] & ls]
                n_s = len(others) + 1
                if n_s < 2:
                    continue
                local = all(devs[d2]["node"] == devs[dev]["node"] for d2 in others)
                beta = links["intra"] if local else devs[dev]["nic"]
                t += 2 * (n_s - 1) * links["lat"] + 2 * (n_s - 1) / n_s * tensor["bytes"] / beta
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
    o: float = 2.0,
    schedule: str = "1f1b",
) -> float:
    """Least V*T + Q_money * y_money over every plan (inf if nothing fits)."""
    devs = _devices(cluster)
    layers = _layers(profile)
    num_layers = len(layers)
    links = {
        "intra": cluster.get("links", {}).get("intra_node_gbps", 800.0) * 1e9 / 8,
        "lat": cluster.get("links", {}).get("latency_us", 20.0) * 1e-6,
    }
    shared = _shared(profile)
    table_cache: dict = {}
    best = math.inf
    for size in range(1, len(devs) + 1):
        for subset in itertools.combinations(range(len(devs)), size):
            price = sum(devs[d]["price"] for d in subset)
            for labels in _labelings(size):
                blocks = [
                    [subset[i] for i in range(size) if labels[i] == lab]
                    for lab in range(max(labels) + 1)
                ]
                if len(blocks) > batch:
                    continue
                for orders in itertools.product(*(itertools.permutations(b) for b in blocks)):
                    split_lists = [
                        [
                            (0, *c, num_layers)
                            for c in itertools.combinations(range(1, num_layers), len(o_) - 1)
                        ]
                        for o_ in orders
                    ]
                    for cuts in itertools.product(*split_lists):
                        tables = []
                        for order, cut in zip(orders, cuts, strict=True):
                            key = (order, cut)
                            if key not in table_cache:
                                table_cache[key] = _group_table(
                                    devs, order, cut, layers, shared, links, batch, o, schedule
                                )
                            tables.append(table_cache[key])
                        t_groups = _min_max_shares(tables, batch)
                        if not math.isfinite(t_groups):
                            continue
                        groups = list(zip(orders, cuts, strict=True))
                        t = t_groups + _sync(devs, groups, layers, shared, links)
                        best = min(best, v * t + queue_money * t * price)
    return best
