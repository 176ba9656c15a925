"""Policy benchmark: every SPEC §6 baseline and the Lyapunov controller on the scenarios of
``bench/scenarios/*.yaml`` (real model profiles, catalog devices fitted on measured data, and
dynamics converted from the real traces in ``../shared/data``).

Usage::

    PYTHONPATH=src python bench/policies.py [--only NAME] [--slots N] [--no-scale]

Prints, per scenario and policy, the mean iteration time (migration included), its ratio to the
lower bound ``T_LB`` (SPEC §3), its ratio to the best baseline, and the mean cost against the
budget; then the targets of issue 4 with pass/fail; then the run time of a 1024-device,
1000-slot simulation; the last line is JSON ``{"scenarios": {NAME: {POLICY:
{"mean_iteration_time_s", "ratio_to_lower_bound", "mean_cost"}}}, "scale": {...}}``.

Scenario file keys: ``name``, ``description``, ``model`` (profile path relative to the
repository), ``batch``, ``slots``, ``seed``, ``cluster`` (``kinds: {KIND: count}`` plus
:func:`hetrain.catalog.make_cluster` keywords), ``dynamics`` (any of ``generate`` — keywords of
:func:`hetrain.sim.dynamics.generate_trace` — ``stragglers``, ``bamboo_events``,
``spot_log``, ``spot_prices``; each converter entry names a file under the data folder and the
device-id prefixes it applies to), ``noise`` (``time``, ``measurement``), ``budget``
(``money``: currency per iteration, or ``money_fraction_of_greedy``: that fraction of greedy's
mean cost; checked against the minimum feasible budget),
``fast_links`` (whether the 1.3x-of-lower-bound target applies).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hetrain.catalog import DEVICE_KINDS, make_cluster  # noqa: E402
from hetrain.commands.simulate import minimum_budget  # noqa: E402
from hetrain.control import BASELINE_NAMES, make_policy  # noqa: E402
from hetrain.costmodel import TrainingConfig  # noqa: E402
from hetrain.profile import load_profile  # noqa: E402
from hetrain.sim import converters  # noqa: E402
from hetrain.sim.dynamics import generate_trace  # noqa: E402
from hetrain.sim.simulator import simulate  # noqa: E402
from hetrain.trace import Trace  # noqa: E402

DATA = Path(os.environ.get("HETRAIN_SHARED_DATA", "/work/shared/data"))
POLICIES = ("lyapunov", "greedy", *BASELINE_NAMES)


def _select(ids: list[str], prefixes: list[str] | None) -> list[str]:
    if not prefixes:
        return list(ids)
    return [d for d in ids if any(d.startswith(p) for p in prefixes)]


def build_rows(spec: dict, ids: list[str], slots: int, seed: int) -> list:
    """Trace rows of a scenario's ``dynamics`` block (generators and converters)."""
    dyn = spec.get("dynamics") or {}
    rows = []
    if "generate" in dyn:
        gen = dict(dyn["generate"])
        devices = _select(ids, gen.pop("devices", None))
        rows += generate_trace(devices, slots, seed, **gen)
    for entry in dyn.get("stragglers", []):
        rows += converters.straggler_rows_from_alibaba(
            DATA / entry["file"], _select(ids, entry.get("devices")), slots,
            samples_per_slot=entry.get("samples_per_slot", 1),
        )  # fmt: skip
    for entry in dyn.get("bamboo_events", []):
        rows += converters.bamboo_event_rows(
            DATA / entry["file"], _select(ids, entry.get("devices")), slots,
            slot_seconds=entry.get("slot_seconds", 60.0),
        )  # fmt: skip
    for entry in dyn.get("spot_log", []):
        rows += converters.spot_log_rows(
            DATA / entry["file"], _select(ids, entry.get("devices")), slots,
            slot_seconds=entry.get("slot_seconds", 60.0),
        )  # fmt: skip
    for entry in dyn.get("spot_prices", []):
        rows += converters.spot_price_rows(
            DATA / entry["file"], _select(ids, entry.get("devices")), slots,
            slot_seconds=entry.get("slot_seconds", 3600.0),
            gpus_per_instance=entry.get("gpus_per_instance", 1),
        )  # fmt: skip
    rows.sort(key=lambda r: r.slot)
    return rows


def run_scenario(spec: dict, slots_override: int | None = None) -> dict:
    """Run every policy on one scenario; returns ``{policy: figures}`` plus metadata."""
    slots = int(slots_override or spec.get("slots", 200))
    seed = int(spec.get("seed", 0))
    cluster_kw = dict(spec["cluster"])
    kinds = cluster_kw.pop("kinds")
    cluster = make_cluster(kinds, **cluster_kw)
    profile = load_profile(ROOT / spec["model"]).arrays()
    config = TrainingConfig(batch=int(spec["batch"]))
    rows = build_rows(spec, cluster.ids, slots, seed)
    timeline = Trace(tuple(rows), spec["name"]).timeline(cluster, slots)
    noise = spec.get("noise") or {}
    sim_kw = {
        "time_noise": float(noise.get("time", 0.0)),
        "measurement_noise": float(noise.get("measurement", 0.0)),
        "seed": seed,
    }
    results, budgets = {}, {}
    for name in POLICIES:
        if name == "lyapunov" and "budget" in spec:
            continue
        pol = make_policy(name, profile, config)
        results[name] = simulate(pol, timeline, profile, config, **sim_kw)
    if "budget" in spec:
        if "money" in spec["budget"]:
            budgets = {"money": float(spec["budget"]["money"])}
        else:
            greedy_money = results["greedy"].summary()["mean_cost"]["money"]
            budgets = {"money": float(spec["budget"]["money_fraction_of_greedy"]) * greedy_money}
        least = minimum_budget(timeline, profile, config, "money", slots)
        if budgets["money"] < least:
            raise SystemExit(f"{spec['name']}: budget {budgets['money']:.4g} is below the "
                             f"minimum feasible {least:.4g}")  # fmt: skip
        print(f"{spec['name']}: money budget {budgets['money']:.4g} per iteration, minimum "
              f"feasible {least:.4g}")  # fmt: skip
        pol = make_policy("lyapunov", profile, config, v=float(spec.get("v", 1.0)),
                          budgets=budgets)  # fmt: skip
        results["lyapunov"] = simulate(pol, timeline, profile, config, budgets=budgets, **sim_kw)
    speeds = [DEVICE_KINDS[k].tflops for k in kinds]
    out = {"_results": results, "_timeline": timeline, "_profile": profile, "_config": config,
           "_sim_kw": sim_kw}  # fmt: skip
    out["_meta"] = {"slots": slots, "batch": config.batch, "model": spec["model"],
                     "devices": len(cluster.ids), "budgets": budgets,
                     "speed_ratio_slowest_to_fastest": min(speeds) / max(speeds),
                     "heterogeneous": bool(spec.get("heterogeneous", len(kinds) > 1)),
                     "fast_links": bool(spec.get("fast_links", False))}  # fmt: skip
    for name in POLICIES:
        res = results[name]
        s = res.summary()
        t, lb = s["mean_iteration_time_s"], s["mean_lower_bound_s"]
        out[name] = {
            "mean_iteration_time_s": t,
            "ratio_to_lower_bound": (t / lb) if t is not None and lb else None,
            "mean_cost": s["mean_cost"],
            "mean_lower_bound_s": lb,
            "plan_changes": s["plan_changes"],
            "infeasible_slots": s["infeasible_slots"],
            "searches": res.searches,
            "wall_time_s": res.wall_time_s,
        }
    return out


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "infeasible" if x is None else format(x, spec)


def report(name: str, out: dict) -> list[tuple[str, bool, str]]:
    """Print one scenario's table; return the targets ``(what, passed, detail)``."""
    meta = out["_meta"]
    base_times = [out[b]["mean_iteration_time_s"] for b in BASELINE_NAMES]
    feasible = [
        t
        for t in base_times
        if t is not None and out[BASELINE_NAMES[base_times.index(t)]]["infeasible_slots"] == 0
    ]  # noqa: E501
    best = min(feasible) if feasible else None
    budget = meta["budgets"].get("money")
    extra = f", money budget {budget:.4g}/iter" if budget else ""
    print(f"\n== {name}: {meta['devices']} devices, model {meta['model']}, B = {meta['batch']}, "
          f"{meta['slots']} slots{extra}")  # fmt: skip
    print(f"{'policy':16s} {'mean T (s)':>11s} {'T/T_LB':>7s} {'T/best':>7s} {'money/iter':>11s} "
          f"{'vs budget':>9s} {'changes':>7s} {'infeas':>6s} {'wall s':>6s}")  # fmt: skip
    for pol in POLICIES:
        r = out[pol]
        t = r["mean_iteration_time_s"]
        money = r["mean_cost"]["money"]
        vs = "" if not budget or money is None else f"{money / budget:.3f}"
        rel = "" if t is None or best is None else f"{t / best:.3f}"
        print(f"{pol:16s} {_fmt(t):>11s} {_fmt(r['ratio_to_lower_bound'], '.3f'):>7s} {rel:>7s} "
              f"{_fmt(money):>11s} {vs:>9s} {r['plan_changes']:>7d} {r['infeasible_slots']:>6d} "
              f"{r['wall_time_s']:>6.1f}")  # fmt: skip
    checks = []
    ly = out["lyapunov"]["mean_iteration_time_s"]
    if budget:
        spent = out["lyapunov"]["mean_cost"]["money"] / budget
        checks.append(("lyapunov mean money within 2% of budget", spent <= 1.02,
                       f"{spent:.3f} of budget"))  # fmt: skip
        ly = out["greedy"]["mean_iteration_time_s"]  # time targets: budgets aside
    if best is not None and ly is not None:
        checks.append(("no slower than every baseline", ly <= best * 1.0 + 1e-12,
                       f"{ly / best:.3f} of best baseline"))  # fmt: skip
    even = out["dp-even"]["mean_iteration_time_s"]
    lb = out["lyapunov"]["mean_lower_bound_s"]
    if meta["heterogeneous"] and even is not None and ly is not None and lb:
        gap = (even - ly) / (even - lb) if even > lb else 1.0
        checks.append(("closes >= 60% of dp-even's gap to T_LB", gap >= 0.6, f"{gap:.2f}"))
        if meta["speed_ratio_slowest_to_fastest"] <= 1 / 3:
            cut = 1 - ly / even
            checks.append(("slowest <= 1/3 fastest: >= 40% lower than dp-even", cut >= 0.4,
                           f"{cut:.2f} lower"))  # fmt: skip
    if meta["fast_links"] and ly is not None and lb:
        checks.append(("fast links: within 1.3x of T_LB", ly / lb <= 1.3, f"{ly / lb:.3f}"))
    for what, ok, detail in checks:
        print(f"  target {'PASS' if ok else 'FAIL'}: {what} ({detail})")
    return checks


def write_plots(name: str, out: dict, folder: Path) -> None:
    """Per-policy plots of one scenario; for a budgeted scenario also the V sweep."""
    from hetrain.report.sim_plots import plot_policies, plot_v_sweep

    folder.mkdir(parents=True, exist_ok=True)
    results = [out["_results"][p] for p in POLICIES]
    plot_policies(results, folder / f"{name}.png", title=name)
    budgets = out["_meta"]["budgets"]
    if budgets:
        sweep = {}
        for v in (0.3, 1.0, 3.0, 10.0, 30.0):
            pol = make_policy("lyapunov", out["_profile"], out["_config"], v=v, budgets=budgets)
            sweep[v] = simulate(pol, out["_timeline"], out["_profile"], out["_config"],
                                budgets=budgets, **out["_sim_kw"])  # fmt: skip
        plot_v_sweep(sweep, folder / f"{name}-v-sweep.png")
        for v, res in sweep.items():
            s = res.summary()
            print(f"  V={v:<5g} mean T {s['mean_iteration_time_s']:.4g} s, money/iter "
                  f"{s['mean_cost']['money']:.4g} ({s['mean_cost']['money'] / budgets['money']:.3f}"
                  f" of budget), final backlog {s['final_backlog']['money']:.4g}")  # fmt: skip


def scale_run(devices: int = 1024, slots: int = 1000) -> dict:
    """Wall time of the Lyapunov controller on a ``devices``-device mixed cluster for ``slots``
    slots with drift, stragglers and preemptions (the 'under a minute' target of issue 4)."""
    from hetrain.catalog import make_mixed_cluster

    cluster = make_mixed_cluster(devices, devices_per_node=8, seed=0)
    profile = load_profile(ROOT / "examples/profiles/gpt2-small.json").arrays()
    config = TrainingConfig(batch=4096)
    rows = generate_trace(cluster.ids, slots, 0, drift={"sigma": 0.01},
                          stragglers={"rate": 0.0005, "slowdown": 0.3},
                          preemption={"rate": 0.0002, "mean_downtime_slots": 100})  # fmt: skip
    timeline = Trace(tuple(rows)).timeline(cluster, slots)
    started = time.perf_counter()
    pol = make_policy("lyapunov", profile, config)
    res = simulate(pol, timeline, profile, config, time_noise=0.02, measurement_noise=0.02)
    wall = time.perf_counter() - started
    s = res.summary()
    return {"devices": devices, "slots": slots, "wall_time_s": wall, "searches": res.searches,
            "plan_changes": s["plan_changes"], "ratio_to_lower_bound":
            s["mean_iteration_time_s"] / s["mean_lower_bound_s"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", type=Path, default=ROOT / "bench" / "scenarios")
    ap.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    ap.add_argument("--slots", type=int, default=None, help="override every scenario's slots")
    ap.add_argument("--no-scale", action="store_true", help="skip the 1024-device timing run")
    ap.add_argument(
        "--plots",
        type=Path,
        default=None,
        help="write per-scenario plots (and the V sweep of budgeted scenarios) here",
    )
    args = ap.parse_args(argv)
    specs = [yaml.safe_load(p.read_text()) for p in sorted(args.scenarios.glob("*.yaml"))]
    if args.only:
        specs = [s for s in specs if s["name"] in args.only]
    summary: dict = {"scenarios": {}}
    failed = 0
    for spec in specs:
        out = run_scenario(spec, args.slots)
        failed += sum(1 for _, ok, _ in report(spec["name"], out) if not ok)
        summary["scenarios"][spec["name"]] = {
            pol: {
                k: out[pol][k]
                for k in ("mean_iteration_time_s", "ratio_to_lower_bound", "mean_cost")
            }  # fmt: skip
            for pol in POLICIES
        }
        summary["scenarios"][spec["name"]]["budget"] = out["_meta"]["budgets"]
        if args.plots is not None:
            write_plots(spec["name"], out, args.plots)
    if not args.no_scale:
        sc = scale_run()
        print(f"\nscale: lyapunov, {sc['devices']} devices, {sc['slots']} slots: "
              f"{sc['wall_time_s']:.1f} s wall ({sc['searches']} searches, {sc['plan_changes']} "
              f"plan changes, T/T_LB {sc['ratio_to_lower_bound']:.3f}); target < 60 s: "
              f"{'PASS' if sc['wall_time_s'] < 60 else 'FAIL'}")  # fmt: skip
        summary["scale"] = sc
    print(f"\ntargets failed: {failed}")
    print(
        json.dumps(summary, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    )
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
