"""Body of ``hetrain train``: validate in the parent, launch the ranks, print the report.

Everything that can be wrong with the input (plan, world size, files, ``--slowdown``) is checked
here before any process starts (:func:`hetrain.runtime.api.build_job`): one line, exit 2.
A failed rank exits 1 with one line naming the rank and the cause. Under ``torchrun`` (the
environment has ``TORCHELASTIC_RUN_ID`` and ``RANK``) this process *is* a rank and trains
directly.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hetrain._text import plural
from hetrain.errors import InputError

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


def run_train(
    *,
    size: str | None = None,
    example: str = "gpt2",
    workers: int | None = None,
    steps: int | None = None,
    plan: Path | None = None,
    seed: int = 0,
    batch: int | None = None,
    lr: float | None = None,
    optimizer: str | None = None,
    dtype: str = "float32",
    slowdown: list[str] | None = None,
    trace: Path | None = None,
    cluster: Path | None = None,
    metrics_out: Path | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int = 0,
    checkpoint_keep: int = 3,
    on_nonfinite: str = "stop",
    rdzv_timeout_s: float = 60.0,
    max_restarts: int = 0,
    hang_timeout_s: float | None = None,
    norm_block: int | None = None,
    exact: bool = False,
    model: str | None = None,
    data: Path | None = None,
    schedule: str | None = None,
    microbatch_size: int | None = None,
    grad_clip_norm: float | None = None,
    bf16: bool = False,
    lr_schedule: str = "cosine",
    warmup_steps: int | None = None,
    weight_decay: float | None = None,
    momentum: float = 0.0,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    run_dir: Path | None = None,
    out: Path | None = None,
    demo_slowdown: bool = True,
    report: bool = True,
    progress: bool = True,
    json_out: bool = False,
    tensorboard: bool = False,
) -> int:
    """Run ``hetrain train``; returns the exit status (0 ok, 1 a rank failed, 2 bad input is
    raised as :class:`InputError`)."""
    from hetrain._io import check_seed
    from hetrain.runtime.api import build_job, run_job
    from hetrain.runtime.launch import LaunchError, RunStopped, torchrun_world, under_torchrun

    check_seed("--seed", seed)  # before a --model factory is seeded with it
    task = _task(example, model, data, size, seed)
    name = task.name if model is None else "model"
    run_dir = run_dir or Path("runs") / name
    metrics_out = metrics_out or run_dir / "metrics.jsonl"
    sources = []  # input files a run must not overwrite (the others are checked by build_job)
    if data is not None:
        sources.append(("--data", data))
    if model is not None:  # the factory's own source file (a --out there replaced the code)
        module = sys.modules.get(model.partition(":")[0])
        if getattr(module, "__file__", None):
            sources.append(("--model", Path(module.__file__)))
    for source_option, source in sources:
        for option, path in (
            ("--out", out or run_dir / "model.pt"),
            ("--metrics-out", metrics_out),
        ):
            if path.resolve() == source.resolve():
                raise InputError(
                    f"{option} and {source_option}",
                    "",
                    f"expected a file other than the {source_option} input, got {path}",
                )
    options: dict[str, Any] = dict(
        steps=steps,
        batch=batch,
        seed=seed,
        lr=lr,
        optimizer=optimizer,
        dtype=dtype,
        bf16=bf16,
        lr_schedule=lr_schedule,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        momentum=momentum,
        schedule=schedule,
        plan=plan,
        microbatch_size=microbatch_size,
        cluster=cluster,
        slowdown=slowdown,
        trace=trace,
        metrics_out=metrics_out,
        run_dir=run_dir,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        checkpoint_keep=checkpoint_keep,
        on_nonfinite=on_nonfinite,
        out=out,
        hang_timeout_s=hang_timeout_s,
        norm_block=norm_block,
        exact=exact,
        tensorboard=tensorboard,
    )
    if grad_clip_norm is not None:
        options["grad_clip_norm"] = grad_clip_norm

    if under_torchrun():
        # this process is one rank of a torchrun job: devices are the plan's (plan order) or
        # w0..w{W-1}; validation runs on every rank (same inputs, same answer, no hang)
        from hetrain.plan import load_plan
        from hetrain.runtime.elastic import elastic_device_ids_given, gather_device_ids
        from hetrain.runtime.worker_main import run_worker

        rank, world = torchrun_world()
        devices = load_plan(plan).devices if plan is not None else [f"w{i}" for i in range(world)]
        if elastic_device_ids_given():
            # elastic: one torchrun agent per device (hetrain.runtime.elastic); the devices of
            # this round are the agents present, whatever joined or left since the last one.
            # --cluster is restricted to them; --plan is used while it names exactly them
            # (else the round starts from even shares and the controller re-plans)
            devices = gather_device_ids(hang_timeout_s)
            if cluster is not None:
                options["cluster"] = _cluster_subset(cluster, devices)
            if plan is not None and set(load_plan(plan).devices) != set(devices):
                options["plan"] = None
            if slowdown:  # factors of devices that are not in this round do not apply
                options["slowdown"] = [s for s in slowdown if s.split("=", 1)[0] in devices]
        if len(devices) != world:
            raise InputError(
                str(plan),
                "groups[].devices",
                f"expected {plural(world, 'device')} (torchrun world size), the plan names "
                f"{len(devices)}",
            )
        job = build_job(task, devices=devices, progress=progress and rank == 0, **options)
        try:
            summary = run_worker(job)
        except SystemExit:  # a graceful stop (SIGTERM): exit status 143 or 75
            raise
        except BaseException as exc:  # every rank's traceback in RUN_DIR/rank_errors.jsonl
            from hetrain.runtime.launch import record_rank_error

            record_rank_error(job, exc)
            raise
        if summary is not None:
            _print_summary(summary, job, report, json_out)
        return 0

    job = build_job(task, workers=workers, nnodes=nnodes, progress=progress, **options)
    # the launch options are checked before anything is printed (one line on bad input)
    if nnodes > 1 and rdzv_endpoint is None:
        raise InputError("--rdzv-endpoint", "", "expected HOST:PORT with --nnodes > 1")
    if rdzv_endpoint is not None:
        # torch's rendezvous raised a ValueError traceback (exit 1) on a bad port
        host, sep, port = rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(
                "--rdzv-endpoint",
                str(rdzv_endpoint),
                "expected HOST:PORT with a port from 1 to 65535",
            )
    if max_restarts < 0:
        raise InputError("--max-restarts", "", f"expected an integer >= 0, got {max_restarts}")
    if (
        demo_slowdown
        and model is None
        and plan is None
        and trace is None
        and not slowdown
        and cluster is None
        and len(job.devices) > 1
    ):
        from hetrain.runtime.api import check_trace_steps

        check_trace_steps(job.steps, len(job.devices), "the demo slow-down (--no-demo-slowdown)")
        job.trace_rows = demo_trace_rows(job.devices, job.steps)
        print(
            f"hetrain: demo dynamics: {job.devices[1]} computes {DEMO_SLOWDOWN_FACTOR:g}x slower "
            f"from step {job.steps // 3} on (--no-demo-slowdown to turn off)",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    try:
        summary = run_job(
            job,
            nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint,
            run_id=rdzv_id,
            max_restarts=max_restarts,
            rdzv_timeout_s=rdzv_timeout_s,
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
        _print_summary(summary, job, report, json_out)
    return 0


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
