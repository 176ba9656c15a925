"""The short report at the end of ``hetrain train``: text summary + plots from the metrics file.

Never imports torch (reads the JSONL metrics file only).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from hetrain._io import read_jsonl as read_metrics


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures of a run from its events: steps, replans, mean iteration time per plan,
    final loss, validation metrics (``end`` event)."""
    steps = [e for e in events if e.get("event") == "step"]
    replans = [e for e in events if e.get("event") == "replan"]
    per_plan: dict[int, list[float]] = {}
    for e in steps:
        per_plan.setdefault(int(e["plan_id"]), []).append(float(e["iteration_time_s"]))
    end = next((e for e in reversed(events) if e.get("event") == "end"), {})
    return {
        "steps": len(steps),
        "replans": len(replans),
        "replan_steps": [r["step"] for r in replans],
        "median_iteration_time_s_per_plan": {
            k: statistics.median(v) for k, v in sorted(per_plan.items())
        },
        "final_loss": steps[-1]["loss"] if steps else None,
        "metrics": end.get("metrics", {}),
        "wall_time_s": end.get("wall_time_s"),
    }


def controller_log_path(metrics_path: str | Path) -> Path:
    """The controller's per-step predictions beside the metrics (``controller.jsonl``)."""
    return Path(metrics_path).with_name("controller.jsonl")


def slowdown_changes(events: list[dict[str, Any]]) -> list[tuple[int, dict[str, float]]]:
    """The steps whose emulated slow-down factors (a step record's ``slowdown``: factor per
    device) differ from those of the step before in the same round, each with the factors
    that changed (``{device: new factor}``), in step order.

    A round is the part of the metrics file between two ``restart`` records (a resumed run
    or a restart of the ranks appends to the same file, with a ``restart`` record first; a
    step number that does not follow the previous one starts a round too). Rounds are not
    compared with each other: a run resumed with fewer or other devices, or other
    ``--slowdown`` settings, has no slow-down at its resume. Within a round a device missing
    from a step's ``slowdown`` (``{}``: no emulation) runs at factor 1.
    """
    out: list[tuple[int, dict[str, float]]] = []
    previous: dict[str, float] | None = None
    previous_step: int | None = None
    for e in events:
        kind = e.get("event")
        if kind == "restart":
            previous = None
            continue
        if kind != "step":
            continue
        step = int(e["step"])
        if previous_step is not None and step != previous_step + 1:
            previous = None
        previous_step = step
        now = {str(d): float(f) for d, f in (e.get("slowdown") or {}).items()}
        if previous is not None:
            changed = {
                d: now.get(d, 1.0)
                for d in sorted(set(now) | set(previous))
                if now.get(d, 1.0) != previous.get(d, 1.0)
            }
            if changed:
                out.append((step, changed))
        previous = now
    return out


def slowdown_step(events: list[dict[str, Any]]) -> int | None:
    """First step whose emulated slow-down factors differ from those of the first step of its
    round (None: no change): the first of :func:`slowdown_changes` (rounds as there)."""
    changes = slowdown_changes(events)
    return changes[0][0] if changes else None


def compare_with_dp_even(
    events: list[dict[str, Any]], controller_rows: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """Mean measured iteration time after the slow-down next to even data parallelism on the
    same measured speeds.

    The controller logs, for every step, the docs/model.md §3 prediction of the plan in force and of
    dp-even (docs/model.md §6) on its current estimates. The model leaves out per-step costs that
    are
    the same for every plan (Python, optimizer, launch), so dp-even's measured-scale figure is
    its prediction times the run's measured/predicted ratio over the same steps
    (``dp_even_time_s``); the raw predictions are given too. The speed-up is never stated above
    what the measured speeds allow: with per-sample speeds ``s_d`` (the controller's estimates
    at the last row) even data parallelism takes ``(B/D)/min_d s_d`` of compute and a perfect
    balance ``B/Σ_d s_d``, so the figure is capped at ``Σ_d s_d / (D · min_d s_d)``
    (``speedup_bound``; 2.5 for one 3x-slow device of four) and ``dp_even_time_s`` with it;
    where the rows carry ``lower_bound_s`` (``T_LB + F`` on the same estimates, which no
    plan's prediction is below), also at the mean dp-even prediction over the mean of those,
    the most the cost model on those estimates lets any plan gain.
    ``None`` without a slow-down or without controller rows after it.
    """
    start = slowdown_step(events)
    if start is None:
        return None
    measured = {
        int(e["step"]): float(e["iteration_time_s"])
        for e in events
        if e.get("event") == "step" and int(e["step"]) >= start
    }
    rows = [r for r in controller_rows if int(r["step"]) in measured]
    if not rows or not measured:
        return None
    mean_measured = statistics.fmean(measured.values())
    pred = statistics.fmean(float(r["predicted_time_s"]) for r in rows)
    even = statistics.fmean(float(r["dp_even_time_s"]) for r in rows)
    ratio = statistics.fmean(measured[int(r["step"])] for r in rows) / pred if pred > 0 else 1.0
    speedup = even * ratio / mean_measured if mean_measured > 0 else None
    bound = speedup_bound(rows[-1].get("speed_flops"))
    lower = [float(r["lower_bound_s"]) for r in rows if r.get("lower_bound_s")]
    if len(lower) == len(rows):  # the model's own bound on the same estimates, same rows
        model_bound = even / statistics.fmean(lower)
        bound = model_bound if bound is None else min(bound, model_bound)
    if speedup is not None and bound is not None and speedup > bound:
        speedup = bound
    return {
        "slowdown_step": start,
        "mean_measured_time_s": mean_measured,
        "mean_predicted_time_s": pred,
        "dp_even_predicted_time_s": even,
        "measured_over_predicted": ratio,
        "dp_even_time_s": mean_measured * speedup if speedup is not None else even * ratio,
        "speedup_over_dp_even": speedup,
        "speedup_bound": bound,
    }


def speedup_bound(speeds_flops: dict[str, float] | None) -> float | None:
    """``Σ_d s_d / (D · min_d s_d)``: the most any balance of the batch over devices of speeds
    ``s_d`` (FLOP/s) can gain over equal shares on compute (equal shares wait for the slowest
    device's ``B/D`` samples; a perfect balance takes ``B/Σ s_d``); None without speeds."""
    values = [float(v) for v in (speeds_flops or {}).values() if v and float(v) > 0]
    if not values:
        return None
    return sum(values) / (len(values) * min(values))


def comparison_line(cmp: dict[str, Any]) -> str:
    """One console line of :func:`compare_with_dp_even`."""
    return (
        f"after the slow-down (step {cmp['slowdown_step']} on): mean iteration "
        f"{cmp['mean_measured_time_s'] * 1e3:.1f} ms measured; even data parallelism on the "
        f"same measured speeds: {cmp['dp_even_time_s'] * 1e3:.1f} ms "
        f"({cmp['speedup_over_dp_even']:.2f}x; predicted {cmp['mean_predicted_time_s'] * 1e3:.1f}"
        f" vs {cmp['dp_even_predicted_time_s'] * 1e3:.1f} ms)"
    )


def write_report(metrics_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Plots (``iteration_time.png``, ``timeline_<step>.png``, ``predicted_vs_measured.png``
    when the controller logged predictions) and ``report.txt`` into ``out_dir``; returns the
    summary with ``files`` and ``dp_even`` (:func:`compare_with_dp_even`)."""
    from hetrain.report.plots import (
        plot_iteration_times,
        plot_predicted_vs_measured,
        plot_timeline,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    events = read_metrics(metrics_path)
    summary = summarize(events)
    ctl_path = controller_log_path(metrics_path)
    controller_rows = read_metrics(ctl_path) if ctl_path.is_file() else []
    files = []
    if summary["steps"]:
        files.append(plot_iteration_times(events, out / "iteration_time.png"))
    if controller_rows:
        files.append(
            plot_predicted_vs_measured(events, controller_rows, out / "predicted_vs_measured.png")
        )
    summary["dp_even"] = compare_with_dp_even(events, controller_rows)
    for e in events:
        if e.get("event") == "timeline":
            files.append(plot_timeline(e, out / f"timeline_step{e['step']}.png"))
    lines = [
        f"steps: {summary['steps']}, plan changes: {summary['replans']} "
        f"(before steps {summary['replan_steps']})",
        "median iteration time per plan: "
        + ", ".join(
            f"plan {k}: {v:.4f}s" for k, v in summary["median_iteration_time_s_per_plan"].items()
        ),
        f"final training loss: {summary['final_loss']}",
        "validation: " + ", ".join(f"{k} {v:.4f}" for k, v in summary["metrics"].items()),
        "plots: " + ", ".join(str(f) for f in files),
    ]
    if summary["dp_even"]:
        lines.insert(2, comparison_line(summary["dp_even"]))
    (out / "report.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary["files"] = [str(f) for f in files]
    summary["text"] = lines
    return summary
