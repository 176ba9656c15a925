"""Stopping a rank's training loop: on a signal (:class:`StopRequest`, ending in
:class:`TrainingStopped`) or on a non-finite loss or gradient norm (:class:`NonFiniteError`,
its one line from :func:`nonfinite_line`). Used by :mod:`hetrain.runtime.trainer`; the
launcher (:mod:`hetrain.runtime.launch`) turns :class:`TrainingStopped` into its one line."""

from __future__ import annotations

import math
import os
import signal
from typing import Any

from hetrain.runtime import checkpoint as ckpt

EXIT_STOPPED_BY_PEER = 75
"""Exit status of a rank that stopped because another rank was asked to stop (EX_TEMPFAIL): its
agent restarts it into the next round."""
EXIT_STOPPED = 143
"""Exit status of a rank that stopped after its own SIGTERM (128 + 15; 130 after SIGINT)."""
STOP_GRACE_S = 20.0
"""Seconds a rank asked to stop (SIGTERM) waits for the ranks to agree on a stop step (the end of
the current step) before it just exits; below the 30 s torch's elastic agent waits before its
SIGKILL. Once the stop is agreed the checkpoint of that step is never cut short by it (it was 5 s
and cut the stop checkpoint of a join on a loaded machine: the next round redid 4 steps)."""


class StopRequest:
    """A SIGTERM or SIGINT received by this rank (a spot instance's warning, a scale-down,
    Ctrl-C, or the elastic agent restarting the group because a device joins): the loop stops
    after the current step with a checkpoint at a step every rank agrees on. When the step
    cannot finish (a peer is gone), the rank exits anyway after :data:`STOP_GRACE_S` seconds
    (``grace=True``, several ranks), unless the ranks agreed on the stop step first
    (:meth:`agree`): then the stop checkpoint is written whatever it takes (its collectives
    fail by themselves if a peer dies, and the agent's SIGKILL bounds it).

    Attributes:
        requested: a signal arrived.
        signum: the first signal received (``signal.SIGTERM`` or ``signal.SIGINT``), or None.
    """

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self, *, grace: bool = True) -> None:
        self.requested = False
        self.agreed = False
        self.signum: int | None = None
        self._grace = grace
        self._timer: Any = None
        self._previous: dict[int, Any] = {}

    @property
    def signal_name(self) -> str:
        """``"SIGTERM"``/``"SIGINT"`` of the first signal received (``"SIGTERM"`` if none)."""
        return signal.Signals(self.signum).name if self.signum else "SIGTERM"

    @property
    def exit_code(self) -> int:
        """``128 + signal`` of the first signal received (143 for SIGTERM, 130 for SIGINT)."""
        return 128 + (self.signum or 15)

    def install(self) -> StopRequest:
        """Handle SIGTERM and SIGINT in this process (the main thread only) until
        :meth:`restore`."""
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced (idempotent)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        if self._timer is not None:
            self._timer.cancel()

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        import threading

        if self.signum is None:
            self.signum = int(signum)
        self.requested = True
        if not self._grace or self.agreed or self._timer is not None:
            return  # one grace period, none after agreement
        self._timer = threading.Timer(STOP_GRACE_S, os._exit, (self.exit_code,))
        self._timer.daemon = True
        self._timer.start()

    def agree(self) -> None:
        """Every rank knows the stop step (this step's all-gather carried the request): the
        grace timer is cancelled so that it cannot cut the stop checkpoint short."""
        self.agreed = True
        if self._timer is not None:
            self._timer.cancel()


class TrainingStopped(SystemExit):
    """The run stopped on a signal (SIGTERM, SIGINT) after an agreed step; ``code`` is the
    rank's exit status (``128 + signal``, or :data:`EXIT_STOPPED_BY_PEER` for a rank whose
    peer got the signal).

    Attributes:
        step: steps done (the stop step; a rerun resumes here).
        path: the stop checkpoint's folder, or None (no ``--checkpoint-dir``).
        signal_name: ``"SIGTERM"`` or ``"SIGINT"``.
    """

    def __init__(self, code: int, *, step: int, path: str | None, signal_name: str) -> None:
        super().__init__(code)
        self.step = step
        self.path = path
        self.signal_name = signal_name


class NonFiniteError(RuntimeError):
    """A step's loss or global gradient norm was NaN or infinite and the job says
    ``on_nonfinite="stop"``: every rank raises it at that step, before any checkpoint of the
    step and before the export (the last good checkpoint stays the newest). The message is one
    line naming the step and the rank, group and stage where the value first showed."""


def nonfinite_line(
    devices: list[str],
    checkpoint_dir: str | None,
    step: int,
    result: Any,
    table: list[list[float]],
) -> str:
    """The one line of :class:`NonFiniteError` (see there). ``devices``: the device id of each
    rank; ``checkpoint_dir``: the run's checkpoint folder (its newest checkpoint is named), or
    None; ``result``: the step's ``StepResult`` (``loss``, ``grad_norm``); ``table`` has one row
    per rank: ``[own part not finite (0/1), group index, stage index]`` (indices -1 when
    unused)."""
    what = []
    if not math.isfinite(result.loss):
        what.append(f"loss {result.loss}")
    if not math.isfinite(result.grad_norm):
        what.append(f"gradient norm {result.grad_norm}")
    seen = sorted((int(row[1]), int(row[2]), r) for r, row in enumerate(table) if row[0] > 0)
    where = ""
    if seen:
        g, k, r = seen[0]
        where = f" (first on rank {r} ({devices[r]}), group {g} stage {k})"
    latest = ckpt.list_checkpoints(checkpoint_dir) if checkpoint_dir else []
    kept = f"last good checkpoint {latest[-1]}" if latest else "no checkpoint written"
    return (
        f"non-finite {' and '.join(what) or 'value'} at step {step}{where}; run stopped "
        f"(--on-nonfinite skip skips such updates), {kept}, no model exported"
    )
