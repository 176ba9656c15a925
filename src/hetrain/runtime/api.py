"""``hetrain.train``: train your own chain model on your own data with hetrain's runtime.

Example::

    import torch, hetrain
    from torch import nn
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 3))
    x, y = torch.randn(1000, 20), torch.randint(0, 3, (1000,))
    result = hetrain.train(model=model, dataset=(x, y), loss_fn=nn.functional.cross_entropy,
                           workers=3, steps=100, batch=48, slowdown={"w1": 3.0})
    # model now holds the trained weights; result["model_path"] is a plain state_dict file

All validation of a run's configuration lives here (:func:`build_job`), used by the CLI too:
bad values raise :class:`~hetrain.errors.InputError` before any process starts.
"""

from __future__ import annotations

import copy
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hetrain._io import MAX_BATCH, check_seed
from hetrain._text import plural
from hetrain.cluster import ClusterSpec, cluster_from_dict, load_cluster
from hetrain.errors import InputError
from hetrain.plan import Plan, load_plan, plan_from_dict
from hetrain.runtime.data import DEFAULT_TARGET_KEY, Task, as_chain, as_source
from hetrain.runtime.launch import launch
from hetrain.runtime.optim import check_factory, resolve_param_groups
from hetrain.runtime.worker_main import DTYPES, TrainJob, base_slowdowns, local_cluster_spec

OPTIMIZERS = ("sgd", "adamw")


def parse_slowdown(items: Sequence[str] | Mapping[str, float] | None, devices: Sequence[str]):
    """``["w1=3", ...]`` (or a mapping) -> ``{"w1": 3.0}``.

    Raises:
        InputError: not ``DEVICE=FACTOR``, a device that is not one of ``devices``, or a factor
            that is not a finite number >= 1.
    """
    out: dict[str, float] = {}
    if items is None:
        return out
    pairs = items.items() if isinstance(items, Mapping) else [_split(i) for i in items]
    for device, value in pairs:
        if device not in devices:
            raise InputError(
                "--slowdown",
                str(device),
                f"expected a device of this run ({', '.join(devices)}), got {device!r}",
            )
        try:
            factor = float(value)
        except (TypeError, ValueError):
            raise InputError(
                "--slowdown", str(device), f"expected a number, got {value!r}"
            ) from None
        if not (math.isfinite(factor) and factor >= 1.0):
            raise InputError(
                "--slowdown", str(device), f"expected a finite factor >= 1, got {value}"
            )
        out[str(device)] = factor
    return out


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


def _split(item: str) -> tuple[str, str]:
    device, sep, value = str(item).partition("=")
    if not sep or not device.strip():
        raise InputError("--slowdown", str(item), "expected DEVICE=FACTOR, e.g. w1=3")
    return device.strip(), value.strip()


def _positive_int(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(name, "", f"expected an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise InputError(
            name, "", f"expected an integer between {minimum} and {maximum:.0e}, got {value!r}"
        )
    return value


def _finite(
    name: str,
    value: Any,
    *,
    minimum: float = 0.0,
    strict: bool = True,
    maximum: float | None = None,
) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(name, "", f"expected a number, got {value!r}") from None
    if not math.isfinite(v) or v < minimum or (strict and v == minimum):
        bound = ">" if strict else ">="
        raise InputError(name, "", f"expected a finite number {bound} {minimum:g}, got {value}")
    if maximum is not None and v > maximum:
        raise InputError(name, "", f"expected at most {maximum:g}, got {value}")
    return v


# optimizer hyper-parameters beyond these overflow float32 in the optimizer step (--lr 1e300:
# "value cannot be converted to type float without overflow" in a rank, exit 1) or train to
# NaN from the first step (--weight-decay/--momentum 1e300); SGD momentum above 1 diverges
MAX_LR = 1e6
MAX_WEIGHT_DECAY = 1e6
MAX_MOMENTUM = 1.0


def load_model_factory(spec: str) -> Callable[[], Any]:
    """Import ``"pkg.module:factory"``.

    Raises:
        InputError: malformed spec, module not importable, or no such callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError("--model", spec, "expected pkg.module:factory")
    import os
    import sys

    if os.getcwd() not in sys.path:  # like `python -m`: modules of the current folder
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError("--model", spec, f"cannot import {module_name!r} ({exc})") from None
    except Exception as exc:  # the module's own code failed (a SyntaxError, 1/0 at import)
        where = ""
        if isinstance(exc, SyntaxError) and exc.filename:
            where = f" at {exc.filename}:{exc.lineno}"
        raise InputError(
            "--model",
            spec,
            f"importing {module_name!r} failed{where}: {type(exc).__name__}: {exc}",
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InputError("--model", spec, f"expected a callable {attr!r} in {module_name}")
    return factory


def task_from_objects(
    model: nn.Module | Sequence[nn.Module],
    dataset: Any,
    loss_fn: Callable | None,
    *,
    val_dataset: Any = None,
    evaluate: Callable | None = None,
    name: str = "model",
    layers: Sequence[str] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    target_key: str = DEFAULT_TARGET_KEY,
    optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
) -> Task:
    """A :class:`Task` for a user's chain and data. Every rank deep-copies ``model`` (ranks are
    forked, so all start from its current weights). Without ``evaluate``, the validation
    quality is the mean ``loss_fn`` over ``val_dataset``. ``collate_fn`` and ``target_key``:
    how map-style data sets are collated and which key of a dict sample holds the targets
    (:func:`hetrain.runtime.data.as_source`), for both data sets. ``optimizer``: the user's
    ``param groups -> torch.optim.Optimizer``; ``param_groups``: ``[{"params": [names or
    parameters of model], **options}, ...]`` (resolved to names here, against ``model``).

    Raises:
        InputError: not a chain, bad data set, no loss function, an optimizer that is not
            callable, bad parameter groups.
    """
    chain = as_chain(model, name)
    if optimizer is not None and not callable(optimizer):
        raise InputError(
            "optimizer",
            "",
            f"expected a callable (param groups -> torch.optim.Optimizer), got "
            f"{type(optimizer).__name__}",
        )
    groups = resolve_param_groups(chain, param_groups) if param_groups is not None else None
    train = as_source(dataset, "dataset", collate_fn=collate_fn, target_key=target_key)
    val = (
        as_source(val_dataset, "val_dataset", collate_fn=collate_fn, target_key=target_key)
        if val_dataset is not None
        else None
    )
    if not callable(loss_fn):
        raise InputError("loss_fn", "", "expected a callable (outputs, targets) -> mean loss")

    def build() -> nn.Module:
        return copy.deepcopy(chain)

    def default_eval(m: nn.Module, dtype: torch.dtype) -> dict[str, float]:
        from hetrain.runtime.data import _mean_loss

        return {"val_loss": _mean_loss(m, loss_fn, val, 256, len(val), dtype)}

    return Task(
        name=name,
        build_model=build,
        train=train,
        val=val,
        loss_fn=loss_fn,
        evaluate=evaluate or (default_eval if val is not None else None),
        quality_metric="val_loss" if evaluate is None and val is not None else None,
        layers=list(layers) if layers is not None else None,
        optimizer=optimizer,
        param_groups=groups,
    )


FACTORY_KEYS = (
    "model",
    "dataset",
    "loss_fn",
    "val_dataset",
    "evaluate",
    "layers",
    "collate_fn",
    "target_key",
    "optimizer",
    "param_groups",
)
"""Keys a ``--model`` factory's mapping may hold (docs/training.md); any other is refused."""


def task_from_factory(spec: str, seed: int | None = None) -> Task:
    """The task of ``--model pkg.module:factory``: the factory returns a :class:`Task`, or a
    mapping with ``model`` (chain or list of blocks), ``dataset`` and ``loss_fn`` (optional
    ``val_dataset``, ``evaluate``). With ``seed``, torch's global generator is seeded with it
    just before the factory is called, so a model the factory builds has the same random
    weights in every run with that ``--seed`` (and on every node of a torchrun job).

    Raises:
        InputError: the factory fails or returns something else.
    """
    factory = load_model_factory(spec)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        made = factory()
    except Exception as exc:  # the user's code: report it in one line
        raise InputError("--model", spec, f"factory raised {type(exc).__name__}: {exc}") from None
    if isinstance(made, Task):
        return made
    if isinstance(made, Mapping) and {"model", "dataset", "loss_fn"} <= set(made):
        unknown = sorted(str(k) for k in set(made) - set(FACTORY_KEYS))
        if unknown:  # a key hetrain would not use is an error, never silently ignored
            raise InputError(
                "--model",
                spec,
                f"the factory returned unknown keys {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(FACTORY_KEYS)})",
            )
        return task_from_objects(
            made["model"],
            made["dataset"],
            made["loss_fn"],
            val_dataset=made.get("val_dataset"),
            evaluate=made.get("evaluate"),
            name=spec,
            layers=made.get("layers"),
            collate_fn=made.get("collate_fn"),
            target_key=made.get("target_key", DEFAULT_TARGET_KEY),
            optimizer=made.get("optimizer"),
            param_groups=made.get("param_groups"),
        )
    raise InputError(
        "--model",
        spec,
        f"expected the factory to return a Task or {{'model', 'dataset', 'loss_fn'}}, got "
        f"{type(made).__name__}",
    )


MAX_LOCAL_WORKERS = 1024
"""Most ranks ``--workers`` starts on one machine (one process of about 0.4 GB each): a typo
such as ``--workers 100000`` forked processes until the machine ran out of memory."""

MAX_HANG_TIMEOUT_S = 1e6
"""Longest ``--hang-timeout`` accepted (seconds, about 11.6 days): far above any step, and
within what ``datetime.timedelta`` and the process group's millisecond timeout hold (1e300
was an ``OverflowError`` in every rank)."""


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


def _check_output_path(option: str, path: Path, *, folder: bool) -> None:
    """An output path that training could not write is bad input, found before any rank starts
    (not after the ranks trained): a folder where a file is expected or the reverse, or a
    parent that is a file.

    Raises:
        InputError: one line naming the option and the path.
    """
    kind = "a folder" if folder else "a file"
    if path.exists() and path.is_dir() != folder:
        raise InputError(
            option, "", f"expected {kind}, got {'a file' if folder else 'a folder'}: {path}"
        )
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(option, "", f"expected {kind} path, but {parent} is a file")
            break


REPORT_FILES = ("report.txt", "iteration_time.png", "predicted_vs_measured.png")


def _check_outputs_apart(
    out: str | Path | None,
    metrics_out: str | Path | None,
    run_dir: str | Path | None,
    checkpoint_dir: str | Path | None,
) -> None:
    """``--out`` and ``--metrics-out`` are not files the run writes itself into ``--run-dir``
    (the report: ``report.txt``, ``iteration_time.png``, ``predicted_vs_measured.png``,
    ``timeline_step<N>.png``; ``model/``, where a Hugging Face model is exported) and not in
    ``--checkpoint-dir`` (an ``--out`` there replaced a checkpoint's data file, and the
    resume then refused the checkpoint as corrupted).

    Raises:
        InputError: naming the option and the file it would overwrite.
    """
    import fnmatch

    for option, given in (("--out", out), ("--metrics-out", metrics_out)):
        if given is None:
            continue
        path = Path(given).resolve()
        if run_dir is not None:
            folder = Path(run_dir).resolve()
            if path.parent == folder and (
                path.name in REPORT_FILES or fnmatch.fnmatch(path.name, "timeline_step*.png")
            ):
                raise InputError(
                    option,
                    str(given),
                    f"expected a file other than the run report's {path.name} in --run-dir",
                )
            hf = folder / "model"
            if path == hf or hf in path.parents:
                raise InputError(
                    option,
                    str(given),
                    "expected a path outside RUN_DIR/model (where a Hugging Face model is "
                    "exported)",
                )
        if checkpoint_dir is not None:
            ckpt_dir = Path(checkpoint_dir).resolve()
            if path == ckpt_dir or ckpt_dir in path.parents:
                raise InputError(
                    option,
                    str(given),
                    f"expected a path outside --checkpoint-dir {checkpoint_dir} (it would "
                    "overwrite the checkpoints)",
                )


def _check_distinct_outputs(
    out: str | Path | None,
    metrics_out: str | Path | None,
    run_dir: str | Path | None,
    inputs: Sequence[tuple[str, Path]] = (),
) -> None:
    """The files a run writes are distinct: the trained ``state_dict`` (``--out``, default
    ``RUN_DIR/model.pt``), the metrics (``--metrics-out``) and the controller log
    (``controller.jsonl`` beside the metrics, hetrain.runtime.worker_main). ``--out`` equal to
    ``--metrics-out`` overwrote the metrics with the state_dict at the end (then a traceback).
    None of them is one of the ``inputs`` (``--plan``, ``--cluster``, ``--trace`` files: the
    metrics overwrote the plan they were trained with).

    Raises:
        InputError: two of them are the same file, or one is an input file, naming the options.
    """
    files: list[tuple[str, Path, str]] = []
    if out is not None:
        files.append(("--out", Path(out), "the trained state_dict"))
    elif run_dir is not None:
        files.append(("--run-dir", Path(run_dir) / "model.pt", "the trained state_dict"))
    if metrics_out is not None:
        files.append(("--metrics-out", Path(metrics_out), "the metrics"))
        controller = Path(metrics_out).with_name("controller.jsonl")
        files.append(("--metrics-out", controller, "the controller log"))
    elif run_dir is not None:
        files.append(("--run-dir", Path(run_dir) / "controller.jsonl", "the controller log"))
    for option, path, what in files:
        for in_option, in_path in inputs:
            if path.resolve() == in_path.resolve():
                raise InputError(
                    f"{option} and {in_option}",
                    "",
                    f"expected {what} in a file other than the {in_option} input, got {path}",
                )
    for i, (option, path, what) in enumerate(files):
        for earlier_option, earlier, earlier_what in files[:i]:
            if path.resolve() == earlier.resolve():
                raise InputError(
                    option if option == earlier_option else f"{earlier_option} and {option}",
                    "",
                    f"expected different files for {earlier_what} and {what}, got {path} for both",
                )


def _check_checkpoint_dir(path: Path, chain: Any, steps: int) -> None:
    """Bad checkpoint folders are bad input, found before any rank starts: a file instead of a
    folder (or under a file), a latest checkpoint that is corrupted (size/sha256) or malformed,
    one written for another model (fingerprint), or one already at or past ``steps`` (nothing
    left to train).

    Raises:
        InputError: one line naming the folder or the checkpoint file.
    """
    from hetrain.runtime import checkpoint as ckpt

    _check_output_path("--checkpoint-dir", path, folder=True)
    latest = ckpt.load_latest(path)
    if latest is not None:
        mine = ckpt.model_fingerprint(chain)
        if latest.model_fingerprint != mine:
            raise InputError(
                str(latest.path / ckpt.MANIFEST),
                "model_fingerprint",
                f"checkpoint of another model ({latest.model_fingerprint}; this model {mine})",
            )
    if latest is not None and latest.step >= steps:
        raise InputError(
            "--steps",
            "",
            f"more than the {latest.step} steps of the latest checkpoint {latest.path} to "
            f"resume from, got {steps} (nothing left to train)",
        )


def build_job(
    task: Task,
    *,
    workers: int | None = None,
    nnodes: int = 1,
    steps: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    lr: float | None = None,
    optimizer: str | Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None,
    weight_decay: float | None = None,
    momentum: float = 0.0,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
    warmup_steps: int | None = None,
    lr_schedule: str = "cosine",
    grad_clip_norm: float | None | str = "default",
    dtype: str = "float32",
    bf16: bool = False,
    schedule: str | None = None,
    plan: Plan | str | Path | dict | None = None,
    adaptive: bool | None = None,
    microbatch_size: int | None = None,
    cluster: ClusterSpec | str | Path | dict | None = None,
    slowdown: Sequence[str] | Mapping[str, float] | None = None,
    trace: str | Path | None = None,
    metrics_out: str | Path | None = None,
    run_dir: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    checkpoint_keep: int = 3,
    on_nonfinite: str = "stop",
    out: str | Path | None = None,
    progress: bool = False,
    devices: Sequence[str] | None = None,
    hang_timeout_s: float | None = None,
    norm_block: int | None = None,
    exact: bool = False,
    tensorboard: bool = False,
) -> TrainJob:
    """Validate a run's configuration and return the :class:`TrainJob` every rank runs.

    Devices: the ids of ``cluster`` when given (its size is the world size), else the plan's
    devices in plan order when running under torchrun with a plan (``devices`` given by the
    caller), else ``w0 … w{N-1}`` for ``N = workers * nnodes``.

    Raises:
        InputError: any bad value: counts < 1, unknown optimizer/dtype/schedule, a norm block
            that does not divide the global batch or a plan's shares/micro-batches (BatchNorm,
            ``norm_block``; ``exact`` refuses uncovered random ops at run time), a plan naming
            unknown devices, not covering the layers, not matching the world size or ``batch``,
            bad ``--slowdown``, unreadable trace/cluster/plan files, ``tensorboard`` without
            the ``tensorboard`` package; a seed outside ``[0, 2**63-1]``, steps, batch or
            micro-batch size above ``MAX_BATCH`` (1e15), a trace's steps x devices above 1e7,
            ``hang_timeout_s`` above :data:`MAX_HANG_TIMEOUT_S`, ``microbatch_size`` with a
            fixed plan, output files that coincide with each other or with an input file;
            ``checkpoint_keep`` < 1, ``on_nonfinite`` other than ``"stop"``/``"skip"``.
    """
    d = task.defaults
    if tensorboard:
        from hetrain.runtime.metrics import check_tensorboard

        check_tensorboard()
    seed = check_seed("--seed", seed)
    nnodes = _positive_int("--nnodes", nnodes)
    # steps, batch and micro-batch size: at most MAX_BATCH (1e15), like hetrain plan's --batch;
    # above it numpy's arrays of one global batch cannot be made (a rank failed, exit 1)
    steps = _positive_int(
        "--steps", steps if steps is not None else d.get("steps", 100), maximum=MAX_BATCH
    )
    user_optimizer = task.optimizer
    if callable(optimizer):  # hetrain.train(optimizer=torch.optim.AdamW, ...)
        if user_optimizer is not None:
            raise InputError("optimizer", "", "given twice (the factory gives one too)")
        user_optimizer, optimizer = optimizer, None
    if user_optimizer is not None:
        # the user's optimizer sets its own hyper-parameters: hetrain's would be ignored
        for option, value in (
            ("--optimizer", optimizer),
            ("--lr", lr),
            ("--weight-decay", weight_decay),
            ("--momentum", momentum or None),
        ):
            if value is not None:
                raise InputError(
                    option,
                    "",
                    "not used with the user's own optimizer: set it in the optimizer (or its "
                    "param_groups)",
                )
    lr = _finite("--lr", lr if lr is not None else d.get("lr", 1e-3), maximum=MAX_LR)
    optimizer = "user" if user_optimizer is not None else optimizer or d.get("optimizer", "adamw")
    if optimizer not in (*OPTIMIZERS, "user"):
        raise InputError("--optimizer", "", f"expected sgd or adamw, got {optimizer!r}")
    if dtype not in DTYPES:
        raise InputError("--dtype", "", f"expected float32 or float64, got {dtype!r}")
    if schedule not in (None, "1f1b", "gpipe"):
        raise InputError("--schedule", "", f"expected 1f1b or gpipe, got {schedule!r}")
    if lr_schedule not in ("cosine", "constant"):
        raise InputError("--lr-schedule", "", f"expected cosine or constant, got {lr_schedule!r}")
    checkpoint_every = _positive_int("--checkpoint-every", checkpoint_every, 0)
    if checkpoint_every > 0 and checkpoint_dir is None:
        raise InputError("--checkpoint-every", "", "expected --checkpoint-dir as well")
    checkpoint_keep = _positive_int("--checkpoint-keep", checkpoint_keep, maximum=MAX_BATCH)
    if on_nonfinite not in ("stop", "skip"):
        raise InputError("--on-nonfinite", "", f"expected stop or skip, got {on_nonfinite!r}")
    if hang_timeout_s is not None:
        hang_timeout_s = _finite("--hang-timeout", hang_timeout_s)  # seconds > 0
        if hang_timeout_s > MAX_HANG_TIMEOUT_S:  # 1e300 overflowed timedelta in every rank
            raise InputError(
                "--hang-timeout",
                "",
                f"expected at most {MAX_HANG_TIMEOUT_S:.0e} seconds, got {hang_timeout_s:g}",
            )
    if grad_clip_norm == "default":
        grad_clip_norm = d.get("grad_clip_norm")
    if grad_clip_norm is not None:
        grad_clip_norm = _finite("--grad-clip-norm", grad_clip_norm)
    weight_decay = _finite(
        "--weight-decay",
        weight_decay if weight_decay is not None else d.get("weight_decay", 0.0),
        strict=False,
        maximum=MAX_WEIGHT_DECAY,
    )
    momentum = _finite("--momentum", momentum, strict=False, maximum=MAX_MOMENTUM)
    opt_groups = task.param_groups
    if param_groups is not None:
        if opt_groups is not None:
            raise InputError("param_groups", "", "given twice (the factory gives them too)")
        opt_groups = resolve_param_groups(task.build_model(), param_groups)
    opt_groups = tuple(opt_groups or ())
    warmup_steps = _positive_int(
        "--warmup-steps", warmup_steps if warmup_steps is not None else d.get("warmup_steps", 0), 0
    )

    # ---- devices and world size ----
    cluster_spec: ClusterSpec | None = None
    if cluster is not None:
        if isinstance(cluster, ClusterSpec):
            cluster_spec = cluster
        elif isinstance(cluster, dict):
            cluster_spec = cluster_from_dict(cluster, "cluster")
        else:
            cluster_spec = load_cluster(cluster)
    plan_obj: Plan | None = None
    plan_source = "--plan"
    if isinstance(plan, Plan):
        plan_obj = plan
    elif isinstance(plan, dict):
        plan_obj = plan_from_dict(plan, "plan")
    elif plan is not None:
        plan_source = str(plan)
        plan_obj = load_plan(plan)
    if devices is not None:
        device_ids = list(devices)
    elif cluster_spec is not None:
        device_ids = list(cluster_spec.ids)
        if workers is not None and workers * nnodes != len(device_ids):
            raise InputError(
                "--workers",
                "",
                f"expected {plural(len(device_ids), 'rank')}, one per device of the cluster file, "
                f"got {workers * nnodes}",
            )
    else:
        local = _positive_int("--workers", workers if workers is not None else 4)
        if local > MAX_LOCAL_WORKERS:
            raise InputError(
                "--workers",
                "",
                f"expected at most {MAX_LOCAL_WORKERS} ranks on one machine (one process each), "
                f"got {local}",
            )
        n = local * nnodes
        device_ids = [f"w{i}" for i in range(n)]

    torch.manual_seed(seed)
    built = task.build_model()
    if not isinstance(built, nn.Module):
        raise InputError(
            task.name, "model", f"expected the factory to build an nn.Module, got {type(built)}"
        )
    from hetrain.runtime.data import task_chain

    # any module is cut into layers here, so a bad cut point or a module that cannot be
    # captured is reported before any process starts (runtime/cutting.py)
    num_layers = task_chain(task, built, verify=True).num_layers
    chain = built
    if exact:  # random ops that cannot be made plan-invariant (hetrain.runtime.randomness)
        from hetrain.runtime.randomness import InvariantRandomness

        static = InvariantRandomness(built, exact=True).static_problems()
        if static:
            raise InputError(task.name, "model", f"{static[0]} (--exact)")
    # buffers a training forward changes: plan-dependent values (hetrain.runtime.startup)
    from hetrain.runtime.data import cast_inputs
    from hetrain.runtime.startup import check_forward_buffers, warn

    floats = [p.dtype for p in built.parameters() if p.is_floating_point()]
    sample, _ = task.train.batch(np.arange(min(2, len(task.train))))
    warn(
        check_forward_buffers(
            built,
            cast_inputs(sample, floats[0] if floats else torch.float32),
            norm_block=norm_block,
            exact=exact,
            source=task.name,
        )
    )
    if checkpoint_dir is not None:
        _check_checkpoint_dir(Path(checkpoint_dir), chain, steps)
    if run_dir is not None:
        _check_output_path("--run-dir", Path(run_dir), folder=True)
    if metrics_out is not None:
        _check_output_path("--metrics-out", Path(metrics_out), folder=False)
    if out is not None:
        _check_output_path("--out", Path(out), folder=False)
    _check_outputs_apart(out, metrics_out, run_dir, checkpoint_dir)
    _check_distinct_outputs(
        out,
        metrics_out,
        run_dir,
        inputs=[
            (option, Path(path))
            for option, path in (("--plan", plan), ("--cluster", cluster), ("--trace", trace))
            if isinstance(path, (str, Path))
        ],
    )
    if plan_obj is not None:
        if batch is None:
            batch = plan_obj.global_batch
        plan_obj.validate_for(device_ids, num_layers, batch, plan_source)
        if set(plan_obj.devices) != set(device_ids):
            missing = [x for x in device_ids if x not in plan_obj.devices]
            raise InputError(
                plan_source,
                "groups[].devices",
                f"expected the plan to name every rank's device (world size {len(device_ids)}: "
                f"{', '.join(device_ids)}); missing {', '.join(missing)}",
            )
    batch = _positive_int(
        "--batch", batch if batch is not None else d.get("batch", 32), maximum=MAX_BATCH
    )
    if plan_obj is not None and plan_obj.global_batch == 0:
        raise InputError(plan_source, "groups[].batch", "expected a global batch > 0")
    if microbatch_size is not None and plan_obj is not None and not adaptive:
        # μ of the plans chosen online; a fixed plan's groups set theirs (was silently ignored)
        raise InputError(
            "--microbatch-size",
            "",
            f"not used with {plan_source} (a fixed plan: its groups set microbatch_size)",
        )
    microbatch_size = _positive_int(
        "--microbatch-size",
        microbatch_size if microbatch_size is not None else d.get("microbatch_size", 8),
        maximum=MAX_BATCH,
    )
    if norm_block is not None:  # BatchNorm norm block G (hetrain.runtime.norm)
        norm_block = _positive_int("--norm-block", norm_block)
        if batch % norm_block:
            raise InputError(
                "--norm-block",
                "",
                f"{norm_block} does not divide the global batch {batch}",
            )
        if plan_obj is not None:
            from hetrain.runtime.norm import check_plan_norm_block

            groups = [(i, g.batch, g.microbatch_size) for i, g in enumerate(plan_obj.groups)]
            try:
                check_plan_norm_block(groups, norm_block)
            except InputError as exc:
                raise InputError(plan_source, exc.field, exc.expected) from None
    slow = parse_slowdown(slowdown, device_ids)
    trace_rows = None
    if trace is not None:
        from hetrain.trace import load_trace

        spec = cluster_spec or local_cluster_spec(device_ids)
        try:
            trace_rows = list(load_trace(trace, spec).rows)
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
        if trace_rows:
            check_trace_steps(steps, len(device_ids), "--trace")
    _check_emulated_slowdown(slow, cluster_spec, trace_rows or [], list(device_ids))
    if adaptive is None:
        adaptive = plan_obj is None
    # the optimizer and its groups, tried on stand-in parameters (hetrain.runtime.optim)
    from hetrain.runtime.optim import OptimizerSpec

    spec = OptimizerSpec(
        name=optimizer,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        factory=user_optimizer,
        param_groups=opt_groups,
    )
    opt_lr, state_factor = check_factory(spec._factory(), opt_groups)
    if user_optimizer is not None:
        lr = opt_lr
    return TrainJob(
        task=task,
        devices=device_ids,
        steps=steps,
        batch=batch,
        seed=seed,
        optimizer=optimizer,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        optimizer_factory=user_optimizer,
        param_groups=opt_groups,
        optimizer_state_factor=state_factor,
        warmup_steps=warmup_steps,
        lr_schedule=lr_schedule,
        grad_clip_norm=grad_clip_norm,
        dtype=dtype,
        bf16=bf16,
        schedule=schedule,
        plan=plan_obj.to_json_dict() if plan_obj is not None else None,
        adaptive=bool(adaptive) and len(device_ids) > 1,
        microbatch_size=microbatch_size,
        cluster=cluster_spec.model_dump(mode="json") if cluster_spec is not None else None,
        slowdown=slow,
        trace_rows=trace_rows,
        metrics_out=str(metrics_out) if metrics_out is not None else None,
        run_dir=str(run_dir) if run_dir is not None else None,
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir is not None else None,
        checkpoint_every=checkpoint_every,
        checkpoint_keep=checkpoint_keep,
        on_nonfinite=on_nonfinite,
        out=str(out) if out is not None else None,
        progress=progress,
        example=task.name,
        hang_timeout_s=hang_timeout_s,
        norm_block=norm_block,
        exact=bool(exact),
        tensorboard=bool(tensorboard),
    )


def train(
    model: nn.Module | Sequence[nn.Module],
    dataset: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    val_dataset: Any = None,
    evaluate: Callable[[nn.Module, torch.dtype], dict[str, float]] | None = None,
    cluster: ClusterSpec | str | Path | dict | None = None,
    workers: int | None = None,
    steps: int = 100,
    batch: int = 32,
    optimizer: str | Callable[[list[dict[str, Any]]], torch.optim.Optimizer] = "adamw",
    lr: float | None = None,
    run_dir: str | Path | None = None,
    load_into_model: bool = True,
    report: bool = True,
    tensorboard: bool = False,
    layers: Sequence[str] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    target_key: str = DEFAULT_TARGET_KEY,
    **options: Any,
) -> dict[str, Any]:
    """Train ``model`` (an ``nn.Sequential`` or a list of blocks = the pipeline layers) on
    ``dataset`` with hetrain's runtime on local worker processes, adapting the plan online.

    Args:
        model: any ``nn.Module`` (cut into layers at its blocks, docs/model.md §5: every block of
        every
            ``ModuleList``/``Sequential`` of two or more blocks of one class, plus a prefix and
            a suffix layer), an ``nn.Sequential`` (one layer per child) or a list of blocks;
            its current weights are the starting point on every rank.
        dataset: ``(inputs, targets)`` tensors ``(N, ...)``, a ``TensorDataset``, or any
            map-style data set (a list too) of ``(input, target)`` pairs, of dicts (the
            model's keyword arguments, targets under ``target_key``) or of ``(dict, target)``
            pairs.
        loss_fn: ``(outputs, targets) -> scalar`` mean over the samples given, or ``->
            (sum, count)`` (token-level means with masking: divided by the global count).
        val_dataset / evaluate: validation data, and optionally ``(model, dtype) -> {metric:
            value}``; the default reports the mean ``loss_fn`` on ``val_dataset``.
        cluster: a cluster file (path/dict/ClusterSpec) whose devices the local ranks emulate
            (relative speeds by sleeping, links), one rank per device.
        workers: local ranks ``w0 … w{N-1}`` without ``cluster`` (default 4).
        steps, batch: iterations, global batch ``B``.
        optimizer: ``sgd``/``adamw`` (hetrain's, learning rate ``lr``, default 1e-3,
            ``weight_decay``, ``momentum``), or the user's own: any callable ``param groups ->
            torch.optim.Optimizer`` (``torch.optim.AdamW``, ``functools.partial(
            torch.optim.SGD, lr=0.1, momentum=0.9)``, a lambda), built on every rank over the
            parameters it holds; its learning rates are scaled by the schedule
            (``warmup_steps``, ``lr_schedule``).
        lr: hetrain's optimizer's learning rate (not with the user's optimizer).
        run_dir: folder for metrics, report and the exported ``state_dict`` (default
            ``./runs/<name>``).
        load_into_model: load the trained weights into ``model`` when done.
        report: write the report into ``run_dir`` when done: ``iteration_time.png`` (plan
            changes marked), ``timeline_step<N>.png`` (one iteration per group) and
            ``report.txt`` (:func:`hetrain.report.run_report.write_report`).
        tensorboard: also write TensorBoard event files next to ``metrics.jsonl`` (needs the
            ``tensorboard`` package: ``pip install 'hetrain[tensorboard]'``).
        layers: cut points (module names, e.g. ``["transformer.h.0", ...]``) instead of the
            default cut.
        collate_fn: ``list of items -> batch`` (a dict or ``(inputs, targets)``), applied to
            each micro-batch's samples (e.g. padding to the micro-batch's longest sequence);
            default: stack the samples.
        target_key: the key of dict samples that holds the targets (``labels``).
        **options: also ``param_groups``: ``[{"params": [names or parameters of model],
            **options}, ...]`` (e.g. ``{"weight_decay": 0.0}`` for norms and biases), every
            trainable parameter in one group.
        **options: any keyword of :func:`build_job` (``plan``, ``slowdown``, ``trace``,
            ``dtype``, ``bf16``, ``grad_clip_norm``, ``warmup_steps``, ``lr_schedule``,
            ``checkpoint_dir``, ``checkpoint_every``, ``checkpoint_keep`` (complete checkpoints
            kept, default 3), ``on_nonfinite`` (``"stop"``/``"skip"``), ``metrics_out``, ``out``,
            ``norm_block`` (BatchNorm norm block ``G``), ``exact`` (refuse random ops that
            cannot be made plan-invariant), ...), and ``max_restarts`` (restart all ranks
            after a failure, resuming from the latest checkpoint; default 0).

    Returns:
        rank 0's summary: ``final_loss``, ``metrics`` (validation), ``replans``, ``final_plan``,
        ``wall_time_s``, ``model_path``, ``metrics_path`` and, with ``report``,
        ``report_files`` (the plots written).

    Raises:
        InputError: bad configuration (before any process starts).
        hetrain.runtime.launch.LaunchError: a rank failed (message: the first failing rank's
            own error, ``rank R (device), layer L (Class): Error: ...``; every rank's traceback
            in ``run_dir/rank_errors.jsonl``), or a non-finite loss stopped the run.
        hetrain.runtime.launch.RunStopped: SIGTERM or SIGINT stopped the run after a step
            (its ``step`` and stop checkpoint ``path``).
    """
    user_optimizer = optimizer if callable(optimizer) else None
    task = task_from_objects(
        model,
        dataset,
        loss_fn,
        val_dataset=val_dataset,
        evaluate=evaluate,
        layers=layers,
        collate_fn=collate_fn,
        target_key=target_key,
        optimizer=user_optimizer,
        # resolved against ``model`` itself: its parameter objects may name the groups
        param_groups=options.pop("param_groups", None),
    )
    run_dir = Path(run_dir) if run_dir is not None else Path("runs") / task.name
    options.setdefault("metrics_out", run_dir / "metrics.jsonl")
    options.setdefault("grad_clip_norm", None)
    max_restarts = int(options.pop("max_restarts", 0))
    job = build_job(
        task,
        workers=workers,
        cluster=cluster,
        steps=steps,
        batch=batch,
        optimizer=None if user_optimizer is not None else optimizer,
        lr=lr,
        run_dir=run_dir,
        tensorboard=tensorboard,
        **options,
    )
    summary = run_job(job, max_restarts=max_restarts)
    if report and summary and job.metrics_out and job.run_dir:
        from hetrain.report.run_report import write_report

        summary["report_files"] = write_report(job.metrics_out, job.run_dir)["files"]
    if load_into_model and isinstance(model, nn.Module) and summary.get("model_path"):
        state = torch.load(summary["model_path"], weights_only=True)
        model.load_state_dict(
            {k: v.to(dtype=model.state_dict()[k].dtype) for k, v in state.items()}
        )
    return summary


def make_run_dir(run_dir: str | Path) -> Path:
    """Create the run folder ``run_dir`` (parents too) and, when hetrain creates it, a
    ``.gitignore`` of ``*`` inside it (as ``venv`` and pytest's cache do), so that run outputs
    are never committed wherever they are written.

    Raises:
        OSError: the folder cannot be created.
    """
    path = Path(run_dir)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    if created:
        (path / ".gitignore").write_text("# created by hetrain: run outputs are not sources\n*\n")
    return path


def run_job(
    job: TrainJob,
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
    rdzv_timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Launch ``job`` (``len(job.devices) / nnodes`` ranks on this node) and return rank 0's
    summary (with ``metrics_path``); ``{}`` on a node without rank 0. ``rdzv_timeout_s``:
    seconds to join the rendezvous (:func:`hetrain.runtime.launch.launch`).

    Raises:
        InputError: ``max_restarts`` < 0, ``rdzv_timeout_s`` not a finite number > 0.
    """
    if max_restarts < 0:
        raise InputError("--max-restarts", "", f"expected an integer >= 0, got {max_restarts}")
    rdzv_timeout_s = _finite("--rdzv-timeout", rdzv_timeout_s, maximum=MAX_HANG_TIMEOUT_S)
    if job.run_dir is not None:
        make_run_dir(job.run_dir)
    nproc = len(job.devices) // nnodes
    summary = launch(
        job,
        nproc,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint,
        run_id=run_id,
        max_restarts=max_restarts,
        rdzv_timeout_s=rdzv_timeout_s,
    )
    summary = dict(summary or {})
    if summary:
        summary["metrics_path"] = job.metrics_out
    return summary
