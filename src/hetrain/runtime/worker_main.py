"""The per-rank entry of ``hetrain train`` (one process per device) and what its run is made of.

:func:`run_worker` is what every rank runs (started by :mod:`hetrain.runtime.launch` through
torch's elastic launcher, by ``torchrun ... -m hetrain train``, or in-process for
``--workers 1``): it sets up ``torch.distributed`` and runs a
:class:`hetrain.runtime.trainer.Trainer`, whose parts are start-up
(:mod:`hetrain.runtime.trainer_setup`: resume, first plan, start-up measurements of
:func:`startup_measurements`, controller round), per iteration ``t``:

1. set the emulation of slot ``t`` (``--slowdown``, ``--trace``, ``--cluster``;
   :class:`~hetrain.runtime.emulation.EmulationSchedule`);
2. build the global batch of ``t`` (:class:`~hetrain.runtime.data.GlobalBatchSampler`, same on
   every rank) and run ``Worker.step`` (``Trainer.train_step``);
3. no collective of the loop's own: each rank's row of ``Worker.step``'s ``report`` (its stop
   request, rank 0's "a new plan follows" flag, read from memory: the
   :class:`~hetrain.runtime.adapt.ControllerLink` thread talks to the controller's store, and
   the times of the rank's previous step) rides in the step's own combination (the gradient
   all-reduce of a data-parallel step; a step later on other plans), so every rank acts on
   the flags at the same step; every rank writes its own measurements to the controller's
   store (queued, never waited for);
4. rank 0 writes a step's metrics line once every rank's row for it is there
   (:mod:`hetrain.runtime.step_metrics`); when a new plan was flagged, it is broadcast and
   every rank calls ``Worker.apply_plan`` (``Trainer.switch_plan``);
5. every ``checkpoint_every`` steps a collective checkpoint (``Trainer.checkpoint``); a
   signal or a non-finite value stops the loop (:mod:`hetrain.runtime.stop`).

At the end rank 0 gathers the whole model (``Worker.full_state_dict``), evaluates it on the
validation split, exports the plain ``state_dict`` and returns a summary (``Trainer.finish``).
Here too: the ``TrainJob``, its optimizer, learning-rate schedule and cost-model config, and
the start-up calibration.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hetrain.cluster import ClusterState, cluster_from_dict
from hetrain.costmodel import TrainingConfig
from hetrain.profile import ProfileArrays
from hetrain.profiler import profile_chain as measured_profile
from hetrain.runtime.calibrate import (
    _measure_device,
    _measure_update_s_per_byte,
    _sample_unit,
    measure_layer_times,
    with_layer_times,
)
from hetrain.runtime.emulation import (  # noqa: F401  (re-exported: api, benches, tests)
    EmulationSchedule,
    base_slowdowns,
    local_cluster_spec,
    local_cluster_state,
)
from hetrain.runtime.optim import OptimizerSpec
from hetrain.runtime.stop import (  # noqa: F401  (re-exported: launch, tests)
    EXIT_STOPPED,
    EXIT_STOPPED_BY_PEER,
    STOP_GRACE_S,
    NonFiniteError,
    StopRequest,
    TrainingStopped,
)
from hetrain.runtime.trainjob import TrainJob, lr_multiplier  # noqa: F401  (re-exported)
from hetrain.runtime.watchdog import process_group_timeout

DTYPES = {"float32": torch.float32, "float64": torch.float64}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _profile(model: nn.Sequential, sample: torch.Tensor) -> ProfileArrays:
    """The model profile from :func:`hetrain.profiler.profile_chain` (FLOPs, saved-activation
    bytes)."""
    return measured_profile(model, sample).arrays()


def optimizer_spec(job: TrainJob) -> OptimizerSpec:
    """The job's optimizer (hetrain's or the user's, its parameter groups) with the job's
    learning-rate schedule (:func:`lr_multiplier`)."""
    return OptimizerSpec(
        name=job.optimizer,
        lr=job.lr,
        momentum=job.momentum,
        weight_decay=job.weight_decay,
        lr_schedule=lr_multiplier(job),
        factory=job.optimizer_factory,
        param_groups=tuple(job.param_groups or ()),
        measured_state_factor=job.optimizer_state_factor,
    )


def _state_factor(job: TrainJob) -> float:
    """docs/model.md §2 ``o`` of the job's optimizer (measured when the job carries it)."""
    if job.optimizer_state_factor is not None:
        return float(job.optimizer_state_factor)
    return 2.0 if job.optimizer == "adamw" else (1.0 if job.momentum > 0 else 0.0)


def _training_config(job: TrainJob) -> TrainingConfig:
    o = _state_factor(job)
    # this engine overlaps each gradient bucket's all-reduce with the last backward
    # (GradientSync; Worker's default bucket cap is TrainingConfig's default, 64 MiB): the
    # controller's model charges only the exposed part of the sync
    return TrainingConfig(
        batch=job.batch,
        optimizer_state_factor=o,
        schedule=job.schedule or "1f1b",
        sync_overlap=True,
        norm_block=job.norm_block,
    )


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------


def run_worker(job: TrainJob, num_threads: int | None = None) -> dict[str, Any] | None:
    """Train on this rank (``torch.distributed`` initialised from the environment when not yet
    up). ``num_threads``: torch threads of this rank (default: cores / local ranks). Returns
    the run summary on rank 0, None elsewhere."""
    from hetrain.runtime.engine import Worker, gather_measurements

    own_group = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kwargs = {}
        if job.hang_timeout_s is not None:
            kwargs["timeout"] = process_group_timeout(job.hang_timeout_s)
        dist.init_process_group(backend, **kwargs)
        own_group = True
    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(num_threads or max(1, (os.cpu_count() or 1) // max(local_world, 1)))
        return _train(job, Worker, gather_measurements)
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(job: TrainJob, Worker, gather_measurements) -> dict[str, Any] | None:
    """One rank's run: start-up, steps, end (:class:`hetrain.runtime.trainer.Trainer`)."""
    from hetrain.runtime.trainer import Trainer

    return Trainer(job, Worker, gather_measurements).train()


def startup_measurements(
    job: TrainJob,
    model: nn.Module,
    chain: Any,
    profile: ProfileArrays,
    config: TrainingConfig,
    sampler: Any,
    start_step: int,
    emu: EmulationSchedule,
    coll: torch.device,
) -> tuple[ClusterState, ProfileArrays, TrainingConfig]:
    """Adaptive runs, collective: measured speeds and per-micro-batch overheads κ of the local
    ranks (emulation of the first slot applied), all ranks busy at once (see
    :func:`_measure_device`), gathered over the ranks. Returns the cluster state the
    controller starts from (:func:`_base_state`), ``profile`` with every layer's forward and
    backward times measured on each rank's device as the measured times of its kind
    (:func:`hetrain.runtime.calibrate.with_layer_times`; ``chain``: the cut model), and
    ``config`` refined with this host's
    measurements (docs/profiling.md §6: the straggler of G' jittered groups and the weight
    update per parameter byte). ``model`` is left in the job's dtype on ``coll``'s device
    (the caller restores it); ``sampler``: the run's ``GlobalBatchSampler``."""
    world = dist.get_world_size()
    dtype = DTYPES[job.dtype]
    factor = emu.factors(start_step)[job.devices[dist.get_rank()]]
    calib_device = coll
    calib_model = model.to(dtype=dtype, device=calib_device)
    unit = _sample_unit(model, job.norm_block)  # the smallest micro-batch both timings run
    mine = _measure_device(
        job.task,
        calib_model,
        dtype,
        np.asarray(profile.train_flops),
        sampler.indices(start_step),
        factor,
        device=calib_device,
        overhead_weights=np.asarray(profile.overhead_weights),
        sample_unit=unit,
    )
    mine = (*mine, _measure_update_s_per_byte(calib_model, optimizer_spec(job)))
    layer_times = measure_layer_times(
        job.task,
        chain,
        dtype,
        sampler.indices(start_step),
        factor,
        device=calib_device,
        sample_unit=unit,
        activation_bytes_per_sample=float(np.sum(profile.activation_memory_bytes)),
    )
    gathered = [torch.zeros(5, dtype=torch.float64, device=coll) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64, device=coll))
    measured = [float(t[0]) for t in gathered]
    kappa = [float(t[1]) for t in gathered]
    lam = [float(t[2]) for t in gathered]
    base_state = _base_state(job, measured, kappa, lam)
    # each rank's layer times as the measured times of its kind (docs/runtime.md)
    base_state, profile = with_layer_times(
        base_state, profile, job.devices, layer_times, own_kinds=job.cluster is None
    )
    if config is not None:
        config = dataclasses.replace(
            config,
            group_time_jitter=float(np.median([float(t[3]) for t in gathered])),
            update_time_s_per_param_byte=float(max(float(t[4]) for t in gathered)),
        )
    return base_state, profile, config


def _to_device(obj: Any, device: torch.device) -> Any:
    """Tensors of ``obj`` (nested tuple/list/dict) on ``device``: pinned host memory and a
    non-blocking copy (CUDA); other values unchanged."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and device.type == "cuda":
            return obj.pin_memory().to(device, non_blocking=True)
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


_CURRENT_LAYER: list[str | None] = [None]


def current_layer() -> str | None:
    """``"L (Class)"`` of the layer whose forward this rank is in (set by hooks of
    :func:`_track_layers`; stays set when that forward raised), else None."""
    return _CURRENT_LAYER[0]


def _track_layers(chain) -> None:
    """Forward hooks on the modules of each layer of the chain (a
    :class:`hetrain.runtime.cutting.Chain`) that record which layer is running, so that a
    rank's failure names its layer (``rank 1 (w1), layer 3 (Linear): ...``)."""
    for i in range(chain.num_layers):
        modules = chain.layer_modules(i)
        if not modules:
            continue
        label = f"{i} ({type(modules[0]).__name__})"

        def enter(_m, _args, label=label):
            _CURRENT_LAYER[0] = label

        def leave(_m, _args, _out):
            _CURRENT_LAYER[0] = None

        for module in modules:
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)


def _base_state(
    job: TrainJob,
    measured_flops: list[float] | None,
    kappa_s: list[float] | None = None,
    layer_overhead_s: list[float] | None = None,
) -> ClusterState:
    """Cluster state the planner starts from: ``--cluster``'s devices when given (speeds, κ
    and λ replaced by measurements when there are any), else the local ranks."""
    if job.cluster is not None:
        state = cluster_from_dict(job.cluster, "--cluster").state()
    else:
        state = local_cluster_state(job.devices, [1e9] * len(job.devices))
    if measured_flops is not None:
        idx = state.index()
        speed = state.speed_flops.copy()
        kap = state.kappa_s.copy()
        lam = state.layer_overhead_s.copy()
        for i, d in enumerate(job.devices):
            speed[idx[d]] = measured_flops[i]
            if kappa_s is not None:
                kap[idx[d]] = kappa_s[i]
            if layer_overhead_s is not None:
                lam[idx[d]] = layer_overhead_s[i]
        state = state.with_changes(speed_flops=speed, kappa_s=kap, layer_overhead_s=lam)
    return state


def job_summary_json(summary: dict[str, Any]) -> str:
    """The summary as one JSON line."""
    return json.dumps(summary, default=str)
