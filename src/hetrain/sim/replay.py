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
decisions. A resumed run's log holds every round's rows, each tagged with its round; each
resumed round's start (its start-up state and the controller state it restored from its
checkpoint) is kept beside it (:func:`hetrain.runtime.adapt.round_init_path`), and each
round is replayed from its own start. A log without them (an older version's) replays its
first round only and says so (:class:`~hetrain.errors.InputError`).

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


def _round_starts(init: dict[str, Any], rows: list[dict[str, Any]]) -> list[int]:
    """Indices of ``rows`` at which a round starts (0 first): where the row's ``round``
    differs from the row before's; in a log whose rows carry no round (an older version's),
    where the step does not follow the row before's or the plan id is none the round has run
    or decided (a resumed round takes a new plan id)."""
    starts = [0]
    known = {int(init["plan"].plan_id or 0)}
    for i in range(1, len(rows)):
        prev, row = rows[i - 1], rows[i]
        if "round" in row or "round" in prev:
            new = row.get("round") != prev.get("round")
        else:
            new = int(row["step"]) != int(prev["step"]) + 1 or int(row["plan_id"]) not in known
        if new:
            starts.append(i)
            known = {int(row["plan_id"])}
        known.add(int(row["plan_id"]))
        if "decision" in row:
            known.add(int(row["decision"]["plan_id"]))
    return starts


def controller_rounds(run: str | Path) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """``[(init, rows)]`` per round of a run folder's controller log, in order: the first
    round's start (``controller_init.json``) and each resumed round's
    (:func:`hetrain.runtime.adapt.round_init_path`, with the controller state it restored),
    each with its rows.

    Raises:
        InputError: see :func:`read_controller_log`; a round after the first whose start is
            not kept (one line: the run was resumed at step N and rounds after the first are
            not replayable), or a first round that is not the one ``controller_init.json``
            started.
    """
    from hetrain.runtime.adapt import round_init_path
    from hetrain.runtime.ctlwire import WireError, decode_init

    init, rows = read_controller_log(run)
    path = Path(run)
    log = path / "controller.jsonl" if path.is_dir() else path
    if not rows:
        return [(init, rows)]
    starts = _round_starts(init, rows)
    first = rows[0].get("round")
    if first is not None and first != init["round"]:
        raise InputError(
            str(log), "line 1", f"rows of round {first!s:.40}, not of the round that "
            f"{log.with_name('controller_init.json').name} started",
        )  # fmt: skip
    out = []
    for n, (a, b) in enumerate(zip(starts, [*starts[1:], len(rows)], strict=True)):
        part = rows[a:b]
        if n == 0:
            out.append((init, part))
            continue
        step = int(part[0]["step"])
        round_id = part[0].get("round")
        where = None if round_id is None else round_init_path(log, str(round_id))
        if where is None or not where.is_file():
            why = (
                "the log, an older version's, does not say where each round starts"
                if where is None
                else f"{where.name}, the round's start, is missing"
            )
            raise InputError(
                "--replay", str(run), f"the run was resumed at step {step}; rounds after the "
                f"first are not replayable: {why}",
            )  # fmt: skip
        try:
            start = decode_init(where.read_bytes())
        except WireError as exc:
            raise InputError(str(where), "", f"a controller round's start ({exc})") from None
        if start["round"] != round_id or int(start["start_step"]) > step:
            raise InputError(str(where), "", f"the start of round {round_id!s:.40} at step {step}")
        out.append((start, part))
    return out


def replay_run(run: str | Path) -> list[dict[str, Any]]:
    """Every decision of the controller on the run's recorded measurements:
    ``[{"step": k, "plan_id", "shares_after", "structure_changed"}]`` where ``step`` is the
    measured step after which it was made (the row it is logged in). Each round
    (:func:`controller_rounds`) is replayed by a controller built from its own start, a
    resumed round's with the controller state it restored.

    Raises:
        InputError: see :func:`controller_rounds`; a resumed round's kept controller state
            that the controller does not take.
    """
    from hetrain.runtime.ctlcontroller import round_controller

    decisions = []
    for init, rows in controller_rounds(run):
        ctl = round_controller(init, async_search=True)
        if int(init["start_step"]) > 0 and init.get("controller_state") is not None:
            try:
                ctl.load_state_dict(init["controller_state"])
            except ValueError as exc:
                raise InputError(
                    "--replay", str(run), f"the round resumed at step {init['start_step']}: {exc}"
                ) from None
        ctl.replay_joins = {
            int(r["search_joined"][0]): int(r["search_joined"][1])
            for r in rows
            if "search_joined" in r
        }
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
