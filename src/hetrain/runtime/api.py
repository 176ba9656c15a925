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

The run's keywords are the fields of :class:`hetrain.runtime.config.RunConfig` (the same
options, defaults and help as ``hetrain train``'s flags): :func:`train`'s signature and the
"Run options" of its docstring are generated from them. Bad values raise
:class:`~hetrain.errors.InputError` before any process starts (the config's constructor, then
:func:`hetrain.runtime.job.build_job`).
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetrain.runtime.config import (
    MAX_HANG_TIMEOUT_S,
    MAX_LOCAL_WORKERS,
    MAX_LR,
    MAX_MOMENTUM,
    MAX_WEIGHT_DECAY,
    OPTIMIZERS,
    RunConfig,
)
from hetrain.runtime.data import DEFAULT_TARGET_KEY
from hetrain.runtime.job import (
    MAX_EMULATED_SLOWDOWN,
    build_job,
    check_trace_steps,
    parse_slowdown,
)
from hetrain.runtime.launch import launch
from hetrain.runtime.run_outputs import REPORT_FILES
from hetrain.runtime.trainjob import TrainJob
from hetrain.runtime.usertask import (
    FACTORY_KEYS,
    load_model_factory,
    task_from_factory,
    task_from_objects,
)

__all__ = [
    "FACTORY_KEYS",
    "MAX_EMULATED_SLOWDOWN",
    "MAX_HANG_TIMEOUT_S",
    "MAX_LOCAL_WORKERS",
    "MAX_LR",
    "MAX_MOMENTUM",
    "MAX_WEIGHT_DECAY",
    "OPTIMIZERS",
    "REPORT_FILES",
    "RunConfig",
    "build_job",
    "check_trace_steps",
    "load_model_factory",
    "make_run_dir",
    "parse_slowdown",
    "run_job",
    "task_from_factory",
    "task_from_objects",
    "train",
]


def train(
    model: nn.Module | Sequence[nn.Module],
    dataset: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    val_dataset: Any = None,
    evaluate: Callable[[nn.Module, torch.dtype], dict[str, float]] | None = None,
    layers: Sequence[str] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    target_key: str = DEFAULT_TARGET_KEY,
    param_groups: Sequence[dict[str, Any]] | None = None,
    load_into_model: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Train ``model`` (any ``nn.Module``, cut into pipeline layers at its blocks) on
    ``dataset`` with hetrain's runtime on local worker processes, adapting the plan online.

    Args:
        model: any ``nn.Module`` (cut into layers at its blocks, docs/model.md §5: every block
            of every ``ModuleList``/``Sequential`` of two or more blocks of one class, plus a
            prefix and a suffix layer), an ``nn.Sequential`` (one layer per child) or a list of
            blocks; its current weights are the starting point on every rank.
        dataset: ``(inputs, targets)`` tensors ``(N, ...)``, a ``TensorDataset``, or any
            map-style data set (a list too) of ``(input, target)`` pairs, of dicts (the
            model's keyword arguments, targets under ``target_key``) or of ``(dict, target)``
            pairs.
        loss_fn: ``(outputs, targets) -> scalar`` mean over the samples given, or ``->
            (sum, count)`` (token-level means with masking: divided by the global count).
        val_dataset / evaluate: validation data, and optionally ``(model, dtype) -> {metric:
            value}``; the default reports the mean ``loss_fn`` on ``val_dataset``.
        layers: cut points (module names, e.g. ``["transformer.h.0", ...]``) instead of the
            default cut.
        collate_fn: ``list of items -> batch`` (a dict or ``(inputs, targets)``), applied to
            the whole global batch's samples (e.g. padding to its longest sequence, as one
            device's loop does) before the plan splits its rows; default: stack the samples.
        target_key: the key of dict samples that holds the targets (``labels``).
        param_groups: ``[{"params": [names or parameters of model], **options}, ...]`` (e.g.
            ``{"weight_decay": 0.0}`` for norms and biases), every trainable parameter in one
            group.
        load_into_model: load the trained weights into ``model`` when done.
        **options: the run options below (:class:`hetrain.runtime.config.RunConfig`). Besides
            ``sgd``/``adamw``, ``optimizer`` may be the user's own: any callable ``param groups
            -> torch.optim.Optimizer`` (``torch.optim.AdamW``, ``functools.partial(
            torch.optim.SGD, lr=0.1, momentum=0.9)``, a lambda), built on every rank over the
            parameters it holds; its learning rates are scaled by the schedule
            (``warmup_steps``, ``lr_schedule``). ``cluster`` and ``plan`` may be files, dicts
            or ``ClusterSpec``/``Plan`` objects; ``slowdown`` a mapping ``{"w1": 3.0}``.

    Returns:
        rank 0's summary: ``final_loss``, ``metrics`` (validation), ``replans``, ``final_plan``,
        ``wall_time_s``, ``model_path``, ``metrics_path`` and, with ``report``,
        ``report_files`` (the plots written).

    Raises:
        InputError: bad configuration (before any process starts), an unknown keyword.
        hetrain.runtime.launch.LaunchError: a rank failed (message: the first failing rank's
            own error, ``rank R (device), layer L (Class): Error: ...``; every rank's traceback
            in ``run_dir/rank_errors.jsonl``), or a non-finite loss stopped the run.
        hetrain.runtime.launch.RunStopped: SIGTERM or SIGINT stopped the run after a step
            (its ``step`` and stop checkpoint ``path``).
    """
    config = RunConfig.from_keywords(options)
    user_optimizer = config.optimizer if callable(config.optimizer) else None
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
        param_groups=param_groups,
    )
    if user_optimizer is not None:  # the task holds it now
        config = dataclasses.replace(config, optimizer=None)
    config = config.with_output_defaults(task.name)
    job = build_job(task, config)
    summary = run_job(job, max_restarts=config.max_restarts, rdzv_timeout_s=config.rdzv_timeout_s)
    if config.report and summary and job.metrics_out and job.run_dir:
        from hetrain.report.run_report import write_report

        summary["report_files"] = write_report(job.metrics_out, job.run_dir)["files"]
    if load_into_model and isinstance(model, nn.Module) and summary.get("model_path"):
        state = torch.load(summary["model_path"], weights_only=True)
        model.load_state_dict(
            {k: v.to(dtype=model.state_dict()[k].dtype) for k, v in state.items()}
        )
    return summary


def _with_run_options(fn: Callable[..., Any]) -> None:
    """Give ``fn`` (``train``) the fields of :class:`RunConfig` as keyword-only parameters in
    its signature (in place of ``**options``, same defaults) and as "Run options" in its
    docstring (``name: help``), so ``help(hetrain.train)`` shows every run option once."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    lines = ["", "    Run options (keywords; ``hetrain train`` flags with the same defaults):"]
    for f in dataclasses.fields(RunConfig):
        kind = inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=f.type))
        text = f"{f.name}: {f.metadata['help']} (default {f.default!r})"
        lines.append(textwrap.fill(text, 96, initial_indent=" " * 8, subsequent_indent=" " * 12))
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    fn.__doc__ = (fn.__doc__ or "") + "\n".join(lines) + "\n"


_with_run_options(train)


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
    summary (with ``metrics_path``); ``{}`` on a node without rank 0. ``max_restarts`` and
    ``rdzv_timeout_s`` (seconds to join the rendezvous, :func:`hetrain.runtime.launch.launch`)
    are a :class:`RunConfig`'s, checked there; ``nnodes``, ``rdzv_endpoint`` and ``run_id``
    a :class:`hetrain.runtime.config.CommandOptions`'.

    Raises:
        OSError: the run folder cannot be created.
        hetrain.runtime.launch.LaunchError, hetrain.runtime.launch.RunStopped: see :func:`train`.
    """
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
