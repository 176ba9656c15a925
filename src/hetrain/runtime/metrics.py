"""The JSONL metrics file of a training run: one JSON object per line, one line per event.

Every line has ``event`` and ``step`` and ``time_s`` (seconds since the run started).

- ``"step"`` (one per iteration): ``loss`` (mean over the global batch), ``iteration_time_s``
  (wall time of the iteration on the slowest rank, seconds), ``plan_id`` (integer, grows with
  each new plan), ``global_batch`` (B), ``shares`` (``b_g`` per group, plan order),
  ``lr``, ``compute_time_s`` (per rank: measured compute of the rank's stage, emulated
  slow-down included), ``slowdown`` (per rank: emulated factor in force), ``skipped``
  (only when true: the loss or gradient norm was not finite and no rank updated,
  ``--on-nonfinite skip``).
- ``"plan"``: the plan in force from ``step`` on (``plan``: the docs/model.md §7 plan object);
  written at
  the start and after each change.
- ``"replan"``: the plan changed before ``step``: ``plan_id``, ``old_plan_id``, ``reason``,
  ``predicted_time_s``/``current_time_s`` (cost-model estimates on the measured speeds),
  ``migration_time_s`` (measured time of ``apply_plan``), ``structure_changed``.
- ``"checkpoint"``: ``path`` of the checkpoint written after ``step`` steps.
- ``"restart"``: the run resumed from the checkpoint ``path`` at ``step``.
- ``"timeline"``: ``groups``, per group per stage the measured ``(kind, microbatch, start_s,
  end_s)`` events of one iteration (from the engine's measurements), for the report.
- ``"nonfinite"``: the run stopped at this step on a NaN/inf loss or gradient norm
  (``message``: the error line; ``--on-nonfinite stop``).
- ``"end"``: final ``metrics`` (validation quality) and ``wall_time_s``.

Sinks: :class:`MetricsWriter` also hands every record to its ``sinks`` (objects with
``write(record)`` and ``close()``); :class:`TensorBoardSink` writes TensorBoard event files
(``hetrain train --tensorboard``, ``hetrain.train(..., tensorboard=True)``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetrain._io import read_jsonl

EVENTS = (
    "step",
    "plan",
    "replan",
    "checkpoint",
    "restart",
    "stop",
    "nonfinite",
    "timeline",
    "end",
)


def _clean(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become None, tuples lists, numpy scalars floats."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Append events to a JSONL file (flushed per line so a crash loses nothing written).

    Args:
        path: the file; its parent folder is created. ``None`` = keep events in memory only.
        append: keep existing lines (a resumed run continues the same file).
        sinks: more consumers of every record (``write(record)``, ``close()``), e.g.
            :class:`TensorBoardSink`.
    """

    def __init__(
        self, path: str | Path | None, *, append: bool = False, sinks: Sequence[Any] = ()
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.sinks = list(sinks)
        self.start_time = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def write(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        """Write one event line; returns the record.

        Raises:
            ValueError: unknown ``event``.
        """
        if event not in EVENTS:
            raise ValueError(f"event: expected one of {EVENTS}, got {event!r}")
        record = {"event": event, "step": int(step)}
        record["time_s"] = round(time.perf_counter() - self.start_time, 6)
        record.update(_clean(fields))
        self.events.append(record)
        if self._fh is not None:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
        for sink in self.sinks:
            sink.write(record)
        return record

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


TENSORBOARD_INSTALL_HINT = "pip install 'hetrain[tensorboard]'"


def check_tensorboard(option: str = "--tensorboard") -> None:
    """Check that ``torch.utils.tensorboard`` can be imported (it needs the ``tensorboard``
    package, the optional extra ``hetrain[tensorboard]``).

    Raises:
        InputError: the package is missing (one line naming ``option`` and how to install it).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        from hetrain.errors import InputError

        raise InputError(
            option,
            "",
            f"expected the tensorboard package (not installed): {TENSORBOARD_INSTALL_HINT}",
        ) from None


class TensorBoardSink:
    """A metrics sink that writes TensorBoard event files into ``log_dir`` with
    ``torch.utils.tensorboard.SummaryWriter`` (TensorBoard's own format, read by
    ``tensorboard --logdir``). The global step is the training step.

    Scalars written, per event of the metrics file:

    - ``step``: ``train/loss``, ``train/iteration_time_s``, ``train/lr``, ``train/grad_norm``,
      ``plan/plan_id``, ``plan/global_batch`` and ``shares/group<g>`` (``b_g``, samples);
    - ``replan``: ``plan/predicted_time_s`` and ``plan/migration_time_s``;
    - ``end``: every validation metric as ``val/<name>`` without a ``val_`` prefix (``val_loss``
      -> ``val/loss``, ``val_accuracy`` -> ``val/accuracy``) and
      ``run/wall_time_s``.

    Raises:
        InputError: (at construction) the ``tensorboard`` package is missing.
    """

    def __init__(self, log_dir: str | Path) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def _scalar(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return
        if math.isfinite(value):
            self._writer.add_scalar(tag, value, global_step=step)

    def write(self, record: dict[str, Any]) -> None:
        """Write the scalars of one metrics record (other events are ignored)."""
        event, step = record.get("event"), int(record.get("step", 0))
        if event == "step":
            for key in ("loss", "iteration_time_s", "lr", "grad_norm"):
                self._scalar(f"train/{key}", record.get(key), step)
            for key in ("plan_id", "global_batch"):
                self._scalar(f"plan/{key}", record.get(key), step)
            for g, share in enumerate(record.get("shares") or []):
                self._scalar(f"shares/group{g}", share, step)
        elif event == "replan":
            for key in ("predicted_time_s", "migration_time_s"):
                self._scalar(f"plan/{key}", record.get(key), step)
        elif event == "end":
            for name, value in (record.get("metrics") or {}).items():
                self._scalar(f"val/{name.removeprefix('val_')}", value, step)
            self._scalar("run/wall_time_s", record.get("wall_time_s"), step)
        else:
            return
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All events of a metrics file, in order (:func:`hetrain._io.read_jsonl`: its JSON-object
    lines; a torn line or one that is not an object is skipped)."""
    return read_jsonl(path)
