"""hetrain: joint dynamic data and pipeline parallelism over heterogeneous, changing devices.

The planning path (:mod:`hetrain.cluster`, :mod:`hetrain.profile`, :mod:`hetrain.plan`,
:mod:`hetrain.costmodel`, :mod:`hetrain.planner`, :mod:`hetrain.control`, :mod:`hetrain.sim`)
imports neither torch nor anything with side effects. :func:`train` is the one entry point that
needs torch; it is imported lazily.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "train"]


def train(*args, **kwargs):
    """Train a model with hetrain's runtime; see :func:`hetrain.runtime.api.train`."""
    from hetrain.runtime.api import train as _train

    return _train(*args, **kwargs)
