"""How long the runtime's controller takes to answer a step, and the CPU it takes per step
(issue 19, "decisions in time"; the controller shares the ranks' cores).

For D data-parallel single-device ranks (D = 4, 16, 64; w1 3x slower, ±15 % measurement noise
by default, ``--noise``) the runtime's :class:`hetrain.runtime.adapt.PlanController` (async mode:
every step the cheap keep-or-rebalance decision, searches in its thread) is fed a synthetic
measurement stream; per D the script prints the median and 95th percentile wall time of
``observe`` + ``decide`` (what the controller does per step) and, separately, of one planner
search (``search_plan``); and the thread CPU time per step (``time.thread_time``: observe,
decide and the log's predictions, what the controller service does per measured step; not
stretched by other processes' load the way wall time is, which makes it the figure to compare
on a shared machine). ``--noise 0`` makes the measurements repeat: once the estimates stop
moving, a step evaluates no plan (the per-state memo of
:class:`~hetrain.control.lyapunov.LyapunovController`).

``--repeats R``: the stream fed R times (the same work each time), per step the least thread
CPU time: a figure that others' load barely moves. ``--ab R``: also R alternated pairs of runs
with the memo on and off (``LyapunovController.memoize``,
``PlanController.reuse_unchanged_state``; the same decisions either way), the median CPU per
step of each and their ratio.

Usage::

    PYTHONPATH=src python bench/controller_latency.py [--steps 60] [--devices 4 16 64]
    PYTHONPATH=src python bench/controller_latency.py --devices 4 16 --ab 5

Timings on a loaded machine are polluted; run on a quiet one for the stated figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hetrain.costmodel import TrainingConfig  # noqa: E402
from hetrain.profile import ProfileArrays  # noqa: E402
from hetrain.runtime.adapt import PlanController, even_dp_plan  # noqa: E402
from hetrain.runtime.worker_main import local_cluster_state  # noqa: E402

SPEED = 1e10
KAPPA = 2e-3


def _profile() -> ProfileArrays:
    f = np.full(8, 1e-3 * SPEED / 3 / 8)
    return ProfileArrays(
        names=tuple(f"block{i}" for i in range(8)), fwd_flops=f, bwd_flops=2 * f,
        activation_bytes=np.full(8, 256.0), activation_memory_bytes=np.full(8, 256.0),
        param_bytes=np.full(8, 4e4),
    )  # fmt: skip


def measure(
    devices: int,
    steps: int,
    seed: int = 0,
    *,
    noise: float = 0.15,
    memo: bool = True,
    searches: bool = True,
) -> dict[str, float]:
    """Per-step answer times (s) and thread CPU per step (s) of the runtime's controller on
    ``devices`` ranks (``memo``: the per-state memo and the reused unchanged state on)."""
    ids = [f"w{i}" for i in range(devices)]
    batch = 16 * devices
    base = local_cluster_state(ids, [SPEED] * devices).with_changes(kappa_s=np.full(devices, KAPPA))
    profile = _profile()
    config = TrainingConfig(batch=batch, sync_overlap=True)
    ctl = PlanController(base, profile, config, even_dp_plan(ids, 8, batch, 1), steps + 1,
                         async_search=True)  # fmt: skip
    ctl.policy.memoize = memo
    ctl.reuse_unchanged_state = memo
    rng = np.random.default_rng(seed)
    flops = float(profile.train_flops.sum())
    answers, cpu = [], []
    for t in range(steps):
        compute = {}
        for g in ctl.current.groups:
            for d in g.devices:
                factor = 3.0 if d == "w1" and t >= 10 else 1.0
                work = flops * g.batch / SPEED + g.num_microbatches * KAPPA
                compute[d] = factor * work * rng.uniform(1.0 - noise, 1.0 + noise)
        started, started_cpu = time.perf_counter(), time.thread_time()
        ctl.observe(t, int(ctl.current.plan_id), compute, max(compute.values()))
        inputs = ctl.prediction_inputs()
        ctl.decide(t + 1)
        answers.append(time.perf_counter() - started)
        ctl.predictions_of(inputs)  # the log's row (the service computes it after posting)
        cpu.append(time.thread_time() - started_cpu)
        ctl.wait_for_search()  # (the search's time is measured below, not here)
    if not searches:
        return {"median_cpu_s": float(np.median(cpu[10:])), "mean_cpu_s": float(np.mean(cpu[10:])),
                "cpu_s": cpu}  # fmt: skip
    state = ctl.observed_state()
    searches = []
    for _ in range(3):
        started = time.perf_counter()
        ctl.policy.search_plan(state, {}, ctl.current)
        searches.append(time.perf_counter() - started)
    return {
        "median_answer_s": float(np.median(answers[10:])),
        "p95_answer_s": float(np.percentile(answers[10:], 95)),
        "median_search_s": float(np.median(searches)),
        "median_cpu_s": float(np.median(cpu[10:])),
        "mean_cpu_s": float(np.mean(cpu[10:])),
        "cpu_s": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--devices", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--noise", type=float, default=0.15, help="relative measurement noise")
    ap.add_argument("--ab", type=int, default=0, metavar="R",
                    help="R alternated pairs of runs with the memo on and off")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1,
                    help="feed the (deterministic) stream this many times; per step the least "
                         "CPU time (others' load only adds to it)")  # fmt: skip
    args = ap.parse_args(argv)
    for d in args.devices:
        m = measure(d, args.steps, noise=args.noise)
        print(f"{d:>3} ranks: answer per step median {m['median_answer_s'] * 1e3:.1f} ms, "
              f"95th percentile {m['p95_answer_s'] * 1e3:.1f} ms; one planner search "
              f"{m['median_search_s'] * 1e3:.0f} ms; CPU per step median "
              f"{m['median_cpu_s'] * 1e3:.2f} ms, mean {m['mean_cpu_s'] * 1e3:.2f} ms",
              flush=True)  # fmt: skip
        if args.repeats > 1:
            runs = [m["cpu_s"]] + [
                measure(d, args.steps, noise=args.noise, searches=False)["cpu_s"]
                for _ in range(args.repeats - 1)
            ]
            least = np.min(np.asarray(runs), axis=0)[10:]
            print(f"{d:>3} ranks: CPU per step, the least of {args.repeats} runs per step: "
                  f"median {np.median(least) * 1e3:.2f} ms, mean {np.mean(least) * 1e3:.2f} ms",
                  flush=True)  # fmt: skip
        if args.ab > 0:
            runs: dict[bool, list[float]] = {True: [], False: []}
            for i in range(args.ab):
                for memo in (True, False) if i % 2 == 0 else (False, True):
                    r = measure(d, args.steps, noise=args.noise, memo=memo, searches=False)
                    runs[memo].append(r["median_cpu_s"])
            on, off = (float(np.median(runs[k])) for k in (True, False))
            print(f"{d:>3} ranks: CPU per step (median of {args.ab} alternated runs each) "
                  f"memo on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms, on/off {on / off:.2f}",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
