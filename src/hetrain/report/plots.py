"""Plots of a training run (matplotlib, imported lazily, Agg backend; never imports torch).

- :func:`plot_iteration_times`: iteration time over steps, plan changes marked (vertical
  lines labelled with the new plan id), loss on a second axis.
- :func:`plot_timeline`: one iteration per group as a Gantt chart, one row per stage (rank):
  compute (forward + backward, emulated slow-down hatched), time blocked in pipeline
  send/recv, gradient sync and optimizer, from the engine's per-rank measurements
  (``StepResult``); per-micro-batch events are drawn when the engine provides ``events``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetrain.report.run_report import slowdown_changes


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_iteration_times(events: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Iteration time (s) per step with plan changes marked; writes ``path`` (PNG)."""
    plt = _plt()
    steps = [e for e in events if e.get("event") == "step"]
    replans = [e for e in events if e.get("event") == "replan"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = [e["step"] for e in steps]
    ax.plot(xs, [e["iteration_time_s"] for e in steps], lw=1.2, label="iteration time (s)")

    def mark(step: int, text: str, color: str, ls: str, lw: float, top: bool) -> None:
        """A vertical line before ``step`` labelled ``text`` at the top or the bottom."""
        ax.axvline(step - 0.5, color=color, ls=ls, lw=lw)
        ax.annotate(text, (step - 0.5, 1.0 if top else 0.0), xycoords=("data", "axes fraction"),
                    rotation=90, va="top" if top else "bottom", ha="right", fontsize=7,
                    color=color)  # fmt: skip

    for r in replans:
        mark(r["step"], f"plan {r['plan_id']}", "tab:red", "--", 0.9, top=True)
    # emulated slow-down changes (trace, demo) within a round, dotted grey (a resume on other
    # devices is not one: run_report.slowdown_changes)
    for step, changed in slowdown_changes(events):
        text = " ".join(f"{d}x{f:g}" for d, f in changed.items())
        mark(step, text, "tab:gray", ":", 1.0, top=False)
    ax.set_xlabel("step")
    ax.set_ylabel("iteration time (s)")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(xs, [e["loss"] for e in steps], color="tab:gray", lw=0.8, alpha=0.6, label="loss")
    ax2.set_ylabel("loss")
    ax.set_title("iteration time over steps (dashed: plan changes, dotted: emulated slow-down)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_predicted_vs_measured(
    events: Sequence[dict[str, Any]], controller_rows: Sequence[dict[str, Any]], path: str | Path
) -> Path:
    """Measured iteration time per step next to the controller's docs/model.md §3 prediction of the
    plan
    in force and of even data parallelism on the same estimates (``controller.jsonl``); writes
    ``path`` (PNG)."""
    plt = _plt()
    steps = [e for e in events if e.get("event") == "step"]
    replans = [e for e in events if e.get("event") == "replan"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(
        [e["step"] for e in steps],
        [e["iteration_time_s"] for e in steps],
        lw=1.0,
        label="measured",
    )
    xs = [r["step"] for r in controller_rows]
    ax.plot(xs, [r["predicted_time_s"] for r in controller_rows], lw=1.2, label="predicted (plan)")
    ax.plot(
        xs,
        [r["dp_even_time_s"] for r in controller_rows],
        lw=1.0,
        ls="--",
        label="predicted (dp-even)",
    )
    for r in replans:
        ax.axvline(r["step"] - 0.5, color="tab:red", ls="--", lw=0.9)
    ax.set_xlabel("step")
    ax.set_ylabel("iteration time (s)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title("predicted vs measured iteration time (dashed red: plan changes)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(timeline: dict[str, Any], path: str | Path) -> Path:
    """Gantt chart of one iteration: a panel per group, a row per stage; writes ``path``."""
    plt = _plt()
    plan = timeline["plan"]
    ranks = {r["device_id"]: r for r in timeline["ranks"]}
    groups = [g for g in plan["groups"] if g.get("batch", 0) > 0]
    fig, axes = plt.subplots(
        len(groups),
        1,
        figsize=(8, 1.0 + 0.7 * sum(len(g["devices"]) for g in groups)),
        squeeze=False,
        sharex=True,
    )
    colors = {
        "compute": "tab:blue",
        "emulated": "tab:cyan",
        "send/recv": "tab:orange",
        "sync": "tab:green",
        "optimizer": "tab:purple",
    }
    for ax, (gi, group) in zip(axes[:, 0], enumerate(groups), strict=True):
        for k, dev in enumerate(group["devices"]):
            r = ranks.get(dev)
            if r is None:
                continue
            y = len(group["devices"]) - 1 - k
            if r.get("events"):
                for ev in r["events"]:
                    kind = ev.get("kind", "compute")
                    ax.barh(
                        y,
                        ev["end_s"] - ev["start_s"],
                        left=ev["start_s"],
                        height=0.6,
                        color=colors.get(kind, "tab:blue"),
                        edgecolor="k",
                        lw=0.3,
                    )
                continue
            real = max(r["compute_time_s"] - r.get("emulated_compute_time_s", 0.0), 0.0)
            parts = [
                ("compute", real),
                ("emulated", r.get("emulated_compute_time_s", 0.0)),
                ("send/recv", r.get("send_recv_time_s", 0.0)),
                ("sync", r.get("sync_time_s", 0.0)),
                ("optimizer", r.get("optimizer_time_s", 0.0)),
            ]
            left = 0.0
            for kind, width in parts:
                if width > 0:
                    ax.barh(
                        y,
                        width,
                        left=left,
                        height=0.6,
                        color=colors[kind],
                    )
                    left += width
        ax.set_yticks(range(len(group["devices"])))
        ax.set_yticklabels(
            [f"{d} {tuple(s)}" for d, s in zip(group["devices"], group["stages"], strict=True)][
                ::-1
            ],
            fontsize=7,
        )
        ax.set_title(
            f"group {gi}: b={group['batch']}, μ={group['microbatch_size']}", fontsize=8, loc="left"
        )
    axes[-1, 0].set_xlabel("seconds within the iteration")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in colors.items()]
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=5)
    fig.suptitle(
        f"one iteration (step {timeline['step']}, plan {plan.get('plan_id')})",
        fontsize=9,
        x=0.02,
        ha="left",
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
