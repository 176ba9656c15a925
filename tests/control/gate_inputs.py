"""Inputs shared by the controller's gate tests: a two-layer model whose move is expensive.

Two layers of 1e10 FLOP forward per sample, 62.5 MB of parameters each (moving the model costs
3 s with Adam state over 1 Gbit/s, syncing it 1 s) and 100 MB activations (a pipeline is
hopeless): on two devices the best plan is the faster device alone."""

from __future__ import annotations

from hetrain.profile import ProfileArrays, profile_from_dict


def two_layer_profile() -> ProfileArrays:
    """The two-layer model (module docstring)."""
    return profile_from_dict(
        {
            "name": "two-layer",
            "layers": [
                {
                    "name": f"l{i}",
                    "fwd_flops": 1e10,
                    "activation_bytes": 1e8,
                    "activation_memory_bytes": 1e6,
                    "param_bytes": 6.25e7,
                }
                for i in range(2)
            ],
        }
    ).arrays()
