"""The job every rank runs, built from a :class:`~hetrain.runtime.config.RunConfig` once in the
launching process (:func:`build_job`): the checks that need the task's model, the input files
or the world (plan against the layers and the ranks, the cluster and trace files, a checkpoint
of another model, output paths, the user's optimizer), and the resolution of the ``None``
defaults against the task. Bad input raises a one-line :class:`~hetrain.errors.InputError`
before any process starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hetrain._text import plural
from hetrain.cluster import ClusterSpec, cluster_from_dict, load_cluster
from hetrain.errors import InputError
from hetrain.plan import Plan, load_plan, plan_from_dict
from hetrain.runtime.config import RunConfig, check_int, parse_slowdown_items
from hetrain.runtime.data import Task
from hetrain.runtime.optim import check_factory, resolve_param_groups
from hetrain.runtime.run_outputs import check_outputs
from hetrain.runtime.trainjob import TrainJob
from hetrain.runtime.worker_main import base_slowdowns, local_cluster_spec


def parse_slowdown(
    items: Sequence[tuple[str, float]] | Sequence[str] | Mapping[str, float] | None,
    devices: Sequence[str],
) -> dict[str, float]:
    """The slow-down factors of ``items`` (``RunConfig.slowdown`` pairs, ``["w1=3", ...]`` or
    ``{"w1": 3.0}``) as ``{"w1": 3.0}``, for devices of this run only.

    Raises:
        InputError: bad items (:func:`hetrain.runtime.config.parse_slowdown_items`), or a device
            that is not one of ``devices``.
    """
    pairs = parse_slowdown_items(items)
    for device, _ in pairs:
        if device not in devices:
            raise InputError(
                "--slowdown",
                str(device),
                f"expected a device of this run ({', '.join(devices)}), got {device!r}",
            )
    return dict(pairs)


MAX_EMULATED_SLOWDOWN = 1e6


def _check_emulated_slowdown(
    slow: dict[str, float],
    cluster_spec: ClusterSpec | None,
    trace_rows: Sequence[Any],
    devices: list[str],
) -> None:
    """The slowest emulated device is at most ``MAX_EMULATED_SLOWDOWN`` (1e6) x a host core:
    :func:`hetrain.runtime.worker_main.base_slowdowns` (``--slowdown``, with ``--cluster`` its
    tflops ratio) divided by, with ``--trace``, the device's smallest ``speed_factor`` below 1
    (as ``EmulationSchedule.factors``). The ranks sleep that factor minus one times their
    compute: ``--slowdown w1=1e30`` overflowed ``time.sleep`` in a rank (exit 1) and a 1e9
    tflops ratio slept for hours.

    Raises:
        InputError: naming the options that set the factor and the device.
    """
    base = base_slowdowns(devices, slow, cluster_spec)
    lowest = {d: 1.0 for d in devices}  # the smallest speed factor of the trace, at most 1
    for row in trace_rows:
        if row.device in lowest and row.speed_factor is not None and row.speed_factor > 0:
            lowest[row.device] = min(lowest[row.device], row.speed_factor)
    for d in devices:
        factor = base[d] / lowest[d]
        if factor > MAX_EMULATED_SLOWDOWN:
            options = [
                option
                for option, used in (
                    ("--slowdown", slow.get(d, 1.0) > 1.0),
                    ("--cluster", base[d] > slow.get(d, 1.0)),
                    ("--trace", lowest[d] < 1.0),
                )
                if used
            ]
            raise InputError(
                " and ".join(options) or "--slowdown",
                d,
                f"expected an emulated slow-down of at most {MAX_EMULATED_SLOWDOWN:g}x a host "
                f"core, got {factor:.3g}x (the rank would sleep that many times its compute)",
            )


def check_trace_steps(steps: int, num_devices: int, option: str) -> None:
    """A trace is expanded into dense ``(steps, devices)`` arrays on every rank
    (:meth:`hetrain.trace.Trace.timeline`): at most ``MAX_DEVICE_SLOTS`` (1e7) device-steps, the
    bound of ``hetrain simulate --slots`` (above it a rank ran out of memory, exit 1).

    Raises:
        InputError: ``steps * num_devices`` above the bound, naming ``option``.
    """
    from hetrain.commands.simulate import MAX_DEVICE_SLOTS

    if steps * num_devices > MAX_DEVICE_SLOTS:
        raise InputError(
            "--steps",
            "",
            f"expected at most {MAX_DEVICE_SLOTS // num_devices} steps with {option} "
            f"({MAX_DEVICE_SLOTS:.0e} device-steps for {plural(num_devices, 'device')}), "
            f"got {steps}",
        )


def _load_cluster(cluster: Any) -> ClusterSpec | None:
    if cluster is None or isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, Mapping):
        return cluster_from_dict(dict(cluster), "cluster")
    return load_cluster(cluster)


def _load_plan(plan: Any) -> tuple[Plan | None, str]:
    """The plan object of ``RunConfig.plan`` and the name its errors are reported under."""
    if plan is None or isinstance(plan, Plan):
        return plan, "--plan"
    if isinstance(plan, Mapping):
        return plan_from_dict(dict(plan), "plan"), "--plan"
    return load_plan(plan), str(plan)


def _device_ids(
    config: RunConfig, nnodes: int, cluster_spec: ClusterSpec | None, devices: Sequence[str] | None
) -> list[str]:
    """The device id of every rank: ``devices`` when given, else the cluster file's ids (its
    size is the world size), else ``w0 … w{N-1}`` for ``N = workers * nnodes``.

    Raises:
        InputError: ``workers * nnodes`` is not the cluster file's size.
    """
    if devices is not None:
        return list(devices)
    if cluster_spec is not None:
        ids = list(cluster_spec.ids)
        if config.workers is not None and config.workers * nnodes != len(ids):
            raise InputError(
                "--workers",
                "",
                f"expected {plural(len(ids), 'rank')}, one per device of the cluster file, "
                f"got {config.workers * nnodes}",
            )
        return ids
    return [f"w{i}" for i in range((config.workers or 4) * nnodes)]


def _check_model(task: Task, config: RunConfig) -> tuple[nn.Module, int]:
    """Build the task's model once (seeded with ``config.seed``) and check what the ranks would
    otherwise find one by one: it cuts into layers (runtime/cutting.py), ``exact`` random ops,
    buffers a training forward changes (hetrain.runtime.startup).

    Returns:
        the model and its number of layers.

    Raises:
        InputError: not an ``nn.Module``, a cut that fails, a random op ``exact`` refuses.
    """
    from hetrain.runtime.data import cast_inputs, task_chain
    from hetrain.runtime.startup import check_forward_buffers, warn

    torch.manual_seed(config.seed)
    built = task.build_model()
    if not isinstance(built, nn.Module):
        raise InputError(
            task.name, "model", f"expected the factory to build an nn.Module, got {type(built)}"
        )
    num_layers = task_chain(task, built, verify=True).num_layers
    if config.exact:  # random ops that cannot be made plan-invariant (hetrain.runtime.randomness)
        from hetrain.runtime.randomness import InvariantRandomness

        static = InvariantRandomness(built, exact=True).static_problems()
        if static:
            raise InputError(task.name, "model", f"{static[0]} (--exact)")
    floats = [p.dtype for p in built.parameters() if p.is_floating_point()]
    sample, _ = task.train.batch(np.arange(min(2, len(task.train))))
    warn(
        check_forward_buffers(
            built,
            cast_inputs(sample, floats[0] if floats else torch.float32),
            norm_block=config.norm_block,
            exact=config.exact,
            source=task.name,
        )
    )
    return built, num_layers


def _load_trace(trace: Path, cluster_spec: ClusterSpec | None, device_ids: list[str]) -> list:
    """The rows of trace file ``trace`` for this run's devices.

    Raises:
        InputError: an unreadable trace or a device that is not one of this run's.
    """
    from hetrain.trace import load_trace

    spec = cluster_spec or local_cluster_spec(device_ids)
    try:
        return list(load_trace(trace, spec).rows)
    except InputError as exc:
        if cluster_spec is not None or not exc.field.endswith(".device"):
            raise
        # no cluster file: the devices are this run's ranks (it said "of the cluster file")
        got = exc.expected.rpartition(", got ")[2]
        raise InputError(
            exc.source,
            exc.field,
            f"expected a device of this run ({', '.join(device_ids)}; no --cluster), got {got}",
        ) from None


def _idle_ranks_added(plan: Plan, device_ids: Sequence[str], source: str) -> Plan:
    """``plan`` with an idle group (``b_g = 0``, the whole model as one stage) for each rank's
    device it does not name, as ``hetrain plan`` leaves out a device too slow to help and the
    runtime runs idle groups (they hold nothing and are sent nothing); a warning line names
    them."""
    from hetrain.runtime.startup import warn

    missing = [d for d in device_ids if d not in set(plan.devices)]
    if not missing:
        return plan
    warn(f"{source} leaves {', '.join(missing)} out: idle (given no layers and no samples)")
    return plan.with_idle_groups(device_ids)


def build_job(
    task: Task,
    config: RunConfig,
    *,
    nnodes: int = 1,
    devices: Sequence[str] | None = None,
    progress: bool = False,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
) -> TrainJob:
    """The :class:`TrainJob` every rank runs: ``config`` resolved against ``task`` (its
    defaults, model and optimizer) and the world, after the checks that need them. Runs once,
    in the launching process (under ``torchrun``, where there is none, on every rank: same
    inputs, same answer).

    Args:
        task: the model, data and defaults.
        config: the run's options (already checked value by value by its constructor).
        nnodes: nodes of the run (``CommandOptions.nnodes``, checked there); without
            ``devices`` or a cluster the devices are ``w0 … w{workers * nnodes - 1}``.
        devices: the device id of every rank (under ``torchrun``), overriding the others.
        progress: rank 0 shows a progress bar.
        param_groups: parameter groups ``[{"params": [names], **options}, ...]`` of the task's
            model (``hetrain.train``'s; the factory's are ``task.param_groups``).

    Raises:
        InputError: any bad value: an optimizer given twice (the task's and ``config``'s) or
            hetrain's hyper-parameters with the task's own optimizer, a plan naming unknown
            devices, not covering the layers, not matching the world size or the batch, a
            norm block that does not divide the global batch or a plan's shares/micro-batches,
            ``microbatch_size`` with a fixed plan, a ``slowdown`` device that is not a rank,
            emulated slow-downs above :data:`MAX_EMULATED_SLOWDOWN`, a trace's steps x devices
            above 1e7, unreadable trace/cluster/plan files, output files that coincide with
            each other or with an input file or cannot be written, a checkpoint of another
            model or at/after ``steps``, ``tensorboard`` without the ``tensorboard`` package, a
            model that cannot be cut into layers, ``exact`` refusing a random op.
    """
    d = task.defaults
    if config.tensorboard:
        from hetrain.runtime.metrics import check_tensorboard

        check_tensorboard()
    user_optimizer = task.optimizer
    if user_optimizer is not None:
        if config.optimizer is not None and callable(config.optimizer):
            raise InputError("optimizer", "", "given twice (the factory gives one too)")
        # the user's optimizer sets its own hyper-parameters: hetrain's would be ignored
        for option, value in (
            ("--optimizer", config.optimizer),
            ("--lr", config.lr),
            ("--weight-decay", config.weight_decay),
            ("--momentum", config.momentum or None),
        ):
            if value is not None:
                raise InputError(
                    option,
                    "",
                    "not used with the user's own optimizer: set it in the optimizer (or its "
                    "param_groups)",
                )
    elif callable(config.optimizer):  # hetrain.train(optimizer=torch.optim.AdamW, ...)
        user_optimizer = config.optimizer
    cluster_spec = _load_cluster(config.cluster)
    plan_obj, plan_source = _load_plan(config.plan)
    device_ids = _device_ids(config, nnodes, cluster_spec, devices)
    if plan_obj is not None and plan_obj.global_batch == 0:
        raise InputError(plan_source, "groups[].batch", "expected a global batch > 0")
    # the None defaults: the task's (then the plan's batch); dataclasses.replace runs the one
    # validation of RunConfig on the resolved values too
    grad_clip = config.grad_clip_norm
    config = dataclasses.replace(
        config,
        steps=config.steps if config.steps is not None else d.get("steps", 100),
        batch=config.batch
        if config.batch is not None
        else plan_obj.global_batch
        if plan_obj is not None
        else d.get("batch", 32),
        lr=None if user_optimizer is not None else config.lr or d.get("lr", 1e-3),
        optimizer=None
        if user_optimizer is not None
        else config.optimizer or d.get("optimizer", "adamw"),
        weight_decay=None
        if user_optimizer is not None
        else config.weight_decay
        if config.weight_decay is not None
        else d.get("weight_decay", 0.0),
        warmup_steps=config.warmup_steps
        if config.warmup_steps is not None
        else d.get("warmup_steps", 0),
        grad_clip_norm=grad_clip if grad_clip is not None else d.get("grad_clip_norm"),
    )
    steps, batch = config.steps, config.batch
    opt_groups = task.param_groups
    if param_groups is not None:
        if opt_groups is not None:
            raise InputError("param_groups", "", "given twice (the factory gives them too)")
        opt_groups = resolve_param_groups(task.build_model(), param_groups)
    opt_groups = tuple(opt_groups or ())

    model, num_layers = _check_model(task, config)
    check_outputs(config, model, steps)
    if plan_obj is not None:
        plan_obj.validate_for(device_ids, num_layers, batch, plan_source)
        plan_obj = _idle_ranks_added(plan_obj, device_ids, plan_source)
        if config.schedule is not None and plan_obj.schedule != config.schedule:
            # --schedule names the schedule of every plan, a given one too (the plan file's
            # default 1f1b otherwise stood in the plan events while the engine ran gpipe)
            plan_obj = plan_obj.model_copy(update={"schedule": config.schedule})
    # re-plan online: by default without a fixed plan (and always only with more than one rank)
    adaptive = config.adaptive if config.adaptive is not None else plan_obj is None
    if config.microbatch_size is not None and plan_obj is not None and not adaptive:
        # μ of the plans chosen online; a fixed plan's groups set theirs (was silently ignored)
        raise InputError(
            "--microbatch-size",
            "",
            f"not used with {plan_source} (a fixed plan: its groups set microbatch_size)",
        )
    microbatch_size = check_int(
        "--microbatch-size",
        config.microbatch_size
        if config.microbatch_size is not None
        else d.get("microbatch_size", 8),
    )
    norm_block = config.norm_block
    if norm_block is not None:  # BatchNorm norm block G (hetrain.runtime.norm)
        if batch % norm_block:
            raise InputError(
                "--norm-block", "", f"{norm_block} does not divide the global batch {batch}"
            )
        if plan_obj is not None:
            from hetrain.runtime.norm import check_plan_norm_block

            groups = [(i, g.batch, g.microbatch_size) for i, g in enumerate(plan_obj.groups)]
            try:
                check_plan_norm_block(groups, norm_block)
            except InputError as exc:
                raise InputError(plan_source, exc.field, exc.expected) from None
    slow = parse_slowdown(config.slowdown, device_ids)
    trace_rows = None
    if config.trace is not None:
        trace_rows = _load_trace(config.trace, cluster_spec, device_ids)
        if trace_rows:
            check_trace_steps(steps, len(device_ids), "--trace")
    _check_emulated_slowdown(slow, cluster_spec, trace_rows or [], list(device_ids))
    # the optimizer and its groups, tried on stand-in parameters (hetrain.runtime.optim)
    from hetrain.runtime.optim import OptimizerSpec

    spec = OptimizerSpec(
        name=config.optimizer or "user",
        lr=config.lr if config.lr is not None else 1e-3,
        momentum=config.momentum,
        weight_decay=config.weight_decay or 0.0,
        factory=user_optimizer,
        param_groups=opt_groups,
    )
    opt_lr, state_factor = check_factory(spec._factory(), opt_groups)
    grad_clip = config.grad_clip_norm
    return TrainJob(
        task=task,
        devices=device_ids,
        steps=steps,
        batch=batch,
        seed=config.seed,
        optimizer=config.optimizer if user_optimizer is None else "user",
        lr=opt_lr if user_optimizer is not None else config.lr,
        weight_decay=config.weight_decay or 0.0,
        momentum=config.momentum,
        optimizer_factory=user_optimizer,
        param_groups=opt_groups,
        optimizer_state_factor=state_factor,
        warmup_steps=config.warmup_steps,
        lr_schedule=config.lr_schedule,
        grad_clip_norm=grad_clip if grad_clip else None,  # 0: off
        dtype=config.dtype,
        bf16=config.bf16,
        schedule=config.schedule,
        plan=plan_obj.to_json_dict() if plan_obj is not None else None,
        adaptive=bool(adaptive) and len(device_ids) > 1,
        microbatch_size=microbatch_size,
        cluster=cluster_spec.model_dump(mode="json") if cluster_spec is not None else None,
        slowdown=slow,
        trace_rows=trace_rows,
        metrics_out=str(config.metrics_out) if config.metrics_out is not None else None,
        run_dir=str(config.run_dir) if config.run_dir is not None else None,
        checkpoint_dir=str(config.checkpoint_dir) if config.checkpoint_dir is not None else None,
        checkpoint_every=config.checkpoint_every,
        checkpoint_keep=config.checkpoint_keep,
        on_nonfinite=config.on_nonfinite,
        out=str(config.out) if config.out is not None else None,
        progress=progress,
        example=task.name,
        hang_timeout_s=config.hang_timeout_s,
        norm_block=norm_block,
        exact=config.exact,
        tensorboard=config.tensorboard,
    )
