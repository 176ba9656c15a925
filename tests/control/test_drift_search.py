"""The controller's search trigger watches the plan's whole predicted iteration time (the
slowest group and the gradient sync): a link that slows the all-reduce calls for a search as a
slow device does, and the controller leaves the device behind it."""

from __future__ import annotations

import numpy as np
import pytest

from hetrain.cluster import cluster_from_dict
from hetrain.control import make_policy
from hetrain.costmodel import TrainingConfig
from hetrain.profile import profile_from_dict
from hetrain.sim.simulator import simulate
from hetrain.trace import Trace, TraceRow

# four layers of 1e10 FLOP forward per sample and 1 MB of parameters: data parallelism over
# every device is the best plan on 1 Gbit/s links (the sync takes milliseconds)
SMALL = profile_from_dict(
    {
        "name": "small",
        "layers": [
            {
                "name": f"l{i}",
                "fwd_flops": 1e10,
                "activation_bytes": 1e5,
                "activation_memory_bytes": 1e5,
                "param_bytes": 1e6,
            }
            for i in range(4)
        ],
    }
).arrays()


@pytest.mark.parametrize("seed", range(8))
def test_a_degraded_link_under_the_all_reduce_is_left(seed):
    # n equal devices, each on its own node behind a 1 Gbit/s NIC; from a seeded slot one
    # device's NIC drops to a seeded 1-10 Mbit/s: the all-reduce over it takes seconds to a
    # minute, no device's compute changed and none came or went. The plan must leave that
    # device within three slots of the drop (measured in slot s, seen before s + 1, decided
    # then, run from s + 2 with the decision delay; one slot of slack) and not return to it
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 9))
    rows = [
        {"id": f"d{i}", "kind": "fast", "tflops": 0.96, "memory_gib": 16, "nic_gbps": 1.0}
        for i in range(n)
    ]
    cluster = cluster_from_dict(
        {"links": {"intra_node_gbps": 800, "latency_us": 20}, "devices": rows}
    )
    bad = f"d{int(rng.integers(0, n))}"
    at = int(rng.integers(5, 16))
    gbps = float(rng.uniform(0.001, 0.01))
    slots = at + 30
    timeline = Trace((TraceRow(slot=at, device=bad, nic_gbps=gbps),)).timeline(cluster, slots)
    config = TrainingConfig(batch=8 * n)
    res = simulate(make_policy("greedy", SMALL, config), timeline, SMALL, config, keep_plans=True)
    used = [{d for g in p.groups if g.batch > 0 for d in g.devices} for p in res.plans]
    times = [r.iteration_time_s for r in res.records]
    assert used[at - 1] == {f"d{i}" for i in range(n)}  # every device before the drop
    assert times[at] > 3 * times[at - 1]  # the drop shows in the slot it happens
    assert all(bad not in u for u in used[at + 3 :]), [sorted(u) for u in used[at:]]
    # without it: one device fewer of n, and no sync over the slow link
    assert max(times[at + 3 :]) < 1.5 * n / (n - 1) * times[at - 1]
