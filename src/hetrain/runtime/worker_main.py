"""The per-rank training loop of ``hetrain train`` (one process per device).

:func:`run_worker` is what every rank runs (started by :mod:`hetrain.runtime.launch` through
torch's elastic launcher, by ``torchrun ... -m hetrain train``, or in-process for
``--workers 1``). Per iteration ``t``:

1. set the emulation of slot ``t`` (``--slowdown``, ``--trace``, ``--cluster``);
2. build the global batch of ``t`` (:class:`~hetrain.runtime.data.GlobalBatchSampler`, same on
   every rank) and run ``Worker.step``;
3. no collective of the loop's own: each rank's row of ``Worker.step``'s ``report`` (its stop
   request, rank 0's "a new plan follows" flag, read from memory: the
   :class:`~hetrain.runtime.adapt.ControllerLink` thread talks to the controller's store, and
   the times of the rank's previous step) rides in the step's own combination (the gradient
   all-reduce of a data-parallel step; a step later on other plans), so every rank acts on
   the flags at the same step; every rank writes its own measurements to the controller's
   store (queued, never waited for);
4. rank 0 writes a step's metrics line once every rank's row for it is there; when a new plan
   was flagged, it is broadcast and every rank calls ``Worker.apply_plan``;
5. every ``checkpoint_every`` steps a collective checkpoint.

At the end rank 0 gathers the whole model (``Worker.full_state_dict``), evaluates it on the
validation split, exports the plain ``state_dict`` and returns a summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hetrain.cluster import ClusterSpec, ClusterState, cluster_from_dict
from hetrain.costmodel import TrainingConfig
from hetrain.plan import Plan, plan_from_dict
from hetrain.profile import ProfileArrays
from hetrain.profiler import profile_chain as measured_profile
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.adapt import ControllerLink, Decision, even_dp_plan, spawn_controller_process
from hetrain.runtime.calibrate import (
    _measure_device,
    _measure_update_s_per_byte,
    _sample_unit,
    measure_layer_times,
    with_layer_times,
)
from hetrain.runtime.data import (
    GlobalBatchSampler,
    Task,
    cast_inputs,
    global_batch,
    task_chain,
)
from hetrain.runtime.metrics import MetricsWriter, TensorBoardSink, read_metrics
from hetrain.runtime.optim import OptimizerSpec
from hetrain.runtime.startup import unchanged
from hetrain.runtime.watchdog import Watchdog, process_group_timeout

DTYPES = {"float32": torch.float32, "float64": torch.float64}
EXIT_STOPPED_BY_PEER = 75
"""Exit status of a rank that stopped because another rank was asked to stop (EX_TEMPFAIL): its
agent restarts it into the next round."""
EXIT_STOPPED = 143
"""Exit status of a rank that stopped after its own SIGTERM (128 + 15; 130 after SIGINT)."""
STOP_GRACE_S = 20.0
"""Seconds a rank asked to stop (SIGTERM) waits for the ranks to agree on a stop step (the end of
the current step) before it just exits; below the 30 s torch's elastic agent waits before its
SIGKILL. Once the stop is agreed the checkpoint of that step is never cut short by it (it was 5 s
and cut the stop checkpoint of a join on a loaded machine: the next round redid 4 steps)."""


class StopRequest:
    """A SIGTERM or SIGINT received by this rank (a spot instance's warning, a scale-down,
    Ctrl-C, or the elastic agent restarting the group because a device joins): the loop stops
    after the current step with a checkpoint at a step every rank agrees on. When the step
    cannot finish (a peer is gone), the rank exits anyway after :data:`STOP_GRACE_S` seconds
    (``grace=True``, several ranks), unless the ranks agreed on the stop step first
    (:meth:`agree`): then the stop checkpoint is written whatever it takes (its collectives
    fail by themselves if a peer dies, and the agent's SIGKILL bounds it).

    Attributes:
        requested: a signal arrived.
        signum: the first signal received (``signal.SIGTERM`` or ``signal.SIGINT``), or None.
    """

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self, *, grace: bool = True) -> None:
        self.requested = False
        self.agreed = False
        self.signum: int | None = None
        self._grace = grace
        self._timer: Any = None
        self._previous: dict[int, Any] = {}

    @property
    def signal_name(self) -> str:
        """``"SIGTERM"``/``"SIGINT"`` of the first signal received (``"SIGTERM"`` if none)."""
        return signal.Signals(self.signum).name if self.signum else "SIGTERM"

    @property
    def exit_code(self) -> int:
        """``128 + signal`` of the first signal received (143 for SIGTERM, 130 for SIGINT)."""
        return 128 + (self.signum or 15)

    def install(self) -> StopRequest:
        """Handle SIGTERM and SIGINT in this process (the main thread only) until
        :meth:`restore`."""
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced (idempotent)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        if self._timer is not None:
            self._timer.cancel()

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        import threading

        if self.signum is None:
            self.signum = int(signum)
        self.requested = True
        if not self._grace or self.agreed or self._timer is not None:
            return  # one grace period, none after agreement
        self._timer = threading.Timer(STOP_GRACE_S, os._exit, (self.exit_code,))
        self._timer.daemon = True
        self._timer.start()

    def agree(self) -> None:
        """Every rank knows the stop step (this step's all-gather carried the request): the
        grace timer is cancelled so that it cannot cut the stop checkpoint short."""
        self.agreed = True
        if self._timer is not None:
            self._timer.cancel()


class TrainingStopped(SystemExit):
    """The run stopped on a signal (SIGTERM, SIGINT) after an agreed step; ``code`` is the
    rank's exit status (``128 + signal``, or :data:`EXIT_STOPPED_BY_PEER` for a rank whose
    peer got the signal).

    Attributes:
        step: steps done (the stop step; a rerun resumes here).
        path: the stop checkpoint's folder, or None (no ``--checkpoint-dir``).
        signal_name: ``"SIGTERM"`` or ``"SIGINT"``.
    """

    def __init__(self, code: int, *, step: int, path: str | None, signal_name: str) -> None:
        super().__init__(code)
        self.step = step
        self.path = path
        self.signal_name = signal_name


class NonFiniteError(RuntimeError):
    """A step's loss or global gradient norm was NaN or infinite and the job says
    ``on_nonfinite="stop"``: every rank raises it at that step, before any checkpoint of the
    step and before the export (the last good checkpoint stays the newest). The message is one
    line naming the step and the rank, group and stage where the value first showed."""


def _nonfinite_line(job: TrainJob, step: int, result: Any, table: list[list[float]]) -> str:
    """The one line of :class:`NonFiniteError` (see there); ``table`` has one row per rank:
    ``[own part not finite (0/1), group index, stage index]`` (indices -1 when unused)."""
    what = []
    if not math.isfinite(result.loss):
        what.append(f"loss {result.loss}")
    if not math.isfinite(result.grad_norm):
        what.append(f"gradient norm {result.grad_norm}")
    seen = sorted((int(row[1]), int(row[2]), r) for r, row in enumerate(table) if row[0] > 0)
    where = ""
    if seen:
        g, k, r = seen[0]
        where = f" (first on rank {r} ({job.devices[r]}), group {g} stage {k})"
    latest = ckpt.list_checkpoints(job.checkpoint_dir) if job.checkpoint_dir else []
    kept = f"last good checkpoint {latest[-1]}" if latest else "no checkpoint written"
    return (
        f"non-finite {' and '.join(what) or 'value'} at step {step}{where}; run stopped "
        f"(--on-nonfinite skip skips such updates), {kept}, no model exported"
    )


@dataclass
class TrainJob:
    """Everything a rank needs (validated by the parent before launching; passed by ``fork``).

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
            (:class:`NonFiniteError`) or the update is ``"skip"``ped on every rank.
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

    task: Task
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


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def lr_multiplier(job: TrainJob):
    """``step -> factor`` of the learning rate: linear warm-up over ``warmup_steps``, then
    cosine decay from 1 to ``min_lr_ratio`` at the last step (``lr_schedule="cosine"``)."""
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


def _profile(model: nn.Sequential, sample: torch.Tensor) -> ProfileArrays:
    """The model profile from :func:`hetrain.profiler.profile_chain` (FLOPs, saved-activation
    bytes)."""
    return measured_profile(model, sample).arrays()


def local_cluster_state(devices: list[str], speeds_flops: list[float]) -> ClusterState:
    """A cluster of the local ranks: each its own node (so a trace's ``nic_gbps`` limits its
    links), measured speeds, 16 GiB each, 20 Gbit/s NICs, 20 µs latency (nominal loopback)."""
    spec = cluster_from_dict(
        {
            "links": {"intra_node_gbps": 20.0, "latency_us": 20.0},
            "devices": [
                {"id": d, "tflops": max(s, 1.0) / 1e12, "memory_gib": 16.0, "nic_gbps": 20.0}
                for d, s in zip(devices, speeds_flops, strict=True)
            ],
        },
        "<local ranks>",
    )
    return spec.state()


def base_slowdowns(
    devices: list[str], slowdown: dict[str, float], cluster: ClusterSpec | None
) -> dict[str, float]:
    """``base_d`` of :class:`EmulationSchedule` (dimensionless, ``>= 1`` per device of
    ``devices``): ``--slowdown``'s factor times, with ``--cluster``, ``max_e tflops_e /
    tflops_d`` (the local ranks emulate the cluster's relative speeds)."""
    base = {d: float(slowdown.get(d, 1.0)) for d in devices}
    if cluster is not None:
        top = max(dv.tflops for dv in cluster.devices)
        for dv in cluster.devices:
            if dv.id in base:
                base[dv.id] *= top / dv.tflops
    return base


class EmulationSchedule:
    """Per-step emulation: ``slowdown_d(t) = base_d / speed_factor_d(t)`` and NIC bandwidth from
    the trace (docs/model.md §7: one slot = one step); ``base_d`` from :func:`base_slowdowns`
    (the local ranks emulate the cluster's relative speeds and its links)."""

    def __init__(self, job: TrainJob) -> None:
        self.devices = list(job.devices)
        self.cluster: ClusterSpec | None = None
        if job.cluster is not None:
            self.cluster = cluster_from_dict(job.cluster, "--cluster")
        self.base = base_slowdowns(self.devices, dict(job.slowdown), self.cluster)
        self.timeline = None
        if job.trace_rows:
            from hetrain.trace import Trace

            spec = self.cluster or local_cluster_spec(self.devices)
            self.timeline = Trace(tuple(job.trace_rows), "--trace").timeline(spec, job.steps)
        self._key: Any = None
        self._emulation = None

    def factors(self, step: int) -> dict[str, float]:
        """Slow-down factor of every device at ``step``."""
        out = dict(self.base)
        if self.timeline is not None:
            ids = self.timeline.base.ids
            s = min(step, self.timeline.num_slots - 1)
            for i, d in enumerate(ids):
                if d in out and s >= 0:
                    out[d] = out[d] / float(self.timeline.speed_factor[s, i])
        return {d: max(f, 1.0) for d, f in out.items()}

    def emulation(self, step: int):
        """The engine's ``Emulation`` for ``step`` (the same object while nothing changes)."""
        from hetrain.runtime.emulation import Emulation

        factors = self.factors(step)
        nic = None
        state = None
        if self.timeline is not None:
            state = self.timeline.state_at(step)
            nic = tuple(float(v) for v in state.nic_bytes_per_s)
        elif self.cluster is not None:
            state = self.cluster.state()
        key = (tuple(sorted(factors.items())), nic)
        if key != self._key:
            self._key = key
            if state is not None and (self.cluster is not None or self._trace_sets_nic()):
                self._emulation = Emulation.from_cluster_state(state, factors)
            else:
                self._emulation = Emulation(slowdown=factors)
        return self._emulation

    def _trace_sets_nic(self) -> bool:
        return self.timeline is not None and bool(
            np.any(self.timeline.nic_bytes_per_s != self.timeline.nic_bytes_per_s[:1])
        )


def local_cluster_spec(devices: list[str]) -> ClusterSpec:
    """The nominal cluster file of the local ranks (see :func:`local_cluster_state`)."""
    return cluster_from_dict(
        {
            "links": {"intra_node_gbps": 20.0, "latency_us": 20.0},
            "devices": [
                {"id": d, "tflops": 1.0, "memory_gib": 16.0, "nic_gbps": 20.0} for d in devices
            ],
        },
        "<local ranks>",
    )


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
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(job.devices) != world:
        raise ValueError(
            f"world size {world} differs from the {len(job.devices)} devices of the job"
        )
    device_id = job.devices[rank]
    dtype = DTYPES[job.dtype]
    lead = rank == 0
    wall0 = time.perf_counter()

    # NCCL (CUDA) collectives take CUDA tensors; gloo CPU ones
    coll = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    torch.manual_seed(job.seed)
    model = job.task.build_model()
    # start-up (cut, profile, calibration) runs the model in training mode: everything it
    # changes (buffers, dtype, device, random states) is put back before training
    startup = contextlib.ExitStack()
    startup.enter_context(unchanged(model))
    chain = task_chain(job.task, model)  # any module, cut into layers (runtime/cutting.py)
    num_layers = chain.num_layers
    fingerprint = ckpt.model_fingerprint(model)
    _track_layers(chain)
    sampler = GlobalBatchSampler(len(job.task.train), job.batch, job.seed)
    emu = EmulationSchedule(job)

    # ---- resume ---------------------------------------------------------------------------
    resume = ckpt.load_latest(job.checkpoint_dir) if job.checkpoint_dir else None
    if resume is not None and resume.model_fingerprint != fingerprint:
        raise ValueError(
            f"{resume.path}: model fingerprint {resume.model_fingerprint} differs from this "
            f"model's {fingerprint}"
        )
    start_step = resume.step if resume is not None else 0
    if resume is not None:
        # the data position is kept in samples: a run resumed with another global batch
        # continues where the checkpoint stopped (no sample skipped or repeated)
        offset = int(resume.data_position) - start_step * job.batch
        sampler = GlobalBatchSampler(len(job.task.train), job.batch, job.seed, offset=offset)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    # an elastic round (one agent per device) may have a fresh agent as rank 0 (restart count
    # 0): it continues the run's metrics like any other round
    elastic_round = bool(os.environ.get("HETRAIN_DEVICE_ID"))

    # ---- first plan ----------------------------------------------------------------------
    # the given plan, else the checkpoint's (same devices and batch), else even data
    # parallelism; the controller (in its own process) improves it from measured steps
    profile = None
    config = _training_config(job)
    if job.adaptive or job.plan is None:
        x0, _ = job.task.train.batch(sampler.indices(start_step)[:2])
        profile = _profile(chain, cast_inputs(x0, torch.float32))
    plan: Plan | None = plan_from_dict(job.plan, "--plan") if job.plan is not None else None
    if (
        plan is None
        and resume is not None
        and set(resume.plan.devices) == set(job.devices)
        and resume.plan.global_batch == job.batch
    ):
        plan = resume.plan
    if job.adaptive:
        # measured speeds and per-micro-batch overheads κ of the local ranks (emulation of the
        # first slot applied), all ranks busy at once (see _measure_device)
        factor = emu.factors(start_step)[device_id]
        calib_device = coll
        calib_model = model.to(dtype=dtype, device=calib_device)
        mine = _measure_device(
            job.task,
            calib_model,
            dtype,
            np.asarray(profile.train_flops),
            sampler.indices(start_step),
            factor,
            device=calib_device,
            overhead_weights=np.asarray(profile.overhead_weights),
            sample_unit=_sample_unit(model, job.norm_block),
        )
        mine = (*mine, _measure_update_s_per_byte(calib_model, optimizer_spec(job)))
        layer_times = measure_layer_times(
            job.task,
            chain,
            dtype,
            sampler.indices(start_step),
            factor,
            device=calib_device,
            sample_unit=_sample_unit(model, job.norm_block),
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
            # the refinement of docs/profiling.md §6 with this host's measurements: the
            # straggler of G' jittered groups and the weight update per parameter byte
            config = dataclasses.replace(
                config,
                group_time_jitter=float(np.median([float(t[3]) for t in gathered])),
                update_time_s_per_param_byte=float(max(float(t[4]) for t in gathered)),
            )
    else:
        base_state = _base_state(job, None)
    startup.close()  # the model as built (hetrain.runtime.startup.unchanged)
    chain._index_tensors()
    if plan is None:
        plan = even_dp_plan(
            job.devices, num_layers, job.batch, job.microbatch_size, norm_block=job.norm_block
        )
    if resume is not None or restart_count > 0:
        # a new round (restart, resume, other devices or batch) runs a new plan id: one above
        # every id used so far (the checkpoint's and, after it, the controller's re-plans)
        box = [_max_plan_id(job, resume) + 1 if lead else None]
        dist.broadcast_object_list(box, src=0)
        plan = plan.model_copy(update={"plan_id": int(box[0])})
    if plan.plan_id is None:
        plan = plan.model_copy(update={"plan_id": 0})
    link: ControllerLink | None = None
    controller_proc = None
    if job.adaptive:
        # every rank writes its own measurements to the controller's store (no per-step
        # gather); rank 0 starts the round and reads the decisions
        endpoint = round_id = None
        if lead:
            endpoint = job.controller_endpoint
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
            if endpoint is None or not local:
                # under torchrun (no launcher of ours) or several nodes (the launcher's
                # controller listens on loopback): rank 0 starts one, on loopback when every
                # rank is on this host, else on the rendezvous address the other nodes reach
                host = "127.0.0.1" if local else os.environ.get("MASTER_ADDR", "0.0.0.0")
                controller_proc, endpoint = spawn_controller_process(host=host)
            round_id = uuid.uuid4().hex
        if world > 1:
            box = [(endpoint, round_id)]
            dist.broadcast_object_list(box, src=0)
            endpoint, round_id = box[0]
        link = ControllerLink(endpoint, rank=rank, round_id=round_id)
        if lead:
            link.start_round(
                {
                    "world_size": world,
                    "base_state": base_state,
                    "profile": profile,
                    "config": config,
                    "plan": plan,
                    "steps": job.steps,
                    "start_step": start_step,
                    "optimizer_state_factor": _state_factor(job),
                    "checkpoint_dir": job.checkpoint_dir,
                    "checkpoint_every": job.checkpoint_every,
                    "log_path": _controller_log_path(job),
                }
            )

    spec = optimizer_spec(job)
    worker = Worker(
        chain,
        plan,
        device_id,
        job.task.loss_fn,
        spec,
        schedule=job.schedule,
        emulation=emu.emulation(start_step),
        dtype=dtype,
        grad_clip_norm=job.grad_clip_norm,
        autocast_bf16=job.bf16,
        seed=job.seed,
        norm_block=job.norm_block,
        exact=job.exact,
    )
    sinks = []
    if lead and job.tensorboard and job.metrics_out:
        sinks.append(TensorBoardSink(Path(job.metrics_out).parent))
    metrics = MetricsWriter(
        job.metrics_out if lead else None,
        append=resume is not None or restart_count > 0 or elastic_round,
        sinks=sinks,
    )
    resumed: dict[str, Any] | None = None
    if resume is not None:
        owned = set(worker.owned_layers)
        held_shared = [n for n, ls in worker.shared.items() if owned.intersection(ls)]
        state = ckpt.restore(resume, owned, held_shared)
        worker.load_layer_state_dict(state)
        before = [str(d) for d in resume.manifest.get("devices") or []]
        resumed = {
            "step": start_step,
            "path": str(resume.path),
            "devices": list(job.devices),
            "checkpoint_devices": before,
            "checkpoint_batch": resume.plan.global_batch,
            "data_position": int(resume.data_position),
        }
    if lead and (resume is not None or restart_count > 0):
        # every restart of the ranks (--max-restarts, elastic rounds) and every resumed run is
        # recorded, also before the first checkpoint (then from step 0, path None)
        before = resumed["checkpoint_devices"] if resumed else []
        logged = [
            int(e["step"])
            for e in (
                read_metrics(job.metrics_out) if Path(job.metrics_out or "").is_file() else []
            )
            if e.get("event") == "step"
        ]
        done_before = max(logged) + 1 if logged else 0
        metrics.write(
            "restart",
            start_step,
            path=resumed["path"] if resumed else None,
            restart_count=restart_count,
            plan_id=plan.plan_id,
            devices=list(job.devices),
            lost_devices=sorted(set(before) - set(job.devices)),
            joined_devices=sorted(set(job.devices) - set(before)) if before else [],
            batch=job.batch,
            checkpoint_batch=resumed["checkpoint_batch"] if resumed else None,
            data_position=sampler.position(start_step),
            resumed_from_step=start_step,
            steps_done_before=done_before,
            redone_steps=max(done_before - start_step, 0),
        )
        if resumed is None:
            what = "restarted from step 0 (no checkpoint yet)"
        else:
            batch_note = (
                f"global batch {resumed['checkpoint_batch']} -> {job.batch}, "
                if resumed["checkpoint_batch"] != job.batch
                else ""
            )
            what = (
                f"resumed from step {start_step} of {resumed['path']} ({batch_note}data "
                f"position {resumed['data_position']} samples)"
            )
        print(
            f"hetrain: {what} on {len(job.devices)} devices ({', '.join(job.devices)})"
            + (f"; restart {restart_count}" if restart_count else ""),
            file=sys.stderr,
            flush=True,
        )
    if lead:
        metrics.write(
            "plan",
            start_step,
            plan_id=plan.plan_id,
            plan=plan.to_json_dict(),
            device_type=worker.device.type,
            backend=dist.get_backend(),
            speed_flops=dict(zip(base_state.ids, base_state.speed_flops.tolist(), strict=True)),
            kappa_s=dict(zip(base_state.ids, base_state.kappa_s.tolist(), strict=True)),
        )

    progress = _Progress(job.steps, start_step) if (lead and job.progress) else None
    replans = 0
    adapt_time_s = 0.0  # rank 0's time talking to the controller (post + poll), all steps
    timelines: list[dict[str, Any]] = []
    last_loss = float("nan")
    step_times: list[float] = []
    watchdog = Watchdog(job.hang_timeout_s, rank=rank) if job.hang_timeout_s else None
    # SIGTERM and SIGINT (Ctrl-C: the whole process group) ask for a graceful stop after the
    # current step, with a checkpoint; until here they ended the rank at once (nothing to save
    # yet). Signals can be handled in the main thread only (a rank run from another thread
    # keeps the process's handlers).
    import threading

    stop = StopRequest(grace=world > 1)
    if threading.current_thread() is threading.main_thread():
        stop.install()
    stopped: TrainingStopped | None = None
    skipped_steps = 0  # updates skipped for a non-finite loss or gradient norm
    if watchdog is not None:
        watchdog.start()
    # What the ranks exchange per step rides in the step's own combination of sums
    # (Worker.step's report; docs/runtime.md "Per-step collectives"): this rank's stop request,
    # rank 0's "a new plan follows" flag and the measurements of the rank's last finished step.
    # Rows of a step arrive with its result, or a step later when the result is late; every
    # rank acts on them at the same step.
    last: list[Any] = [None]  # this rank's last StepResult
    announced: dict[int, Decision] = {}  # rank 0: step -> the decision its row announced
    link_failure: list[BaseException] = []
    waiting: list[Any] = []  # late results, completed by the next step
    lines: dict[int, dict[str, Any]] = {}  # rank 0: step -> its metrics fields so far

    def row_of(step: int, plan_id: int):
        def row() -> list[float]:
            nonlocal adapt_time_s
            flag = 0.0
            polling = not link_failure and not stop.requested
            if link is not None and lead and world > 1 and step + 1 < job.steps and polling:
                t_adapt = time.perf_counter()
                try:
                    decision = link.poll(plan_id)
                except BaseException as exc:  # raised after the step (not in a hook)
                    link_failure.append(exc)
                    decision = None
                if decision is not None:
                    announced[step] = decision
                    flag = 1.0
                adapt_time_s += time.perf_counter() - t_adapt
            signum = float(stop.signum or signal.SIGTERM) if stop.requested else 0.0
            return [signum, flag, *_measured_row(last[0])]

        return row

    def check_nonfinite(results: list[Any]) -> int:
        """Of finished steps (their loss and gradient norm combined over the ranks, the same on
        every rank): how many had a non-finite value, whose update was skipped (``skip``), or
        :class:`NonFiniteError` at the first one (``stop``; one small all-gather, on every rank
        at the same step, says where it first showed)."""
        skipped = 0
        for done in results:
            if math.isfinite(done.loss) and math.isfinite(done.grad_norm):
                continue
            if job.on_nonfinite != "stop":
                skipped += 1
                continue
            where = [
                1.0 if done.nonfinite_here else 0.0,
                -1.0 if done.group_index is None else float(done.group_index),
                -1.0 if done.stage_index is None else float(done.stage_index),
            ]
            rows = [torch.tensor(where, dtype=torch.float64, device=coll)]
            if world > 1:
                rows = [torch.zeros(3, dtype=torch.float64, device=coll) for _ in range(world)]
                dist.all_gather(rows, rows[0].new_tensor(where))
            line = _nonfinite_line(job, done.step, done, [r.tolist() for r in rows])
            flush_lines()
            if lead:
                metrics.write("nonfinite", done.step, action="stop", message=line)
            raise NonFiniteError(line)
        return skipped

    def flush_lines() -> None:
        """Write the metrics lines still owed (late results and the last finished step's
        measurements: one gather; on every rank at the same point, at the end of the run or
        before a non-finite stop)."""
        for done in waiting:
            if lead:
                write_line(done.report)
        if last[0] is not None:
            mine = torch.tensor(_measured_row(last[0]), dtype=torch.float64, device=coll)
            rows = [mine]
            if world > 1:
                rows = [torch.zeros_like(mine) for _ in range(world)]
                dist.all_gather(rows, mine)
            if lead:
                write_line([[0.0, 0.0, *r.tolist()] for r in rows])

    def write_line(table: list[list[float]]) -> None:
        measured = int(table[0][2])
        fields = lines.pop(measured, None)
        if fields is None:
            return
        nonlocal last_loss
        result = fields.pop("result")
        last_loss = result.loss
        iteration_time_s = max(r[4] for r in table)
        step_times.append(iteration_time_s)
        metrics.write(
            "step",
            measured,
            loss=result.loss,
            iteration_time_s=iteration_time_s,
            grad_norm=result.grad_norm,
            compute_time_s={d: r[3] for d, r in zip(job.devices, table, strict=True)},
            send_recv_time_s={d: r[5] for d, r in zip(job.devices, table, strict=True)},
            sync_time_s=max(r[6] for r in table),
            **fields,
            **({} if math.isfinite(result.loss + result.grad_norm) else {"skipped": True}),
        )
        if progress is not None:
            progress.update(measured, result.loss, iteration_time_s, fields["plan_id"])

    try:
        for step in range(start_step, job.steps):
            worker.emulation = emu.emulation(step)
            x, y = global_batch(job.task.train, sampler.indices(step))
            if worker.device.type == "cuda":
                # one pinned host buffer and an asynchronous copy per step (the engine's
                # per-micro-batch slices are then already on the GPU)
                x, y = _to_device(x, worker.device), _to_device(y, worker.device)
            result = worker.step(x, y, step, report=row_of(step, int(plan.plan_id)))
            if watchdog is not None:
                watchdog.beat(step)
            if link_failure and not stop.requested:
                # (a SIGTERM to rank 0's process group also ends a controller it started:
                # then the stop, agreed at the next step, goes on without it)
                raise link_failure[0]
            last[0] = result
            if link is not None and step + 1 < job.steps:
                link.post(
                    step,
                    {
                        "device": device_id,
                        "plan_id": int(plan.plan_id),
                        "compute_time_s": result.compute_time_s,
                        "iteration_time_s": result.iteration_time_s,
                        "send_recv_time_s": result.send_recv_time_s,
                        "sync_time_s": result.sync_time_s,
                    },
                )
            if lead:
                lines[step] = {
                    "result": result,
                    "plan_id": plan.plan_id,
                    "world_size": world,
                    "global_batch": plan.global_batch,
                    "shares": [g.batch for g in plan.groups],
                    "lr": spec.lr_at(step),
                    "slowdown": worker.emulation.slowdown if worker.emulation else {},
                }
            ready, waiting = (
                [*waiting, *([] if result.late else [result])],
                ([result] if result.late else []),
            )
            stopping = False
            flagged: list[int] = []
            for done in ready:
                table = done.report
                stopping = stopping or any(r[0] > 0 for r in table)
                if table[0][1] > 0:
                    flagged.append(done.step)
                if lead:
                    write_line(table)
            skipped_steps += check_nonfinite(ready)
            # a stop during the last step is no stop: the run ends normally
            stopping = stopping and step + 1 < job.steps
            if stopping:
                stop.agree()
                # the signal of the lowest rank that got one (the same name on every rank)
                rows = [r for done in ready for r in done.report if r[0] > 0]
                stop_signal = signal.Signals(int(rows[0][0])).name
            want_timeline = step == job.steps - 1 or (
                job.adaptive and step == start_step + 3 and job.timeline_steps > 1
            )
            if want_timeline:
                per_rank = gather_measurements(result)
                if lead:
                    timelines.append({"step": step, "plan": plan.to_json_dict(), "ranks": per_rank})
            if flagged and not stopping and step + 1 < job.steps:
                # the plan object only when it is newer than the plan in force: every rank
                # switches at the same step
                decision = None
                if lead:
                    newest = [announced.pop(s) for s in flagged if s in announced]
                    newest = [d for d in newest if int(d.plan.plan_id) > int(plan.plan_id)]
                    decision = max(newest, key=lambda d: int(d.plan.plan_id), default=None)
                box = [decision.plan.to_json_dict() if decision is not None else None]
                dist.broadcast_object_list(box, src=0)
                if box[0] is not None:
                    new_plan = plan_from_dict(box[0], "<re-plan>")
                    migration = worker.apply_plan(new_plan)
                    if lead:
                        _report_replan(metrics, progress, decision, step + 1, plan, migration)
                        metrics.write(
                            "plan", step + 1, plan_id=new_plan.plan_id, plan=new_plan.to_json_dict()
                        )
                    plan = new_plan
                    replans += 1
            path = None
            if job.checkpoint_dir and (
                stopping or (job.checkpoint_every > 0 and (step + 1) % job.checkpoint_every == 0)
            ):
                # no checkpoint holds a non-finite step: late sums of the steps before are
                # complete here (the same wait on every rank)
                check_nonfinite(waiting if job.on_nonfinite == "stop" else [])
                with watchdog.suspended() if watchdog is not None else nullcontext():
                    path = ckpt.save(
                        job.checkpoint_dir,
                        step + 1,
                        worker.layer_state_dict(),
                        {
                            "data_position": sampler.position(step + 1),
                            "plan": plan.to_json_dict(),
                            "model_fingerprint": fingerprint,
                            "world_size": world,
                            "devices": job.devices,
                            "seed": job.seed,
                            "batch": job.batch,
                            "example": job.example,
                            **({"stop": stop_signal} if stopping else {}),
                        },
                        keep=job.checkpoint_keep,
                        controller_state=_staged_controller_state(
                            job, step + 1, stopping or step + 1 == job.steps
                        )
                        if lead and link is not None
                        else None,
                    )
                if lead:
                    metrics.write("checkpoint", step + 1, path=str(path))
            if stopping:
                # a graceful stop (spot warning, or the agents restarting the group for a
                # device that joins): every rank checkpointed this same step; the next round
                # resumes here without redoing a step
                stopped = TrainingStopped(
                    stop.exit_code if stop.requested else EXIT_STOPPED_BY_PEER,
                    step=step + 1,
                    path=str(path) if path is not None else None,
                    signal_name=stop_signal,
                )
                break
        skipped_steps += check_nonfinite(waiting)
        flush_lines()
        if lead and stopped is not None:
            metrics.write("stop", stopped.step, reason=stopped.signal_name, world_size=world)
    finally:
        stop.restore()
        if watchdog is not None:
            watchdog.stop()
        if progress is not None:
            progress.close()
        if link is not None:
            link.close()
        if controller_proc is not None:
            try:
                controller_proc.wait(timeout=10)
            except Exception:
                controller_proc.kill()
    if stopped is not None:
        metrics.close()
        raise stopped

    # ---- end: gather, evaluate, export ---------------------------------------------------------
    full = worker.full_state_dict()
    if not lead:
        metrics.close()
        return None
    for t in timelines:
        metrics.write("timeline", t["step"], plan=t["plan"], ranks=t["ranks"])
    torch.manual_seed(job.seed)
    final = job.task.build_model().to(dtype)
    final.load_state_dict(full)
    final.eval()
    quality = job.task.evaluate(final, dtype) if job.task.evaluate else {}
    out = Path(job.out) if job.out else (Path(job.run_dir) / "model.pt" if job.run_dir else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(full, out)
    hf_dir = _export_pretrained(final, job)
    wall = time.perf_counter() - wall0
    summary = {
        "steps": job.steps,
        "start_step": start_step,
        "trained_steps": job.steps - start_step,
        "resumed": resumed,
        "restarts": restart_count,
        "final_loss": last_loss,
        "metrics": quality,
        "quality": job.task.quality_line(quality),
        "quality_reached": job.task.quality_reached(quality),
        "replans": replans,
        "skipped_steps": skipped_steps,
        "adapt_time_s": adapt_time_s,
        "final_plan": plan.to_json_dict(),
        "wall_time_s": wall,
        "mean_iteration_time_s": float(np.mean(step_times)) if step_times else None,
        "model_path": str(out) if out is not None else None,
        "pretrained_dir": hf_dir,
    }
    metrics.write(
        "end",
        job.steps,
        metrics=quality,
        wall_time_s=wall,
        replans=replans,
        skipped_steps=skipped_steps,
    )
    metrics.close()
    return summary


CONTROLLER_STATE_WAIT_S = 10.0
"""Seconds rank 0 waits at a periodic checkpoint for the controller to stage its state of that
step (it usually has within milliseconds: the step's measurements were just posted)."""


def _staged_controller_state(job: TrainJob, step: int, no_wait: bool) -> Path | None:
    """The controller's staged state for the checkpoint of ``step`` (rank 0): that step's,
    waited for up to :data:`CONTROLLER_STATE_WAIT_S` at a periodic checkpoint; at a stop or
    the last step (``no_wait``: their last measurements are never posted) or when it does not
    come, the newest staged state of an earlier step; None when there is none."""
    from hetrain.runtime.adapt import controller_state_path

    exact = controller_state_path(job.checkpoint_dir, step)
    if not no_wait:
        deadline = time.monotonic() + CONTROLLER_STATE_WAIT_S
        while not exact.is_file() and time.monotonic() < deadline:
            time.sleep(0.01)
    if exact.is_file():
        return exact
    found = []
    for p in exact.parent.glob("state-*.json"):
        digits = p.stem.split("-", 1)[1]
        if digits.isdigit() and int(digits) <= step:
            found.append((int(digits), p))
    return max(found)[1] if found else None


def _measured_row(result: Any) -> list[float]:
    """``[step, compute, iteration, send/recv, sync]`` seconds of a rank's step (step -1:
    none yet), the part of the per-step report row the metrics line needs."""
    if result is None:
        return [-1.0, 0.0, 0.0, 0.0, 0.0]
    return [
        float(result.step),
        result.compute_time_s,
        result.iteration_time_s,
        result.send_recv_time_s,
        result.sync_time_s,
    ]


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


def _max_plan_id(job: TrainJob, resume) -> int:
    """The highest plan id of the checkpoint and of the metrics file so far (-1: none)."""
    ids = [int(resume.plan.plan_id or 0)] if resume is not None else [-1]
    path = Path(job.metrics_out) if job.metrics_out else None
    if path is not None and path.is_file():
        ids += [int(e["plan_id"]) for e in read_metrics(path) if e.get("plan_id") is not None]
    return max(ids)


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


def _controller_log_path(job: TrainJob) -> str | None:
    """The controller's per-step predictions (JSONL): ``controller.jsonl`` beside the
    metrics."""
    if job.metrics_out:
        return str(Path(job.metrics_out).with_name("controller.jsonl"))
    if job.run_dir:
        return str(Path(job.run_dir) / "controller.jsonl")
    return None


def _report_replan(metrics, progress, decision: Decision, step: int, old: Plan, migration) -> None:
    """Rank 0: the ``replan`` metrics record and one console line (step, why, shares before
    and after, predicted iteration time before and after)."""
    metrics.write(
        "replan",
        step,
        old_plan_id=old.plan_id,
        migration_time_s=migration.time_s,
        **decision.to_json_dict(),
    )
    line = "hetrain: " + decision.console_line(step)
    if progress is not None:
        progress.print(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _export_pretrained(model: nn.Module, job: TrainJob) -> str | None:
    """A Hugging Face model is also saved with ``save_pretrained`` into ``run_dir/model``
    (config + safetensors; ``AutoModel...from_pretrained(run_dir/model)`` loads it without
    hetrain). Returns the folder, or None for other models or without a run folder."""
    if job.run_dir is None or not hasattr(model, "save_pretrained"):
        return None
    folder = Path(job.run_dir) / "model"
    model.to(torch.float32).save_pretrained(folder)
    return str(folder)


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


class _Progress:
    """Rich progress bar of rank 0: loss, iteration time, plan id."""

    def __init__(self, total: int, start: int) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._p = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("iter {task.fields[it]:.3f}s"),
            TextColumn("plan {task.fields[plan]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._p.start()
        self._task = self._p.add_task(
            "train", total=total, completed=start, loss=float("nan"), it=0.0, plan=0
        )

    def update(self, step: int, loss: float, it: float, plan_id: int | None) -> None:
        self._p.update(self._task, completed=step + 1, loss=loss, it=it, plan=plan_id)

    def print(self, line: str) -> None:
        """A line above the bar."""
        self._p.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        self._p.stop()


def job_summary_json(summary: dict[str, Any]) -> str:
    """The summary as one JSON line."""
    return json.dumps(summary, default=str)
