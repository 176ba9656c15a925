"""Replay a training run's recorded measurements through the controller (issue 19).

The runtime's controller process logs, per measured step, a row of ``controller.jsonl``
(:class:`hetrain.runtime.adapt.ControllerService`): the plan id the ranks ran, each rank's
measured compute seconds, the iteration time, whether that step was decided on (the service
decides only for the newest steps when it is behind), the search events (the step whose
decision started a planner search in the search thread, and the step at which a finished
search joined the controller's pool) and the decision it made; and, once per run,
``controller_init.json`` beside it (profile, start-up state, configuration, first plan, steps).

:func:`replay_run` rebuilds :class:`hetrain.runtime.ctlcontroller.PlanController` from those, feeds
the same measurements in the same order, decides at the same steps, runs each search at the
step that started it and hands its plan in at the step it joined in the run, and returns every
decision; with searches reproducible (up to 16 devices, docs/controller.md) they are the run's
decisions. Only a run that started at step 0 (not a resumed round) can be replayed.

Pure Python over the log (numpy and the planning modules; no torch, no processes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetrain.errors import InputError


def read_controller_log(run: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(init, rows)`` of a run folder (or its ``controller.jsonl``).

    Raises:
        InputError: no controller log, no ``controller_init.json`` beside it (a run from an
            older version or a resumed round), or a row that is not a replayable record.
    """
    path = Path(run)
    log = path / "controller.jsonl" if path.is_dir() else path
    from hetrain.runtime.adapt import replay_init_path

    init_path = replay_init_path(log)
    if not log.is_file():
        raise InputError("--replay", str(run), "a run folder with controller.jsonl")
    if not init_path.is_file():
        raise InputError(
            "--replay", str(log), f"a controller log with {init_path.name} beside it (written "
            "by hetrain train from step 0)",
        )  # fmt: skip
    from hetrain.runtime.ctlwire import WireError, decode_init

    try:
        init = decode_init(init_path.read_bytes())
    except WireError as exc:
        raise InputError(str(init_path), "", f"a controller round's start ({exc})") from None
    rows = []
    for n, line in enumerate(log.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise InputError(str(log), f"line {n}", "a JSON object") from None
        if not isinstance(row, dict) or "compute_time_s" not in row or "decided" not in row:
            raise InputError(str(log), f"line {n}", "a controller row with its measurements")
        rows.append(row)
    return init, rows


def replay_run(run: str | Path) -> list[dict[str, Any]]:
    """Every decision of the controller on the run's recorded measurements:
    ``[{"step": k, "plan_id", "shares_after", "structure_changed"}]`` where ``step`` is the
    measured step after which it was made (the row it is logged in).

    Raises:
        InputError: see :func:`read_controller_log`.
    """
    from hetrain.runtime.ctlcontroller import round_controller

    init, rows = read_controller_log(run)
    ctl = round_controller(init, async_search=True)
    ctl.replay_joins = {
        int(r["search_joined"][0]): int(r["search_joined"][1]) for r in rows if "search_joined" in r
    }
    decisions = []
    for r in rows:
        k = int(r["step"])
        ctl.observe(k, int(r["plan_id"]), r["compute_time_s"], r.get("measured_time_s"))
        if not r["decided"]:
            continue
        made = ctl.decide(k + 1)
        if made is not None:
            decisions.append(
                {
                    "step": k,
                    "plan_id": int(made.plan.plan_id),
                    "shares_after": made.shares_after,
                    "structure_changed": made.structure_changed,
                }
            )
    return decisions


def recorded_decisions(run: str | Path) -> list[dict[str, Any]]:
    """The decisions the run's controller logged, in :func:`replay_run`'s form."""
    _, rows = read_controller_log(run)
    return [{"step": int(r["step"]), **r["decision"]} for r in rows if "decision" in r]
