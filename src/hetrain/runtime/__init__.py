"""Runtime: the only code that talks to processes (docs/model.md §5). The engine is
:class:`hetrain.runtime.engine.Worker`; see ``docs/runtime.md``.

The names below are imported on first use (PEP 562), so that importing a torch-free module of
this package (``hetrain.runtime.adapt``'s controller, which ``hetrain simulate --replay`` runs)
does not import torch."""

from __future__ import annotations

from typing import Any

__all__ = [
    "Emulation",
    "MigrationResult",
    "OptimizerSpec",
    "StepResult",
    "Worker",
    "gather_measurements",
]

_SOURCES = {
    "Emulation": "hetrain.runtime.emulation",
    "MigrationResult": "hetrain.runtime.engine",
    "StepResult": "hetrain.runtime.engine",
    "Worker": "hetrain.runtime.engine",
    "gather_measurements": "hetrain.runtime.engine",
    "OptimizerSpec": "hetrain.runtime.optim",
}


def __getattr__(name: str) -> Any:
    if name in _SOURCES:
        import importlib

        return getattr(importlib.import_module(_SOURCES[name]), name)
    raise AttributeError(f"module 'hetrain.runtime' has no attribute {name!r}")
