"""The start-up of one rank's run (:class:`TrainerSetup`, the constructor of
:class:`hetrain.runtime.trainer.Trainer`): the model cut into layers, the checkpoint it
resumes from, the first plan and its id, the controller link, the engine's ``Worker``, the
metrics writer and the round's ``restart`` and ``plan`` records.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetrain._text import plural
from hetrain.plan import Plan, plan_from_dict
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.adapt import spawn_controller_process
from hetrain.runtime.ctlcontroller import startup_decision
from hetrain.runtime.ctldecision import even_dp_plan
from hetrain.runtime.ctlstore import ControllerLink
from hetrain.runtime.data import GlobalBatchSampler, cast_inputs, task_chain
from hetrain.runtime.emulation import EmulationSchedule
from hetrain.runtime.metrics import MetricsWriter, TensorBoardSink, read_metrics
from hetrain.runtime.startup import unchanged
from hetrain.runtime.step_metrics import StepLines
from hetrain.runtime.worker_main import (
    DTYPES,
    _base_state,
    _profile,
    _state_factor,
    _track_layers,
    _training_config,
    optimizer_spec,
    startup_measurements,
)


class TrainerSetup:
    """Everything a rank builds before its first step, in this order: the model (seeded) cut
    into layers; the checkpoint to resume from (:meth:`_resume`); the first plan with its id
    (:meth:`_first_plan`, start-up measurements when adaptive); the controller round
    (:meth:`_start_controller`); the ``Worker``; the metrics writer, the restored layer state
    and the round's records (:meth:`_open_round`).

    Args:
        job: the run's ``TrainJob``.
        Worker: :class:`hetrain.runtime.engine.Worker`.
        gather_measurements: :func:`hetrain.runtime.engine.gather_measurements`.

    Raises:
        ValueError: the world size differs from the job's devices, or the checkpoint holds
            another model.
    """

    def __init__(self, job: Any, Worker: Any, gather_measurements: Any) -> None:
        self.job = job
        self.gather_measurements = gather_measurements
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if len(job.devices) != self.world:
            raise ValueError(
                f"world size {self.world} differs from the {len(job.devices)} devices of the job"
            )
        self.device_id = job.devices[self.rank]
        self.dtype = DTYPES[job.dtype]
        self.lead = self.rank == 0
        self.wall0 = time.perf_counter()
        # NCCL (CUDA) collectives take CUDA tensors; gloo CPU ones
        self.coll = (
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
        self.chain = task_chain(job.task, model)  # any module, cut into layers (runtime/cutting.py)
        self.num_layers = self.chain.num_layers
        self.fingerprint = ckpt.model_fingerprint(model)
        _track_layers(self.chain)
        self.sampler = GlobalBatchSampler(len(job.task.train), job.batch, job.seed)
        self.emu = EmulationSchedule(job)
        self._resume()
        self._first_plan(model, startup)
        self._start_controller()
        self.spec = optimizer_spec(job)
        self.worker = Worker(
            self.chain,
            self.plan,
            self.device_id,
            job.task.loss_fn,
            self.spec,
            schedule=job.schedule,
            emulation=self.emu.emulation(self.start_step),
            dtype=self.dtype,
            grad_clip_norm=job.grad_clip_norm,
            autocast_bf16=job.bf16,
            seed=job.seed,
            norm_block=job.norm_block,
            exact=job.exact,
        )
        self._open_round()
        self.progress = None
        if self.lead and job.progress:
            self.progress = _Progress(job.steps, self.start_step)
        self.log = StepLines(
            self.metrics,
            job.devices,
            lead=self.lead,
            world=self.world,
            coll=self.coll,
            progress=self.progress,
        )

    def _resume(self) -> None:
        """The newest checkpoint (if any) and the step and data position it resumes from."""
        job = self.job
        resume = ckpt.load_latest(job.checkpoint_dir) if job.checkpoint_dir else None
        if resume is not None and resume.model_fingerprint != self.fingerprint:
            raise ValueError(
                f"{resume.path}: model fingerprint {resume.model_fingerprint} differs from this "
                f"model's {self.fingerprint}"
            )
        self.resume = resume
        self.start_step = resume.step if resume is not None else 0
        if resume is not None:
            # the data position is kept in samples: a run resumed with another global batch
            # continues where the checkpoint stopped (no sample skipped or repeated)
            offset = int(resume.data_position) - self.start_step * job.batch
            self.sampler = GlobalBatchSampler(
                len(job.task.train), job.batch, job.seed, offset=offset
            )
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        # an elastic round (one agent per device) may have a fresh agent as rank 0 (restart
        # count 0): it continues the run's metrics like any other round
        self.elastic_round = bool(os.environ.get("HETRAIN_DEVICE_ID"))

    def _first_plan(self, model: torch.nn.Module, startup: contextlib.ExitStack) -> None:
        """The given plan, else the checkpoint's (:meth:`Checkpoint.plan_to_resume`), else even data
        parallelism (the controller, in its own process, improves it from measured steps);
        with the start-up measurements of an adaptive run (``base_state``, ``config``). A new
        round (restart, resume) takes a new plan id: one above every id of the run so far."""
        job, resume = self.job, self.resume
        self.profile = None
        self.startup_controller_state: dict[str, Any] | None = None
        self.config = _training_config(job)
        if job.adaptive or job.plan is None:
            x0, _ = job.task.train.batch(self.sampler.indices(self.start_step)[:2])
            self.profile = _profile(self.chain, cast_inputs(x0, torch.float32))
        plan: Plan | None = plan_from_dict(job.plan, "--plan") if job.plan is not None else None
        if plan is None and resume is not None:
            plan = resume.plan_to_resume(job.devices, job.batch)
        if job.adaptive:
            self.base_state, self.profile, self.config = startup_measurements(
                job, model, self.chain, self.profile, self.config, self.sampler, self.start_step,
                self.emu, self.coll,
            )  # fmt: skip
        else:
            self.base_state = _base_state(job, None)
        startup.close()  # the model as built (hetrain.runtime.startup.unchanged)
        self.chain._index_tensors()
        if plan is None:
            plan = even_dp_plan(
                job.devices,
                self.num_layers,
                job.batch,
                job.microbatch_size,
                norm_block=job.norm_block,
            )
            if job.adaptive:
                plan = self._startup_plan(plan)
        if resume is not None or self.restart_count > 0:
            box = [self._highest_plan_id() + 1 if self.lead else None]
            dist.broadcast_object_list(box, src=0)
            plan = plan.model_copy(update={"plan_id": int(box[0])})
        if plan.plan_id is None:
            plan = plan.model_copy(update={"plan_id": 0})
        if self.lead and job.checkpoint_dir:
            ckpt.record_plan_id(job.checkpoint_dir, int(plan.plan_id))
        self.plan = plan

    def _startup_plan(self, even: Plan) -> Plan:
        """Rank 0's controller decision on the start-up calibration against ``even``
        (:func:`hetrain.runtime.ctlcontroller.startup_decision`; its controller state kept in
        :attr:`startup_controller_state` for the round's controller), broadcast to every rank;
        ``even`` when no plan fits (one warning line: the controller then starts from it)."""
        box: list[Any] = [None]
        if self.lead:
            try:
                chosen, self.startup_controller_state = startup_decision(
                    self.base_state, self.profile, self.config, even,
                    self.job.steps - self.start_step,
                )  # fmt: skip
                box = [chosen.to_json_dict()]
            except Exception as exc:  # noqa: BLE001  (the run goes on from the even plan)
                why = " ".join(str(exc).split())[:200]
                print(f"hetrain: warning: no start-up plan ({why}); starting from even data "
                      "parallelism", file=sys.stderr, flush=True)  # fmt: skip
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        return even if box[0] is None else plan_from_dict(box[0], "start-up plan")

    def _highest_plan_id(self) -> int:
        """Rank 0: the highest plan id of the run so far (-1: none): from the checkpoint
        folder (the resumed checkpoint's plan and the ids put in force after it,
        :func:`hetrain.runtime.checkpoint.max_plan_id`); without a checkpoint folder (a
        restart from step 0) from the metrics file, the only record there is."""
        job = self.job
        if job.checkpoint_dir:
            return ckpt.max_plan_id(job.checkpoint_dir, self.resume)
        path = Path(job.metrics_out) if job.metrics_out else None
        ids = [-1]
        if path is not None and path.is_file():
            ids += [int(e["plan_id"]) for e in read_metrics(path) if e.get("plan_id") is not None]
        return max(ids)

    def _start_controller(self) -> None:
        """Adaptive runs: every rank writes its own measurements to the controller's store (no
        per-step gather); rank 0 starts the round (and, under torchrun or on several nodes,
        the controller process) and reads the decisions."""
        job, world = self.job, self.world
        self.link: ControllerLink | None = None
        self.controller_proc = None
        if not job.adaptive:
            return
        endpoint = round_id = None
        if self.lead:
            endpoint = job.controller_endpoint
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
            if endpoint is None or not local:
                # under torchrun (no launcher of ours) or several nodes (the launcher's
                # controller listens on loopback): rank 0 starts one, on loopback when every
                # rank is on this host, else on the rendezvous address the other nodes reach
                host = "127.0.0.1" if local else os.environ.get("MASTER_ADDR", "0.0.0.0")
                self.controller_proc, endpoint = spawn_controller_process(host=host)
            round_id = uuid.uuid4().hex
        if world > 1:
            box = [(endpoint, round_id)]
            dist.broadcast_object_list(box, src=0)
            endpoint, round_id = box[0]
        self.link = ControllerLink(endpoint, rank=self.rank, round_id=round_id)
        if self.lead:
            self.link.start_round(
                {
                    "world_size": world,
                    "base_state": self.base_state,
                    "profile": self.profile,
                    "config": self.config,
                    "plan": self.plan,
                    "steps": job.steps,
                    "start_step": self.start_step,
                    "optimizer_state_factor": _state_factor(job),
                    "checkpoint_dir": job.checkpoint_dir,
                    "checkpoint_every": job.checkpoint_every,
                    "log_path": _controller_log_path(job),
                    "controller_state": self.startup_controller_state
                    if self.start_step == 0
                    else None,
                }
            )

    def _open_round(self) -> None:
        """The metrics writer (appending for a resumed or restarted round), the checkpoint's
        layer state loaded into the worker, and rank 0's ``restart`` record (with one console
        line) and ``plan`` record."""
        job, resume, start_step = self.job, self.resume, self.start_step
        sinks = []
        if self.lead and job.tensorboard and job.metrics_out:
            sinks.append(TensorBoardSink(Path(job.metrics_out).parent))
        self.metrics = MetricsWriter(
            job.metrics_out if self.lead else None,
            append=resume is not None or self.restart_count > 0 or self.elastic_round,
            sinks=sinks,
        )
        self.resumed: dict[str, Any] | None = None
        if resume is not None:
            owned = set(self.worker.owned_layers)
            held_shared = [n for n, ls in self.worker.shared.items() if owned.intersection(ls)]
            state = ckpt.restore(resume, owned, held_shared)
            self.worker.load_layer_state_dict(state)
            before = [str(d) for d in resume.manifest.get("devices") or []]
            self.resumed = {
                "step": start_step,
                "path": str(resume.path),
                "devices": list(job.devices),
                "checkpoint_devices": before,
                "checkpoint_batch": resume.plan.global_batch,
                "data_position": int(resume.data_position),
            }
        if self.lead and (resume is not None or self.restart_count > 0):
            self._record_restart()
        if self.lead:
            base_state = self.base_state
            self.metrics.write(
                "plan",
                start_step,
                plan_id=self.plan.plan_id,
                plan=self.plan.to_json_dict(),
                device_type=self.worker.device.type,
                backend=dist.get_backend(),
                speed_flops=dict(zip(base_state.ids, base_state.speed_flops.tolist(), strict=True)),
                kappa_s=dict(zip(base_state.ids, base_state.kappa_s.tolist(), strict=True)),
            )

    def _record_restart(self) -> None:
        """Rank 0: every restart of the ranks (``--max-restarts``, elastic rounds) and every
        resumed run is recorded, also before the first checkpoint (then from step 0, path
        None). ``steps_done_before``/``redone_steps`` describe the metrics file itself (its
        step lines past the resumed step are redone), so they are read from it."""
        job, resumed, start_step = self.job, self.resumed, self.start_step
        before = resumed["checkpoint_devices"] if resumed else []
        logged = [
            int(e["step"])
            for e in (
                read_metrics(job.metrics_out) if Path(job.metrics_out or "").is_file() else []
            )
            if e.get("event") == "step"
        ]
        done_before = max(logged) + 1 if logged else 0
        self.metrics.write(
            "restart",
            start_step,
            path=resumed["path"] if resumed else None,
            restart_count=self.restart_count,
            plan_id=self.plan.plan_id,
            devices=list(job.devices),
            lost_devices=sorted(set(before) - set(job.devices)),
            joined_devices=sorted(set(job.devices) - set(before)) if before else [],
            batch=job.batch,
            checkpoint_batch=resumed["checkpoint_batch"] if resumed else None,
            data_position=self.sampler.position(start_step),
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
            f"hetrain: {what} on {plural(len(job.devices), 'device')} ({', '.join(job.devices)})"
            + (f"; restart {self.restart_count}" if self.restart_count else ""),
            file=sys.stderr,
            flush=True,
        )


def _controller_log_path(job: Any) -> str | None:
    """The controller's per-step predictions (JSONL): ``controller.jsonl`` beside the
    metrics."""
    if job.metrics_out:
        return str(Path(job.metrics_out).with_name("controller.jsonl"))
    if job.run_dir:
        return str(Path(job.run_dir) / "controller.jsonl")
    return None


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
