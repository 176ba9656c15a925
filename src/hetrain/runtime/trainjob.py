"""The job every rank runs: :class:`TrainJob`, a run's
:class:`~hetrain.runtime.config.RunConfig` resolved against its task and the world by
:func:`hetrain.runtime.job.build_job`, and its learning-rate schedule :func:`lr_multiplier`.
No torch (the launcher's and the controller's imports stay light).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from hetrain.runtime.data import Task


@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs: the :class:`RunConfig` resolved against the task and the world
    by :func:`hetrain.runtime.job.build_job` (passed by ``fork``; never changed after it:
    derive a changed job with :func:`dataclasses.replace`).

    Attributes:
        task: model factory, data, loss, evaluation (:class:`~hetrain.runtime.data.Task`).
        devices: device id of every rank (index = global rank).
        steps, batch, seed: iterations, global batch ``B``, seed of weights and sampler.
        optimizer, lr, weight_decay, momentum: optimizer (``sgd`` or ``adamw``), or
            ``user``: ``optimizer_factory`` (``param groups -> torch.optim.Optimizer``; ``lr``
            its first group's learning rate).
        param_groups: parameter groups by name with their options
            (:attr:`hetrain.runtime.optim.OptimizerSpec.param_groups`); empty: one group.
        optimizer_state_factor: optimizer state bytes per parameter byte (measured by
            :func:`hetrain.runtime.optim.check_factory`); None: from ``optimizer``.
        warmup_steps: linear warm-up; then cosine decay to ``min_lr_ratio * lr``
            (``lr_schedule="cosine"``) or constant (``"constant"``).
        grad_clip_norm: clip the global gradient norm (None = off).
        dtype: ``float32`` or ``float64``; ``bf16``: bf16 autocast of forward passes.
        plan: the fixed (``adaptive=False``) or first plan; None = chosen at start.
        microbatch_size: μ of the plans chosen here.
        cluster: cluster file contents (SI conversion here) or None (local ranks).
        slowdown: constant emulated slow-down factor per device.
        trace_rows: docs/model.md §7 trace rows (slot = step) or None.
        metrics_out: JSONL metrics file; run_dir: folder for the report and export.
        checkpoint_dir / checkpoint_every: DCP checkpoints (0 = never); resume from the latest.
        checkpoint_keep: complete checkpoints kept (older ones are deleted once a new one is
            complete); None keeps all.
        on_nonfinite: a non-finite loss or gradient norm ``"stop"``s the run at that step
            (:class:`hetrain.runtime.worker_main.NonFiniteError`) or the update is
            ``"skip"``ped on every rank.
        out: where to export the trained ``state_dict`` (``torch.save``); None = run_dir.
        progress: show a rich progress bar on rank 0.
        norm_block: BatchNorm norm block ``G`` (ghost batch norm) or None (per micro-batch);
        exact: refuse random ops that cannot be made plan-invariant (docs/runtime.md).
        hang_timeout_s: a rank that finishes no step for this long is failed (exit 124, see
            :mod:`hetrain.runtime.watchdog`), and collectives time out after it; None = off.
        controller_endpoint: ``host:port`` of the controller's store
            (:class:`~hetrain.runtime.adapt.ControllerThread` of the launching process); None
            under ``torchrun``: rank 0 then starts the controller process itself.
        tensorboard: rank 0 also writes TensorBoard event files next to ``metrics_out``
            (:class:`hetrain.runtime.metrics.TensorBoardSink`).
    """

    task: "Task"
    devices: list[str]
    steps: int
    batch: int
    seed: int = 0
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.0
    optimizer_factory: Any = None
    param_groups: tuple = ()
    optimizer_state_factor: float | None = None
    warmup_steps: int = 0
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip_norm: float | None = None
    dtype: str = "float32"
    bf16: bool = False
    schedule: str | None = None
    plan: dict | None = None
    adaptive: bool = True
    microbatch_size: int = 8
    cluster: dict | None = None
    slowdown: dict[str, float] = field(default_factory=dict)
    trace_rows: list | None = None
    metrics_out: str | None = None
    run_dir: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int | None = 3
    on_nonfinite: str = "stop"
    out: str | None = None
    progress: bool = False
    timeline_steps: int = 1
    example: str | None = None
    hang_timeout_s: float | None = None
    norm_block: int | None = None
    exact: bool = False
    controller_endpoint: str | None = None
    tensorboard: bool = False


def lr_multiplier(job: TrainJob) -> Callable[[int], float]:
    """``step -> factor`` of the learning rate: linear warm-up over ``warmup_steps``, then
    cosine decay from 1 to ``min_lr_ratio`` at the last step (``lr_schedule="cosine"``; the
    cosine schedule of Loshchilov & Hutter, SGDR, without restarts), or 1 (``"constant"``)."""
    warm, total, floor, kind = job.warmup_steps, job.steps, job.min_lr_ratio, job.lr_schedule

    def factor(step: int) -> float:
        if warm > 0 and step < warm:
            return (step + 1) / warm
        if kind == "constant":
            return 1.0
        span = max(total - warm, 1)
        progress = min(max(step - warm, 0) / span, 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
