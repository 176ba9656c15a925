"""Elastic membership: devices that vanish or join mid-run, on torchrun's elastic agent, running
``hetrain train``'s per-rank loop (:mod:`hetrain.runtime.worker_main`, the only one).

One torchrun agent per device (``--nnodes MIN:MAX --nproc-per-node 1``, c10d rendezvous), so
losing an agent is losing a device. The rendezvous store is hosted by
:class:`ElasticController` (e.g. a test, ``bench/soak.py``, or a small launcher on the
controller host), not by an agent, so any agent may die. Each round of the rendezvous runs
``python -m hetrain train ...`` on every member:

1. :func:`gather_device_ids`: ``init_process_group`` and all-gather the device ids of this round
   (``HETRAIN_DEVICE_ID`` of each agent); ``--cluster`` is restricted to them, ``--plan`` is
   used while it names exactly them;
2. the trainer loads the latest valid checkpoint (:mod:`hetrain.runtime.checkpoint`) and
   resumes at its step, under a plan for this round's devices (the next ``plan_id``), and
   records the membership change in the metrics (``restart`` event: ``lost_devices``,
   ``joined_devices``, ``resumed_from_step``, ``redone_steps``);
3. it trains, beating the watchdog every step and checkpointing every ``--checkpoint-every``
   steps. Each step's all-gather of measurements carries every rank's stop request
   (SIGTERM: a spot warning, or the agent restarting the group because a device joins); on one,
   all ranks checkpoint at that same step and exit (143 for the rank that got SIGTERM, 75 for
   the others), so a graceful departure or a join loses no step.

A rank that dies (SIGKILL) breaks the others' collectives; their agents restart them
(``--max-restarts``), the new round has the surviving devices, and step 2 resumes (the steps
after the last checkpoint are redone: at most ``--checkpoint-every``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetrain.errors import InputError


def _device_id() -> str:
    ids = [s for s in os.environ.get("HETRAIN_DEVICE_ID", "").split(",") if s]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not ids:
        return f"w{os.environ.get('RANK', '0')}"
    return ids[local] if local < len(ids) else f"{ids[-1]}-{local}"


def elastic_device_ids_given() -> bool:
    """True in a rank started by an :class:`ElasticController` agent (``HETRAIN_DEVICE_ID``)."""
    return bool(os.environ.get("HETRAIN_DEVICE_ID"))


def gather_device_ids(hang_timeout_s: float | None = None) -> list[str]:
    """Start the round's process group (gloo; collective timeout ``hang_timeout_s`` if given)
    and all-gather every rank's device id (index = rank): the devices of this round.

    Raises:
        InputError: two agents claim the same device id.
    """
    import torch.distributed as dist

    from hetrain.runtime.watchdog import process_group_timeout

    if not dist.is_initialized():
        kwargs = {"timeout": process_group_timeout(hang_timeout_s)} if hang_timeout_s else {}
        dist.init_process_group("gloo", **kwargs)
    ids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ids, _device_id())
    if len(set(ids)) != len(ids):
        raise InputError("HETRAIN_DEVICE_ID", "", f"expected unique device ids, got {ids}")
    return [str(d) for d in ids]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """Child processes of ``pid``, recursively (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@dataclass
class ElasticController:
    """Hosts the rendezvous store and runs one torchrun agent per device on this machine.

    Args:
        worker_args: arguments of ``python -m hetrain`` (``["train", "--example", "digits",
            ...]``; ``--plan``, ``--cluster`` and ``--trace`` work as in any run).
        min_devices, max_devices: ``--nnodes MIN:MAX``.
        max_restarts: ``--max-restarts`` of each agent (failures, not joins).
        log_dir: each agent's stdout/stderr go to ``log_dir/agent-{device}-{n}.log``.
        last_call_s: how long a round waits for more devices once ``min_devices`` joined.
        env: extra environment for the agents.
        worker_module: what each rank runs (``python -m``); ``hetrain`` (the trainer).
    """

    worker_args: list[str]
    min_devices: int
    max_devices: int
    max_restarts: int
    log_dir: Path
    last_call_s: int = 2
    env: dict[str, str] = field(default_factory=dict)
    run_id: str = "hetrain"
    worker_module: str = "hetrain"
    port: int = 0
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)
    _store: Any = None
    _starts: int = 0

    def start_store(self) -> None:
        """Host the c10d rendezvous store on 127.0.0.1 (a free port)."""
        import datetime

        import torch.distributed as dist

        for _ in range(20):
            self.port = free_port()
            try:
                self._store = dist.TCPStore(
                    "127.0.0.1", self.port, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=30),
                )  # fmt: skip
                return
            except RuntimeError:
                continue
        raise RuntimeError("could not host the rendezvous store on 127.0.0.1")

    def agent_argv(self) -> list[str]:
        conf = (
            f"is_host=false,join_timeout=120,last_call_timeout={self.last_call_s},"
            "close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
        )
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.min_devices}:{self.max_devices}", "--nproc-per-node=1",
            f"--max-restarts={self.max_restarts}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}", "--monitor-interval=0.2", "--local-addr=127.0.0.1",
            "-m", self.worker_module, *self.worker_args,
        ]  # fmt: skip

    def add_device(self, device: str) -> subprocess.Popen:
        """Start the agent of ``device`` (its own session, so it can be killed as a unit)."""
        if self._store is None:
            self.start_store()
        env = dict(os.environ)
        env.update(self.env)
        env["HETRAIN_DEVICE_ID"] = device
        env.setdefault("OMP_NUM_THREADS", "1")
        # torch shares the rank-0 agent's store with the workers, but agents that were not
        # rank 0 keep the old address when rank 0 changes after a membership change (workers of
        # one round then meet in different stores, or find stale keys). A fresh store per
        # round, hosted by the round's rank-0 worker, avoids it.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._starts += 1
        log = open(self.log_dir / f"agent-{device}-{self._starts}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            self.agent_argv(), stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        self.agents[device] = proc
        return proc

    def kill_device(self, device: str, sig: int = signal.SIGKILL) -> None:
        """Lose ``device`` without warning: ``sig`` to its agent and its worker(s)."""
        proc = self.agents.pop(device)
        pids = [proc.pid, *_descendants(proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def alive(self) -> list[str]:
        return [d for d, p in self.agents.items() if p.poll() is None]

    def wait(self, timeout_s: float) -> dict[str, int | None]:
        """Wait until every agent exits (or ``timeout_s``); returns their exit codes."""
        deadline = time.monotonic() + timeout_s
        for proc in self.agents.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return {d: p.poll() for d, p in self.agents.items()}

    def close(self) -> None:
        """Kill every agent and worker left (cleanup; idempotent)."""
        for device in list(self.agents):
            with contextlib.suppress(Exception):
                self.kill_device(device)
        self._store = None

    def __enter__(self) -> ElasticController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def elastic_run(**kwargs: Any) -> Iterator[ElasticController]:
    """``with elastic_run(...) as ctl:`` — an :class:`ElasticController` closed on exit."""
    ctl = ElasticController(**kwargs)
    try:
        yield ctl
    finally:
        ctl.close()
