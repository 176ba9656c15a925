"""What one engine step and one plan change report: :class:`StepResult` (seconds, bytes, the
loss and gradient norm, completed late when the step's sums travel non-blocking),
:class:`MigrationResult`, and :func:`gather_measurements` (every rank's results on every rank).
See docs/runtime.md.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class StepResult:
    """What one rank measured in one step (seconds and bytes).

    Attributes:
        loss: mean loss over the global batch ``B`` (identical on every rank).
        grad_norm: global L2 norm of the combined gradient before clipping (every layer counted
            once).
        compute_time_s: forward + backward time of this rank's stage over all its
            micro-batches, emulated slow-down included (``emulated_compute_time_s`` of it, the
            time actually slept; ``compute_time_s - emulated_compute_time_s`` is the real
            compute, which the sleeps are ``factor - 1`` times).
        send_recv_time_s: time blocked in pipeline send/recv (emulated link delay included).
        link_time_s: peer device -> time blocked receiving from it.
        sync_time_s: gradient all-reduce/broadcast time; ``sync_bytes`` all-reduced.
        iteration_time_s: wall time of the whole step on this rank.
        skipped: the global loss or gradient norm was not finite, so no rank updated its
            weights or optimizer state at this step (the same on every rank: both are
            all-reduced before the update).
        nonfinite_here: this rank's own loss part or gradient square norm was not finite
            (where a NaN/inf first showed; set only on skipped steps).
        group_index / stage_index / stage: this rank's place in the plan (None if unused);
        batch: ``b_g``; microbatch_size: ``μ_g``; num_microbatches: ``n_g``.
        report: the rows the ranks passed to :meth:`Worker.step` as ``report`` (index = rank;
            empty rows without one), the same on every rank.
        late: ``loss``, ``grad_norm`` and ``report`` travelled in a non-blocking all-reduce
            that the next :meth:`Worker.step` completes (on every rank, at its end); reading
            one of them earlier waits for it (docs/runtime.md "Per-step collectives").
    """

    step: int
    rank: int
    device_id: str
    plan_id: int | None
    loss: float
    grad_norm: float
    iteration_time_s: float
    compute_time_s: float
    forward_time_s: float
    backward_time_s: float
    emulated_compute_time_s: float
    send_recv_time_s: float
    sync_time_s: float
    sync_bytes: int
    optimizer_time_s: float
    bytes_sent: int
    bytes_received: int
    group_index: int | None
    stage_index: int | None
    stage: tuple[int, int] | None
    batch: int
    microbatch_size: int
    num_microbatches: int
    link_time_s: dict[str, float] = field(default_factory=dict)
    skipped: bool = False
    nonfinite_here: bool = False
    report: list[list[float]] = field(default_factory=list)
    late: bool = False
    _pending: Any = field(default=None, repr=False, compare=False)

    def __getattribute__(self, name: str) -> Any:
        if name in _LATE_FIELDS and object.__getattribute__(self, "_pending") is not None:
            object.__getattribute__(self, "_pending").resolve()
        return object.__getattribute__(self, name)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (late values waited for)."""
        return {
            f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name[0] != "_"
        }


_LATE_FIELDS = frozenset({"loss", "grad_norm", "report"})
_SUMS_HEAD = 5  # loss sum, squared gradient norm, item count, (sum, count) flag, random-op flag


class _LateSums:
    """A step's sums in flight; :meth:`resolve` waits for them (``fetch()``: the summed
    vector as floats) and fills the step's :class:`StepResult` (idempotent)."""

    def __init__(
        self,
        fetch: Callable[[], list[float]],
        result: StepResult,
        world: int,
        num_flags: int,
    ) -> None:
        self.fetch, self.result, self.world = fetch, result, world
        self.num_flags = num_flags  # got-gradient flags between the head and the report rows
        self.random_problems = 0.0
        self.done = False
        self.values: list[float] | None = None

    def prefetch(self) -> None:
        """Wait for the values now (kept for :meth:`resolve`, which then waits no more)."""
        if self.values is None:
            self.values = self.fetch()

    def resolve(self) -> None:
        if self.done:
            return
        self.done = True
        self.prefetch()
        values = self.values
        result = self.result
        object.__setattr__(result, "_pending", None)
        result.loss = values[0]
        result.grad_norm = math.sqrt(max(values[1], 0.0))
        result.report = _rows(values[_SUMS_HEAD + self.num_flags :], self.world)
        self.random_problems = values[4]


STORE_SLOTS = 3
"""Store keys per rank that :class:`StoreSums` cycles through (step modulo this)."""


class StoreSums:
    """Per-step sums of every rank through the process group's key-value store, without a
    collective: :meth:`post` writes this rank's vector of step ``t`` under its own key (one
    store request), :meth:`fetch` reads every rank's (one request) and sums them in rank order.

    A value is ``float64[t, *vector]``; the keys ``{prefix}/{t mod STORE_SLOTS}/{rank}`` are
    reused, so the store holds ``STORE_SLOTS x world`` keys at most. Reading step ``t`` while
    a rank's key still holds an older step (only a rank that holds no stage can get that far
    ahead) waits for it: every rank posts step ``t`` before it reads step ``t - 1`` finished,
    so a key is never overwritten before every rank read it (``STORE_SLOTS >= 2``).

    Raises (:meth:`fetch`):
        RuntimeError: a rank's value of step ``t`` did not arrive within ``timeout_s``.
    """

    def __init__(self, store: Any, prefix: str, rank: int, world: int, timeout_s: float) -> None:
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world
        self.timeout_s = timeout_s

    def _keys(self, step: int) -> list[str]:
        slot = step % STORE_SLOTS
        return [f"{self.prefix}/{slot}/{r}" for r in range(self.world)]

    def post(self, step: int, vector: torch.Tensor) -> Callable[[], list[float]]:
        """Write this rank's ``vector`` (1-D float64) of ``step``; returns the ``fetch`` of
        that step."""
        value = np.concatenate(([float(step)], vector.detach().cpu().numpy()))
        self.store.set(self._keys(step)[self.rank], value.astype(np.float64).tobytes())
        return lambda: self.fetch(step, vector.numel())

    def fetch(self, step: int, length: int) -> list[float]:
        """Every rank's vector of ``step``, summed in rank order (float64)."""
        keys = self._keys(step)
        deadline = time.monotonic() + self.timeout_s
        while True:
            rows = [np.frombuffer(v, dtype=np.float64) for v in self.store.multi_get(keys)]
            if all(r.size == length + 1 and r[0] == step for r in rows):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"step sums: no value of step {step} from every rank within "
                    f"{self.timeout_s:.0f} s"
                )
            time.sleep(0.001)
        total = rows[0][1:].copy()
        for r in rows[1:]:
            total += r[1:]
        return total.tolist()


def _rows(flat: list[float], world: int) -> list[list[float]]:
    width = len(flat) // world if world else 0
    return [flat[r * width : (r + 1) * width] for r in range(world)]


@dataclass(frozen=True)
class MigrationResult:
    """What :meth:`Worker.apply_plan` moved: ``transfers`` layer copies in all (every rank),
    of which this rank sent ``bytes_sent`` and received ``bytes_received`` payload bytes
    (parameters, buffers and optimizer state, serialised), in ``time_s`` seconds (emulated
    link time included)."""

    transfers: int
    bytes_sent: int
    bytes_received: int
    time_s: float


def gather_measurements(result: StepResult) -> list[dict[str, Any]]:
    """All-gather every rank's :class:`StepResult` (collective); returns one dict per rank
    (index = rank) on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, result.to_dict())
    return out
