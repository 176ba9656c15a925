"""Runtime: the only code that talks to processes (docs/model.md §5). The engine is
:class:`hetrain.runtime.engine.Worker`; see ``docs/runtime.md``."""

from hetrain.runtime.emulation import Emulation
from hetrain.runtime.engine import MigrationResult, StepResult, Worker, gather_measurements
from hetrain.runtime.optim import OptimizerSpec

__all__ = [
    "Emulation",
    "MigrationResult",
    "OptimizerSpec",
    "StepResult",
    "Worker",
    "gather_measurements",
]
