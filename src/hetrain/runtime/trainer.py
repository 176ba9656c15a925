"""One rank's training run as named parts (:class:`Trainer`), in the shape of torchtitan's
``Trainer`` (torchtitan/train.py: everything built in the constructor, ``train_step`` per step,
``train`` the loop). :func:`hetrain.runtime.worker_main.run_worker` builds one per rank.

Parts: start-up (:class:`Trainer`'s constructor, :mod:`hetrain.runtime.trainer_setup`), one
step (:meth:`Trainer.train_step`), reading the step's rows (:meth:`Trainer.read_reports`:
metrics lines, non-finite values, stop requests, plan flags), the plan switch
(:meth:`Trainer.switch_plan`), the checkpoint (:meth:`Trainer.checkpoint`) and the end
(:meth:`Trainer.finish`: gather, evaluate, export, summary).
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hetrain.plan import Plan, plan_from_dict
from hetrain.runtime import checkpoint as ckpt
from hetrain.runtime.ctldecision import Decision
from hetrain.runtime.stop import (
    EXIT_STOPPED_BY_PEER,
    NonFiniteError,
    StopRequest,
    TrainingStopped,
    nonfinite_line,
)
from hetrain.runtime.trainer_setup import TrainerSetup
from hetrain.runtime.watchdog import Watchdog
from hetrain.runtime.worker_main import _to_device

CONTROLLER_STATE_WAIT_S = 10.0
"""Seconds rank 0 waits at a periodic checkpoint for the controller to stage its state of that
step (it usually has within milliseconds: the step's measurements were just posted)."""


class Trainer(TrainerSetup):
    """One rank's run of a ``TrainJob`` (``torch.distributed`` already initialised).

    The constructor is the start-up (:class:`~hetrain.runtime.trainer_setup.TrainerSetup`);
    :meth:`train` runs the steps and returns rank 0's summary (None on other ranks).

    Raises:
        TrainingStopped: (from :meth:`train`) a SIGTERM/SIGINT stop after an agreed step.
        NonFiniteError: (from :meth:`train`) a non-finite loss or gradient norm with
            ``on_nonfinite="stop"``.
    """

    def __init__(self, job: Any, Worker: Any, gather_measurements: Any) -> None:
        super().__init__(job, Worker, gather_measurements)
        self.replans = 0
        # rank 0, per plan change: the first step run under it minus the last step whose
        # measurements its decision used, minus 1 (``hetrain simulate --decision-delay``'s unit)
        self.decision_delays: list[int] = []
        self.adapt_time_s = 0.0  # rank 0's time talking to the controller (post + poll)
        self.skipped_steps = 0  # updates skipped for a non-finite loss or gradient norm
        self.timelines: list[dict[str, Any]] = []
        self.stopped: TrainingStopped | None = None
        self.watchdog: Watchdog | None = None
        self.stop = StopRequest(grace=self.world > 1)
        # What the ranks exchange per step rides in the step's own combination of sums
        # (Worker.step's report; docs/runtime.md "Per-step collectives"): this rank's stop
        # request, rank 0's "a new plan follows" flag and the measurements of the rank's last
        # finished step. Rows of a step arrive with its result, or a step later when the
        # result is late; every rank acts on them at the same step.
        self.announced: dict[int, Decision] = {}  # rank 0: step -> the decision its row announced
        self.link_failure: list[BaseException] = []

    # ---- the loop -------------------------------------------------------------------------
    def train(self) -> dict[str, Any] | None:
        """Run steps ``start_step .. steps-1`` (see the module's parts), then :meth:`finish`."""
        job = self.job
        self._arm()
        try:
            for step in range(self.start_step, job.steps):
                result = self.train_step(step)
                stop_signal, flagged = self.read_reports(step, result)
                self.record_timeline(step, result)
                if flagged and stop_signal is None and step + 1 < job.steps:
                    self.switch_plan(step, flagged)
                path = self.checkpoint(step, stop_signal)
                if stop_signal is not None:
                    # a graceful stop (spot warning, or the agents restarting the group for a
                    # device that joins): every rank checkpointed this same step; the next
                    # round resumes here without redoing a step
                    self.stopped = TrainingStopped(
                        self.stop.exit_code if self.stop.requested else EXIT_STOPPED_BY_PEER,
                        step=step + 1,
                        path=str(path) if path is not None else None,
                        signal_name=stop_signal,
                    )
                    break
            self.skipped_steps += self.check_nonfinite(self.log.waiting)
            self.log.flush()
            if self.lead and self.stopped is not None:
                self.metrics.write(
                    "stop",
                    self.stopped.step,
                    reason=self.stopped.signal_name,
                    world_size=self.world,
                )
        finally:
            self._disarm()
        if self.stopped is not None:
            self.metrics.close()
            raise self.stopped
        return self.finish()

    def _arm(self) -> None:
        """The watchdog, and SIGTERM/SIGINT handling (Ctrl-C: the whole process group) as a
        graceful stop after the current step with a checkpoint; until here they ended the rank
        at once (nothing to save yet). Signals can be handled in the main thread only (a rank
        run from another thread keeps the process's handlers)."""
        job = self.job
        self.watchdog = Watchdog(job.hang_timeout_s, rank=self.rank) if job.hang_timeout_s else None
        if threading.current_thread() is threading.main_thread():
            self.stop.install()
        if self.watchdog is not None:
            self.watchdog.start()

    def _disarm(self) -> None:
        """Undo :meth:`_arm`; close the progress bar, the controller link and a controller
        process this rank started."""
        self.stop.restore()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.progress is not None:
            self.progress.close()
        if self.link is not None:
            self.link.close()
        if self.controller_proc is not None:
            try:
                self.controller_proc.wait(timeout=10)
            except Exception:
                self.controller_proc.kill()

    # ---- one step -------------------------------------------------------------------------
    def train_step(self, step: int) -> Any:
        """Run step ``step`` under the emulation of its slot (``Worker.step``, its report row
        from :meth:`_report_row`), post the measurements to the controller; returns the
        ``StepResult``.

        Raises:
            BaseException: the controller link failed (unless a stop is under way).
        """
        job, worker, plan = self.job, self.worker, self.plan
        worker.emulation = self.emu.emulation(step)
        x, y = job.task.train.batch(self.sampler.indices(step))
        if worker.device.type == "cuda":
            # one pinned host buffer and an asynchronous copy per step (the engine's
            # per-micro-batch slices are then already on the GPU)
            x, y = _to_device(x, worker.device), _to_device(y, worker.device)
        result = worker.step(x, y, step, report=self._report_row(step, int(plan.plan_id)))
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if self.link_failure and not self.stop.requested:
            # (a SIGTERM to rank 0's process group also ends a controller it started: then
            # the stop, agreed at the next step, goes on without it)
            raise self.link_failure[0]
        if self.link is not None and step + 1 < job.steps:
            self.link.post(
                step,
                {
                    "device": self.device_id,
                    "plan_id": int(plan.plan_id),
                    "compute_time_s": result.compute_time_s,
                    "iteration_time_s": result.iteration_time_s,
                    "send_recv_time_s": result.send_recv_time_s,
                    "sync_time_s": result.sync_time_s,
                },
            )
        if self.lead:
            self.log.begin(
                step,
                result,
                {
                    "plan_id": plan.plan_id,
                    "world_size": self.world,
                    "global_batch": plan.global_batch,
                    "shares": [g.batch for g in plan.groups],
                    "lr": self.spec.lr_at(step),
                    "slowdown": worker.emulation.slowdown if worker.emulation else {},
                },
            )
        return result

    def _report_row(self, step: int, plan_id: int):
        """The callable giving this rank's report row of ``step`` (called by the engine when
        the step's sums are formed): ``[stop signal or 0, rank 0's "a new plan follows" flag,
        *measured times of the last finished step]``; rank 0 polls the controller here."""

        def row() -> list[float]:
            flag = 0.0
            polling = not self.link_failure and not self.stop.requested
            if (
                self.link is not None
                and self.lead
                and self.world > 1
                and step + 1 < self.job.steps
                and polling
            ):
                t_adapt = time.perf_counter()
                try:
                    decision = self.link.poll(plan_id)
                except BaseException as exc:  # raised after the step (not in a hook)
                    self.link_failure.append(exc)
                    decision = None
                if decision is not None:
                    self.announced[step] = decision
                    flag = 1.0
                self.adapt_time_s += time.perf_counter() - t_adapt
            stop = self.stop
            signum = float(stop.signum or signal.SIGTERM) if stop.requested else 0.0
            return self.log.report_row([signum, flag])

        return row

    def read_reports(self, step: int, result: Any) -> tuple[str | None, list[int]]:
        """Act on the rows of the steps finished now (``result`` and late ones): rank 0 writes
        their metrics lines; non-finite values are counted or stop the run
        (:meth:`check_nonfinite`). Returns (the stop signal's name when the ranks stop after
        this step, else None; the steps whose rows flag a new plan)."""
        stopping = False
        flagged: list[int] = []
        ready = self.log.ready(result)
        for done in ready:
            table = done.report
            stopping = stopping or any(r[0] > 0 for r in table)
            if table[0][1] > 0:
                flagged.append(done.step)
            if self.lead:
                self.log.write_line(table)
        self.skipped_steps += self.check_nonfinite(ready)
        # a stop during the last step is no stop: the run ends normally
        if not (stopping and step + 1 < self.job.steps):
            return None, flagged
        self.stop.agree()
        # the signal of the lowest rank that got one (the same name on every rank)
        rows = [r for done in ready for r in done.report if r[0] > 0]
        return signal.Signals(int(rows[0][0])).name, flagged

    def check_nonfinite(self, results: list[Any]) -> int:
        """Of finished steps (their loss and gradient norm combined over the ranks, the same on
        every rank): how many had a non-finite value, whose update was skipped (``skip``), or
        :class:`NonFiniteError` at the first one (``stop``; one small all-gather, on every rank
        at the same step, says where it first showed)."""
        job, coll, world = self.job, self.coll, self.world
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
            table = [r.tolist() for r in rows]
            line = nonfinite_line(job.devices, job.checkpoint_dir, done.step, done, table)
            self.log.flush()
            if self.lead:
                self.metrics.write("nonfinite", done.step, action="stop", message=line)
            raise NonFiniteError(line)
        return skipped

    def record_timeline(self, step: int, result: Any) -> None:
        """The measured events of the last step (and, adaptive, of the 4th step of the round)
        for the report: one gather on every rank; rank 0 keeps them for the end."""
        job = self.job
        want_timeline = step == job.steps - 1 or (
            job.adaptive and step == self.start_step + 3 and job.timeline_steps > 1
        )
        if want_timeline:
            per_rank = self.gather_measurements(result)
            if self.lead:
                self.timelines.append(
                    {"step": step, "plan": self.plan.to_json_dict(), "ranks": per_rank}
                )

    # ---- plan switch ----------------------------------------------------------------------
    def switch_plan(self, step: int, flagged: list[int]) -> None:
        """Rank 0's rows of steps ``flagged`` announced a decision: rank 0 broadcasts the plan
        object only when it is newer than the plan in force, and every rank switches to it
        before step ``step + 1`` (``Worker.apply_plan``); rank 0 records it."""
        decision = None
        if self.lead:
            newest = [self.announced.pop(s) for s in flagged if s in self.announced]
            newest = [d for d in newest if int(d.plan.plan_id) > int(self.plan.plan_id)]
            decision = max(newest, key=lambda d: int(d.plan.plan_id), default=None)
        box = [decision.plan.to_json_dict() if decision is not None else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        new_plan = plan_from_dict(box[0], "<re-plan>")
        migration = self.worker.apply_plan(new_plan)
        if self.lead:
            if self.job.checkpoint_dir:  # recorded before any line names it
                ckpt.record_plan_id(self.job.checkpoint_dir, int(new_plan.plan_id))
            _report_replan(self.metrics, self.progress, decision, step + 1, self.plan, migration)
            self.metrics.write(
                "plan", step + 1, plan_id=new_plan.plan_id, plan=new_plan.to_json_dict()
            )
        self.plan = new_plan
        self.replans += 1
        if decision is not None:  # rank 0: steps between the decision's data and its first step
            self.decision_delays.append(step - int(decision.decided_after_step))

    # ---- checkpoint -----------------------------------------------------------------------
    def checkpoint(self, step: int, stop_signal: str | None) -> Path | None:
        """The collective checkpoint after step ``step`` (``step + 1`` steps done) when it is
        a periodic one or the ranks stop (``stop_signal``); returns its folder, or None.

        Raises:
            NonFiniteError: a late step's sums were not finite (``on_nonfinite="stop"``).
            CheckpointWriteError: the file system failed (every earlier checkpoint intact).
        """
        job = self.job
        stopping = stop_signal is not None
        if not job.checkpoint_dir or not (
            stopping or (job.checkpoint_every > 0 and (step + 1) % job.checkpoint_every == 0)
        ):
            return None
        # no checkpoint holds a non-finite step: late sums of the steps before are complete
        # here (the same wait on every rank)
        self.check_nonfinite(self.log.waiting if job.on_nonfinite == "stop" else [])
        watchdog = self.watchdog
        with watchdog.suspended() if watchdog is not None else nullcontext():
            path = ckpt.save(
                job.checkpoint_dir,
                step + 1,
                self.worker.layer_state_dict(),
                {
                    "data_position": self.sampler.position(step + 1),
                    "plan": self.plan.to_json_dict(),
                    "model_fingerprint": self.fingerprint,
                    "world_size": self.world,
                    "devices": job.devices,
                    "seed": job.seed,
                    "batch": job.batch,
                    "example": job.example,
                    **({"stop": stop_signal} if stopping else {}),
                },
                keep=job.checkpoint_keep,
                controller_state=_staged_controller_state(
                    job, step + 1, stopping or step + 1 == job.steps, after=self.start_step
                )
                if self.lead and self.link is not None
                else None,
            )
        if self.lead:
            self.metrics.write("checkpoint", step + 1, path=str(path))
        return path

    # ---- end: gather, evaluate, export ------------------------------------------------------
    def finish(self) -> dict[str, Any] | None:
        """Gather the whole model (collective); rank 0 writes the timelines, evaluates the
        model on the validation split, exports it (``model.pt``, and ``save_pretrained`` for a
        Hugging Face model) and returns the run summary; other ranks return None."""
        job, metrics = self.job, self.metrics
        full = self.worker.full_state_dict()
        if not self.lead:
            metrics.close()
            return None
        for t in self.timelines:
            metrics.write("timeline", t["step"], plan=t["plan"], ranks=t["ranks"])
        torch.manual_seed(job.seed)
        final = job.task.build_model().to(self.dtype)
        final.load_state_dict(full)
        final.eval()
        quality = job.task.evaluate(final, self.dtype) if job.task.evaluate else {}
        out = (
            Path(job.out) if job.out else (Path(job.run_dir) / "model.pt" if job.run_dir else None)
        )
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(full, out)
        hf_dir = _export_pretrained(final, job)
        wall = time.perf_counter() - self.wall0
        step_times = self.log.step_times_s
        summary = {
            "steps": job.steps,
            "start_step": self.start_step,
            "trained_steps": job.steps - self.start_step,
            "resumed": self.resumed,
            "restarts": self.restart_count,
            "final_loss": self.log.last_loss,
            "metrics": quality,
            "quality": job.task.quality_line(quality),
            "quality_reached": job.task.quality_reached(quality),
            "replans": self.replans,
            "decision_delay_steps": list(self.decision_delays),
            "skipped_steps": self.skipped_steps,
            "adapt_time_s": self.adapt_time_s,
            "final_plan": self.plan.to_json_dict(),
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
            replans=self.replans,
            decision_delay_steps=list(self.decision_delays),
            skipped_steps=self.skipped_steps,
        )
        metrics.close()
        return summary


def _staged_controller_state(job: Any, step: int, no_wait: bool, *, after: int = 0) -> Path | None:
    """The controller's staged state for the checkpoint of ``step`` (rank 0): that step's,
    waited for up to :data:`CONTROLLER_STATE_WAIT_S` at a periodic checkpoint; at a stop or
    the last step (``no_wait``: their last measurements are never posted) or when it does not
    come, the newest staged state of an earlier step of this round (a step above ``after``,
    the round's first step: a state staged by the round before a resume is stale, and the
    controller deletes it when this round starts); None when there is none."""
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
        if digits.isdigit() and after < int(digits) <= step:
            found.append((int(digits), p))
    return max(found)[1] if found else None


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
    line = "hetrain: " + decision.console_line(step, old)
    if progress is not None:
        progress.print(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _export_pretrained(model: torch.nn.Module, job: Any) -> str | None:
    """A Hugging Face model is also saved with ``save_pretrained`` into ``run_dir/model``
    (config + safetensors; ``AutoModel...from_pretrained(run_dir/model)`` loads it without
    hetrain). Returns the folder, or None for other models or without a run folder."""
    if job.run_dir is None or not hasattr(model, "save_pretrained"):
        return None
    folder = Path(job.run_dir) / "model"
    model.to(torch.float32).save_pretrained(folder)
    return str(folder)
