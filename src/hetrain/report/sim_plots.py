"""Plots of simulations (matplotlib, imported lazily inside each function; Agg backend).

* :func:`plot_policies` — one figure, four panels, one line per policy: iteration time per slot,
  cumulative average money per iteration against the budget, virtual-queue backlog, cumulative
  plan changes;
* :func:`plot_v_sweep` — the V sweep as a time-versus-cost curve (one point per V, the budget as
  a vertical line).

Inputs are :class:`hetrain.sim.simulator.SimulationResult` objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_policies(results: Sequence, path: str | Path, *, title: str = "") -> Path:
    """Write a 2x2 figure comparing ``results`` (one line per policy) to ``path`` (PNG/PDF by
    suffix) and return the path.

    Panels: iteration time per slot (s, migration included; infeasible slots are gaps),
    cumulative average money per iteration (currency) with each result's budget dashed,
    money-queue backlog ``Q_money`` (currency), cumulative plan changes.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    (ax_t, ax_c), (ax_q, ax_p) = axes
    for res in results:
        slots = np.array([r.slot for r in res.records])
        times = np.array([r.iteration_time_s for r in res.records], dtype=float)
        money = np.nan_to_num(np.array([r.cost_money for r in res.records], dtype=float))
        feasible = np.array([r.feasible for r in res.records], dtype=float)
        counted = np.maximum(np.cumsum(feasible), 1.0)
        (line,) = ax_t.plot(slots, times, lw=0.9, label=res.policy)
        ax_c.plot(slots, np.cumsum(money) / counted, lw=1.2, color=line.get_color())
        if "money" in res.budgets:
            ax_c.axhline(res.budgets["money"], ls="--", lw=0.8, color=line.get_color())
        ax_q.plot(slots, [r.queue_money for r in res.records], lw=1.0, color=line.get_color())
        ax_p.step(slots, np.cumsum([r.plan_changed for r in res.records]), where="post",
                  color=line.get_color())  # fmt: skip
    ax_t.set_ylabel("iteration time (s)")
    ax_c.set_ylabel("cumulative mean money / iteration")
    ax_c.set_yscale("log")
    ax_q.set_ylabel("money queue backlog Q")
    ax_p.set_ylabel("plan changes (cumulative)")
    for ax in (ax_q, ax_p):
        ax.set_xlabel("slot")
    ax_t.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_v_sweep(
    results: Mapping[float, object], path: str | Path, *, resource: str = "money"
) -> Path:
    """Write the time-versus-cost curve of a V sweep (``{V: SimulationResult}``): mean cost per
    iteration of ``resource`` on x, mean iteration time (s) on y, each point labelled with its V;
    the budget (from the first result) as a dashed vertical line."""
    plt = _pyplot()
    vs = sorted(results)
    cost = [results[v].summary()["mean_cost"][resource] for v in vs]
    time_s = [results[v].summary()["mean_iteration_time_s"] for v in vs]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(cost, time_s, "o-")
    for v, x, y in zip(vs, cost, time_s, strict=True):
        ax.annotate(f"V={v:g}", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    budget = results[vs[0]].budgets.get(resource) if vs else None
    if budget:
        ax.axvline(budget, ls="--", color="gray", label=f"{resource} budget")
        ax.legend()
    ax.set_xlabel(f"mean {resource} per iteration")
    ax.set_ylabel("mean iteration time (s)")
    ax.set_title("V sweep: time vs cost")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
