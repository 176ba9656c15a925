"""Per-rank timelines of one ``bench/pipelining_peer.py`` case on both sides: when each rank
computes, sleeps (the emulated slow-down), waits for a message and posts one, per micro-batch.

Runs ``--runs`` alternated pairs of runs (hetrain, torch, ...) of the case (``slow-1f1b`` by
default: rank 1 3x slower) with the bench's own ranks (``pipelining_peer._rank``), each
instrumented in its process:

- compute: the window each side's emulation measures (hetrain: ``stages.run_stage``'s
  forward, loss included on the last stage, and ``autograd.backward``; torch:
  ``forward_maybe_with_nosync``, the loss function and ``backward_maybe_with_nosync``),
  i.e. the ``slow_down`` calls (every rank of both sides is given an ``Emulation``; factor 1
  sleeps nothing);
- sleep: the emulated slow-down (``slow_down``'s sleep);
- wait: blocked on a message (hetrain ``P2P.recv_tree``; torch ``_wait_batch_p2p`` of a batch
  holding a receive), and hetrain's ``P2P.wait_sends``;
- step: the rank's whole step (``Worker.step``; torch: the optimizer's zero_grad, the
  schedule's ``step`` and the optimizer steps).

Printed per side (medians over the timed steps of all runs), per rank: wall ms per step, and
of it compute, sleep, wait and the rest ("other": Python, packing, the optimizer, the step's
sums), and the rank's CPU ms per step; then the slow rank's critical path: the step's time
split into its own compute + sleep, its waits per peer (forward inputs from rank 0, gradients
from rank 2) and the rest; then one step's event list per rank (times in ms from the step's
start on rank 0).

Usage::

    PYTHONPATH=src python bench/peer_timeline.py --runs 3 --steps 30 --warmup 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import pipelining_peer as bench  # noqa: E402

_EVENTS: list[tuple] = []
"""(kind, label, t0, t1, c0, c1): wall times in perf_counter seconds (CLOCK_MONOTONIC, one
clock for every process), thread CPU seconds at both ends where measured (else 0)."""


def _record(kind: str, label: str, t0: float, t1: float, c0: float = 0.0, c1: float = 0.0):
    _EVENTS.append((kind, label, t0, t1, c0, c1))


def _instrument(out_dir: str) -> None:
    """Patch the hooks named in the module docstring (in the parent, before the ranks fork)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as sched_mod
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    import hetrain.runtime.emulation as emu
    import hetrain.runtime.stages as stages
    from hetrain.runtime import Worker

    orig_slow = emu.slow_down

    def slow_down(emulation, device, measured_s, microbatch=False, cpu_s=None):
        now = time.perf_counter()
        _record("compute", "", now - measured_s, now)
        if emulation is None or emulation.slowdown_of(device) < 1.0 + 1e-9:
            return 0.0  # an equal rank (given an Emulation only to be timed)
        slept = orig_slow(emulation, device, measured_s, microbatch=microbatch, cpu_s=cpu_s)
        if slept > 0:
            _record("sleep", "", now, time.perf_counter())
        return slept

    emu.slow_down = slow_down
    stages.slow_down = slow_down

    from torch.distributed.pipelining import PipelineStage

    from hetrain.runtime.cut_chains import SequentialChain

    def timed_kernel(kind, fn):
        def wrapper(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            out = fn(*args, **kwargs)
            _record(kind, "", t0, time.perf_counter(), c0, time.thread_time())
            return out

        return wrapper

    SequentialChain.stage_forward = timed_kernel("fwd", SequentialChain.stage_forward)
    PipelineStage.forward_maybe_with_nosync = timed_kernel(
        "fwd", PipelineStage.forward_maybe_with_nosync
    )
    torch.autograd.backward = timed_kernel("bwd", torch.autograd.backward)

    orig_recv = stages.P2P.recv_tree

    def recv_tree(self, src):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = orig_recv(self, src)
        _record("wait", f"recv<{src}", t0, time.perf_counter(), c0, time.thread_time())
        return out

    stages.P2P.recv_tree = recv_tree
    orig_send = stages.P2P.send_tree

    def send_tree(self, obj, dst):
        t0, c0 = time.perf_counter(), time.thread_time()
        orig_send(self, obj, dst)
        _record("post", f"send>{dst}", t0, time.perf_counter(), c0, time.thread_time())

    stages.P2P.send_tree = send_tree
    orig_wait_sends = stages.P2P.wait_sends

    def wait_sends(self):
        t0, c0 = time.perf_counter(), time.thread_time()
        orig_wait_sends(self)
        _record("wait", "sends", t0, time.perf_counter(), c0, time.thread_time())

    stages.P2P.wait_sends = wait_sends
    orig_step = Worker.step

    def worker_step(self, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = orig_step(self, *args, **kwargs)
        _record("step", "", t0, time.perf_counter(), c0, time.thread_time())
        return out

    Worker.step = worker_step

    # torch: every rank an EmulatedStage (factor 1: no sleep), its waits and posts
    orig_batch = sched_mod._batch_p2p

    def batch_p2p(ops, desc=None):
        if not ops:
            return []
        t0, c0 = time.perf_counter(), time.thread_time()
        works = orig_batch(ops, desc=desc)
        peers = ",".join(f"{'send>' if op.op is dist.isend else 'recv<'}{op.peer}" for op in ops)
        _record("post", peers, t0, time.perf_counter(), c0, time.thread_time())
        for w in works:
            _LABELS[id(w)] = peers
        return works

    _LABELS: dict[int, str] = {}
    orig_wait = sched_mod._wait_batch_p2p

    def wait_batch(works):
        if isinstance(works, dict):
            works = [w for ws in works.values() for w in ws]
        t0, c0 = time.perf_counter(), time.thread_time()
        orig_wait(works)
        label = "+".join(sorted({_LABELS.pop(id(w), "?") for w in works}))
        _record("wait", label, t0, time.perf_counter(), c0, time.thread_time())

    sched_mod._batch_p2p = batch_p2p
    sched_mod._wait_batch_p2p = wait_batch
    orig_sched_step = PipelineScheduleSingle.step

    def sched_step(self, *args, **kwargs):
        if _ALL_SGD:  # the bench's optimizers of this rank, stepped in this order
            _ALL_SGD[0]._first_of_step = True
            _ALL_SGD[-1]._last_of_step = True
        t0 = time.perf_counter()
        out = orig_sched_step(self, *args, **kwargs)
        _record("sched", "", t0, time.perf_counter())
        return out

    PipelineScheduleSingle.step = sched_step
    orig_zero = torch.optim.Optimizer.zero_grad
    orig_opt_step = torch.optim.SGD.step

    def zero_grad(self, *a, **k):
        if getattr(self, "_first_of_step", False):
            _STEP_START[0] = (time.perf_counter(), time.thread_time())
        return orig_zero(self, *a, **k)

    def opt_step(self, *a, **k):
        out = orig_opt_step(self, *a, **k)
        if getattr(self, "_last_of_step", False) and _STEP_START[0] is not None:
            t0, c0 = _STEP_START[0]
            _record("step", "", t0, time.perf_counter(), c0, time.thread_time())
        return out

    _STEP_START: list[tuple[float, float] | None] = [None]
    torch.optim.Optimizer.zero_grad = zero_grad
    torch.optim.SGD.step = opt_step

    # the bench builds the torch side's optimizers in a list: mark its first and last
    orig_sgd_init = torch.optim.SGD.__init__

    def sgd_init(self, *a, **k):
        orig_sgd_init(self, *a, **k)
        _ALL_SGD.append(self)

    _ALL_SGD: list = []
    torch.optim.SGD.__init__ = sgd_init

    orig_destroy = dist.destroy_process_group

    def destroy(*a, **k):
        rank = dist.get_rank()
        side = os.environ.get("HETRAIN_TIMELINE_SIDE", "?")
        run = os.environ.get("HETRAIN_TIMELINE_RUN", "0")
        path = Path(out_dir) / f"{side}.{run}.rank{rank}.json"
        path.write_text(json.dumps({"rank": rank, "side": side, "events": _EVENTS}))
        return orig_destroy(*a, **k)

    dist.destroy_process_group = destroy


def _load(out_dir: str, side: str) -> list[dict]:
    runs: dict[int, list[dict]] = {}
    for p in sorted(Path(out_dir).glob(f"{side}.*.json")):
        d = json.loads(p.read_text())
        runs.setdefault(int(p.name.split(".")[1]), []).append(d)
    return [{r["rank"]: r for r in rows} for rows in runs.values()]


def _per_step(rank_events: list, timed: int) -> list[dict]:
    """Split one rank's events by its steps (the last ``timed`` step windows)."""
    steps = [(a, b, c0, c1) for k, _, a, b, c0, c1 in rank_events if k == "step"][-timed:]
    out = []
    for a, b, c0, c1 in steps:
        ev = [e for e in rank_events if e[0] != "step" and a <= e[2] < b]
        out.append({"t0": a, "t1": b, "c0": c0, "c1": c1, "events": ev})
    return out


def _ops(rank_events: list) -> list[tuple[float, float]]:
    """A rank's compute operations in order: ``(start, end)``, its emulated sleep included."""
    ops: list[list[float]] = []
    for k, _, a, b, *_ in rank_events:
        if k == "compute":
            ops.append([a, b])
        elif k == "sleep" and ops:
            ops[-1][1] = b
    return [(a, b) for a, b in ops]


def _summary(side_runs: list[dict], timed: int) -> dict:
    per_rank: dict[int, dict[str, list[float]]] = {}
    waits_by_label: dict[str, list[float]] = {}
    gaps: dict[int, list[float]] = {}  # slow rank: idle time before its op n of a step
    for run in side_runs:
        for rank, d in run.items():
            steps = _per_step(d["events"], timed)
            for s in steps:
                agg = per_rank.setdefault(rank, {})
                wall = s["t1"] - s["t0"]
                parts = {"compute": 0.0, "sleep": 0.0, "wait": 0.0}
                waits: dict[str, float] = {}
                kernels = [e for e in s["events"] if e[0] in ("fwd", "bwd")]
                if kernels:
                    # the step's head (its start to the first kernel) and tail (the last
                    # kernel's end to the step's end): wall and thread CPU
                    agg.setdefault("head", []).append(kernels[0][2] - s["t0"])
                    agg.setdefault("head_cpu", []).append(kernels[0][4] - s["c0"])
                    agg.setdefault("tail", []).append(s["t1"] - kernels[-1][3])
                    agg.setdefault("tail_cpu", []).append(s["c1"] - kernels[-1][5])
                    agg.setdefault("kernel_cpu", []).append(sum(e[5] - e[4] for e in kernels))
                agg.setdefault("step_cpu", []).append(s["c1"] - s["c0"])
                # thread CPU inside the message calls (posting, waiting, packing, unpacking)
                agg.setdefault("msg_cpu", []).append(
                    sum(e[5] - e[4] for e in s["events"] if e[0] in ("post", "wait"))
                )
                for k, label, a, b, *_ in s["events"]:
                    if k in parts:
                        parts[k] += b - a
                    if k == "wait":
                        waits[label] = waits.get(label, 0.0) + b - a
                parts["other"] = wall - sum(parts.values())
                agg.setdefault("wall", []).append(wall)
                for k, v in parts.items():
                    agg.setdefault(k, []).append(v)
                if rank == bench.SLOW_RANK:
                    for label, v in waits.items():
                        waits_by_label.setdefault(label, []).append(v)
            if rank == bench.SLOW_RANK:
                ops = _ops(d["events"])
                per = len(ops) // max(sum(e[0] == "step" for e in d["events"]), 1)
                first_timed = len(ops) - per * len(steps)
                for n in range(max(first_timed, 1), len(ops)):
                    pos = (n - first_timed) % per
                    gaps.setdefault(pos, []).append(ops[n][0] - ops[n - 1][1])
    table = {
        r: {k: round(1e3 * statistics.median(v), 2) for k, v in agg.items()}
        for r, agg in sorted(per_rank.items())
    }
    waits_ms = {k: round(1e3 * statistics.median(v), 2) for k, v in sorted(waits_by_label.items())}
    gap_ms = [round(1e3 * statistics.median(gaps[p]), 2) for p in sorted(gaps)]
    return {
        "per_rank_ms": table,
        "slow_rank_waits_ms": waits_ms,
        "slow_rank_gaps_ms": gap_ms,
        "running_in_slow_compute_ms": _overlap(side_runs, timed),
    }


def _overlap(side_runs: list[dict], timed: int) -> dict[int, float]:
    """Per other rank: how long it runs (inside its timed steps and not waiting for a
    message) while the slow rank computes (its measured compute windows, which the emulation
    multiplies: on a shared host every other running rank can stretch them), ms per step
    (mean over the runs)."""
    out: dict[int, list[float]] = {}
    for run in side_runs:
        slow = run.get(bench.SLOW_RANK)
        if slow is None:
            continue
        steps = _per_step(slow["events"], timed)
        if not steps:
            continue
        t0, t1 = steps[0]["t0"], steps[-1]["t1"]
        windows = [(a, b) for k, _, a, b, *_ in slow["events"] if k == "compute" and t0 <= a < t1]
        for rank, d in run.items():
            if rank == bench.SLOW_RANK:
                continue
            busy = [(s["t0"], s["t1"]) for s in _per_step(d["events"], timed)]
            idle = [(a, b) for k, _, a, b, *_ in d["events"] if k in ("wait", "sleep")]
            total = 0.0
            for a, b in windows:
                inside = sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)
                waiting = sum(max(0.0, min(b, y) - max(a, x)) for x, y in idle)
                total += max(inside - waiting, 0.0)
            out.setdefault(rank, []).append(total / len(steps))
    return {r: round(1e3 * statistics.mean(v), 2) for r, v in sorted(out.items())}


def _one_step_listing(run: dict, timed: int, index: int) -> list[str]:
    lines = []
    base = None
    for rank in sorted(run):
        steps = _per_step(run[rank]["events"], timed)
        if index >= len(steps):
            continue
        s = steps[index]
        if base is None:
            base = s["t0"]
        row = [f"rank {rank}: step {1e3 * (s['t0'] - base):7.2f}..{1e3 * (s['t1'] - base):7.2f}"]
        for k, label, a, b, *_ in s["events"]:
            if k in ("fwd", "bwd"):
                continue
            if k == "post":
                row.append(f"  {1e3 * (a - base):7.2f} post {label}")
            elif b - a >= 0.0002 or k != "wait":
                row.append(
                    f"  {1e3 * (a - base):7.2f}-{1e3 * (b - base):7.2f} {k} {label}".rstrip()
                )
        lines += row
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("slow-1f1b", "equal-1f1b", "equal-gpipe"),
                        default="slow-1f1b")  # fmt: skip
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--listing-step", type=int, default=10, help="timed step listed")
    parser.add_argument("--no-listing", action="store_true")
    args = parser.parse_args()
    out_dir = tempfile.mkdtemp(prefix="hetrain-timeline-")
    _instrument(out_dir)
    slow = args.case == "slow-1f1b"
    schedule = "gpipe" if args.case == "equal-gpipe" else "1f1b"
    # every rank of both sides gets an Emulation (factor 1 but the slow rank's), so that each
    # side's compute windows show on every rank; hetrain's engine takes it as given
    factors = [f if f > 1.0 else 1.0 + 1e-12 for f in bench._factors(slow, 1.0)]
    timed = args.steps - args.warmup
    print(f"uptime: {os.popen('uptime').read().strip()}")
    for i in range(args.runs):
        for side in ("hetrain", "torch") if i % 2 == 0 else ("torch", "hetrain"):
            os.environ["HETRAIN_TIMELINE_SIDE"] = side
            os.environ["HETRAIN_TIMELINE_RUN"] = str(i)
            bench.run_once(side, schedule, args.steps, args.warmup, args.batch,
                           args.microbatches, factors)  # fmt: skip
    for side in ("hetrain", "torch"):
        runs = _load(out_dir, side)
        summ = _summary(runs, timed)
        print(f"== {side} ({args.case}, {len(runs)} runs, {timed} timed steps each; ms per step,"
              " medians)")  # fmt: skip
        for r, row in summ["per_rank_ms"].items():
            print(f"  rank {r}: " + "  ".join(f"{k} {v:6.2f}" for k, v in row.items()))
        print(f"  rank {bench.SLOW_RANK} waits: {summ['slow_rank_waits_ms']}")
        gaps = summ["slow_rank_gaps_ms"]
        print(
            f"  rank {bench.SLOW_RANK} idle before each of its ops (op 0: the step boundary), "
            f"sum {sum(gaps):.2f}: {gaps}"
        )
        print(
            "  other ranks running during the slow rank's compute windows (ms per step): "
            f"{summ['running_in_slow_compute_ms']}"
        )
        if not args.no_listing and runs:
            print("\n".join(_one_step_listing(runs[0], timed, args.listing_step)))


if __name__ == "__main__":
    main()
