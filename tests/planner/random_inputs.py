"""Seeded random model profiles shared by the planner's property tests."""

from __future__ import annotations

import numpy as np


def random_profile(rng: np.random.Generator, min_layers: int, max_layers: int) -> dict:
    """A docs/model.md §7 profile object with ``min_layers..max_layers`` (inclusive) layers of
    random
    FLOPs (1e9-5e11 per sample), activation bytes (1e5-5e7) and parameter bytes (~1e6-1e9)."""
    num_layers = int(rng.integers(min_layers, max_layers + 1))
    return {
        "layers": [
            {"name": f"l{i}", "fwd_flops": float(rng.uniform(1e9, 5e11)),
             "activation_bytes": float(rng.uniform(1e5, 5e7)),
             "param_bytes": float(rng.choice([1e6, 1e8, 1e9]) * rng.uniform(0.5, 1.5))}
            for i in range(num_layers)
        ]
    }  # fmt: skip
