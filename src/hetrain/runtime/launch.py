"""Starting the ranks: one process per device with torch's elastic launch API (what
``torchrun`` runs inside), or in-process for a single rank.

- Local (default): ``nproc_per_node = N`` worker processes on this machine, c10d rendezvous on
  ``127.0.0.1`` with a free port, started with ``fork`` (the job, including the user's model and
  data, is inherited, nothing is pickled; about 0.5 s instead of several seconds per spawn).
  Forked ranks use one torch thread each (OpenMP's pool does not survive ``fork``); ranks
  started by ``torchrun`` use ``cores / local ranks`` threads.
- Several nodes: every node runs the same ``hetrain train ... --nnodes M --nproc-per-node K
  --rdzv-endpoint HOST:PORT`` (c10d rendezvous; the ranks of node ``i`` get global ranks by
  the rendezvous order); ``torchrun`` itself works too (see ``docs/training.md``).
- One rank without ``--nnodes``: in-process, gloo over a ``file://`` store (no launcher).

Gloo on CPU, NCCL when CUDA is present (each local rank takes GPU ``LOCAL_RANK``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetrain._io import read_jsonl
from hetrain.runtime.worker_main import TrainingStopped, TrainJob, run_worker


class LaunchError(RuntimeError):
    """A rank failed; the message is one line naming the rank and the root cause."""


class RunStopped(Exception):
    """The run was stopped by a signal (SIGTERM, or SIGINT: Ctrl-C) to the launching process
    or its whole process group; the ranks finished the current step, wrote the stop
    checkpoint when there is a checkpoint folder, and exited.

    Attributes:
        signal_name: ``"SIGTERM"``, ``"SIGINT"``, ...
        step: steps done at the stop (None when unknown: no stop checkpoint was written).
        path: the stop checkpoint's folder, or None.
        exit_code: 0 when the stop checkpoint was written, else ``128 + signal``.
    """

    def __init__(self, signal_name: str, step: int | None, path: str | None) -> None:
        import signal

        self.signal_name = signal_name
        self.step = step
        self.path = path
        signum = int(getattr(signal, signal_name, signal.SIGTERM))
        self.exit_code = 0 if path is not None else 128 + signum
        if path is not None:
            line = (
                f"stopped at step {step} ({signal_name}); checkpoint {path}; the same command "
                f"resumes from it"
            )
        elif step is not None:
            line = f"stopped at step {step} ({signal_name}); no checkpoint (no --checkpoint-dir)"
        else:
            line = f"stopped ({signal_name}) before a stop checkpoint was written"
        super().__init__(line)


def _checkpoint_stamp(job: TrainJob) -> tuple[str, int] | None:
    """(folder, manifest mtime in ns) of the newest complete checkpoint, or None."""
    from hetrain.runtime import checkpoint as ckpt

    if not job.checkpoint_dir:
        return None
    found = ckpt.list_checkpoints(job.checkpoint_dir)
    if not found:
        return None
    try:
        return str(found[-1]), (found[-1] / ckpt.MANIFEST).stat().st_mtime_ns
    except OSError:
        return None


def _metrics_stamp(job: TrainJob) -> int | None:
    """Modification time (ns) of the run's metrics file, or None when there is none."""
    try:
        return Path(job.metrics_out).stat().st_mtime_ns if job.metrics_out else None
    except OSError:
        return None


def _stopped(
    job: TrainJob, signum: int, before: tuple[str, int] | None, metrics_before: int | None = None
) -> RunStopped:
    """The :class:`RunStopped` of a launch ended by ``signum``: the stop checkpoint is the
    newest checkpoint when it is new since ``before`` and its manifest records the stop;
    without one, the step is that of the metrics file's ``stop`` event when it is the file's
    last event and the file changed since ``metrics_before`` (its stamp at launch), so that a
    stop without ``--checkpoint-dir`` still names its step."""
    import signal

    from hetrain.runtime import checkpoint as ckpt

    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    now = _checkpoint_stamp(job)
    if now is not None and now != before:
        try:
            found = ckpt.read_checkpoint(now[0])
        except ckpt.CheckpointError:
            found = None
        if found is not None and found.manifest.get("stop"):
            return RunStopped(str(found.manifest["stop"]), found.step, str(found.path))
    stamp = _metrics_stamp(job)
    if stamp is not None and stamp != metrics_before:
        from hetrain.runtime.metrics import read_metrics

        events = read_metrics(job.metrics_out)
        if events and events[-1].get("event") == "stop":
            return RunStopped(str(events[-1].get("reason") or name), int(events[-1]["step"]), None)
    return RunStopped(name, None, None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RANK_ERRORS_FILE = "rank_errors.jsonl"
"""Every failed rank's full traceback, one JSON line each, in the run directory."""


def _errors_path(job: TrainJob) -> Path | None:
    return Path(job.run_dir) / RANK_ERRORS_FILE if job.run_dir else None


def _entry(job: TrainJob) -> dict[str, Any] | None:
    # forked from a process that has used torch: OpenMP's thread pool does not survive fork
    # (a parallel region in the child can hang), so forked ranks compute with one thread
    try:
        return run_worker(job, num_threads=1)
    except SystemExit:  # a graceful stop (SIGTERM), not a failure
        raise
    except BaseException as exc:
        record_rank_error(job, exc)
        raise


def record_rank_error(job: TrainJob, exc: BaseException) -> None:
    """Append this rank's failure (time, rank, device, layer being computed, one-line error,
    full traceback) to ``{run_dir}/rank_errors.jsonl`` (one ``write`` of one line: lines of
    concurrent ranks do not interleave)."""
    import traceback

    from hetrain.runtime.worker_main import current_layer

    path = _errors_path(job)
    if path is None:
        return
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "time_s": time.time(),
        "rank": rank,
        "device": job.devices[rank] if rank < len(job.devices) else None,
        "layer": current_layer(),
        "error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:1000],
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


_CONSEQUENCES = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "signalexception",  # the agent terminating the survivors of a failed rank
    "got signal",
)


def first_failure(path: Path, since_s: float = 0.0) -> str | None:
    """The one line of the root cause among the recorded rank failures: the earliest failure
    that is not a consequence of another (a lost connection to a peer, a timeout, the agent's
    SIGTERM); ``rank R (device), layer L (Class): Error: message``. None when there is no such
    record (a rank that exited without an exception, e.g. its watchdog: the caller then uses
    the elastic agent's record)."""
    if not path.is_file():
        return None
    rows = [row for row in read_jsonl(path) if float(row.get("time_s", 0.0)) >= since_s]
    if not rows:
        return None
    rows.sort(key=lambda r: r["time_s"])
    own = [r for r in rows if not any(c in r["error"].lower() for c in _CONSEQUENCES)]
    if not own:  # only consequences recorded (e.g. a rank ended by its watchdog): the agent's
        return None  # own record of the first failure is the better line
    row = own[0]
    if row["error"].startswith("NonFiniteError: "):  # names its own rank and stage
        return f"{row['error'].split(': ', 1)[1]} (tracebacks of all ranks: {path})"
    where = f"rank {row['rank']} ({row['device']})"
    if row.get("layer"):
        where += f", layer {row['layer']}"
    return f"{where}: {row['error']} (tracebacks of all ranks: {path})"


def launch(
    job: TrainJob,
    nproc_per_node: int,
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
    rdzv_timeout_s: float = 60.0,
) -> dict[str, Any] | None:
    """Run ``job`` on ``nnodes * nproc_per_node`` ranks; returns rank 0's summary (None on a
    node that does not hold rank 0).

    Args:
        rdzv_timeout_s: seconds to reach the rendezvous store at ``rdzv_endpoint`` and to
            join the rendezvous (torch's c10d ``read_timeout`` and ``join_timeout``).

    Raises:
        LaunchError: a rank failed (message: rank and root-cause exception, one line), or the
            rendezvous could not be joined within ``rdzv_timeout_s`` (naming the endpoint).
        RunStopped: SIGTERM or SIGINT stopped the run.
    """
    if nnodes == 1 and nproc_per_node == 1:
        return _run_in_process(job)
    controller = None
    if job.adaptive and job.controller_endpoint is None:
        # the controller runs here, in the launching process, beside the store it hosts;
        # rank 0 posts each step's measurements and reads its decisions (hetrain.runtime.adapt)
        from hetrain.runtime.adapt import ControllerThread

        controller = ControllerThread().start()
        job = dataclasses.replace(job, controller_endpoint=controller.endpoint)
    try:
        return _launch(
            job, nproc_per_node, nnodes, rdzv_endpoint, run_id, max_restarts, rdzv_timeout_s
        )
    finally:
        if controller is not None:
            controller.close()


def _rendezvous_problem(endpoint: str, timeout_s: float) -> str | None:
    """Why the c10d rendezvous store at ``endpoint`` (``HOST:PORT``) cannot be used, or None.

    On this machine with the port free, the elastic agent will host the store: None. Else a
    store must answer there: a ``TCPStore`` client is tried in a daemon thread for at most
    ``timeout_s`` seconds (torch's own client waits forever on a port held by a program that is
    not a store, whatever its timeout)."""
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    host, _, port_text = endpoint.rpartition(":")
    port = int(port_text)
    if _matches_machine_hostname(host):
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return None  # free: the agent hosts the store here
            except OSError:
                pass
    answer: list[str | None] = []

    def attempt() -> None:
        try:
            TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            answer.append(None)
        except Exception as exc:  # noqa: BLE001 - reported as the one line
            answer.append(" ".join(str(exc).split()).split(" Exception raised from")[0][:200])

    probe = threading.Thread(target=attempt, name="hetrain-rdzv-probe", daemon=True)
    probe.start()
    probe.join(timeout_s)
    if not answer:
        return f"no rendezvous store answered within --rdzv-timeout {timeout_s:g} s"
    return answer[0]


_QUIET_LOGGERS = ("torch.distributed", "torch.multiprocessing")


def _launch(job, nproc_per_node, nnodes, rdzv_endpoint, run_id, max_restarts, rdzv_timeout_s):
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    endpoint = rdzv_endpoint or f"127.0.0.1:{free_port()}"
    timeout_s = max(1, math.ceil(rdzv_timeout_s))  # torch wants whole seconds
    if rdzv_endpoint is not None:
        problem = _rendezvous_problem(endpoint, rdzv_timeout_s)
        if problem is not None:
            raise LaunchError(
                f"rendezvous at {endpoint} cannot be joined: {problem}; is another program "
                "using that port?"
            )
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc_per_node,
        run_id=run_id or f"hetrain-{uuid.uuid4().hex[:8]}",
        rdzv_endpoint=endpoint,
        rdzv_backend="c10d",
        rdzv_configs={"join_timeout": timeout_s, "read_timeout": timeout_s},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="fork",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A fresh worker store per round, hosted by the round's rank 0. With torch's default (the
    # agent's store shared across rounds) the ranks of a restarted round read the previous
    # round's gloo addresses and fail with "connectFullMesh ... Connection refused", so
    # --max-restarts never recovered (issue 6; see docs/reliability.md).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    import logging

    started = time.time()
    before = _checkpoint_stamp(job)
    metrics_before = _metrics_stamp(job)
    # the elastic agent logs a multi-line report of every failed child, and torch's process
    # context a "Terminating process ... via signal SIGTERM" line for every rank still alive
    # when another failed; the root cause is reported below in one line (rank_errors.jsonl
    # keeps every traceback). torch's loggers have their own levels: each is set, not only
    # the parents, and the process context's is created here if not imported yet.
    import torch.multiprocessing.spawn  # noqa: F401  (creates its logger)

    quiet = [
        logging.getLogger(n)
        for n in sorted(logging.root.manager.loggerDict)
        if any(n == p or n.startswith(p + ".") for p in _QUIET_LOGGERS)
    ]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, _entry)(job)
    except ChildFailedError as exc:
        raise LaunchError(_failure_line(job, started) or _root_cause(exc)) from None
    except RendezvousError as exc:
        # the store at the endpoint is not reachable (another program holds the port, a
        # firewall) or the other nodes did not come: one line naming the endpoint
        cause = exc.__cause__ or exc.__context__
        detail = " ".join(str(cause or exc).split())[:200]
        raise LaunchError(
            f"rendezvous at {endpoint} could not be joined within --rdzv-timeout "
            f"{rdzv_timeout_s:g} s ({type(exc).__name__}: {detail}); are the other nodes "
            "started?"
        ) from None
    except SignalException as exc:
        # SIGTERM/SIGINT to this process (or Ctrl-C to the whole group): the agent forwarded it
        # to the ranks, which wrote the stop checkpoint and exited; one line, no traceback
        raise _stopped(job, int(exc.sigval), before, metrics_before) from None
    finally:
        for lg, level in zip(quiet, levels, strict=True):
            lg.setLevel(level)
    return results.get(0)


def _failure_line(job: TrainJob, since_s: float) -> str | None:
    """:func:`first_failure` of the run's ``rank_errors.jsonl`` since ``since_s`` (None
    without a run folder or a usable record)."""
    path = _errors_path(job)
    return first_failure(path, since_s) if path is not None else None


def _root_cause(exc: Any) -> str:
    """One line from an elastic ``ChildFailedError``: the first failed rank and its error."""
    try:
        rank, failure = exc.get_first_failure()
        message = ""
        if failure.error_file and Path(failure.error_file).is_file():
            data = json.loads(Path(failure.error_file).read_text())
            message = data.get("message", {}).get("message", "") or str(data.get("message", ""))
        if not message:
            message = f"exit code {failure.exitcode}"
        first = message.strip().splitlines()[-1] if message.strip() else message
        return f"rank {rank} failed: {first}"
    except Exception:  # never let error formatting hide the failure
        return " ".join(str(exc).split())[:500]


def _run_in_process(job: TrainJob) -> dict[str, Any] | None:
    """A single rank in this process over a ``file://`` store in a temporary folder: NCCL on
    the current GPU when CUDA is present, else gloo."""
    if dist.is_initialized():
        return run_worker(job)
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one GPU: CUDA placement, NCCL collectives (of one rank)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from hetrain.errors import InputError

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="hetrain-") as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            return run_worker(job)
        except TrainingStopped as stop:
            raise RunStopped(stop.signal_name, stop.step, stop.path) from None
        except (InputError, SystemExit, KeyboardInterrupt):
            raise
        except Exception as exc:
            # as with several ranks: one line, the traceback in rank_errors.jsonl (it was the
            # whole traceback on the console, exit 1, and no record)
            record_rank_error(job, exc)
            first = (str(exc).strip().splitlines() or [""])[0]
            line = _failure_line(job, started) or f"rank 0 failed: {type(exc).__name__}: {first}"
            raise LaunchError(line) from None
        finally:
            dist.destroy_process_group()


def under_torchrun() -> bool:
    """True inside a process started by ``torchrun`` (or the elastic agent): then ``hetrain
    train`` runs the rank itself instead of launching."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def torchrun_world() -> tuple[int, int]:
    """``(rank, world_size)`` of a process started by torchrun."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
