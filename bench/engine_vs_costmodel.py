"""Runtime engine against the docs/model.md §3 cost model: measured iteration time of real training
on
local gloo ranks vs ``hetrain.costmodel.evaluate_plan``'s prediction, for several plans.

The model is a chain of "sleep layers" (a small ``Linear`` plus a fixed sleep per sample, 2x in
backward), so that stage compute times are known and stable on a busy machine; device speeds
come from emulated slow-down factors and links from an emulated cluster (docs/model.md §5), and the
cluster file given to the cost model states the same speeds and links. A ratio near 1 means the
runtime executes plans the way the planner models them (1F1B bubbles, uneven shares,
bottleneck stages, link-bound boundaries).

Usage::

    PYTHONPATH=src python bench/engine_vs_costmodel.py [--steps 4]

Prints a table and, as its last line, JSON ``{"plans": {NAME: {"measured_s", "predicted_s",
"ratio"}}}`` (measured = median over steps after the first of the slowest rank's iteration).
The runtime's own per-micro-batch cost (Python, messages, sleep wake-up) is what docs/model.md's
``κ``
stands for; ``--kappa-ms`` lets the cost model and planner assume one. Known difference: the
emulation gives each direction of a link its own bandwidth, while docs/model.md §3
charges activations and gradients on one shared link (``2 a``), so link-bound plans run faster
than predicted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from hetrain.cluster import cluster_from_dict
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.plan import plan_from_dict
from hetrain.planner import best_plan
from hetrain.profile import profile_from_dict
from hetrain.runtime import Emulation, OptimizerSpec, Worker
from hetrain.runtime.testing import run_ranks

WIDTH = 64  # features per sample; activation = WIDTH float32
LAYERS = 4
SLEEP_S_PER_SAMPLE = 1e-3  # forward sleep per sample and layer; backward sleeps twice this
FLOPS_PER_SAMPLE = 1e9  # nominal forward FLOPs per sample and layer (profile)
BATCH = 48
SLOWDOWN = {"w0": 1.0, "w1": 1.0, "w2": 2.0, "w3": 3.0}


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: D102
        time.sleep(x.shape[0] * SLEEP_S_PER_SAMPLE)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        time.sleep(grad.shape[0] * 2 * SLEEP_S_PER_SAMPLE)
        return grad


class SleepLayer(nn.Module):
    """``Linear(WIDTH, WIDTH)`` followed by a sleep of ``rows x SLEEP_S_PER_SAMPLE`` seconds
    (twice that in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.linear(x))


def _cluster(nic_gbps: float, same_node: bool, kappa_ms: float = 0.0):
    tflops = FLOPS_PER_SAMPLE / SLEEP_S_PER_SAMPLE / 1e12
    return cluster_from_dict(
        {
            "links": {"intra_node_gbps": 1000, "latency_us": 50},
            "devices": [
                {
                    "id": d,
                    "node": "n0" if same_node else d,
                    "tflops": tflops / f,
                    "memory_gib": 1,
                    "nic_gbps": nic_gbps,
                    "microbatch_overhead_ms": kappa_ms,
                }
                for d, f in SLOWDOWN.items()
            ],
        }
    )


def _profile():
    act = WIDTH * 4
    return profile_from_dict(
        {
            "name": "sleep-chain",
            "layers": [
                {
                    "name": f"sleep{i}",
                    "fwd_flops": FLOPS_PER_SAMPLE,
                    "activation_bytes": act,
                    "param_bytes": (WIDTH * WIDTH + WIDTH) * 4,
                }
                for i in range(LAYERS)
            ],
        }
    ).arrays()


def _run(rank, world, plan, emulation, steps):
    torch.manual_seed(0)
    model = nn.Sequential(*[SleepLayer() for _ in range(LAYERS)])
    worker = Worker(
        model,
        plan_from_dict(plan),
        f"w{rank}",
        F.mse_loss,
        OptimizerSpec("sgd", lr=0.01),
        emulation=emulation,
        allow_unused_ranks=True,
    )
    x = torch.randn(BATCH, WIDTH)
    y = torch.randn(BATCH, WIDTH)
    return [worker.step(x, y, t).iteration_time_s for t in range(steps)]


def _g(devices, stages, mb, batch):
    return {"devices": devices, "stages": stages, "microbatch_size": mb, "batch": batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--kappa-ms",
        type=float,
        default=0.0,
        help="per-micro-batch overhead κ assumed by the cost model and planner "
        "(not emulated: it stands for the runtime's own overhead)",
    )
    args = parser.parse_args()
    profile = _profile()
    config = TrainingConfig(batch=BATCH, optimizer_state_factor=0.0)
    fast = _cluster(100.0, same_node=True, kappa_ms=args.kappa_ms)
    slow_links = _cluster(
        0.02, same_node=False, kappa_ms=args.kappa_ms
    )  # 2.5 MB/s NICs: boundaries cost ~ms
    ids = list(SLOWDOWN)
    cases = {
        "dp-even": (fast, {"groups": [_g([d], [[0, 4]], 6, 12) for d in ids]}),
        "dp-proportional": (
            fast,
            {
                "groups": [
                    _g(["w0"], [[0, 4]], 8, 16),
                    _g(["w1"], [[0, 4]], 8, 16),
                    _g(["w2"], [[0, 4]], 8, 8),
                    _g(["w3"], [[0, 4]], 8, 8),
                ]
            },
        ),
        "pipeline-1f1b": (fast, {"groups": [_g(ids, [[0, 1], [1, 2], [2, 3], [3, 4]], 6, BATCH)]}),
        "hybrid-gpipe": (
            fast,
            {
                "schedule": "gpipe",
                "groups": [
                    _g(["w0", "w2"], [[0, 3], [3, 4]], 4, 28),
                    _g(["w1", "w3"], [[0, 3], [3, 4]], 4, 20),
                ],
            },
        ),
        "pipeline-slow-links": (
            slow_links,
            {"groups": [_g(["w0", "w1"], [[0, 2], [2, 4]], 8, BATCH)]},
        ),
    }
    planned = best_plan(fast.state(), profile, config)
    cases["planner-best"] = (fast, planned.to_json_dict())
    print("planner-best:", planned.model_copy(update={"cost": None}).to_json(indent=None))
    out: dict[str, dict[str, float]] = {}
    print(f"{'plan':22s} {'measured_s':>11s} {'predicted_s':>12s} {'ratio':>6s}")
    for name, (cluster, plan) in cases.items():
        state = cluster.state()
        predicted = evaluate_plan(plan_from_dict(plan), state, profile, config).iteration_time_s
        emulation = Emulation.from_cluster_state(state, SLOWDOWN)  # κ is not emulated
        with tempfile.TemporaryDirectory() as tmp:
            times = run_ranks(
                _run, len(ids), tmp, args=(plan, emulation, args.steps), timeout_s=600
            )
        per_step = [max(rank[t] for rank in times) for t in range(1, args.steps)]
        measured = statistics.median(per_step)
        out[name] = {
            "measured_s": measured,
            "predicted_s": predicted,
            "ratio": measured / predicted,
        }
        print(f"{name:22s} {measured:11.3f} {predicted:12.3f} {measured / predicted:6.2f}")
    print(json.dumps({"plans": out}))


if __name__ == "__main__":
    main()
