"""The per-rank training loop of ``hetrain train`` (one process per device).

:func:`run_worker` is what every rank runs (started by :mod:`hetrain.runtime.launch` through
torch's elastic launcher, by ``torchrun ... -m hetrain train``, or in-process for
``--workers 1``). Per iteration ``t``:

1. set the emulation of slot ``t`` (``--slowdown``, ``--trace``, ``--cluster``);
2. build the global batch of ``t`` (:class:`~hetrain.runtime.data.GlobalBatchSampler`, same on
   every rank) and run ``Worker.step``;
3. all-gather each rank's measured compute/iteration times (one small tensor);
4. rank 0 writes the metrics line, feeds :class:`~hetrain.runtime.adapt.Adapter` and decides
   whether to re-plan; the decision is broadcast and every rank calls ``Worker.apply_plan``;
5. every ``checkpoint_every`` steps a collective checkpoint.

At the end rank 0 gathers the whole model (``Worker.full_state_dict``), evaluates it on the
validation split, exports the plain ``state_dict`` and returns a summary.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hetrain.cluster import ClusterSpec, ClusterState, cluster_from_dict
from hetrain.plan import Plan, plan_from_dict
from hetrain.profile import ProfileArrays
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.adapt import (
    Adapter,
    complete_plan,
    even_dp_plan,
    predict_iteration_time_s,
    propose_plan,
)
from hetrain.runtime.data import GlobalBatchSampler, Task, cast_inputs, task_chain
from hetrain.runtime.metrics import MetricsWriter
from hetrain.runtime.watchdog import Watchdog, process_group_timeout

DTYPES = {"float32": torch.float32, "float64": torch.float64}
FIRST_PLAN_MIN_GAIN = 0.3  # relative predicted gain over even shares needed for the first plan


@dataclass
class TrainJob:
    """Everything a rank needs (validated by the parent before launching; passed by ``fork``).

    Attributes:
        task: model factory, data, loss, evaluation (:class:`~hetrain.runtime.data.Task`).
        devices: device id of every rank (index = global rank).
        steps, batch, seed: iterations, global batch ``B``, seed of weights and sampler.
        optimizer, lr, weight_decay, momentum: optimizer (``sgd`` or ``adamw``).
        warmup_steps: linear warm-up; then cosine decay to ``min_lr_ratio * lr``
            (``lr_schedule="cosine"``) or constant (``"constant"``).
        grad_clip_norm: clip the global gradient norm (None = off).
        dtype: ``float32`` or ``float64``; ``bf16``: bf16 autocast of forward passes.
        plan: the fixed (``adaptive=False``) or first plan; None = chosen at start.
        microbatch_size: μ of the plans chosen here.
        cluster: cluster file contents (SI conversion here) or None (local ranks).
        slowdown: constant emulated slow-down factor per device.
        trace_rows: SPEC §7 trace rows (slot = step) or None.
        metrics_out: JSONL metrics file; run_dir: folder for the report and export.
        checkpoint_dir / checkpoint_every: DCP checkpoints (0 = never); resume from the latest.
        out: where to export the trained ``state_dict`` (``torch.save``); None = run_dir.
        progress: show a rich progress bar on rank 0.
        norm_block: BatchNorm norm block ``G`` (ghost batch norm) or None (per micro-batch);
        exact: refuse random ops that cannot be made plan-invariant (docs/runtime.md).
        hang_timeout_s: a rank that finishes no step for this long is failed (exit 124, see
            :mod:`hetrain.runtime.watchdog`), and collectives time out after it; None = off.
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
    out: str | None = None
    progress: bool = False
    timeline_steps: int = 1
    example: str | None = None
    hang_timeout_s: float | None = None
    norm_block: int | None = None
    exact: bool = False


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


def profile_chain(model: nn.Sequential, sample: torch.Tensor) -> ProfileArrays:
    """SPEC §2 per-sample profile of a chain: forward FLOPs ``f_l`` of each child counted by
    ``torch.utils.flop_counter.FlopCounterMode`` on ``sample`` (divided by its rows), ``w_l =
    2 f_l``, output bytes ``a_l``, parameter bytes ``p_l``. Layers without matmuls (embeddings,
    norms) count as 1% of the mean layer so that no stage is free."""
    from torch.utils.flop_counter import FlopCounterMode

    n = sample.shape[0]
    fwd, act, params = [], [], []
    x = sample
    with torch.no_grad():
        for layer in model:
            counter = FlopCounterMode(display=False)
            with counter:
                y = layer(x)
            fwd.append(counter.get_total_flops() / n)
            act.append(y.numel() * y.element_size() / n)
            params.append(sum(p.numel() * p.element_size() for p in layer.parameters()))
            x = y
    f = np.array(fwd, dtype=float)
    f = np.maximum(f, 0.01 * max(f.mean(), 1.0))
    a = np.array(act, dtype=float)
    return ProfileArrays(
        names=tuple(f"layer{i}" for i in range(len(f))),
        fwd_flops=f,
        bwd_flops=2 * f,
        activation_bytes=a,
        activation_memory_bytes=a,
        param_bytes=np.array(params, dtype=float),
    )


def _profile(model: nn.Sequential, sample: torch.Tensor) -> ProfileArrays:
    """The model profile from ``hetrain.profiler.profile_chain`` (FLOPs, saved-activation
    bytes), or :func:`profile_chain` here when the profiler is not available."""
    try:
        from hetrain.profiler import profile_chain as measured_profile
    except ImportError:
        return profile_chain(model, sample)
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


class EmulationSchedule:
    """Per-step emulation: ``slowdown_d(t) = base_d / speed_factor_d(t)`` and NIC bandwidth from
    the trace (SPEC §7: one slot = one step). ``base_d`` is ``--slowdown``'s factor times, with
    ``--cluster``, ``max_e tflops_e / tflops_d`` (the local ranks emulate the cluster's relative
    speeds and its links)."""

    def __init__(self, job: TrainJob) -> None:
        self.devices = list(job.devices)
        self.base = {d: float(job.slowdown.get(d, 1.0)) for d in self.devices}
        self.cluster: ClusterSpec | None = None
        if job.cluster is not None:
            self.cluster = cluster_from_dict(job.cluster, "--cluster")
            top = max(dv.tflops for dv in self.cluster.devices)
            for dv in self.cluster.devices:
                if dv.id in self.base:
                    self.base[dv.id] *= top / dv.tflops
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


def _training_config(job: TrainJob):
    try:
        from hetrain.costmodel import TrainingConfig
    except ImportError:
        return None
    o = 2.0 if job.optimizer == "adamw" else (1.0 if job.momentum > 0 else 0.0)
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


def _make_policy(job: TrainJob, profile: ProfileArrays, config):
    """The Lyapunov controller when ``hetrain.control.make_policy`` exists, else None."""
    if config is None:
        return None
    try:
        from hetrain.control import make_policy
    except ImportError:
        return None
    # measured speeds are noisy (shared CPUs, ±20 % from step to step): a switch must win by
    # 20 % over 20 steps, and a new structure search (0.3-0.6 s of Python in rank 0's planner
    # thread, which holds the GIL against rank 0's training loop) runs only when the current
    # plan's predicted T/T_LB drifted by 25 % (shares are re-balanced every step regardless)
    return make_policy(
        "lyapunov",
        profile,
        config,
        switch_margin=0.2,
        horizon_slots=20.0,
        replan_every=100,
        drift_tolerance=0.25,
    )


def _measure_device(
    task: Task, model: nn.Module, dtype, flops_per_sample: float, batch: int, factor: float
) -> tuple[float, float]:
    """Speed ``s`` (FLOP/s) and per-micro-batch overhead ``κ`` (s) of this rank: forward +
    backward of the whole model on micro-batches of 1, 4 and 16 samples (at most ``batch``;
    median of 3 each), emulated ``factor`` applied by sleeping ``(factor - 1)`` x the measured time
    (SPEC §5), fitted to ``t = μ F / s + κ`` (SPEC §3) by ``hetrain.calibration`` when present,
    else the two-point line."""
    sizes = sorted({1, max(1, min(4, batch)), max(1, min(16, batch))})
    times = []
    for mu in sizes:
        x, y = task.train.batch(np.arange(mu))
        x = cast_inputs(x, dtype)
        reps = []
        for _ in range(3):
            t0 = time.perf_counter()
            value = task.loss_fn(model(x), y)  # a mean, or (sum, count)
            (value[0] if isinstance(value, tuple) else value).backward()
            dt = time.perf_counter() - t0
            time.sleep((factor - 1.0) * dt)
            reps.append(dt * factor)
        times.append(float(np.median(reps)))
    model.zero_grad(set_to_none=True)
    if len(sizes) == 1:
        return flops_per_sample / times[0], 0.0
    # κ must not exceed what the smallest micro-batch took (noise guard)
    cap = 0.5 * times[0]
    try:
        from hetrain.calibration import fit_speed_kappa

        fit = fit_speed_kappa(sizes, flops_per_sample, times)
        if fit.kappa_s <= cap:
            return float(fit.speed_flops), float(fit.kappa_s)
    except (ImportError, ValueError):
        pass
    # fallback: κ = cap at most, speed from the largest micro-batch
    kappa = min(cap, max(times[0] - (times[-1] - times[0]) / (sizes[-1] - sizes[0]), 0.0))
    return flops_per_sample * sizes[-1] / max(times[-1] - kappa, 1e-9), kappa


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------


def run_worker(job: TrainJob, num_threads: int | None = None) -> dict[str, Any] | None:
    """Train on this rank (``torch.distributed`` initialised from the environment when not yet
    up). ``num_threads``: torch threads of this rank (default: cores / local ranks). Returns
    the run summary on rank 0, None elsewhere."""
    from hetrain.runtime.engine import Worker, gather_measurements
    from hetrain.runtime.optim import OptimizerSpec

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
        return _train(job, Worker, gather_measurements, OptimizerSpec)
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(job: TrainJob, Worker, gather_measurements, OptimizerSpec) -> dict[str, Any] | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(job.devices) != world:
        raise ValueError(
            f"world size {world} differs from the {len(job.devices)} devices of the job"
        )
    device_id = job.devices[rank]
    dtype = DTYPES[job.dtype]
    lead = rank == 0
    wall0 = time.perf_counter()

    torch.manual_seed(job.seed)
    model = job.task.build_model()
    chain = task_chain(job.task, model)  # any module, cut into layers (runtime/cutting.py)
    num_layers = chain.num_layers
    fingerprint = ckpt.model_fingerprint(model)
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

    # ---- first plan -----------------------------------------------------------------------
    profile = None
    adapter = None
    config = _training_config(job)
    if job.adaptive or job.plan is None:
        x0, _ = job.task.train.batch(np.arange(2))
        profile = _profile(chain, cast_inputs(x0, torch.float32))
    plan: Plan | None = plan_from_dict(job.plan, "--plan") if job.plan is not None else None
    if plan is None and resume is not None and set(resume.plan.devices) == set(job.devices):
        plan = resume.plan
    if plan is None or job.adaptive:
        # measured speeds and per-micro-batch overheads κ of the local ranks (emulation of the
        # first slot applied); also with a given plan when adapting, else the controller would
        # plan with placeholder speeds and κ = 0 (free micro-batches: tiny μ, long pipelines)
        factor = emu.factors(start_step)[device_id]
        flops_per_sample = float(profile.train_flops.sum())
        mine = _measure_device(
            job.task, model.to(dtype), dtype, flops_per_sample, job.batch, factor
        )
        gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64))
        measured = [float(t[0]) for t in gathered]
        kappa = [float(t[1]) for t in gathered]
        base_state = _base_state(job, measured, kappa)
    else:
        base_state = _base_state(job, None)
    if plan is None:
        if lead:
            first = even_dp_plan(job.devices, num_layers, job.batch, job.microbatch_size)
            if job.adaptive and world > 1:
                # the planner's first plan only when it beats even shares clearly (the start-up
                # measurements are taken while all ranks compete for the same cores)
                cand, _ = propose_plan(base_state, profile, first, config=config)
                cand = complete_plan(cand, job.devices, num_layers)
                t_even = predict_iteration_time_s(first, base_state, profile, config)
                t_cand = predict_iteration_time_s(cand, base_state, profile, config)
                if t_cand < (1.0 - FIRST_PLAN_MIN_GAIN) * t_even:
                    first = cand
            # after a restart on other devices (elastic), the new plan gets the next id
            first_id = int(resume.plan.plan_id or 0) + 1 if resume is not None else 0
            first = first.model_copy(update={"plan_id": first_id})
            payload = [first.to_json_dict()]
        else:
            payload = [None]
        dist.broadcast_object_list(payload, src=0)
        plan = plan_from_dict(payload[0], "<first plan>")
    if plan.plan_id is None:
        plan = plan.model_copy(update={"plan_id": 0})
    if lead and job.adaptive:
        adapter = Adapter(
            base_state=base_state,
            profile=profile,
            steps=job.steps,
            config=config,
            policy=_make_policy(job, profile, config),
            optimizer_state_factor=2.0 if job.optimizer == "adamw" else 1.0,
        )

    spec = OptimizerSpec(
        name=job.optimizer,
        lr=job.lr,
        momentum=job.momentum,
        weight_decay=job.weight_decay,
        lr_schedule=lr_multiplier(job),
    )
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
    metrics = MetricsWriter(job.metrics_out if lead else None, append=resume is not None)
    if resume is not None:
        state = ckpt.restore(resume, set(worker.owned_layers))
        worker.load_layer_state_dict(state)
        if lead:
            before = [str(d) for d in resume.manifest.get("devices") or []]
            metrics.write(
                "restart",
                start_step,
                path=str(resume.path),
                plan_id=plan.plan_id,
                devices=list(job.devices),
                lost_devices=sorted(set(before) - set(job.devices)),
                joined_devices=sorted(set(job.devices) - set(before)) if before else [],
            )
    if lead:
        metrics.write(
            "plan",
            start_step,
            plan_id=plan.plan_id,
            plan=plan.to_json_dict(),
            speed_flops=dict(zip(base_state.ids, base_state.speed_flops.tolist(), strict=True)),
            kappa_s=dict(zip(base_state.ids, base_state.kappa_s.tolist(), strict=True)),
        )

    progress = _Progress(job.steps, start_step) if (lead and job.progress) else None
    next_plan_id = int(plan.plan_id) + 1
    replans = 0
    adapt_time_s = 0.0  # rank 0's time in the adapter (estimates + planner), all steps
    timelines: list[dict[str, Any]] = []
    last_loss = float("nan")
    step_times: list[float] = []
    watchdog = Watchdog(job.hang_timeout_s, rank=rank) if job.hang_timeout_s else None
    if watchdog is not None:
        watchdog.start()
    try:
        for step in range(start_step, job.steps):
            worker.emulation = emu.emulation(step)
            x, y = job.task.train.batch(sampler.indices(step))
            result = worker.step(x, y, step)
            if watchdog is not None:
                watchdog.beat(step)
            mine = torch.tensor(
                [
                    result.compute_time_s,
                    result.iteration_time_s,
                    result.send_recv_time_s,
                    result.sync_time_s,
                ],
                dtype=torch.float64,
            )
            rows = [torch.zeros(4, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(rows, mine)
            table = torch.stack(rows).tolist()
            want_timeline = step == job.steps - 1 or (
                job.adaptive and step == start_step + 3 and job.timeline_steps > 1
            )
            if want_timeline:
                per_rank = gather_measurements(result)
                if lead:
                    timelines.append({"step": step, "plan": plan.to_json_dict(), "ranks": per_rank})
            decision = None
            if lead:
                last_loss = result.loss
                iteration_time_s = max(r[1] for r in table)
                step_times.append(iteration_time_s)
                metrics.write(
                    "step",
                    step,
                    loss=result.loss,
                    iteration_time_s=iteration_time_s,
                    plan_id=plan.plan_id,
                    global_batch=plan.global_batch,
                    shares=[g.batch for g in plan.groups],
                    lr=spec.lr_at(step),
                    grad_norm=result.grad_norm,
                    compute_time_s={d: r[0] for d, r in zip(job.devices, table, strict=True)},
                    send_recv_time_s={d: r[2] for d, r in zip(job.devices, table, strict=True)},
                    sync_time_s=max(r[3] for r in table),
                    slowdown=worker.emulation.slowdown if worker.emulation else {},
                )
                if progress is not None:
                    progress.update(step, result.loss, iteration_time_s, plan.plan_id)
                if adapter is not None and step + 1 < job.steps:
                    t_adapt = time.perf_counter()
                    adapter.observe(
                        plan, {d: r[0] for d, r in zip(job.devices, table, strict=True)}
                    )
                    decision = adapter.decide(step + 1, plan)
                    adapt_time_s += time.perf_counter() - t_adapt
            if job.adaptive and world > 1:
                # a one-element flag every step; the plan object only when it changed
                flag = torch.tensor([1 if (lead and decision is not None) else 0])
                dist.broadcast(flag, src=0)
                box = [None]
                if int(flag.item()):
                    if lead:
                        new = decision.plan.model_copy(update={"plan_id": next_plan_id})
                        box = [new.to_json_dict()]
                    dist.broadcast_object_list(box, src=0)
                if box[0] is not None:
                    new_plan = plan_from_dict(box[0], "<re-plan>")
                    migration = worker.apply_plan(new_plan)
                    if lead:
                        metrics.write(
                            "replan",
                            step + 1,
                            plan_id=new_plan.plan_id,
                            old_plan_id=plan.plan_id,
                            reason=decision.reason,
                            current_time_s=decision.current_time_s,
                            predicted_time_s=decision.predicted_time_s,
                            migration_estimate_s=decision.migration_time_s,
                            migration_time_s=migration.time_s,
                            structure_changed=decision.structure_changed,
                            shares=[g.batch for g in new_plan.groups],
                        )
                        metrics.write(
                            "plan", step + 1, plan_id=new_plan.plan_id, plan=new_plan.to_json_dict()
                        )
                    plan = new_plan
                    next_plan_id += 1
                    replans += 1
            if (
                job.checkpoint_dir
                and job.checkpoint_every > 0
                and (step + 1) % job.checkpoint_every == 0
            ):
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
                        },
                    )
                if lead:
                    metrics.write("checkpoint", step + 1, path=str(path))
    finally:
        if watchdog is not None:
            watchdog.stop()
        if progress is not None:
            progress.close()

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
        "final_loss": last_loss,
        "metrics": quality,
        "quality": job.task.quality_line(quality),
        "quality_reached": job.task.quality_reached(quality),
        "replans": replans,
        "adapt_time_s": adapt_time_s,
        "final_plan": plan.to_json_dict(),
        "wall_time_s": wall,
        "mean_iteration_time_s": float(np.mean(step_times)) if step_times else None,
        "model_path": str(out) if out is not None else None,
        "pretrained_dir": hf_dir,
    }
    metrics.write("end", job.steps, metrics=quality, wall_time_s=wall, replans=replans)
    metrics.close()
    return summary


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
    job: TrainJob, measured_flops: list[float] | None, kappa_s: list[float] | None = None
) -> ClusterState:
    """Cluster state the planner starts from: ``--cluster``'s devices when given (speeds and
    κ replaced by measurements when there are any), else the local ranks."""
    if job.cluster is not None:
        state = cluster_from_dict(job.cluster, "--cluster").state()
    else:
        state = local_cluster_state(job.devices, [1e9] * len(job.devices))
    if measured_flops is not None:
        idx = state.index()
        speed = state.speed_flops.copy()
        kap = state.kappa_s.copy()
        for i, d in enumerate(job.devices):
            speed[idx[d]] = measured_flops[i]
            if kappa_s is not None:
                kap[idx[d]] = kappa_s[i]
        state = state.with_changes(speed_flops=speed, kappa_s=kap)
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

    def close(self) -> None:
        self._p.stop()


def job_summary_json(summary: dict[str, Any]) -> str:
    """The summary as one JSON line."""
    return json.dumps(summary, default=str)
