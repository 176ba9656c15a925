"""A seeded family of policy-bench scenarios (issue 19): ``family_specs(count, seed)`` returns
``count`` scenario dicts in the format of ``bench/scenarios/*.yaml`` (read by
``bench/policies.py``), each drawn from its own seed:

- 8-64 devices of 1-4 catalog kinds that have a price (``hetrain.catalog.DEVICE_KINDS``),
  2-8 devices per node, fast or 10 / 1 Gbit/s NICs;
- a model of ``examples/profiles`` and a batch size of that model's list;
- dynamics from the real traces of the shared data folder: per-worker speeds of an Alibaba PAI
  job (stragglers) on one kind, spot add/remove events of a Bamboo trace (outages in bursts)
  on one kind at 1-5 minutes a slot, AWS spot price history on the K80 / V100 devices (1 h a
  slot); and seeded generators: persistent straggler episodes (mean 30 slots), link
  degradation episodes (NIC at 10 %, mean 20 slots), a slow speed drift, and spot prices of
  the other kinds (mean-reverting with jumps);
- 2 % time and measurement noise, 300 slots (the budget is checked from slot 200 on);
- budgets: money at 0.7 of greedy's mean spend, and money with energy at 0.7 / 0.8.

Scenario ``i`` has seed ``seed · 1000 + i``; half ``A`` is the even indices, ``B`` the odd
ones (tune on one, report both).
"""

from __future__ import annotations

import numpy as np

MODELS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("examples/profiles/bert-base.json", (64, 128, 256)),
    ("examples/profiles/resnet50.json", (128, 256, 512)),
    ("examples/profiles/vgg16.json", (128, 256)),
    ("examples/profiles/gpt2-small.json", (32, 64, 128)),
    ("examples/profiles/opt-350m.json", (32, 64)),
)
"""Profiles (paths from the repository root) and the batch sizes drawn for each."""

DEVICE_COUNTS = (8, 8, 12, 16, 16, 24, 32, 48, 64)
"""Cluster sizes drawn (small ones more often: their searches are exact and reproducible)."""

SPOT_PRICE_FILES = {
    "K80": "spot-prices-aws/us-east-1/p2.xlarge.json",
    "V100-16": "spot-prices-aws/us-east-1/p3.2xlarge.json",
}
"""Kinds with a real spot price history (1 GPU per instance)."""


def _prefix(kind: str) -> str:
    """Device-id prefix of a catalog kind (``make_cluster`` numbers ``"v100-16-0"``, ...)."""
    return kind.lower() + "-"


def family_specs(count: int = 40, seed: int = 0, slots: int = 300) -> list[dict]:
    """``count`` scenario dicts (module docstring); deterministic in ``seed``.

    Raises:
        ValueError: ``count < 1`` or ``slots < 1``.
    """
    from hetrain.catalog import DEVICE_KINDS

    if count < 1 or slots < 1:
        raise ValueError(f"count and slots: expected >= 1, got {count}, {slots}")
    priced = sorted(k for k, v in DEVICE_KINDS.items() if v.price_per_hour > 0)
    specs = []
    for i in range(count):
        s = seed * 1000 + i
        rng = np.random.default_rng(s)
        devices = int(rng.choice(DEVICE_COUNTS))
        kinds = [str(k) for k in rng.choice(priced, size=int(rng.integers(1, 5)), replace=False)]
        split = np.full(len(kinds), devices // len(kinds))
        split[: devices % len(kinds)] += 1
        counts = {k: int(c) for k, c in zip(kinds, split, strict=True) if c > 0}
        model, batches = MODELS[int(rng.integers(len(MODELS)))]
        cluster: dict = {"kinds": counts, "devices_per_node": int(rng.choice([2, 4, 8]))}
        nic = rng.choice([0.0, 10.0, 1.0])
        if nic > 0:
            cluster["nic_gbps"] = float(nic)
        straggling = kinds[int(rng.integers(len(kinds)))]
        spotty = kinds[int(rng.integers(len(kinds)))]
        dynamics: dict = {
            "stragglers": [
                {"file": f"alibaba-stragglers/gpu-v2020__job_{int(rng.integers(1, 5))}_norm.csv",
                 "devices": [_prefix(straggling)]}
            ],
            "bamboo_events": [
                {"file": f"bamboo/{rng.choice(['p3-trace.csv', 'g4dn-trace.csv'])}",
                 "devices": [_prefix(spotty)], "slot_seconds": float(rng.choice([60, 120, 300]))}
            ],
            "spot_prices": [
                {"file": path, "devices": [_prefix(k)], "slot_seconds": 3600.0}
                for k, path in SPOT_PRICE_FILES.items() if k in counts
            ],
            "generate": [
                {"drift": {"sigma": 0.005},
                 "stragglers": {"rate": 0.003, "slowdown": 0.4, "mean_duration_slots": 30.0},
                 "links": {"rate": 0.003, "factor": 0.1, "mean_duration_slots": 20.0}},
                {"devices": [_prefix(k) for k in counts if k not in SPOT_PRICE_FILES],
                 "prices": {"sigma": 0.03, "jump_rate": 0.01}},
            ],
        }  # fmt: skip
        kinds_text = ", ".join(f"{c} {k}" for k, c in counts.items())
        specs.append(
            {
                "name": f"family-{i:02d}",
                "description": f"{devices} devices ({kinds_text}), {model.rsplit('/', 1)[-1]}, "
                f"stragglers on {straggling}, outages on {spotty}",
                "model": model,
                "batch": int(rng.choice(batches)),
                "slots": int(slots),
                "seed": s,
                "cluster": cluster,
                "dynamics": dynamics,
                "noise": {"time": 0.02, "measurement": 0.02},
                "budget": {"money_fraction_of_greedy": 0.7},
                "budget_with_energy": {
                    "money_fraction_of_greedy": 0.7,
                    "energy_fraction_of_greedy": 0.8,
                },
            }
        )
    return specs
