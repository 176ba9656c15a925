"""The ``step`` lines of the metrics file, written by rank 0 once every rank's measurements of
a step are there (:class:`StepLines`).

A step's measurements ride in the step's own combination of sums (``Worker.step``'s
``report``: one row per rank, docs/runtime.md "Per-step collectives"): a rank's row carries the
times of its *previous* finished step (:func:`measured_row`), so a step's line is complete one
step later, or at the end of the run (:meth:`StepLines.flush`, one gather).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def measured_row(result: Any) -> list[float]:
    """``[step, compute, iteration, send/recv, sync]`` seconds of a rank's step (step -1:
    none yet), the part of the per-step report row the metrics line needs."""
    if result is None:
        return [-1.0, 0.0, 0.0, 0.0, 0.0]
    return [
        float(result.step),
        result.compute_time_s,
        result.iteration_time_s,
        result.send_recv_time_s,
        result.sync_time_s,
    ]


class StepLines:
    """The metrics ``step`` lines still owed and this rank's last finished step.

    Args:
        metrics: rank 0's :class:`~hetrain.runtime.metrics.MetricsWriter` (every rank has one;
            only rank 0's writes a file).
        devices: the device id of each rank.
        lead: this is rank 0 (it writes the lines).
        world: number of ranks.
        coll: the device of collective tensors (CPU for gloo, the GPU for NCCL).
        progress: rank 0's progress bar (``update(step, loss, iteration_time_s, plan_id)``),
            or None.

    Attributes:
        last: this rank's last ``StepResult`` (None before the first step).
        waiting: late results (their sums complete at the next step).
        step_times_s: the iteration time of each written line (the slowest rank's, seconds).
        last_loss: the loss of the last written line (NaN before one).
    """

    def __init__(
        self,
        metrics: Any,
        devices: list[str],
        *,
        lead: bool,
        world: int,
        coll: torch.device,
        progress: Any = None,
    ) -> None:
        self.metrics = metrics
        self.devices = list(devices)
        self.lead = lead
        self.world = world
        self.coll = coll
        self.progress = progress
        self.last: Any = None
        self.waiting: list[Any] = []
        self.step_times_s: list[float] = []
        self.last_loss = float("nan")
        self._lines: dict[int, dict[str, Any]] = {}  # rank 0: step -> its fields so far

    def report_row(self, head: list[float]) -> list[float]:
        """This rank's row of the step's report: ``head`` (the stop and plan flags) followed by
        :func:`measured_row` of its last finished step."""
        return [*head, *measured_row(self.last)]

    def begin(self, step: int, result: Any, fields: dict[str, Any]) -> None:
        """Rank 0: the fields of ``step``'s line known when it finishes (``result`` and the
        plan's); the measured times follow with the rows."""
        self._lines[step] = {"result": result, **fields}

    def ready(self, result: Any) -> list[Any]:
        """The finished steps whose sums are complete now (late ones of the previous step and
        ``result`` unless it is late itself); ``result`` becomes :attr:`last`."""
        self.last = result
        ready = [*self.waiting, *([] if result.late else [result])]
        self.waiting = [result] if result.late else []
        return ready

    def write_line(self, table: list[list[float]]) -> None:
        """Rank 0: the ``step`` line of the step whose measurements ``table`` (one report row
        per rank) carries, if it is owed."""
        measured = int(table[0][2])
        fields = self._lines.pop(measured, None)
        if fields is None:
            return
        result = fields.pop("result")
        self.last_loss = result.loss
        iteration_time_s = max(r[4] for r in table)
        self.step_times_s.append(iteration_time_s)
        self.metrics.write(
            "step",
            measured,
            loss=result.loss,
            iteration_time_s=iteration_time_s,
            grad_norm=result.grad_norm,
            compute_time_s={d: r[3] for d, r in zip(self.devices, table, strict=True)},
            send_recv_time_s={d: r[5] for d, r in zip(self.devices, table, strict=True)},
            sync_time_s=max(r[6] for r in table),
            **fields,
            **({} if math.isfinite(result.loss + result.grad_norm) else {"skipped": True}),
        )
        if self.progress is not None:
            self.progress.update(measured, result.loss, iteration_time_s, fields["plan_id"])

    def flush(self) -> None:
        """Write the lines still owed (late results and the last finished step's
        measurements: one gather; on every rank at the same point, at the end of the run or
        before a non-finite stop)."""
        for done in self.waiting:
            if self.lead:
                self.write_line(done.report)
        if self.last is not None:
            mine = torch.tensor(measured_row(self.last), dtype=torch.float64, device=self.coll)
            rows = [mine]
            if self.world > 1:
                rows = [torch.zeros_like(mine) for _ in range(self.world)]
                dist.all_gather(rows, mine)
            if self.lead:
                self.write_line([[0.0, 0.0, *r.tolist()] for r in rows])
