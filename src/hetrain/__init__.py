"""hetrain: joint dynamic data and pipeline parallelism over heterogeneous, changing devices.

The planning path (:mod:`hetrain.cluster`, :mod:`hetrain.profile`, :mod:`hetrain.plan`,
:mod:`hetrain.costmodel`, :mod:`hetrain.planner`, :mod:`hetrain.control`, :mod:`hetrain.sim`)
imports neither torch nor anything with side effects. :func:`train` is the one entry point that
needs torch: ``hetrain.train`` is :func:`hetrain.runtime.api.train` itself (same signature and
docstring), imported on first access (PEP 562 module ``__getattr__``) so that ``import hetrain``
stays light. The model hetrain plans with is described in ``docs/model.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["__version__", "train"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from hetrain.runtime.api import train

#: public names imported on first access: name -> module that defines it
_LAZY = {"train": "hetrain.runtime.api"}


def __getattr__(name: str) -> Any:
    """Import the public function ``name`` on first access (``hetrain.train`` imports torch).

    Raises:
        AttributeError: ``name`` is not a public name of hetrain.
    """
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hetrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
