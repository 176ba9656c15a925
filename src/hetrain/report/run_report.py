"""The short report at the end of ``hetrain train``: text summary + plots from the metrics file.

Never imports torch (reads the JSONL metrics file only).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Events of a JSONL metrics file in order (a torn last line is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


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


def write_report(metrics_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Plots (``iteration_time.png``, ``timeline_<step>.png``) and ``report.txt`` into
    ``out_dir``; returns the summary with ``files``."""
    from hetrain.report.plots import plot_iteration_times, plot_timeline

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    events = read_metrics(metrics_path)
    summary = summarize(events)
    files = []
    if summary["steps"]:
        files.append(plot_iteration_times(events, out / "iteration_time.png"))
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
    (out / "report.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary["files"] = [str(f) for f in files]
    summary["text"] = lines
    return summary
