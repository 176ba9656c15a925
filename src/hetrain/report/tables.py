"""Rich tables for ``hetrain plan`` and ``hetrain evaluate``: groups, stages with layer names,
shares, micro-batches, predicted time, lower bound and ratio, per-device memory, cost."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from hetrain._text import energy_per_iteration, money_per_iteration
from hetrain.costmodel import PlanEvaluation
from hetrain.plan import Plan

GIB = float(2**30)


def _layer_range(names: tuple[str, ...], start: int, end: int) -> str:
    if end - start == 1:
        return f"{start} {names[start]}"
    return f"{start}-{end - 1} {names[start]} .. {names[end - 1]}"


def plan_table(plan: Plan, evaluation: PlanEvaluation, layer_names: tuple[str, ...]) -> Table:
    """One row per stage: group, share, micro-batch size and count, device, layers, stage
    time per micro-batch, memory used / limit."""
    table = Table(title=f"plan ({plan.schedule}, B = {plan.global_batch})", show_lines=False)
    for col in (
        "group",
        "share b_g",
        "μ_g × n_g",
        "T_g (s)",
        "stage",
        "device",
        "layers",
        "C_k (ms)",
        "memory GiB (used/limit)",
    ):
        table.add_column(col, justify="left" if col in ("device", "layers") else "right")
    for g, group in enumerate(plan.groups):
        n = group.num_microbatches
        compute = evaluation.stage_compute_s[g]
        for k, (dev, (start, end)) in enumerate(zip(group.devices, group.stages, strict=True)):
            first = k == 0
            used = evaluation.memory_bytes[dev]
            lim = evaluation.memory_limit_bytes[dev]
            mem = f"{used / GIB:.2f} / {lim / GIB:.2f}"
            if used > lim:
                mem = f"[red]{mem} OOM[/red]"
            table.add_row(
                str(g) if first else "",
                str(group.batch) if first else "",
                f"{group.microbatch_size} × {n}" if first else "",
                f"{evaluation.group_times_s[g]:.4g}" if first else "",
                str(k),
                dev,
                _layer_range(layer_names, start, end),
                f"{compute[k] * 1e3:.4g}",
                mem,
            )
        table.add_section()
    return table


def summary_lines(evaluation: PlanEvaluation, batch: int) -> list[str]:
    """Iteration time, sync, lower bound and ratio, cost, fits."""
    return [
        f"iteration time T = {evaluation.iteration_time_s:.6g} s "
        f"(max group {max(evaluation.group_times_s, default=0.0):.6g} s "
        f"+ sync {evaluation.sync_time_s:.6g} s)",
        f"lower bound T_LB = {evaluation.lower_bound_s:.6g} s for B = {batch}; "
        f"T / T_LB = {evaluation.ratio_to_lower_bound:.4f}",
        f"cost per iteration: money {money_per_iteration(evaluation.cost['money'])}, "
        f"energy {energy_per_iteration(evaluation.cost['energy'])}",
        "fits in memory: " + ("yes" if evaluation.fits else "NO"),
    ]


def print_plan_report(
    plan: Plan,
    evaluation: PlanEvaluation,
    layer_names: tuple[str, ...],
    batch: int,
    console: Console | None = None,
) -> None:
    """Print :func:`plan_table` and :func:`summary_lines`.

    When stdout is not a terminal (a pipe, a file, CI logs) the table is laid out 140 columns
    wide instead of rich's default 80, so that layer names are not folded into many lines.
    """
    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:
            console = Console(highlight=False, width=140)
    console.print(plan_table(plan, evaluation, layer_names))
    for line in summary_lines(evaluation, batch):
        console.print(line)
