"""hetrain's engine vs ``torch.distributed.pipelining`` on one fixed 4-stage pipeline, side by
side in one run.

Same model (8 equal MLP blocks, ``bench/_peer_model.py``), same data and global batch, same
split (2 blocks per stage), same micro-batches (``--microbatches`` equal ones), same optimizer
(SGD with momentum, one optimizer per layer on both sides, ``foreach=False``), 4 gloo ranks
on CPU, one torch thread each:

- ``hetrain``: :class:`hetrain.runtime.Worker` on the plan ``{4 stages, μ = B / n}`` with the
  schedule compared (``1f1b`` or ``gpipe``);
- ``torch``: ``PipelineStage`` + ``Schedule1F1B`` / ``ScheduleGPipe`` (``scale_grads``: the
  gradients are divided by ``n``, as hetrain scales each micro-batch loss by ``rows / B``).

Each case runs ``--repeats`` pairs of runs, one of each side, the order alternating (hetrain
first, then torch first, ...); each run reports the wall time of its steps after ``--warmup``
(the slowest rank, barriers around); the ratio is the median over the pairs of torch's time
over hetrain's (> 1: hetrain faster; a pair's runs are adjacent in time, so a change of the
host's load shifts both). Per-step losses of the two sides must agree (float32, summation
order only: relative difference <= 1e-4).

Cases:

- ``equal-1f1b``, ``equal-gpipe``: equal devices. Target: hetrain >= 0.98x each peer.
- ``slow-1f1b``: stage 1's rank 3x slower, emulated on both sides alike: after each
  micro-batch's forward (the stage's layers; the loss on the last stage) and after its whole
  ``autograd.backward``, :func:`hetrain.runtime.emulation.slow_down` sleeps ``(factor - 1) x``
  the measured time (hetrain's engine does this itself; on the torch side a ``PipelineStage``
  subclass times ``forward_maybe_with_nosync`` and ``backward_maybe_with_nosync`` and the loss
  function), the fixed even split. ``--compute-clock thread_cpu`` makes both sides multiply
  the op's thread CPU time instead of its wall time (others' load then stretches no sleep).
  Target: >= 0.98x.
- ``train`` (``--train``): ``hetrain train`` without a plan vs the fixed plan ``hetrain plan``
  gives for the same measured devices (the speeds and ``κ`` that the first adaptive run's
  start-up calibration measured, w1's emulated slow-down included, as a cluster file; the
  profile from ``hetrain profile --model``; a device the plan leaves out runs idle), both
  with ``--slowdown w1=3``, alternated; rate = steps after ``--warmup`` over their wall time
  (metrics ``time_s``). Target: the adaptive run >= 0.95 of the fixed plan's rate over the
  whole run after ``--warmup`` (its warm-up, decisions and re-plans included: what a user
  gets). Also printed: its rate after its last plan change (the steady state), its
  number of plan changes and the controller's CPU per step (its service thread, from
  ``controller.jsonl``'s ``service_cpu_s``; a planner search runs in another thread).
  ``--only-train`` runs this case alone.

Each peer case also prints every rank's CPU per timed step (``time.process_time`` of the
rank's process, all its threads; medians over the runs): 4 ranks share the host's cores, so a
side's extra CPU shows in its wall time, and unlike the wall time this figure is not stretched
by other processes' load. ``HETRAIN_PEER_PROFILE=R`` profiles rank ``R``'s timed steps with
``cProfile`` on its thread CPU clock, written to ``$HETRAIN_PEER_PROFILE_OUT.{side}.prof``
(default ``/tmp/peer``).

``--base-slowdown F`` makes every rank emulate a device ``F`` times slower than one host core
(both sides; the slow rank ``3 F``), so that 4 ranks on a 2-core machine do not slow each other
down (bench/runtime_vs_ddp.py does the same).

Usage (a quiet machine; the last line is JSON with every ratio)::

    PYTHONPATH=src python bench/pipelining_peer.py --steps 40 --warmup 5 --repeats 9 --train
    PYTHONPATH=src python bench/pipelining_peer.py --smoke   # a few steps, checks it runs
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import _peer_model as peer  # noqa: E402

WORLD = 4
SLOW_RANK = 1
SLOW_FACTOR = 3.0
LR, MOMENTUM = 0.01, 0.9


def _emulated_stage_class():
    """``PipelineStage`` whose forward and backward of each micro-batch last ``factor`` times
    as long: the same windows and rule as hetrain's engine (``stages.run_stage``), which times
    the stage's forward (with the loss on the last stage) and the whole
    ``torch.autograd.backward`` of the micro-batch and then calls
    :func:`hetrain.runtime.emulation.slow_down` on the measured time; here the windows are
    torch's ``forward_maybe_with_nosync`` (the stage module's call), the loss function and
    ``backward_maybe_with_nosync`` (``stage_backward``: the ``autograd.backward`` call), and
    the sleep is that same ``slow_down`` call."""
    from torch.distributed.pipelining import PipelineStage

    from hetrain.runtime.emulation import slow_down

    class EmulatedStage(PipelineStage):
        def __init__(self, *args, emulation, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.emulation = emulation

        def timed(self, fn, *args, **kwargs):
            thread_cpu = self.emulation.compute_clock == "thread_cpu"
            t0, c0 = time.perf_counter(), time.thread_time() if thread_cpu else 0.0
            out = fn(*args, **kwargs)
            dt = time.perf_counter() - t0
            cpu = time.thread_time() - c0 if thread_cpu else None
            slow_down(self.emulation, "self", dt, cpu_s=cpu)
            return out

        def forward_maybe_with_nosync(self, *args, **kwargs):
            return self.timed(super().forward_maybe_with_nosync, *args, **kwargs)

        def backward_maybe_with_nosync(self, *args, **kwargs):
            return self.timed(super().backward_maybe_with_nosync, *args, **kwargs)

    return EmulatedStage


def _factors(slow: bool, base: float) -> list[float]:
    return [base * (SLOW_FACTOR if slow and r == SLOW_RANK else 1.0) for r in range(WORLD)]


def _stages() -> list[list[int]]:
    per = peer.BLOCKS // WORLD
    return [[k * per, (k + 1) * per] for k in range(WORLD)]


def _batch(data, step: int, batch: int):
    x, y = data
    start = (step * batch) % (len(x) - batch + 1)
    return x[start : start + batch], y[start : start + batch]


def _rank(rank, store, side, schedule, steps, warmup, batch, nmb, factors, clock, out) -> None:
    from hetrain.runtime.emulation import Emulation

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=300),
    )
    torch.manual_seed(0)
    model = peer.build_model()
    data = peer.make_data()
    losses: list[float] = []
    if side == "hetrain":
        from hetrain.plan import plan_from_dict
        from hetrain.runtime import OptimizerSpec, Worker

        plan = plan_from_dict(
            {
                "schedule": schedule,
                "groups": [
                    {
                        "devices": [f"w{r}" for r in range(WORLD)],
                        "stages": _stages(),
                        "microbatch_size": batch // nmb,
                        "batch": batch,
                    }
                ],
            }
        )
        emulation = None
        if any(f > 1.0 for f in factors):
            emulation = Emulation(
                slowdown={f"w{r}": f for r, f in enumerate(factors)}, compute_clock=clock
            )
        worker = Worker(
            model,
            plan,
            f"w{rank}",
            peer.loss_fn,
            OptimizerSpec("sgd", lr=LR, momentum=MOMENTUM),
            emulation=emulation,
        )
        results = []

        def one_step(t):
            x, y = _batch(data, t, batch)
            results.append(worker.step(x, y, t))

    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        s0, s1 = _stages()[rank]
        inner = nn.Sequential(*[model[i] for i in range(s0, s1)])
        loss_fn = peer.loss_fn
        if factors[rank] > 1.0:
            stage = _emulated_stage_class()(
                inner,
                rank,
                WORLD,
                torch.device("cpu"),
                emulation=Emulation(slowdown={"self": factors[rank]}, compute_clock=clock),
            )
            loss_fn = functools.partial(stage.timed, peer.loss_fn)
        else:
            stage = PipelineStage(inner, rank, WORLD, torch.device("cpu"))
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        sched = kind(stage, n_microbatches=nmb, loss_fn=loss_fn)
        opts = [
            torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM, foreach=False)
            for m in inner
            if any(True for _ in m.parameters())
        ]

        def one_step(t):
            x, y = _batch(data, t, batch)
            for o in opts:
                o.zero_grad(set_to_none=True)
            if rank == 0:
                sched.step(x)
            elif rank == WORLD - 1:
                mb_losses: list[torch.Tensor] = []
                sched.step(target=y, losses=mb_losses)
                losses.append(float(torch.stack([v.detach() for v in mb_losses]).mean()))
            else:
                sched.step()
            for o in opts:
                o.step()

    for t in range(warmup):
        one_step(t)
    dist.barrier()
    profiler = None
    if os.environ.get("HETRAIN_PEER_PROFILE") and rank == int(os.environ["HETRAIN_PEER_PROFILE"]):
        import cProfile

        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
    t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    for t in range(warmup, steps):
        one_step(t)
    cpu, main_cpu = time.process_time() - c0, time.thread_time() - m0
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(
            f"{os.environ.get('HETRAIN_PEER_PROFILE_OUT', '/tmp/peer')}.{side}.prof"
        )
    if side == "hetrain":
        losses = [r.loss for r in results]  # waits for the last step's late sums
    dist.destroy_process_group()
    out.put(
        (rank, elapsed, losses, cpu / max(steps - warmup, 1), main_cpu / max(steps - warmup, 1))
    )


def run_once(
    side, schedule, steps, warmup, batch, nmb, factors, clock="wall"
) -> tuple[float, list[float], list[float]]:
    """One run of ``side``; returns (seconds of the timed steps on the slowest rank, losses of
    the last stage, one per step, each rank's CPU seconds per timed step: its process's
    ``time.process_time``, every thread of it)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="hetrain-peer-")
    try:
        store = os.path.join(tmp, "rdzv")
        procs = [
            ctx.Process(
                target=_rank,
                args=(r, store, side, schedule, steps, warmup, batch, nmb, factors, clock, out),
            )
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        rows = [out.get(timeout=1800) for _ in range(WORLD)]
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"{side} {schedule}: a rank exited with {p.exitcode}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows.sort()
    return max(r[1] for r in rows), rows[WORLD - 1][2], [r[3] for r in rows]


def compare(name, schedule, factors, args) -> dict:
    """``args.repeats`` pairs of runs, one of each side, the order alternating (hetrain first,
    then torch first, ...); the ratio is the median over the pairs of torch's time over
    hetrain's (a pair's two runs are adjacent in time, so a change of the host's load shifts
    both), the rates are the medians per side; the losses of the two sides must agree."""
    times: dict[str, list[float]] = {"hetrain": [], "torch": []}
    cpus: dict[str, list[list[float]]] = {"hetrain": [], "torch": []}
    losses: dict[str, list[float]] = {}
    for i in range(args.repeats):
        for side in ("hetrain", "torch") if i % 2 == 0 else ("torch", "hetrain"):
            t, lo, cpu = run_once(
                side,
                schedule,
                args.steps,
                args.warmup,
                args.batch,
                args.microbatches,
                factors,
                args.compute_clock,
            )
            times[side].append(t)
            cpus[side].append(cpu)
            losses[side] = lo
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [tt / th for th, tt in zip(times["hetrain"], times["torch"], strict=True)]
    ratio = statistics.median(ratios)
    pairs = zip(losses["hetrain"], losses["torch"], strict=True)
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    timed = args.steps - args.warmup
    # CPU per step per rank (median over the runs): 4 ranks share the host's cores, so every
    # CPU second a side spends beyond the other shows in its wall time; this figure is not
    # stretched by other processes' load as the wall time is
    cpu_ms = {k: [round(1e3 * statistics.median(c[r] for c in v), 2) for r in range(WORLD)]
              for k, v in cpus.items()}  # fmt: skip
    print(
        f"{name:12s} hetrain {timed / med['hetrain']:7.2f} it/s   torch {timed / med['torch']:7.2f}"
        f" it/s   ratio {ratio:.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f})   loss max rel "
        f"diff {diff:.1e}\n{'':12s} CPU ms/step per rank: hetrain {cpu_ms['hetrain']}   torch "
        f"{cpu_ms['torch']}",
        flush=True,
    )
    return {"ratio": round(ratio, 4), "ratio_min": round(min(ratios), 4),
            "ratio_max": round(max(ratios), 4), "loss_max_rel_diff": diff,
            "cpu_ms_per_step": cpu_ms}  # fmt: skip


def _hetrain(*argv: str, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hetrain", *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"hetrain {argv[0]} exited with {done.returncode}: {tail}")
    return done


def train_case(args) -> dict:
    """``hetrain train`` without a plan vs the fixed plan ``hetrain plan`` gives for the
    devices as ``hetrain train``'s start-up calibration measured them (speed and ``κ`` per
    device, w1's 3x slow-down included: the first ``plan`` record of the first adaptive run)."""
    import yaml

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root)])
    env["HETRAIN_PEER_HIDDEN"] = str(peer.HIDDEN)
    tmp = Path(tempfile.mkdtemp(prefix="hetrain-peer-train-"))
    model = "bench._peer_model:make"
    try:
        profile, cluster, plan_path = tmp / "profile.json", tmp / "cluster.yaml", tmp / "plan.json"
        _hetrain("profile", "--model", model, "--out", str(profile), env=env)
        common = ["--model", model, "--workers", str(WORLD), "--steps", str(args.train_steps),
                  "--batch", str(args.batch), "--optimizer", "sgd", "--lr", str(LR),
                  "--slowdown", f"w{SLOW_RANK}={SLOW_FACTOR}", "--no-demo-slowdown",
                  "--no-progress", "--no-report"]  # fmt: skip
        rates: dict[str, list[float]] = {"fixed": [], "adaptive": [], "adaptive_steady": []}
        changes: list[int] = []
        controller_ms: list[float] = []
        planned = ""
        for i in range(args.repeats):
            for kind in ("adaptive", "fixed"):
                run_dir = tmp / f"{kind}{i}"
                extra = ["--plan", str(plan_path)] if kind == "fixed" else []
                _hetrain("train", *common, *extra, "--run-dir", str(run_dir), env=env)
                metrics = run_dir / "metrics.jsonl"
                rates[kind].append(_rate(metrics, args.warmup))
                if kind == "adaptive":
                    rates["adaptive_steady"].append(_rate(metrics, args.warmup, True))
                    changes.append(_plan_changes(metrics))
                    controller_ms.append(_controller_cpu_ms(run_dir / "controller.jsonl"))
                if kind == "adaptive" and i == 0:
                    cluster.write_text(yaml.safe_dump(_measured_cluster(metrics)))
                    planned = _hetrain("plan", "--cluster", str(cluster), "--model",
                                       str(profile), "--batch", str(args.batch),
                                       "--optimizer-state-factor", "1", "--json",
                                       env=env).stdout  # fmt: skip
                    plan_path.write_text(planned)
        med = {k: statistics.median(v) for k, v in rates.items()}
        fraction = med["adaptive"] / med["fixed"]
        steady = med["adaptive_steady"] / med["fixed"]
        shares = [(g["devices"], g["batch"]) for g in json.loads(planned)["groups"]]
        print(
            f"train        fixed plan {med['fixed']:.2f} it/s   adaptive {med['adaptive']:.2f} "
            f"it/s   fraction {fraction:.3f} (whole run after --warmup; after its last plan "
            f"change {med['adaptive_steady']:.2f} it/s, {steady:.3f})   plan changes {changes}"
            f"   plan {shares}   controller CPU {statistics.median(controller_ms):.1f} ms/step",
            flush=True,
        )
        return {"fraction_of_fixed_plan": round(fraction, 4), "fixed_it_per_s": med["fixed"],
                "adaptive_it_per_s": med["adaptive"],
                "adaptive_steady_it_per_s": med["adaptive_steady"],
                "steady_fraction_of_fixed_plan": round(steady, 4),
                "adaptive_plan_changes": changes, "plan_shares": shares,
                "controller_cpu_ms_per_step": statistics.median(controller_ms)}  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _controller_cpu_ms(log: Path) -> float:
    """The controller service thread's CPU per measured step (ms): its ``service_cpu_s`` from
    the second row of ``controller.jsonl`` to the last over the steps between (the first row
    holds its start-up polling)."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    rows = [r for r in rows if "service_cpu_s" in r]
    if len(rows) < 3:
        return float("nan")
    return 1e3 * (rows[-1]["service_cpu_s"] - rows[1]["service_cpu_s"]) / (len(rows) - 2)


def _plan_changes(metrics: Path) -> int:
    lines = metrics.read_text().splitlines()
    return sum(json.loads(line).get("event") == "replan" for line in lines)


def _measured_cluster(metrics: Path) -> dict:
    """A cluster file of the local ranks (the runtime's nominal links, memory and NICs) with
    the speeds and ``κ`` of a run's start-up calibration (its first ``plan`` record)."""
    first = next(
        e for e in map(json.loads, metrics.read_text().splitlines()) if e.get("event") == "plan"
    )
    return {
        "links": {"intra_node_gbps": 20.0, "latency_us": 20.0},
        "devices": [
            {
                "id": d,
                "tflops": float(speed) / 1e12,
                "memory_gib": 16.0,
                "nic_gbps": 20.0,
                "microbatch_overhead_ms": float(first["kappa_s"][d]) * 1e3,
            }
            for d, speed in first["speed_flops"].items()
        ],
    }


def _rate(metrics: Path, warmup: int, after_last_change: bool = False) -> float:
    """Steps per second over the steps after ``warmup`` (metrics ``time_s``); with
    ``after_last_change`` only over those after the run's last plan change (the steady
    state; the whole run when fewer than 5 steps follow it)."""
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = sorted((e for e in events if e.get("event") == "step"), key=lambda e: e["step"])
    first = warmup
    if after_last_change:
        changes = [int(e["step"]) for e in events if e.get("event") == "replan"]
        if changes and max(changes) + 5 < len(steps) - 1:
            first = max(first, max(changes))
    # a line is written a step late, the last one at the end right after the one before it
    timed = [e for e in steps[:-1] if e["step"] >= first]
    return (len(timed) - 1) / (timed[-1]["time_s"] - timed[0]["time_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--base-slowdown", type=float, default=1.0)
    parser.add_argument(
        "--compute-clock",
        choices=("wall", "thread_cpu"),
        default="wall",
        help="what the emulated slow-down multiplies, on both sides (Emulation.compute_clock)",
    )
    parser.add_argument("--train", action="store_true", help="also the hetrain train case")
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--smoke", action="store_true", help="a few steps of every case")
    parser.add_argument(
        "--only-train", action="store_true", help="only the hetrain train case (implies --train)"
    )
    args = parser.parse_args()
    args.train = args.train or args.only_train
    if args.smoke:
        args.steps, args.warmup, args.repeats, args.train_steps = 4, 1, 1, 8
    summary: dict = {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                     "batch": args.batch, "microbatches": args.microbatches,
                     "base_slowdown": args.base_slowdown,
                     "compute_clock": args.compute_clock, "hidden": peer.HIDDEN,
                     "cpu_count": os.cpu_count(), "load_avg_1min": os.getloadavg()[0]}  # fmt: skip
    equal = _factors(False, args.base_slowdown)
    peer_cases = () if args.only_train else ("equal_1f1b", "equal_gpipe", "slow_1f1b")
    if peer_cases:
        summary["equal_1f1b"] = compare("equal-1f1b", "1f1b", equal, args)
        summary["equal_gpipe"] = compare("equal-gpipe", "gpipe", equal, args)
        slow = _factors(True, args.base_slowdown)
        summary["slow_1f1b"] = compare("slow-1f1b", "1f1b", slow, args)
    verdicts = []
    for key in peer_cases:
        r = summary[key]
        ok = r["ratio"] >= 0.98 and r["loss_max_rel_diff"] <= 1e-4
        verdicts.append(ok)
        print(f"{'PASS' if ok else 'FAIL'} {key}: {r['ratio']:.3f}x the peer (target >= 0.98), "
              f"losses within {r['loss_max_rel_diff']:.1e} (target <= 1e-4)")  # fmt: skip
    if args.train:
        summary["train"] = train_case(args)
        f = summary["train"]["fraction_of_fixed_plan"]
        print(f"{'PASS' if f >= 0.95 else 'FAIL'} train: adaptive {f:.3f} of the fixed plan "
              "(target >= 0.95)")  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
