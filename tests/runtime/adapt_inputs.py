"""Shared inputs of the runtime controller's pure-logic tests: a model of 8 equal blocks on
ranks of :data:`SPEED` FLOP/s at start-up (1 ms a sample for the whole model)."""

from __future__ import annotations

import numpy as np

from hetrain.profile import ProfileArrays

SPEED = 1e10  # FLOP/s of a fast rank at start-up
KAPPA = 2e-3  # s per micro-batch and stage (start-up calibration)
PER_SAMPLE_S = 1e-3  # the whole model, one sample, fast rank


def blocks_profile(param_bytes: float = 4e4) -> ProfileArrays:
    """8 equal blocks, forward ``f`` and backward ``2 f`` FLOPs: :data:`PER_SAMPLE_S` a sample
    for the whole model at :data:`SPEED`; ``param_bytes`` per block."""
    f = np.full(8, PER_SAMPLE_S * SPEED / 3 / 8)
    return ProfileArrays(
        names=tuple(f"block{i}" for i in range(8)),
        fwd_flops=f,
        bwd_flops=2 * f,
        activation_bytes=np.full(8, 256.0),
        activation_memory_bytes=np.full(8, 256.0),
        param_bytes=np.full(8, param_bytes),
    )
