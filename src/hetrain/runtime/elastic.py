"""Elastic membership: devices that vanish or join mid-run (issue 6), on torchrun's elastic agent.

One torchrun agent per device (``--nnodes MIN:MAX --nproc-per-node 1``, c10d rendezvous), so
losing an agent is losing a device. The rendezvous store is hosted by the controller
(:class:`ElasticController`, e.g. ``hetrain train`` or a test), not by an agent, so any agent may
die. Each round of the rendezvous runs :func:`worker_main` on every member:

1. ``init_process_group`` (gloo, collective timeout = the hang timeout), all-gather the device
   ids of this round (``HETRAIN_DEVICE_ID`` of each agent);
2. rank 0 plans for exactly these devices (:func:`planned_for_devices`) and broadcasts the
   plan with the next ``plan_id``, and records the membership change in the metrics JSONL
   (``{"event": "restart", "plan_id": ..., "lost_devices": [...], ...}``);
3. load the latest valid checkpoint (:mod:`hetrain.runtime.checkpoint_io`) and resume at its
   step: the data order is a pure function of (seed, step), so no sample is skipped and the
   samples of the steps after that checkpoint are redone (at most ``checkpoint_every``: a kill
   during a checkpoint write falls back to the previous one);
4. train, beating a :class:`~hetrain.runtime.watchdog.Watchdog` every step and checkpointing
   every ``checkpoint_every`` steps. After every step the ranks agree (one all-reduce of a flag)
   whether any rank was asked to stop (SIGTERM: a spot warning, or the agent restarting the
   group because a device joins); if so all ranks checkpoint at that same step and exit, so a
   graceful departure or a join loses no step.

A rank that dies (SIGKILL) breaks the others' collectives; their agents restart them
(``--max-restarts``), the new round has the surviving devices, and step 3 resumes. A device that
joins is admitted by the agents at the next round (torchrun restarts the group when nodes are
waiting) and used by the plan of that round.

Each round is planned by :func:`hetrain.planner.best_plan` for its devices (the cluster file
restricted to them, or equal emulated devices) and run by the engine
(:class:`hetrain.runtime.engine.Worker`) on a small deterministic regression task, so that the
restart mechanics are testable in seconds; ``--executor dp`` uses a built-in data-parallel
executor instead (no planner, no engine). ``hetrain train`` itself runs on these agents too
(``ElasticController(worker_module="hetrain", worker_args=["train", ...])``): its ranks take
their device ids from :func:`gather_device_ids`. Checkpoint keys follow the engine's
``layer_state_dict`` format (``layers.{l}.{name}``, ``optim.{l}.{name}.{state}``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetrain.errors import InputError

EXIT_STOPPED_BY_PEER = 75
"""Exit status of a rank that stopped because another rank was asked to stop (EX_TEMPFAIL): its
agent restarts it into the next round."""
EXIT_STOPPED = 143
"""Exit status of a rank that stopped after its own SIGTERM (128 + 15)."""
MEMBERSHIP_FILE = "membership.json"
STOP_GRACE_S = 5.0
"""Seconds a rank asked to stop (SIGTERM) waits for its peers to agree before it just exits."""


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElasticConfig:
    """Options of an elastic training run (validated in :meth:`validate`).

    Attributes:
        steps: iterations to complete in total.
        batch: global batch ``B`` (samples per iteration).
        checkpoint_dir: where checkpoints, ``membership.json`` live (shared by all ranks).
        checkpoint_every: checkpoint after every this many steps (>= 1).
        metrics_out: JSONL file written by rank 0 (appended across rounds).
        seed: model initialisation and data order.
        lr, momentum: SGD parameters.
        hang_timeout_s: a rank without progress for this long is failed (watchdog and
            collective timeout), seconds.
        min_step_time_s: pad each step to at least this long (emulates a slower device; tests
            use it to have time to kill a device mid-run), seconds.
        cluster: optional cluster file: shares proportional to ``tflops``; else equal shares.
        keep: checkpoints kept on disk.
        executor: ``"engine"`` (default): the planner's best plan for the round's devices
            (:func:`hetrain.planner.best_plan`, any mix of pipelines and data parallelism), run
            by :class:`hetrain.runtime.engine.Worker`; ``"dp"``: the built-in data-parallel
            executor with shares proportional to speed (no planner, no engine).
    """

    steps: int
    batch: int
    checkpoint_dir: Path
    checkpoint_every: int = 10
    metrics_out: Path | None = None
    seed: int = 0
    lr: float = 0.05
    momentum: float = 0.9
    hang_timeout_s: float = 60.0
    min_step_time_s: float = 0.0
    cluster: Path | None = None
    keep: int = 2
    executor: str = "engine"

    def validate(self) -> ElasticConfig:
        """Raises :class:`InputError` (one line, exit 2) for a bad option."""
        for name, lo in (("steps", 1), ("batch", 1), ("checkpoint_every", 1), ("keep", 1)):
            if int(getattr(self, name)) < lo:
                raise InputError(f"--{name.replace('_', '-')}", "", f"expected >= {lo}")
        if self.executor not in ("engine", "dp"):
            raise InputError("--executor", "", f"expected engine or dp, got {self.executor!r}")
        for name in ("lr", "momentum", "hang_timeout_s", "min_step_time_s"):
            v = float(getattr(self, name))
            if not math.isfinite(v) or v < 0 or (name == "hang_timeout_s" and v == 0):
                raise InputError(f"--{name.replace('_', '-')}", "", f"expected >= 0, got {v}")
        return self


def _parse_args(argv: Sequence[str] | None) -> ElasticConfig:
    p = argparse.ArgumentParser(prog="python -m hetrain.runtime.elastic")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--metrics-out", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hang-timeout", type=float, default=60.0, dest="hang_timeout_s")
    p.add_argument("--min-step-time", type=float, default=0.0, dest="min_step_time_s")
    p.add_argument("--cluster", type=Path, default=None)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--executor", default="engine", choices=["engine", "dp"])
    a = p.parse_args(argv)
    return ElasticConfig(**vars(a)).validate()


# ---------------------------------------------------------------------------------------------
# the task: a small deterministic regression, data order a pure function of (seed, step)
# ---------------------------------------------------------------------------------------------

DATASET_SIZE = 1536
IN_FEATURES = 16
OUT_FEATURES = 4


def build_model(seed: int):
    """The toy chain (5 layers, ``nn.Sequential``), same weights for the same seed."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, OUT_FEATURES),
    )  # fmt: skip


class Dataset:
    """Fixed synthetic regression data (``DATASET_SIZE`` samples) and a deterministic order:
    the global batch of step ``t`` is positions ``[t B, (t+1) B)`` of the concatenation of
    per-epoch permutations (epoch ``e`` shuffled with seed ``seed * 1000 + e``)."""

    def __init__(self, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(10_000 + seed)
        self.x = torch.randn(DATASET_SIZE, IN_FEATURES, generator=g)
        w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=g)
        self.y = torch.tanh(self.x @ w) + 0.05 * torch.randn(
            DATASET_SIZE, OUT_FEATURES, generator=g
        )
        self.seed = seed
        self._perm: dict[int, Any] = {}

    def indices(self, step: int, batch: int) -> list[int]:
        """Sample indices of the global batch of ``step`` (0-based)."""
        import torch

        out: list[int] = []
        for pos in range(step * batch, (step + 1) * batch):
            epoch, i = divmod(pos, DATASET_SIZE)
            if epoch not in self._perm:
                g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
                self._perm = {epoch: torch.randperm(DATASET_SIZE, generator=g).tolist()}
            out.append(self._perm[epoch][i])
        return out

    def batch(self, step: int, batch: int):
        idx = self.indices(step, batch)
        return self.x[idx], self.y[idx]


# ---------------------------------------------------------------------------------------------
# plans for the devices of a round
# ---------------------------------------------------------------------------------------------


def plan_for_devices(
    devices: Sequence[str], batch: int, num_layers: int, speeds: dict[str, float] | None = None
):
    """The data-parallel plan of a round: one group per device (in ``devices`` order), all
    layers, shares proportional to speed (largest remainders, ties to the earlier device), so
    the same devices always get the same plan.

    Raises:
        ValueError: no devices, or ``batch < 1``.
    """
    from hetrain.plan import plan_from_dict

    if not devices or batch < 1:
        raise ValueError("plan_for_devices: expected >= 1 device and batch >= 1")
    w = [float((speeds or {}).get(d, 1.0)) for d in devices]
    total = sum(w)
    exact = [batch * x / total for x in w]
    shares = [math.floor(e) for e in exact]
    order = sorted(range(len(devices)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: batch - sum(shares)]:
        shares[i] += 1
    groups = [
        {"devices": [d], "stages": [[0, num_layers]], "microbatch_size": max(b, 1), "batch": b}
        for d, b in zip(devices, shares, strict=True)
    ]
    return plan_from_dict({"groups": groups}, "<elastic plan>")


def cluster_state_for(devices: Sequence[str], cluster: Path | None):
    """The SPEC §2 cluster state of a round: the cluster file with only ``devices`` available,
    or (no file) equal emulated devices in sorted id order: 1 MFLOP/s (``tflops: 1e-6``, so that
    the toy model's compute, not link latency, dominates the plan), 16 GiB, 10 Gbit/s, 1 ms per
    micro-batch.

    Raises:
        InputError: a device of the round is not in the cluster file.
    """
    import numpy as np

    from hetrain.cluster import cluster_from_dict, load_cluster

    if cluster is None:
        spec = cluster_from_dict(
            {"devices": [{"id": d, "tflops": 1e-6, "memory_gib": 16, "nic_gbps": 10,
                          "microbatch_overhead_ms": 1.0} for d in sorted(devices)]},
            "<elastic cluster>",
        )  # fmt: skip
    else:
        spec = load_cluster(cluster)
        unknown = sorted(set(devices) - set(spec.ids))
        if unknown:
            raise InputError(str(cluster), "devices", f"expected device ids {unknown} in it")
    state = spec.state()
    return state.with_changes(available=np.array([d in set(devices) for d in state.ids]))


def planned_for_devices(devices: Sequence[str], model, batch: int, cluster: Path | None):
    """The planner's best plan (SPEC §4, minimum iteration time) for the round's devices and
    the model's measured profile (:func:`hetrain.profiler.chain.profile_chain`)."""
    import torch

    from hetrain.costmodel import TrainingConfig
    from hetrain.planner import best_plan
    from hetrain.profiler.chain import profile_chain

    probe = copy.deepcopy(model)  # profiling runs backward: keep the model's grads untouched
    profile = profile_chain(probe, torch.zeros(2, IN_FEATURES), name="elastic-toy").arrays()
    state = cluster_state_for(devices, cluster)
    # the engine overlaps the gradient all-reduce with the last backward (GradientSync)
    config = TrainingConfig(batch=batch, optimizer_state_factor=1.0, sync_overlap=True)
    return best_plan(state, profile, config)


def _mse(out, target):
    return ((out - target) ** 2).mean(dim=1).mean()


class EngineExecutor:
    """Runs any plan with :class:`hetrain.runtime.engine.Worker` (SGD with momentum, mean
    squared error); state dicts in the engine's ``layer_state_dict`` format."""

    def __init__(self, model, plan, device_id: str, lr: float, momentum: float) -> None:
        from hetrain.runtime.engine import Worker
        from hetrain.runtime.optim import OptimizerSpec

        self.worker = Worker(
            model, plan, device_id, _mse, OptimizerSpec(name="sgd", lr=lr, momentum=momentum),
            allow_unused_ranks=True,
        )  # fmt: skip

    def step(self, x, y, step: int) -> float:
        return float(self.worker.step(x, y, step).loss)

    def state_dict(self, canonical: bool) -> dict[str, Any]:  # noqa: ARG002 - engine dedups
        return self.worker.layer_state_dict()

    def wanted(self, key: str) -> bool:
        parts = key.split(".")
        return len(parts) > 2 and parts[1].isdigit() and int(parts[1]) in self.worker.owned_layers

    def load(self, tensors: dict[str, Any]) -> None:
        self.worker.load_layer_state_dict(tensors)


class DataParallelExecutor:
    """Executes a pure data-parallel plan on the ranks of the current process group: rank ``r``
    (device ``devices[r]``) computes the summed loss of its rows of the global batch, gradients
    are all-reduced (one flat buffer) and divided by ``B``, then SGD with momentum steps. The
    update equals single-device SGD on the whole batch (up to float summation order)."""

    def __init__(self, model, plan, device_id: str, lr: float, momentum: float) -> None:
        import torch

        self.model = model
        self.device_id = device_id
        self.plan = plan
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        offset = 0
        self.rows = (0, 0)
        for g in plan.groups:
            if g.devices[0] == device_id:
                self.rows = (offset, offset + g.batch)
            offset += g.batch
        self.batch = offset

    def wanted(self, key: str) -> bool:  # noqa: ARG002 - every rank holds every layer
        return True

    def step(self, x, y, step: int) -> float:  # noqa: ARG002
        import torch
        import torch.distributed as dist

        lo, hi = self.rows
        self.opt.zero_grad(set_to_none=False)
        if hi > lo:
            out = self.model(x[lo:hi])
            loss_sum = ((out - y[lo:hi]) ** 2).mean(dim=1).sum()
            (loss_sum / self.batch).backward()
            local = float(loss_sum.detach())
        else:
            local = 0.0
        params = list(self.model.parameters())
        flat = torch.cat(
            [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params]
            + [torch.tensor([local])]
        )
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        self.opt.step()
        return float(flat[-1]) / self.batch

    def state_dict(self, canonical: bool) -> dict[str, Any]:
        """Engine-format keys; only the canonical owner (rank 0) returns tensors."""
        if not canonical:
            return {}
        out = {f"layers.{k}": v for k, v in self.model.state_dict().items()}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p, st in self.opt.state.items():
            for key, value in st.items():
                if hasattr(value, "shape"):
                    out[f"optim.{names[id(p)]}.{key}"] = value
        return out

    def load(self, tensors: dict[str, Any]) -> None:
        import torch

        self.model.load_state_dict(
            {k[len("layers.") :]: v for k, v in tensors.items() if k.startswith("layers.")}
        )
        params = dict(self.model.named_parameters())
        for k, v in tensors.items():
            if k.startswith("optim."):
                pname, key = k[len("optim.") :].rsplit(".", 1)
                self.opt.state[params[pname]][key] = torch.as_tensor(v).clone()


# ---------------------------------------------------------------------------------------------
# metrics and membership (rank 0)
# ---------------------------------------------------------------------------------------------


def append_jsonl(path: Path | None, record: dict[str, Any]) -> None:
    """Append one JSON line (flushed); a line cut by an earlier crash is terminated first."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() > 0:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
        fh.write((json.dumps(record, sort_keys=True) + "\n").encode())
        fh.flush()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete JSON lines of a metrics file (a truncated line from a crash is skipped)."""
    out = []
    if not Path(path).exists():
        return out
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict):
                out.append(rec)
    return out


def _read_membership(root: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((root / MEMBERSHIP_FILE).read_text())
        if isinstance(data, dict):
            return data
    return {}


def _write_membership(root: Path, data: dict[str, Any]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    part = root / (MEMBERSHIP_FILE + ".part")
    part.write_text(json.dumps(data, sort_keys=True))
    os.replace(part, root / MEMBERSHIP_FILE)


# ---------------------------------------------------------------------------------------------
# the worker (one per rank, started by torchrun)
# ---------------------------------------------------------------------------------------------


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


def _speeds(cluster: Path | None) -> dict[str, float]:
    if cluster is None:
        return {}
    from hetrain.cluster import load_cluster

    return {d.id: d.tflops for d in load_cluster(cluster).devices}


def worker_main(config: ElasticConfig) -> int:
    """One rank of one round; see the module docstring. Returns the exit status."""
    import torch
    import torch.distributed as dist

    from hetrain.runtime.checkpoint_io import (
        load_latest,
        load_tensors,
        model_fingerprint,
        save_checkpoint,
    )
    from hetrain.runtime.watchdog import Watchdog, process_group_timeout

    torch.set_num_threads(1)
    stop_requested = {"flag": False}

    def on_term(signum, frame):  # noqa: ARG001
        # stop after the current step (all ranks agree, checkpoint, exit); if the step cannot
        # finish (a peer is gone), leave anyway after a short grace period
        stop_requested["flag"] = True
        timer = threading.Timer(STOP_GRACE_S, os._exit, (EXIT_STOPPED,))
        timer.daemon = True
        timer.start()

    dist.init_process_group("gloo", timeout=process_group_timeout(config.hang_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device_id()
    devices: list[Any] = [None] * world
    dist.all_gather_object(devices, device)
    if len(set(devices)) != len(devices):
        raise InputError("HETRAIN_DEVICE_ID", "", f"expected unique device ids, got {devices}")
    restart_counts: list[Any] = [None] * world
    dist.all_gather_object(restart_counts, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    speeds = _speeds(config.cluster)
    model = build_model(config.seed)
    num_layers = len(model)
    fingerprint = model_fingerprint(model, task="elastic-toy", seed=config.seed)
    root = Path(config.checkpoint_dir)
    info = load_latest(root, fingerprint=fingerprint)  # every rank validates the same files
    start = info.step if info is not None else 0

    # rank 0: the plan, its id, the membership change, metrics
    header: list[Any] = [None, None]
    if rank == 0:
        if config.executor == "engine":
            plan = planned_for_devices(devices, model, config.batch, config.cluster)
        else:
            plan = plan_for_devices(devices, config.batch, num_layers, speeds)
        prev = _read_membership(root)
        plan_id = int(prev.get("plan_id", -1)) + 1
        old = list(prev.get("devices", []))
        logged = [
            r["step"] for r in read_jsonl(config.metrics_out or Path("/nonexistent"))
            if r.get("event") == "step"
        ]  # fmt: skip
        done_before = max(logged) + 1 if logged else 0
        event = "restart" if prev else ("resume" if info is not None else "start")
        record = {
            "event": event,
            "plan_id": plan_id,
            "devices": devices,
            "world_size": world,
            "lost_devices": sorted(set(old) - set(devices)),
            "joined_devices": sorted(set(devices) - set(old)) if prev else [],
            "resumed_from_step": start,
            "steps_done_before": done_before,
            "redone_steps": max(done_before - start, 0),
            "restart_count": max(restart_counts),
            "time": time.time(),
        }
        _write_membership(root, {"plan_id": plan_id, "devices": devices, "step": start})
        append_jsonl(config.metrics_out, record)
        append_jsonl(
            config.metrics_out,
            {"event": "plan", "plan_id": plan_id, "step": start, "executor": config.executor,
             "plan": plan.model_copy(update={"plan_id": plan_id}).to_json_dict()},
        )  # fmt: skip
        header = [plan_id, plan.model_copy(update={"plan_id": plan_id}).to_json_dict()]
    dist.broadcast_object_list(header, src=0)
    plan_id = header[0]
    from hetrain.plan import plan_from_dict

    plan = plan_from_dict(header[1], "<round plan>")
    if config.executor == "engine":
        executor: Any = EngineExecutor(model, plan, device, config.lr, config.momentum)
    else:
        executor = DataParallelExecutor(model, plan, device, config.lr, config.momentum)
    if info is not None:
        executor.load(load_tensors(info, executor.wanted))
    data = Dataset(config.seed)
    flag = torch.zeros(1)
    # until here SIGTERM kills at once (nothing to save); from here a stop is graceful
    signal.signal(signal.SIGTERM, on_term)
    exit_code = 0
    wd = Watchdog(config.hang_timeout_s, rank=rank)
    with wd:
        for step in range(start, config.steps):
            t0 = time.perf_counter()
            x, y = data.batch(step, config.batch)
            loss = executor.step(x, y, step)
            pad = config.min_step_time_s - (time.perf_counter() - t0)
            if pad > 0:
                time.sleep(pad)
            if rank == 0:
                append_jsonl(
                    config.metrics_out,
                    {"event": "step", "step": step, "loss": loss, "plan_id": plan_id,
                     "world_size": world, "time": time.time()},
                )  # fmt: skip
            wd.beat(step)
            flag[0] = 1.0 if stop_requested["flag"] else 0.0
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            done = step + 1
            stopping = bool(flag[0] > 0)
            if done % config.checkpoint_every == 0 or done == config.steps or stopping:
                with wd.suspended():
                    save_checkpoint(
                        root, done, executor.state_dict(rank == 0), fingerprint=fingerprint,
                        meta={"data_position": done * config.batch, "plan_id": plan_id,
                              "devices": devices},
                        process_group=dist.group.WORLD, keep=config.keep,
                    )  # fmt: skip
                if rank == 0:
                    append_jsonl(
                        config.metrics_out,
                        {"event": "checkpoint", "step": done, "time": time.time()},
                    )
            if stopping:
                exit_code = EXIT_STOPPED if stop_requested["flag"] else EXIT_STOPPED_BY_PEER
                if rank == 0:
                    append_jsonl(
                        config.metrics_out,
                        {"event": "stop", "step": done, "reason": "SIGTERM", "time": time.time()},
                    )
                break
        else:
            if rank == 0:
                append_jsonl(
                    config.metrics_out,
                    {"event": "end", "step": config.steps, "plan_id": plan_id, "time": time.time()},
                )
    dist.destroy_process_group()
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point under torchrun; bad options print one line and return 2."""
    try:
        config = _parse_args(argv)
    except InputError as exc:
        print(f"hetrain: error: {exc}", file=sys.stderr)
        return 2
    return worker_main(config)


# ---------------------------------------------------------------------------------------------
# the controller side: one torchrun agent per device, store hosted here
# ---------------------------------------------------------------------------------------------


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
        worker_args: arguments of ``python -m hetrain.runtime.elastic`` (``--steps`` ...).
        min_devices, max_devices: ``--nnodes MIN:MAX``.
        max_restarts: ``--max-restarts`` of each agent (failures, not joins).
        log_dir: each agent's stdout/stderr go to ``log_dir/agent-{device}-{n}.log``.
        last_call_s: how long a round waits for more devices once ``min_devices`` joined.
        env: extra environment for the agents.
        worker_module: what each rank runs (``python -m``): this module's :func:`main` (the
            toy task), or ``"hetrain"`` with ``worker_args = ["train", ...]`` for
            ``hetrain train`` (devices = the agents present; no ``--plan``/``--cluster``).
    """

    worker_args: list[str]
    min_devices: int
    max_devices: int
    max_restarts: int
    log_dir: Path
    last_call_s: int = 2
    env: dict[str, str] = field(default_factory=dict)
    run_id: str = "hetrain"
    worker_module: str = "hetrain.runtime.elastic"
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


if __name__ == "__main__":
    sys.exit(main())
