"""Traces of cluster dynamics (docs/model.md §7): one CSV row per change,
``slot,device,speed_factor,available,price_per_hour,nic_gbps``.

A row for slot t sets the device's state from slot t on; empty cells mean "unchanged";
``speed_factor`` multiplies the device's base ``tflops``; rows are in non-decreasing slot order.
:meth:`Trace.timeline` expands a trace to dense ``(slots, D)`` arrays and
:meth:`TraceTimeline.state_at` gives the :class:`~hetrain.cluster.ClusterState` of one slot.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetrain._io import MAX_NUMBER, MIN_POSITIVE, read_text
from hetrain.cluster import GBPS_TO_BYTES_PER_S, ClusterSpec, ClusterState
from hetrain.errors import InputError

TRACE_COLUMNS = ("slot", "device", "speed_factor", "available", "price_per_hour", "nic_gbps")


@dataclass(frozen=True)
class TraceRow:
    """One change: from ``slot`` on, ``device`` has these values (``None`` = unchanged).
    ``price_per_hour`` in currency/hour, ``nic_gbps`` in Gbit/s."""

    slot: int
    device: str
    speed_factor: float | None = None
    available: bool | None = None
    price_per_hour: float | None = None
    nic_gbps: float | None = None


@dataclass(frozen=True)
class Trace:
    """A validated trace: rows in non-decreasing slot order."""

    rows: tuple[TraceRow, ...]
    source: str = "<trace>"

    def timeline(self, cluster: ClusterSpec, num_slots: int) -> TraceTimeline:
        """Dense per-slot arrays for slots ``0..num_slots-1``.

        Raises:
            InputError: a row names a device not in ``cluster``.
        """
        ids = cluster.ids
        index = {d: i for i, d in enumerate(ids)}
        base = cluster.state()
        n, d_count = max(int(num_slots), 0), len(ids)
        speed = np.ones((n, d_count))
        avail = np.ones((n, d_count), dtype=bool)
        price = np.tile(base.price_per_s, (n, 1))
        nic = np.tile(base.nic_bytes_per_s, (n, 1))
        for i, row in enumerate(self.rows):
            if row.device not in index:
                raise InputError(
                    self.source,
                    f"row {i + 2}.device",
                    f"expected a device id of the cluster file, got {row.device!r}",
                )
            if row.slot >= n:
                continue
            j, s = index[row.device], row.slot
            if row.speed_factor is not None:
                speed[s:, j] = row.speed_factor
            if row.available is not None:
                avail[s:, j] = row.available
            if row.price_per_hour is not None:
                price[s:, j] = row.price_per_hour / 3600.0
            if row.nic_gbps is not None:
                nic[s:, j] = row.nic_gbps * GBPS_TO_BYTES_PER_S
        return TraceTimeline(base, speed, avail, price, nic)


@dataclass(frozen=True)
class TraceTimeline:
    """Dense dynamics, arrays of shape ``(slots, D)``: ``speed_factor`` (multiplies base
    FLOP/s), ``available``, ``price_per_s`` (currency/s), ``nic_bytes_per_s``."""

    base: ClusterState
    speed_factor: np.ndarray
    available: np.ndarray
    price_per_s: np.ndarray
    nic_bytes_per_s: np.ndarray

    @property
    def num_slots(self) -> int:
        return int(self.speed_factor.shape[0])

    def state_at(self, slot: int) -> ClusterState:
        """The cluster state of ``slot`` (0-based); the last slot's state beyond the end."""
        s = min(max(int(slot), 0), self.num_slots - 1)
        if self.num_slots == 0:
            return self.base
        return self.base.with_changes(
            speed_flops=self.base.speed_flops * self.speed_factor[s],
            available=self.available[s].copy(),
            price_per_s=self.price_per_s[s].copy(),
            nic_bytes_per_s=self.nic_bytes_per_s[s].copy(),
        )


def _parse_float(source: str, line: int, col: str, text: str, lo: float) -> float | None:
    text = text.strip()
    if text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise InputError(source, f"row {line}.{col}", f"expected a number, got {text!r}") from None
    strictly_positive = col in ("speed_factor", "nic_gbps")
    if (
        not math.isfinite(value)
        or value < lo
        or value > MAX_NUMBER
        or (strictly_positive and value < MIN_POSITIVE)
    ):
        bound = f">= {MIN_POSITIVE:g}" if strictly_positive else f">= {lo:g}"
        raise InputError(
            source,
            f"row {line}.{col}",
            f"expected a finite number {bound} and <= {MAX_NUMBER:g}, got {text}",
        )
    return value


def load_trace(path: str | Path, cluster: ClusterSpec | None = None) -> Trace:
    """Load and validate a docs/model.md §7 trace CSV. With ``cluster``, device ids are checked too.

    Raises:
        InputError: missing file, wrong header, non-integer or decreasing slots, bad numbers,
            ``available`` not 0/1, unknown devices (when ``cluster`` is given).
    """
    source = str(path)
    text = read_text(path)
    reader = csv.reader(text.splitlines())
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise InputError(source, "header", f"expected columns {','.join(TRACE_COLUMNS)}") from None
    except csv.Error:
        raise InputError(source, "header", "expected a CSV header") from None
    unknown = [h for h in header if h not in TRACE_COLUMNS]
    if unknown:
        raise InputError(
            source, f"header.{unknown[0]}", f"unknown column; expected {','.join(TRACE_COLUMNS)}"
        )
    for required in ("slot", "device"):
        if required not in header:
            raise InputError(source, f"header.{required}", "missing required column")
    if len(set(header)) != len(header):
        raise InputError(source, "header", "duplicate column")
    known = set(cluster.ids) if cluster is not None else None
    rows: list[TraceRow] = []
    last_slot = 0
    try:
        for line, cells in enumerate(reader, start=2):
            if not cells or all(not c.strip() for c in cells):
                continue
            if len(cells) != len(header):
                raise InputError(
                    source, f"row {line}", f"expected {len(header)} cells, got {len(cells)}"
                )
            rec = dict(zip(header, cells, strict=True))
            slot_text = rec["slot"].strip()
            if not (slot_text.isascii() and slot_text.isdigit() and len(slot_text) <= 18):
                raise InputError(
                    source, f"row {line}.slot", f"expected an integer >= 0, got {slot_text!r}"
                )
            slot = int(slot_text)
            if slot < last_slot:
                raise InputError(
                    source,
                    f"row {line}.slot",
                    f"expected slots in non-decreasing order, got {slot} after {last_slot}",
                )
            last_slot = slot
            device = rec["device"].strip()
            if not device:
                raise InputError(source, f"row {line}.device", "expected a device id")
            if known is not None and device not in known:
                raise InputError(
                    source,
                    f"row {line}.device",
                    f"expected a device id of the cluster file, got {device!r}",
                )
            avail_text = rec.get("available", "").strip()
            if avail_text not in ("", "0", "1"):
                raise InputError(
                    source, f"row {line}.available", f"expected 0 or 1, got {avail_text!r}"
                )
            rows.append(
                TraceRow(
                    slot=slot,
                    device=device,
                    speed_factor=_parse_float(
                        source, line, "speed_factor", rec.get("speed_factor", ""), 0.0
                    ),
                    available=None if avail_text == "" else avail_text == "1",
                    price_per_hour=_parse_float(
                        source, line, "price_per_hour", rec.get("price_per_hour", ""), 0.0
                    ),
                    nic_gbps=_parse_float(source, line, "nic_gbps", rec.get("nic_gbps", ""), 0.0),
                )
            )
    except csv.Error as exc:
        raise InputError(source, "", f"expected valid CSV ({exc})") from None
    return Trace(tuple(rows), source)


def write_trace(path: str | Path, rows: list[TraceRow]) -> None:
    """Write rows as a docs/model.md §7 trace CSV (sorted by slot, stable)."""
    ordered = sorted(rows, key=lambda r: r.slot)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(TRACE_COLUMNS)
        for r in ordered:
            w.writerow(
                [
                    r.slot,
                    r.device,
                    "" if r.speed_factor is None else f"{r.speed_factor:.6g}",
                    "" if r.available is None else int(r.available),
                    "" if r.price_per_hour is None else f"{r.price_per_hour:.6g}",
                    "" if r.nic_gbps is None else f"{r.nic_gbps:.6g}",
                ]
            )
