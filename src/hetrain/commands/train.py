"""Body of ``hetrain train``: validate in the parent, launch the ranks, print the report.

The options arrive checked value by value (:class:`~hetrain.runtime.config.RunConfig` and
:class:`~hetrain.runtime.config.CommandOptions`, built by the CLI); what needs the model, the
files or the world (plan, world size, outputs, ``--slowdown`` devices) is checked here once
before any process starts (:func:`hetrain.runtime.job.build_job`): one line, exit 2.
A failed rank exits 1 with one line naming the rank and the cause. Under ``torchrun`` (the
environment has ``TORCHELASTIC_RUN_ID`` and ``RANK``) this process *is* a rank and trains
directly.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hetrain._text import plural
from hetrain.errors import InputError
from hetrain.runtime.config import CommandOptions, RunConfig

DEMO_SLOWDOWN_FACTOR = 3.0


def demo_trace_rows(devices: list[str], steps: int) -> list:
    """The default dynamics of an example run (``--demo-slowdown``, on unless a plan, trace,
    slow-down or cluster is given): device ``w1`` computes 3x slower from step ``steps // 3``
    on (docs/model.md §7 trace row ``slot=steps//3, device=w1, speed_factor=1/3``)."""
    from hetrain.trace import TraceRow

    if len(devices) < 2:
        return []
    return [TraceRow(slot=steps // 3, device=devices[1], speed_factor=1.0 / DEMO_SLOWDOWN_FACTOR)]


def _task(
    example: str, model: str | None, data: Path | None, size: str | None = None, seed: int = 0
):
    from hetrain.runtime.api import task_from_factory
    from hetrain.runtime.data import HF_EXAMPLES, charlm_task, example_task

    if size is not None and (model is not None or example not in HF_EXAMPLES):
        used = "--model" if model is not None else f"--example {example}"
        raise InputError(
            "--size", "", f"only used by --example {', '.join(HF_EXAMPLES)} (not with {used})"
        )
    if model is not None:
        if data is not None:
            raise InputError("--data", "", "not used with --model (the factory loads its data)")
        return task_from_factory(model, seed)
    if data is not None:
        if example != "charlm":
            raise InputError("--data", "", "a text file is only used by --example charlm")
        if data.is_dir():
            raise InputError("--data", "", f"expected a text file, got a folder: {data}")
        if not data.is_file():
            raise InputError(str(data), "", "file not found")
        try:
            text = data.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(str(data), "", f"cannot read text ({type(exc).__name__})") from None
        return charlm_task(text=text)
    return example_task(example, size or "tiny")


def run_train(config: RunConfig, command: CommandOptions) -> int:
    """Run ``hetrain train`` with the run's options ``config`` and the command's own
    ``command``; returns the exit status (0 ok, 1 a rank failed; bad input is raised as
    :class:`InputError`, exit 2)."""
    from hetrain.runtime.api import build_job, run_job
    from hetrain.runtime.launch import LaunchError, RunStopped, torchrun_world, under_torchrun

    model, data = command.model, command.data
    task = _task(command.example, model, data, command.size, config.seed)
    config = config.with_output_defaults(task.name if model is None else "model")
    _check_sources(config, model, data)

    if under_torchrun():
        # this process is one rank of a torchrun job: devices are the plan's (plan order) or
        # w0..w{W-1}; the job is built on every rank (same inputs, same answer, no hang)
        from hetrain.plan import load_plan
        from hetrain.runtime.elastic import elastic_device_ids_given, gather_device_ids
        from hetrain.runtime.worker_main import run_worker

        rank, world = torchrun_world()
        plan = config.plan
        devices = load_plan(plan).devices if plan is not None else [f"w{i}" for i in range(world)]
        if elastic_device_ids_given():
            # elastic: one torchrun agent per device (hetrain.runtime.elastic); the devices of
            # this round are the agents present, whatever joined or left since the last one.
            # --cluster is restricted to them; --plan is used while it names exactly them
            # (else the round starts from even shares and the controller re-plans); factors of
            # devices that are not in this round do not apply
            devices = gather_device_ids(config.hang_timeout_s)
            config = dataclasses.replace(
                config,
                cluster=_cluster_subset(config.cluster, devices)
                if config.cluster is not None
                else None,
                plan=plan if plan is None or set(load_plan(plan).devices) == set(devices) else None,
                slowdown=tuple((d, f) for d, f in config.slowdown if d in devices),
            )
        if len(devices) != world:
            raise InputError(
                str(plan),
                "groups[].devices",
                f"expected {plural(world, 'device')} (torchrun world size), the plan names "
                f"{len(devices)}",
            )
        job = build_job(task, config, devices=devices, progress=command.progress and rank == 0)
        try:
            summary = run_worker(job)
        except SystemExit:  # a graceful stop (SIGTERM): exit status 143 or 75
            raise
        except BaseException as exc:  # every rank's traceback in RUN_DIR/rank_errors.jsonl
            from hetrain.runtime.launch import record_rank_error

            record_rank_error(job, exc)
            raise
        if summary is not None:
            _print_summary(summary, job, config.report, command.json_out)
        return 0

    job = build_job(task, config, nnodes=command.nnodes, progress=command.progress)
    if (
        command.demo_slowdown
        and model is None
        and config.plan is None
        and config.trace is None
        and not config.slowdown
        and config.cluster is None
        and len(job.devices) > 1
    ):
        from hetrain.runtime.api import check_trace_steps

        check_trace_steps(job.steps, len(job.devices), "the demo slow-down (--no-demo-slowdown)")
        job = dataclasses.replace(job, trace_rows=demo_trace_rows(job.devices, job.steps))
        print(
            f"hetrain: demo dynamics: {job.devices[1]} computes {DEMO_SLOWDOWN_FACTOR:g}x slower "
            f"from step {job.steps // 3} on (--no-demo-slowdown to turn off)",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    try:
        summary = run_job(
            job,
            nnodes=command.nnodes,
            rdzv_endpoint=command.rdzv_endpoint,
            run_id=command.rdzv_id,
            max_restarts=config.max_restarts,
            rdzv_timeout_s=config.rdzv_timeout_s,
        )
    except RunStopped as exc:
        # SIGTERM / Ctrl-C: one line (step, checkpoint), 0 when the stop checkpoint was written
        print(f"hetrain: {exc}", file=sys.stderr)
        return exc.exit_code
    except LaunchError as exc:
        print(f"hetrain: error: {exc}", file=sys.stderr)
        # bad input found by the ranks (e.g. --exact refusing a random op): exit 2
        return 2 if "failed: InputError: " in str(exc) else 1
    if summary:
        summary["launch_wall_time_s"] = time.perf_counter() - t0
        _print_summary(summary, job, config.report, command.json_out)
    return 0


def _check_sources(config: RunConfig, model: str | None, data: Path | None) -> None:
    """The files a run writes are not its ``--data`` input or its ``--model`` factory's source
    file (an ``--out`` there replaced the code); the other inputs are checked by
    :func:`hetrain.runtime.job.build_job`.

    Raises:
        InputError: naming both options.
    """
    sources = []
    if data is not None:
        sources.append(("--data", data))
    if model is not None:
        module = sys.modules.get(model.partition(":")[0])
        if getattr(module, "__file__", None):
            sources.append(("--model", Path(module.__file__)))
    for source_option, source in sources:
        for option, path in (
            ("--out", config.out or config.run_dir / "model.pt"),
            ("--metrics-out", config.metrics_out),
        ):
            if path.resolve() == source.resolve():
                raise InputError(
                    f"{option} and {source_option}",
                    "",
                    f"expected a file other than the {source_option} input, got {path}",
                )


def _cluster_subset(cluster: Path, devices: list[str]) -> dict:
    """The cluster file restricted to ``devices`` (an elastic round's members).

    Raises:
        InputError: a member is not in the cluster file.
    """
    from hetrain.cluster import load_cluster

    spec = load_cluster(cluster)
    known = {d.id for d in spec.devices}
    missing = [d for d in devices if d not in known]
    if missing:
        raise InputError(str(cluster), "devices", f"expected ids for {', '.join(missing)}")
    raw = spec.model_dump(mode="json")
    raw["devices"] = [d for d in raw["devices"] if d["id"] in set(devices)]
    return raw


def decision_delay_text(delays: list[int]) -> str:
    """`` (decision delay D steps, median)`` of a run's plan changes (``delays``: per change,
    the first step it ran minus the last step its decision saw, minus 1: the unit of
    ``hetrain simulate --decision-delay``); empty without changes."""
    if not delays:
        return ""
    median = statistics.median(delays)
    spread = f", {min(delays)}-{max(delays)}" if min(delays) != max(delays) else ""
    return f" (decision delay {median:g} {'step' if median == 1 else 'steps'}, median{spread})"


def _print_summary(summary: dict[str, Any], job, report: bool, json_out: bool) -> None:
    files: list[str] = []
    if report and job.metrics_out and job.run_dir:
        from hetrain.report.run_report import write_report

        written = write_report(job.metrics_out, job.run_dir)
        files = written["files"]
        summary["report_files"] = files
        summary["dp_even"] = written.get("dp_even")
    if json_out:
        print(json.dumps(summary, default=str))
        return
    wall = summary.get("launch_wall_time_s", summary.get("wall_time_s", 0.0))
    trained = summary.get("trained_steps", summary["steps"])
    start = summary.get("start_step", 0)
    span = f"steps {start}-{summary['steps'] - 1}, " if start else ""
    ranks = len(job.devices)
    print(
        f"trained {plural(trained, 'step')} ({span}resumed from step {start}) "
        if start
        else f"trained {plural(trained, 'step')} ",
        end="",
    )
    print(
        f"on {plural(ranks, 'rank')} in {wall:.1f}s; "
        f"final loss {summary['final_loss']:.4f}; plan changes {summary['replans']}"
        + decision_delay_text(summary.get("decision_delay_steps") or [])
        + (
            f"; updates skipped (non-finite loss or gradient norm): {summary['skipped_steps']}"
            if summary.get("skipped_steps")
            else ""
        )
    )
    if summary.get("dp_even"):
        from hetrain.report.run_report import comparison_line

        print(comparison_line(summary["dp_even"]))
    print(f"quality: {summary['quality']}")
    exported = summary.get("pretrained_dir")  # save_pretrained of a Hugging Face model
    print(
        f"metrics: {job.metrics_out}; model state_dict: {summary.get('model_path')}"
        + (f"; Hugging Face model: {exported}" if exported else "")
    )
    if files:
        print("report: " + ", ".join(files))
