"""How long the runtime's controller takes to answer a step (issue 19, "decisions in time").

For D data-parallel single-device ranks (D = 4, 16, 64; w1 3x slower, ±15 % measurement noise)
the runtime's :class:`hetrain.runtime.adapt.PlanController` (async mode: every step the cheap
keep-or-rebalance decision, searches in its thread) is fed a synthetic measurement stream;
per D the script prints the median and 95th percentile wall time of ``observe`` + ``decide``
(what the controller does per step) and, separately, of one planner search
(``search_plan``). A decision reaches step t + 1 when that answer time is a small fraction of
a step; the printed figures are the ones to state.

Usage::

    PYTHONPATH=src python bench/controller_latency.py [--steps 60] [--devices 4 16 64]

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


def measure(devices: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Per-step answer times (s) of the runtime's controller on ``devices`` ranks."""
    ids = [f"w{i}" for i in range(devices)]
    batch = 16 * devices
    base = local_cluster_state(ids, [SPEED] * devices).with_changes(kappa_s=np.full(devices, KAPPA))
    profile = _profile()
    config = TrainingConfig(batch=batch, sync_overlap=True)
    ctl = PlanController(base, profile, config, even_dp_plan(ids, 8, batch, 1), steps + 1,
                         async_search=True)  # fmt: skip
    rng = np.random.default_rng(seed)
    flops = float(profile.train_flops.sum())
    answers = []
    for t in range(steps):
        compute = {}
        for g in ctl.current.groups:
            for d in g.devices:
                factor = 3.0 if d == "w1" and t >= 10 else 1.0
                work = flops * g.batch / SPEED + g.num_microbatches * KAPPA
                compute[d] = factor * work * rng.uniform(0.85, 1.15)
        started = time.perf_counter()
        ctl.observe(t, int(ctl.current.plan_id), compute, max(compute.values()))
        ctl.decide(t + 1)
        answers.append(time.perf_counter() - started)
        ctl.wait_for_search()  # (the search's time is measured below, not here)
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
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--devices", type=int, nargs="+", default=[4, 16, 64])
    args = ap.parse_args(argv)
    for d in args.devices:
        m = measure(d, args.steps)
        print(f"{d:>3} ranks: answer per step median {m['median_answer_s'] * 1e3:.1f} ms, "
              f"95th percentile {m['p95_answer_s'] * 1e3:.1f} ms; one planner search "
              f"{m['median_search_s'] * 1e3:.0f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
