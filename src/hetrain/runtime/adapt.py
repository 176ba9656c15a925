"""The controller of a training run (docs/model.md §4-§5), in its own process: measured step times
->
speed estimates -> :class:`~hetrain.control.lyapunov.LyapunovController` -> plan changes that hold.

Where it runs. The process that launches the ranks (``hetrain train``: the elastic launcher's
parent) runs :class:`ControllerService` in a thread, beside a ``torch.distributed.TCPStore`` it
hosts (``TrainJob.controller_endpoint``); under ``torchrun`` rank 0 starts it as a separate
process (``python -m hetrain.runtime.adapt --port P``). No search ever runs in a rank's
process, so a search neither holds a rank's GIL nor delays its step.

Protocol (keys of that store, :class:`ControllerLink` on every rank; every value is JSON
data, :mod:`hetrain.runtime.ctlwire`, never a pickle):

- ``init`` (+ ``init_id``, the round's id): the model profile, the start-up cluster state
  (measured speeds and ``κ``), the training configuration, the current plan, the number of
  ranks and the first step of this round (rank 0);
- ``m/{step}/{rank}``: after every step, each rank writes its own compute, iteration,
  send/recv and exposed sync seconds and the plan id it ran under (no collective gathers
  them); the controller observes a step once every rank's record is there; never waited for;
- ``plan``: ``{"round", "decision"}``: the newest decision (plan with its id, the estimates
  that chose it, the predicted before/after figures) and the round it was made for (a
  decision of a round whose rank 0 died is ignored by the next round's); written with
  ``error`` through :func:`~hetrain.runtime.ctlstore.publish`, which raises the ``news``
  counter after it. A thread of rank 0 reads the counter (one request) and, when it moved,
  the decision (rank 0's step never waits on the store) and the step's own combination of sums
  (the gradient all-reduce of a data-parallel step, :meth:`hetrain.runtime.engine.Worker.step`'s
  ``report``) carries whether there is one, so all ranks switch at the same step;
- ``error``: the controller's failure (rank 0 raises it: adaptation never turns off silently);
  ``done``: rank 0 finished.

Where the parts live: the decisions
(:class:`~hetrain.runtime.ctlcontroller.PlanController`; the predictions, :class:`Decision` and
plan forms it uses: :mod:`hetrain.runtime.ctldecision`) and the store with rank 0's
:class:`~hetrain.runtime.ctlstore.ControllerLink` (:mod:`hetrain.runtime.ctlstore`) live in their
own modules; this one holds the service that runs them over the store
(:class:`ControllerService`), in a thread of the launcher (:class:`ControllerThread`) or its own
process (:func:`spawn_controller_process`, :func:`main`), and where the controller's files go
(:func:`replay_init_path`, :func:`round_init_path`, :func:`controller_state_path`).

Imports the planning modules only; torch only for the store, lazily. ``Decision``,
``even_dp_plan`` and ``ControllerLink`` stay importable from here (benches, launch code).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetrain.runtime.ctlcontroller import (  # noqa: F401
    PlanController,
    round_controller,
    shutdown_search_executor,
)
from hetrain.runtime.ctldecision import Decision, even_dp_plan  # noqa: F401  (re-exported)
from hetrain.runtime.ctlstore import (  # noqa: F401  (re-exported)
    PREFIX,
    ControllerLink,
    _store,
    publish,
)
from hetrain.runtime.ctlwire import (
    WireError,
    decode_init,
    decode_record,
    encode_decision,
    encode_init,
    merge_records,
)

DECIDE_BACKLOG_STEPS = 3
"""When the controller is behind the ranks, it decides only for the newest this-many steps."""

CONTROLLER_NICE = 10
"""Nice steps the controller's search thread runs below the thread that starts it (a CFS weight
of 110 against a rank's 1024): a planner search (0.1-3 s of CPU at 4-16 devices) takes the
cores' idle time (pipeline bubbles, a slow device's emulated sleep, waits in collectives)
instead of a rank's share. The service's own thread (the per-step cheap decision and the
log's predictions, about 3-7 ms of CPU per step at 4 devices; docs/controller.md "The
controller's CPU") keeps its priority: at nice 10 on the loaded 2-core machine its
decisions reached the ranks 4-18 steps after their measurements against 3-9 at normal priority
(``hetrain train --example digits --workers 4 --steps 100``, two runs each; docs/controller.md)."""


def lower_thread_priority(increment: int = CONTROLLER_NICE) -> bool:
    """Lower the calling thread's CPU priority by ``increment`` nice steps (at most to 19).

    Linux only: there a nice value belongs to one thread (``setpriority(PRIO_PROCESS, tid)``)
    and the threads it starts inherit it; the other threads of the process keep theirs.
    Elsewhere, or where the OS refuses, nothing changes. Returns whether the priority was
    lowered."""
    if not sys.platform.startswith("linux") or increment <= 0:
        return False
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + int(increment)))
    except (AttributeError, OSError):
        return False
    return True


def replay_init_path(log_path: str | Path) -> Path:
    """Where the start of a round's controller log is kept for replays: the model profile,
    the start-up state, the configuration, the first plan and the run's steps, as the round's
    JSON start message (:func:`~hetrain.runtime.ctlwire.encode_init`; ``controller_init.json``
    beside ``controller.jsonl``)."""
    return Path(log_path).with_name("controller_init.json")


def round_init_path(log_path: str | Path, round_id: str) -> Path:
    """Where a resumed round's start is kept for replays: its JSON start message with the
    controller state it restored from its checkpoint as ``controller_state``
    (``controller_init-<round>.json`` beside ``controller.jsonl``; the round id's characters
    other than letters, digits, ``-`` and ``_`` written as ``_``)."""
    safe = re.sub(r"[^0-9A-Za-z_-]", "_", str(round_id))[:64]
    return Path(log_path).with_name(f"controller_init-{safe}.json")


def _write_atomic(path: Path, blob: bytes) -> None:
    """``blob`` to ``path`` through a temporary file beside it (a reader sees all or none)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


def controller_state_path(checkpoint_dir: str | Path, step: int) -> Path:
    """Where the controller stages its state (:meth:`PlanController.state_dict`, JSON) for the
    checkpoint of ``step``: rank 0 copies it into that checkpoint (``controller.json``, listed
    with its checksum in the manifest, pruned with it; :mod:`hetrain.runtime.checkpoint`)."""
    return Path(checkpoint_dir) / ".controller" / f"state-{int(step):08d}.json"


class ControllerService:
    """The controller loop over a store (see the module docstring for the keys)."""

    ROUND_CHECK_S = 0.1
    """Seconds between two checks for a new round while records keep arriving."""

    IDLE_POLL_MAX_S = 0.05
    """The longest sleep between two store checks (before a round's first step, while the
    ranks start up or write a checkpoint)."""

    IDLE_POLL_STEP_FRACTION = 0.05
    """While steps arrive, a sleep between two checks grows to at most this fraction of the
    mean time between two steps' records (a record is seen within 5 % of a step)."""

    EXPECT_STEP_FRACTION = 0.5
    """While steps arrive, the service sleeps until this fraction of the mean time between two
    steps has passed since the last complete one before it checks again: the checks of a step
    are then about ten (its second half at 5 % of a step each) instead of one every 5 % from
    the start. Steps of the README's jobs on this machine came 0.7-1.3 times the mean apart:
    at 0.75 a fast step's records were read up to 30 ms late."""

    def __init__(self, store: Any, poll_s: float = 0.005) -> None:
        self.store = store
        self.poll_s = poll_s
        self._idle_ticks = 0
        self._step_gap_s: float | None = None  # EWMA of the time between two complete steps
        self._last_seen: float | None = None  # monotonic time of the last complete step
        self._round_checked = -math.inf
        self._world = 1
        self.rejected_init_id: bytes | None = None  # the last malformed init's id
        self.stop = threading.Event()
        self.controller: PlanController | None = None
        self._init_id: bytes | None = None
        self._last = -1
        self._init: dict[str, Any] = {}
        self._log: Any = None

    def _has(self, key: str) -> bool:
        return bool(self.store.check([PREFIX + key]))

    def _get(self, key: str) -> bytes:
        return self.store.get(PREFIX + key)

    def run(self) -> None:
        """Serve until :attr:`stop` is set; a failure is posted as ``error`` and re-raised."""
        try:
            while not self.stop.is_set():
                if self._tick():
                    self._idle_ticks = 0
                else:
                    time.sleep(self.idle_sleep_s())
                    self._idle_ticks += 1
        except Exception:
            publish(self.store, "error", traceback.format_exc())
            raise
        finally:
            shutdown_search_executor()
            if self._log is not None:
                self._log.close()

    def idle_sleep_s(self, now: float | None = None) -> float:
        """Seconds to sleep after a pass that found nothing: :attr:`poll_s` doubled with each
        idle pass in a row, capped at :attr:`IDLE_POLL_STEP_FRACTION` of the time between two
        steps while steps arrive (never below :attr:`poll_s`) and at :attr:`IDLE_POLL_MAX_S`;
        while steps arrive, at least until :attr:`EXPECT_STEP_FRACTION` of that time has passed
        since the last complete step (``now``: ``time.monotonic()``). Each pass is a store
        request that wakes the store's host; a fixed 5 ms poll cost about 1 % of a core while
        nothing arrived."""
        cap = self.IDLE_POLL_MAX_S
        if self._step_gap_s is not None:
            cap = min(cap, max(self.poll_s, self.IDLE_POLL_STEP_FRACTION * self._step_gap_s))
        sleep = min(self.poll_s * 2.0 ** min(self._idle_ticks, 16), cap)
        if self._step_gap_s is not None and self._last_seen is not None:
            now = time.monotonic() if now is None else now
            expected = self._last_seen + self.EXPECT_STEP_FRACTION * self._step_gap_s
            sleep = max(sleep, expected - now)
        return sleep

    def _note_steps(self, count: int) -> None:
        """``count`` steps completed now: update the mean time between two steps."""
        now = time.monotonic()
        if self._last_seen is not None and count > 0:
            gap = (now - self._last_seen) / count
            prev = self._step_gap_s
            self._step_gap_s = gap if prev is None else 0.8 * prev + 0.2 * gap
        self._last_seen = now

    def _start_round(self) -> None:
        init_id = self._get("init_id")
        try:
            init = decode_init(self._get("init"))
            if init["round"].encode() != init_id:
                raise WireError("controller init: its round is not init_id")
        except WireError as exc:
            # one line, nothing changed (the round in progress goes on): the round's rank 0
            # writes a valid one
            print(f"hetrain: controller: ignored {exc}", file=sys.stderr, flush=True)
            self.rejected_init_id = init_id
            return
        self._init_id = init_id
        self._world = int(init["world_size"])
        self._init = init
        ctl = round_controller(init, async_search=True)
        start = int(init["start_step"])
        if init.get("checkpoint_dir"):
            # states staged by an earlier round are stale: this round starts from the state in
            # the checkpoint it resumes from
            for staged in controller_state_path(init["checkpoint_dir"], 0).parent.glob("*.json"):
                with contextlib.suppress(OSError):
                    staged.unlink()
        restored = None  # the controller state this round starts from (replays load it)
        if init.get("checkpoint_dir") and start > 0:
            # the state in the checkpoint the ranks resume from (checksum verified, plain
            # JSON): used when it is this round's devices, else the round starts fresh
            from hetrain.runtime.checkpoint import read_controller_state

            try:
                saved = read_controller_state(init["checkpoint_dir"], start)
                if saved is not None and list(saved.get("devices") or []) == list(
                    ctl.base_state.ids
                ):
                    ctl.load_state_dict(saved)
                    restored = saved
                    if ctl.startup_check is not None:
                        print(f"hetrain: controller: {ctl.startup_check}", file=sys.stderr,
                              flush=True)  # fmt: skip
            except ValueError as exc:  # CheckpointError too: one line, the round goes on
                print(f"hetrain: warning: controller state not restored: {exc}", file=sys.stderr)
        self.controller = ctl
        self._last = start - 1
        self._step_gap_s = self._last_seen = None  # this round's steps set them
        if self._log is not None:
            self._log.close()
        self._log = None
        if init.get("log_path"):
            Path(init["log_path"]).parent.mkdir(parents=True, exist_ok=True)
            mode = "a" if start > 0 else "w"  # a resumed run appends
            self._log = open(init["log_path"], mode, encoding="utf-8")  # noqa: SIM115
            # what a replay rebuilds the round's controller from (hetrain.sim.replay), JSON
            # (the replay validates it as a round's start): the run's first round's, and each
            # resumed round's with the state it restored
            if start == 0:  # a new log: resumed rounds' starts of an earlier one go
                for stale in Path(init["log_path"]).parent.glob("controller_init-*.json"):
                    with contextlib.suppress(OSError):
                        stale.unlink()
                _write_atomic(replay_init_path(init["log_path"]), encode_init(init))
            else:
                blob = encode_init({**init, "controller_state": restored})
                _write_atomic(round_init_path(init["log_path"], init["round"]), blob)

    def _tick(self) -> bool:
        """One pass; False when there was nothing to do. Costs one store request while no
        step is complete (and one more every :attr:`ROUND_CHECK_S`)."""
        now = time.monotonic()
        if now - self._round_checked >= self.ROUND_CHECK_S:
            self._round_checked = now
            if self._has("init_id") and self._get("init_id") not in (
                self._init_id,
                self.rejected_init_id,
            ):
                self._start_round()
        ctl = self.controller
        if ctl is None or self._init.get("round", "").encode() != self._init_id:
            return False
        records: dict[int, dict[str, Any]] = {}
        k = self._last + 1
        while True:  # every step whose records every rank has written
            rec = self._step_record(k)
            if rec is None:
                break
            records[k] = rec
            k += 1
        if not records:
            return False
        newest = k - 1
        self._note_steps(len(records))
        every = int(self._init.get("checkpoint_every") or 0)
        decision = None
        rows: list[tuple[dict[str, Any], Any]] = []  # log rows, the inputs of their predictions
        for k in range(self._last + 1, newest + 1):
            rec = records[k]
            ctl.observe(k, rec["plan_id"], rec["compute_time_s"], rec.get("iteration_time_s"))
            row = {"step": k, "plan_id": rec["plan_id"], "round": self._init["round"]}
            predicted = ctl.prediction_inputs() if self._log is not None else None
            if every > 0 and (k + 1) % every == 0 and self._init.get("checkpoint_dir"):
                path = controller_state_path(self._init["checkpoint_dir"], k + 1)
                tmp = path.with_suffix(".tmp")
                try:  # staged for rank 0's checkpoint of step k + 1 (plain JSON, no pickle)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with open(tmp, "w", encoding="utf-8") as fh:
                        json.dump(ctl.state_dict(), fh)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(tmp, path)
                except OSError:  # a full disk: that checkpoint goes without controller state
                    with contextlib.suppress(OSError):
                        tmp.unlink()
            # one decision in flight: while the ranks still run another plan than the
            # controller's last decision (posted, not yet applied), no step is decided on, so
            # that every decision is made against, and reported from, the plan that runs
            pending = int(rec["plan_id"]) != int(ctl.current.plan_id or 0)
            decided = newest - k < DECIDE_BACKLOG_STEPS and not pending
            made = None
            if decided:
                # one decision per measured step (decisions are a function of the log, the
                # same on replay), except when behind: then only for the newest steps
                started = time.perf_counter()
                made = ctl.decide(k + 1)
                decide_time_s = time.perf_counter() - started
                decision = made or decision
            if self._log is not None:
                # what a replay feeds (hetrain.sim.replay): the raw measurements, whether this
                # step was decided on, the search events and the decision made
                row["compute_time_s"] = dict(rec["compute_time_s"])
                row["decided"] = decided
                if decided:  # the controller's answer time for this step (wall seconds)
                    row["decide_time_s"] = decide_time_s
                if decided and ctl.search_started is not None:
                    row["search_started"] = ctl.search_started
                if decided and ctl.search_joined is not None:
                    row["search_joined"] = list(ctl.search_joined)
                if made is not None:
                    row["decision"] = {
                        "plan_id": int(made.plan.plan_id),
                        "shares_after": made.shares_after,
                        "structure_changed": made.structure_changed,
                    }
                row["measured_time_s"] = rec.get("iteration_time_s")
                row["speed_flops"] = ctl.estimates.speeds_flops()
                row["check"] = ctl.last_check
                rows.append((row, predicted))
        self._last = newest
        if decision is not None:
            # tagged with its round: a decision of a round that ended while it was computed
            # (its rank 0 died) must not reach the next round's rank 0
            publish(self.store, "plan", encode_decision(self._init_id.decode(), decision))
        if self._log is not None:
            # after the decision is posted: the log's predictions (two cost-model evaluations
            # per step) do not delay it; the same values as computed before the decision
            for row, predicted in rows:
                row = {"step": row.pop("step"), "plan_id": row.pop("plan_id"),
                       **ctl.predictions_of(predicted), **row}  # fmt: skip
                row["logged_at_s"] = time.time()
                # this thread's CPU seconds so far (decisions, estimates, the log): the
                # controller's CPU per step is the difference between two rows
                row["service_cpu_s"] = time.thread_time()
                self._log.write(json.dumps(row) + "\n")
            self._log.flush()
        return True

    def _step_record(self, step: int) -> dict[str, Any] | None:
        """Step ``step``'s record (:func:`~hetrain.runtime.ctlwire.merge_records`) once every
        rank of this round wrote its own (keys deleted), else None. A malformed record is
        reported in one line and deleted; a record of another round is left for this
        round's rank to overwrite."""
        keys = [PREFIX + f"m/{step}/{r}" for r in range(self._world)]
        if not self.store.check(keys):
            return None
        records = []
        for rank, (key, raw) in enumerate(zip(keys, self.store.multi_get(keys), strict=True)):
            try:
                rec = decode_record(raw)
                if rec["rank"] != rank:
                    raise WireError(f"measurement record: rank {rec['rank']} under rank {rank}")
            except WireError as exc:
                print(f"hetrain: controller: ignored {exc}", file=sys.stderr, flush=True)
                self.store.delete_key(key)
                return None
            if rec["round"].encode() != self._init_id:
                return None
            records.append(rec)
        for key in keys:
            self.store.delete_key(key)
        return merge_records(records)


class ControllerThread:
    """A :class:`ControllerService` in a daemon thread of this process, beside a store it
    hosts on ``127.0.0.1`` (a free port); :attr:`endpoint` is ``"host:port"``."""

    def __init__(self) -> None:
        self.store = _store("127.0.0.1", 0, master=True)
        self.endpoint = f"127.0.0.1:{self.store.port}"
        self.service = ControllerService(self.store)
        self.thread = threading.Thread(target=self._run, name="hetrain-controller", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.service.run()
        except BaseException as exc:  # posted to the store for rank 0; kept for the launcher
            self.error = exc

    def start(self) -> ControllerThread:
        self.thread.start()
        return self

    def close(self) -> None:
        self.service.stop.set()
        self.thread.join(timeout=10.0)


def spawn_controller_process(timeout_s: float = 60.0, host: str = "127.0.0.1"):
    """Start the controller as a separate process (``python -m hetrain.runtime.adapt``) hosting
    its store on a free port of ``host`` (loopback unless ranks on other nodes must reach it);
    returns ``(process, endpoint)``. Used under ``torchrun``, where no launcher process of
    ours exists. The listening socket is bound here and handed to the process (``--fd``), so
    the ranks' store clients connect at once, while the process is still importing, instead of
    being refused and retrying with back-off."""
    import socket
    import subprocess

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    port = int(sock.getsockname()[1])
    fd = sock.fileno()
    os.set_inheritable(fd, True)
    # one BLAS/OpenMP thread: the controller's numpy shares the host's cores with the ranks
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hetrain.runtime.adapt", "--port", str(port), "--host", host,
             "--fd", str(fd)],
            stdin=subprocess.DEVNULL,
            env=env,
            pass_fds=(fd,),
        )  # fmt: skip
    finally:
        sock.close()  # the child holds its own copy
    return proc, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetrain.runtime.adapt --port P``: serve until rank 0 posts ``done``."""
    parser = argparse.ArgumentParser(prog="hetrain.runtime.adapt")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--fd", type=int, default=None, help="an inherited listening socket")
    args = parser.parse_args(argv)
    store = _store(args.host, args.port, master=True, listen_fd=args.fd)
    service = ControllerService(store)

    parent = os.getppid()

    def watch() -> None:
        # rank 0 posts done at the end; if it dies instead (its round failed), so does this
        while not service.stop.is_set():
            if store.check([PREFIX + "done"]) or os.getppid() != parent:
                service.stop.set()
            time.sleep(0.1)

    threading.Thread(target=watch, name="hetrain-controller-watch", daemon=True).start()
    service.run()
    return 0


if __name__ == "__main__":
    # run the importable module's copy (one PlanController/Decision class, not __main__'s)
    from hetrain._exit import exit_process
    from hetrain.runtime.adapt import main as _main

    exit_process(_main())
