"""Bodies of ``hetrain plan`` and ``hetrain evaluate`` (docs/model.md §7). No torch on this path."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path

from hetrain._io import MAX_BATCH, MAX_NUMBER
from hetrain.cluster import ClusterState, load_cluster
from hetrain.costmodel import SCHEDULES, PlanEvaluation, TrainingConfig, evaluate_plan
from hetrain.errors import InputError, NoFeasiblePlanError, no_fit_input_error
from hetrain.plan import Plan, check_norm_block, load_plan
from hetrain.profile import ProfileArrays, load_profile

PLAN_TIME_BUDGET_S = 10.0
"""Soft wall-clock budget of ``hetrain plan``'s search (``best_plan(time_budget_s=...)``). The
shipped examples plan in well under a second and never reach it; it keeps large inputs from
hanging: 256 devices × 300 layers searched 50 s without it, 256 × 1000 over 100 s (the
partitioner's stage matrices grow with layers² × pipeline length)."""


def training_config(
    batch: int,
    optimizer_state_factor: float,
    schedule: str = "1f1b",
    norm_block: int | None = None,
) -> TrainingConfig:
    """The :class:`TrainingConfig` of the command-line options ``--batch``,
    ``--optimizer-state-factor``, ``--schedule`` and ``--norm-block``.

    Raises:
        InputError: ``--batch`` not in ``[1, MAX_BATCH]``, ``--optimizer-state-factor`` not a
            finite number in ``[0, MAX_NUMBER]``, unknown schedule, ``--norm-block`` not an
            integer >= 1 that divides ``--batch``.
    """
    if batch < 1:
        raise InputError("--batch", "", f"expected an integer >= 1, got {batch}")
    if batch > MAX_BATCH:
        raise InputError("--batch", "", f"expected an integer <= {MAX_BATCH:.0e}, got {batch}")
    o = optimizer_state_factor
    if not (math.isfinite(o) and 0 <= o <= MAX_NUMBER):
        raise InputError(
            "--optimizer-state-factor",
            "",
            f"expected a finite number between 0 and {MAX_NUMBER:g}, got {o}",
        )
    if schedule not in SCHEDULES:
        raise InputError(
            "--schedule", "", f"expected one of {', '.join(SCHEDULES)}, got {schedule!r}"
        )
    return TrainingConfig(
        batch=batch, optimizer_state_factor=o, schedule=schedule, norm_block=norm_block
    )


def check_v(v: float) -> None:
    """Raise :class:`InputError` unless ``--V`` is a finite number in ``(0, MAX_NUMBER]``."""
    if not (math.isfinite(v) and 0 < v <= MAX_NUMBER):
        raise InputError("--V", "", f"expected a finite number > 0 and <= {MAX_NUMBER:g}, got {v}")


def _load(cluster: Path, model: Path) -> tuple[ClusterState, ProfileArrays]:
    return load_cluster(cluster).state(), load_profile(model).arrays()


def check_plan_devices(plan: Plan, state: ClusterState, source: str) -> None:
    """Raise :class:`InputError` when a plan names a device that is unavailable in ``state``
    (unknown ids are caught by :meth:`Plan.validate_for`)."""
    index = state.index()
    for g, group in enumerate(plan.groups):
        for k, d in enumerate(group.devices):
            if d in index and not state.available[index[d]]:
                raise InputError(
                    source, f"groups[{g}].devices[{k}]", f"expected an available device, got {d!r}"
                )


def _print_evaluation(
    plan: Plan, evaluation: PlanEvaluation, profile: ProfileArrays, batch: int
) -> None:
    from hetrain.report.tables import print_plan_report

    print_plan_report(plan, evaluation, profile.names, batch)


def run_plan(
    *,
    cluster: Path,
    model: Path,
    batch: int,
    optimizer_state_factor: float = 2.0,
    v: float = 1.0,
    queues: Mapping[str, float] | None = None,
    schedule: str = "1f1b",
    norm_block: int | None = None,
    json_out: bool = False,
) -> int:
    """``hetrain plan``: print the best plan for one slot (table, or the plan JSON with
    ``--json``). Returns the exit status (0).

    Raises:
        InputError: bad files or options; a model that fits on no arrangement of the devices
            (names the model file).
    """
    config = training_config(batch, optimizer_state_factor, schedule, norm_block)
    check_v(v)
    state, profile = _load(cluster, model)
    from hetrain.planner import best_plan, fewest_microbatches

    try:
        plan = best_plan(
            state,
            profile,
            config,
            v=v,
            queues=dict(queues or {}),
            time_budget_s=PLAN_TIME_BUDGET_S,
        )
    except NoFeasiblePlanError as exc:
        raise no_fit_input_error(str(model), exc) from None
    # the plan as a run executes it (hetrain train --plan runs it as written)
    plan = fewest_microbatches(plan, state, profile, config)
    if json_out:
        print(plan.to_json())
        return 0
    evaluation = evaluate_plan(plan, state, profile, config)
    _print_evaluation(plan, evaluation, profile, batch)
    if queues:
        print(
            f"objective V·T + Σ Q_j y_j = {evaluation.objective(v, dict(queues)):.6g} "
            f"(V = {v}, queues {dict(queues)})"
        )
    return 0


def run_evaluate(
    *,
    cluster: Path,
    model: Path,
    batch: int,
    plan: Path,
    optimizer_state_factor: float = 2.0,
    norm_block: int | None = None,
    json_out: bool = False,
) -> int:
    """``hetrain evaluate``: docs/model.md §3's figures for a given plan. Returns 0 when the plan
    fits,
    1 when some device runs out of memory (each named in a line on stderr).

    Raises:
        InputError (exit 2): bad files; the plan names unknown or unavailable devices, does not
            cover the layers, its shares do not sum to ``--batch``, or (with ``--norm-block``)
            a group's share or micro-batch size is not a multiple of the norm block.
    """
    config = training_config(batch, optimizer_state_factor, norm_block=norm_block)
    state, profile = _load(cluster, model)
    the_plan = load_plan(plan)
    the_plan.validate_for(state.ids, profile.num_layers, batch, str(plan))
    check_norm_block(the_plan, norm_block, str(plan))
    check_plan_devices(the_plan, state, str(plan))
    evaluation = evaluate_plan(the_plan, state, profile, config)
    if json_out:
        print(json.dumps(evaluation.to_json_dict(), indent=2))
    else:
        _print_evaluation(the_plan, evaluation, profile, batch)
    for d in evaluation.out_of_memory:
        print(
            f"hetrain: out of memory: device {d} needs {evaluation.memory_bytes[d]:.0f} bytes, "
            f"has {evaluation.memory_limit_bytes[d]:.0f}",
            file=sys.stderr,
        )
    return 0 if evaluation.fits else 1
