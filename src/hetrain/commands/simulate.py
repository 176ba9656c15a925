"""Body of ``hetrain simulate`` (docs/model.md §7): run a policy over a trace for N slots.

Never imports torch (tested). Bad input of any kind raises :class:`~hetrain.errors.InputError`
(one line, exit 2): unreadable or invalid files, a trace naming unknown devices, negative speeds
or slots out of order (:func:`hetrain.trace.load_trace`), an unknown policy, ``--V`` not > 0,
``--slots`` < 1 or above :data:`MAX_SLOTS` / :data:`MAX_DEVICE_SLOTS`, ``--decision-delay``
outside ``[0, MAX_DECISION_DELAY]``, a trace where no device is
available in any slot, a ``--csv-out`` that cannot be written, a model that fits on no
arrangement of the devices, or a budget below the cheapest plan's cost (the message states the
minimum feasible budget).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from hetrain._io import MIN_POSITIVE, check_output_path
from hetrain._text import energy_per_iteration, money_per_iteration, plural
from hetrain.cluster import ClusterSpec, ClusterState, load_cluster
from hetrain.errors import InputError, NoFeasiblePlanError, no_fit_input_error
from hetrain.profile import ProfileArrays, load_profile
from hetrain.trace import Trace, TraceTimeline, load_trace

MAX_SLOTS = 10**6
"""Most slots ``hetrain simulate`` runs (a few ms each: about an hour)."""

MAX_DECISION_DELAY = 1000
"""Largest ``--decision-delay`` (slots)."""

MAX_DEVICE_SLOTS = 10**7
"""Most slots × devices: the trace is expanded to dense ``(slots, D)`` arrays (~0.3 GB)."""


def minimum_budget(
    timeline: TraceTimeline,
    profile: ProfileArrays,
    config,
    resource: str,
    slots: int,
    samples: int = 8,
) -> float:
    """The least long-run average cost per iteration of ``resource`` any policy can reach on
    this trace, estimated as the mean over ``samples`` evenly spaced slots of the cheapest plan's
    cost in that slot's state (the planner with ``V → 0``: minimise ``y_j`` alone).
    The searches share ``hetrain plan``'s soft time budget (256 devices × 1000 layers searched
    for minutes without it); instances that need more get an upper estimate.

    Raises:
        NoFeasiblePlanError: some sampled slot has no feasible plan.
    """
    from hetrain.commands.plan import PLAN_TIME_BUDGET_S
    from hetrain.planner import best_plan

    picks = np.unique(np.linspace(0, max(slots - 1, 0), num=min(samples, slots)).astype(int))
    rate_of = {"money": "price_per_s", "energy": "power_w"}[resource]
    costs: list[float] = []
    seen: dict[bytes, float] = {}
    for t in picks:
        state = timeline.state_at(int(t))
        if not state.available.any():
            continue
        key = b"".join(
            np.ascontiguousarray(a).tobytes()
            for a in (state.available, state.speed_flops, state.nic_bytes_per_s,
                      getattr(state, rate_of))
        )  # fmt: skip
        if key not in seen:
            rate = float(np.sum(getattr(state, rate_of)[state.available]))
            if rate <= 0:
                seen[key] = 0.0
            else:
                # V -> 0: minimise y_j alone (V·T is 1e-9 of any plan's y_j <= T·rate)
                cheap = best_plan(
                    state, profile, config, v=1e-9 * rate, queues={resource: 1.0},
                    time_budget_s=PLAN_TIME_BUDGET_S / len(picks),
                )  # fmt: skip
                seen[key] = float((cheap.cost or {})[resource])
        costs.append(seen[key])
    return float(np.mean(costs)) if costs else 0.0


def run_simulate(
    *,
    cluster: Path,
    model: Path,
    batch: int,
    trace: Path | None,
    slots: int,
    policy: str,
    v: float,
    budgets: Mapping[str, float],
    optimizer_state_factor: float,
    csv_out: Path | None,
    json_out: bool,
    plan: Path | None = None,
    norm_block: int | None = None,
    decision_delay: int = 1,
    search_latency: int | None = None,
) -> int:
    """Run ``hetrain simulate``; print the docs/model.md §7 summary (``--json``) or a short report.
    ``norm_block``: ``--norm-block G`` (every plan keeps shares and μ multiples of ``G``).

    Returns:
        0 on success.

    Raises:
        InputError: any bad input (see module docstring).
    """
    from hetrain.commands.plan import check_v, training_config
    from hetrain.control import POLICY_NAMES, make_policy
    from hetrain.sim.simulator import simulate

    for flag, value in (("--cluster", cluster), ("--model", model), ("--batch", batch)):
        if value is None:
            raise InputError(flag, "", "a value (or --replay RUN_DIR)")

    spec: ClusterSpec = load_cluster(cluster)
    profile = load_profile(model).arrays()
    config = training_config(batch, optimizer_state_factor, norm_block=norm_block)
    max_slots = min(MAX_SLOTS, MAX_DEVICE_SLOTS // len(spec.devices))
    if not 1 <= slots <= max_slots:
        raise InputError(
            "--slots",
            "",
            f"expected an integer between 1 and {max_slots} (at most {MAX_DEVICE_SLOTS:.0e} "
            f"device-slots for {plural(len(spec.devices), 'device')}), got {slots}",
        )
    if policy not in POLICY_NAMES and plan is None:
        raise InputError(
            "--policy", "", f"expected one of {', '.join(POLICY_NAMES)}, got {policy!r}"
        )
    check_v(v)
    if not 0 <= decision_delay <= MAX_DECISION_DELAY:
        raise InputError(
            "--decision-delay",
            "",
            f"expected an integer between 0 and {MAX_DECISION_DELAY} (slots), got {decision_delay}",
        )
    if search_latency is not None and not 0 <= search_latency <= MAX_DECISION_DELAY:
        raise InputError(
            "--search-latency",
            "",
            f"expected an integer between 0 and {MAX_DECISION_DELAY} (slots), got {search_latency}",
        )
    for name, value in budgets.items():
        if value < MIN_POSITIVE:  # the controller divides by the budget squared
            raise InputError(
                "--budget", name, f"expected a number >= {MIN_POSITIVE:g}, got {value:g}"
            )
    if csv_out is not None:
        check_output_path("--csv-out", csv_out)
        # the per-slot rows overwrote the input they were simulated from
        for option, path in (("--cluster", cluster), ("--model", model), ("--trace", trace),
                             ("--plan", plan)):  # fmt: skip
            if path is not None and Path(csv_out).resolve() == Path(path).resolve():
                raise InputError(
                    "--csv-out", "", f"expected a file other than the {option} input, got {path}"
                )
    parsed = load_trace(trace, spec) if trace is not None else Trace((), "<no trace>")
    timeline = parsed.timeline(spec, slots)
    if not timeline.available.any():
        raise InputError(
            str(trace),
            "available",
            f"expected some device available in some of the {plural(slots, 'slot')} (all are 0)",
        )
    if not budgets:
        _check_model_fits(spec.state(), profile, config, str(model))
    for name, value in budgets.items():
        try:
            least = minimum_budget(timeline, profile, config, name, slots)
        except NoFeasiblePlanError as exc:
            raise no_fit_input_error(str(model), exc) from None
        if value < least * (1.0 - 1e-9):
            raise InputError(
                "--budget",
                name,
                f"expected at least the minimum feasible budget {least:.6g} per iteration "
                f"(the cheapest plan's {name}, averaged over the trace), got {value:g}",
            )
    if plan is not None:
        from hetrain.control.policies import FixedPlanPolicy
        from hetrain.plan import load_plan

        fixed = load_plan(plan)
        fixed.validate_for(spec.ids, profile.num_layers, batch, str(plan))
        from hetrain.plan import check_norm_block

        check_norm_block(fixed, norm_block, str(plan))
        from hetrain.costmodel import evaluate_plan

        ev = evaluate_plan(fixed, spec.state(), profile, config)
        if not ev.fits:
            raise InputError(
                str(plan), "groups", f"device {ev.out_of_memory[0]!r} runs out of memory"
            )
        pol = FixedPlanPolicy(fixed)
    else:
        pol = make_policy(
            policy,
            profile,
            config,
            v=v,
            budgets=budgets or None,
            decision_delay_slots=decision_delay,
        )
    result = simulate(
        pol, timeline, profile, config, slots=slots, budgets=budgets,
        decision_delay=decision_delay, search_latency=search_latency,
    )  # fmt: skip
    if csv_out is not None:
        try:
            result.write_csv(csv_out)
        except OSError as exc:
            raise InputError(
                "--csv-out", "", f"cannot write {str(csv_out)!r} ({exc.strerror})"
            ) from None
    summary = result.summary()
    if json_out:
        print(json.dumps(summary))
        return 0
    _print_report(summary, batch)
    return 0


def run_replay(run: Path, *, json_out: bool = False) -> int:
    """``hetrain simulate --replay RUN``: the controller's decisions on the run's recorded
    measurements (:func:`hetrain.sim.replay.replay_run`) next to the run's own; prints them
    (``--json``: ``{"decisions", "recorded", "matches_recorded"}``). Returns 0 when they
    match, 1 when they differ.

    Raises:
        InputError: no replayable controller log in ``run``.
    """
    from hetrain.sim.replay import read_controller_log, recorded_decisions, replay_run

    decisions = replay_run(run)
    recorded = recorded_decisions(run)
    same = decisions == recorded
    _, rows = read_controller_log(run)
    answer = [float(r["decide_time_s"]) for r in rows if "decide_time_s" in r]
    step = [float(r["measured_time_s"]) for r in rows if r.get("measured_time_s")]
    latency = None
    if answer and step:
        latency = {
            "median_decide_time_s": float(np.median(answer)),
            "p95_decide_time_s": float(np.percentile(answer, 95)),
            "median_step_time_s": float(np.median(step)),
        }
        latency["fraction_of_step"] = latency["p95_decide_time_s"] / latency["median_step_time_s"]
    if json_out:
        print(json.dumps({"decisions": decisions, "recorded": recorded, "matches_recorded": same,
                          "decision_latency": latency}))  # fmt: skip
    else:
        for d in decisions:
            shares = " ".join(f"{k}:{v}" for k, v in d["shares_after"].items())
            print(f"after step {d['step']}: plan {d['plan_id']}: {shares}")
        print(
            f"{len(decisions)} decisions replayed; "
            + ("the same as the run's" if same else f"the run logged {len(recorded)}, different")
        )
        if latency is not None:
            print(
                f"the run's controller answered in {latency['median_decide_time_s'] * 1e3:.1f} ms"
                f" (95th percentile {latency['p95_decide_time_s'] * 1e3:.1f} ms, "
                f"{latency['fraction_of_step']:.2f} of the median step)"
            )
    return 0 if same else 1


def _check_model_fits(
    state: ClusterState, profile: ProfileArrays, config, model_source: str
) -> None:
    from hetrain.planner import baselines, best_plan

    # a docs/model.md §6 static plan that fits settles it cheaply; otherwise ask the full search
    for make in (baselines.dp_even_plan, baselines.pipeline_plan, baselines.static_hybrid_plan):
        if make(state, profile, config) is not None:
            return
    try:
        best_plan(state, profile, config)
    except NoFeasiblePlanError as exc:
        raise no_fit_input_error(model_source, exc) from None


def _print_report(summary: dict, batch: int) -> None:
    t = summary["mean_iteration_time_s"]
    lb = summary["mean_lower_bound_s"]
    print(f"policy {summary['policy']}, {plural(summary['slots'], 'slot')}, batch B = {batch}")
    if t is None:
        print("infeasible: no slot had a plan that fits")
        return
    ratio = t / lb if lb else math.inf
    print(f"mean iteration time {t:.6g} s  (lower bound {lb:.6g} s, ratio {ratio:.3f})")
    cost = summary["mean_cost"]
    line = (
        f"mean cost per iteration: money {money_per_iteration(cost['money'])}, "
        f"energy {energy_per_iteration(cost['energy'])}"
    )
    print(line)
    for name, budget in summary["budgets"].items():
        unit = money_per_iteration if name == "money" else energy_per_iteration
        print(f"budget {name} {unit(budget)}: mean {unit(cost[name])} "
              f"({cost[name] / budget:.3f} of budget)")  # fmt: skip
    print(f"plan changes {summary['plan_changes']}, infeasible slots {summary['infeasible_slots']}")
