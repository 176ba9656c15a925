"""Converters from the real public traces in ``../shared/data`` into docs/model.md §7 trace rows.

Each converter maps one real time series onto the devices of a cluster and onto slots
(``slot_seconds`` of real time per slot, so a long history fits in a run of N slots) and returns
:class:`~hetrain.trace.TraceRow` lists sorted by slot. The sources and their formats are described
in each folder's PROVENANCE.md:

* :func:`spot_price_rows` — ``spot-prices-aws/<region>/<instance>.json``: AWS
  ``describe-spot-price-history`` (USD/hour per instance, price-change events);
* :func:`bamboo_event_rows` — ``bamboo/p3-trace.csv``, ``g4dn-trace.csv``: ``delta_ms,add|remove,
  node`` spot instance events;
* :func:`instance_count_rows` — ``bamboo/*x1-*.txt``: ``YYYY-MM-DD, HH:MM:SS, N`` running
  preemptible instances;
* :func:`spot_log_rows` — ``spot-availability/availability/persistent_*.out``: "Created instance
  X with N GPU(s)", "Instance X running", "Instance X not running" (preempted);
* :func:`straggler_rows_from_alibaba` — ``alibaba-stragglers/gpu-v2020__job_*_norm.csv``:
  per-worker mini-batch time (normalised), turned into speed factors ``median / time``.

Raises :class:`~hetrain.errors.InputError` (file and field named) on unreadable or malformed
input.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import numpy as np

from hetrain.errors import InputError
from hetrain.trace import TraceRow


def _read_text(path: str | Path) -> str:
    p = Path(path)
    if not p.is_file():
        raise InputError(str(path), "", "file not found")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(str(path), "", f"cannot read file ({type(exc).__name__})") from None


def _check_slots(slots: int, slot_seconds: float | None = None) -> None:
    if int(slots) < 1:
        raise ValueError(f"slots: expected an integer >= 1, got {slots!r}")
    if slot_seconds is not None and not (math.isfinite(slot_seconds) and slot_seconds > 0):
        raise ValueError(f"slot_seconds: expected a finite number > 0, got {slot_seconds!r}")


def spot_price_rows(
    path: str | Path,
    devices: Sequence[str],
    slots: int,
    *,
    slot_seconds: float = 3600.0,
    zone: str | None = None,
    gpus_per_instance: int = 1,
    start: str | None = None,
) -> list[TraceRow]:
    """Spot price history -> ``price_per_hour`` rows (per GPU: instance price / GPUs).

    Args:
        path: an AWS spot price JSON (``{"SpotPriceHistory": [{AvailabilityZone, SpotPrice,
            Timestamp}, ...]}``).
        devices: the devices billed at this price.
        slots: number of slots to cover.
        slot_seconds: real seconds per slot.
        zone: availability zone (default: the zone with the most records).
        gpus_per_instance: GPUs per instance (p3.8xlarge: 4).
        start: ISO time of slot 0 (default: the first record of the zone).

    Raises:
        InputError: not the expected JSON, bad price or timestamp, unknown zone.
    """
    _check_slots(slots, slot_seconds)
    source = str(path)
    try:
        records = json.loads(_read_text(path))["SpotPriceHistory"]
    except (ValueError, KeyError, TypeError):
        raise InputError(source, "SpotPriceHistory", "expected AWS spot price JSON") from None
    zones: dict[str, list[tuple[float, float]]] = {}
    for i, rec in enumerate(records):
        try:
            ts = _iso_seconds(rec["Timestamp"])
            price = float(rec["SpotPrice"])
            z = str(rec["AvailabilityZone"])
        except (KeyError, ValueError, TypeError):
            raise InputError(source, f"SpotPriceHistory[{i}]", "expected a price record") from None
        if not (math.isfinite(price) and price >= 0):
            raise InputError(source, f"SpotPriceHistory[{i}].SpotPrice", f"got {price}")
        zones.setdefault(z, []).append((ts, price))
    if not zones:
        raise InputError(source, "SpotPriceHistory", "expected at least one record")
    if zone is None:
        zone = max(zones, key=lambda z: len(zones[z]))
    if zone not in zones:
        raise InputError(source, "AvailabilityZone", f"no records for zone {zone!r}")
    series = sorted(zones[zone])
    t0 = _iso_seconds(start) if start is not None else series[0][0]
    rows: list[TraceRow] = []
    last_price = None
    current = series[0][1]
    k = 0
    for slot in range(int(slots)):
        now = t0 + slot * slot_seconds
        while k < len(series) and series[k][0] <= now:
            current = series[k][1]
            k += 1
        if current != last_price:
            per_gpu = current / max(int(gpus_per_instance), 1)
            rows += [TraceRow(slot=slot, device=d, price_per_hour=per_gpu) for d in devices]
            last_price = current
    return rows


def bamboo_event_rows(
    path: str | Path,
    devices: Sequence[str],
    slots: int,
    *,
    slot_seconds: float = 60.0,
) -> list[TraceRow]:
    """Bamboo spot events ``delta_ms,add|remove,node`` -> ``available`` rows.

    Nodes are assigned to free devices first-come (a removed node frees its device); nodes that
    find no free device are ignored. Every device starts unavailable (slot 0 rows) unless a node
    is added at time 0.

    Raises:
        InputError: a malformed line.
    """
    _check_slots(slots, slot_seconds)
    source = str(path)
    events: list[tuple[int, str, str]] = []
    for line_no, cells in enumerate(csv.reader(_read_text(path).splitlines()), start=1):
        if not cells:
            continue
        if len(cells) != 3 or cells[1].strip() not in ("add", "remove"):
            raise InputError(source, f"line {line_no}", "expected delta_ms,add|remove,node")
        try:
            ms = float(cells[0])
        except ValueError:
            raise InputError(source, f"line {line_no}.delta_ms", "expected a number") from None
        slot = int(ms / 1000.0 // slot_seconds)
        events.append((slot, cells[1].strip(), cells[2].strip()))
    events.sort(key=lambda e: e[0])
    rows = [TraceRow(slot=0, device=d, available=False) for d in devices]
    free = list(devices)
    owner: dict[str, str] = {}
    for slot, kind, node in events:
        if slot >= slots:
            break
        if kind == "add" and node not in owner and free:
            dev = free.pop(0)
            owner[node] = dev
            rows.append(TraceRow(slot=slot, device=dev, available=True))
        elif kind == "remove" and node in owner:
            dev = owner.pop(node)
            free.append(dev)
            rows.append(TraceRow(slot=slot, device=dev, available=False))
    return rows


def instance_count_rows(
    path: str | Path,
    devices: Sequence[str],
    slots: int,
    *,
    slot_seconds: float = 60.0,
    max_instances: int | None = None,
) -> list[TraceRow]:
    """Counts of running instances (``YYYY-MM-DD, HH:MM:SS, N``) -> ``available`` rows: in each
    slot the first ``round(D · N / max_instances)`` devices are up (``max_instances``: the largest
    N of the file by default).

    Raises:
        InputError: a malformed line.
    """
    _check_slots(slots, slot_seconds)
    source = str(path)
    samples: list[tuple[float, int]] = []
    for line_no, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = datetime.strptime(f"{parts[0]} {parts[1]}", "%Y-%m-%d %H:%M:%S").timestamp()
            n = int(parts[2])
        except (ValueError, IndexError):
            raise InputError(
                source, f"line {line_no}", "expected 'YYYY-MM-DD, HH:MM:SS, N'"
            ) from None
        samples.append((ts, n))
    if not samples:
        raise InputError(source, "", "expected at least one line")
    samples.sort()
    top = max_instances or max(n for _, n in samples) or 1
    t0 = samples[0][0]
    d_count = len(devices)
    rows: list[TraceRow] = []
    up = -1
    k = 0
    count = samples[0][1]
    for slot in range(int(slots)):
        now = t0 + slot * slot_seconds
        while k < len(samples) and samples[k][0] <= now:
            count = samples[k][1]
            k += 1
        want = min(d_count, max(0, round(d_count * count / top)))
        if want != up:
            for j, dev in enumerate(devices):
                was = up < 0 or j < up
                now_up = j < want
                if up < 0 or was != now_up:
                    rows.append(TraceRow(slot=slot, device=dev, available=now_up))
            up = want
    return rows


_CREATED = re.compile(r"^\[(?P<ts>[^\]]+)\] Created instance (?P<id>\S+) with (?P<n>\d+) GPU")
_RUNNING = re.compile(r"^\[(?P<ts>[^\]]+)\] Instance (?P<id>\S+) running")
_GONE = re.compile(r"^\[(?P<ts>[^\]]+)\] Instance (?P<id>\S+) not running")


def spot_log_rows(
    path: str | Path,
    devices: Sequence[str],
    slots: int,
    *,
    slot_seconds: float = 60.0,
) -> list[TraceRow]:
    """Spot availability logs (training_on_a_dime) -> ``available`` rows.

    An instance created with N GPUs takes N free devices (first-come) and makes them available
    when it is first seen running; "not running" (preempted) makes them unavailable and frees
    them. Every device starts unavailable.

    Raises:
        InputError: the file has no recognised line.
    """
    _check_slots(slots, slot_seconds)
    rows = [TraceRow(slot=0, device=d, available=False) for d in devices]
    free = list(devices)
    held: dict[str, list[str]] = {}
    gpus: dict[str, int] = {}
    up: set[str] = set()
    t0 = None
    recognised = 0
    for line in _read_text(path).splitlines():
        m = _CREATED.match(line) or _RUNNING.match(line) or _GONE.match(line)
        if m is None:
            continue
        recognised += 1
        ts = _iso_seconds(m["ts"])
        t0 = ts if t0 is None else t0
        slot = int((ts - t0) // slot_seconds)
        if slot >= slots:
            break
        inst = m["id"]
        if m.re is _CREATED:
            gpus[inst] = int(m["n"])
        elif m.re is _RUNNING and inst not in up:
            want = gpus.get(inst, 1)
            take, free = free[:want], free[want:]
            held[inst] = take
            up.add(inst)
            rows += [TraceRow(slot=slot, device=d, available=True) for d in take]
        elif m.re is _GONE and inst in up:
            up.discard(inst)
            gone = held.pop(inst, [])
            free += gone
            rows += [TraceRow(slot=slot, device=d, available=False) for d in gone]
    if recognised == 0:
        raise InputError(str(path), "", "expected spot availability log lines")
    return rows


def straggler_rows_from_alibaba(
    path: str | Path,
    devices: Sequence[str],
    slots: int,
    *,
    samples_per_slot: int = 1,
    resolution: float = 0.02,
    shift_samples: int = 37,
) -> list[TraceRow]:
    """Per-worker mini-batch times (Alibaba PAI, normalised) -> ``speed_factor`` rows.

    Device ``i`` follows worker ``i mod W`` shifted by ``(i // W) · shift_samples`` samples
    (cyclically) so copies of a worker are not in lockstep; slot ``t`` uses the worker's sample
    ``t · samples_per_slot``; ``speed_factor = median time / time`` (the median over all workers
    and samples is speed 1), clipped to [0.05, 4]. Rows are emitted when a factor moves by more
    than ``resolution`` (relative).

    Raises:
        InputError: missing columns or non-numeric values.
    """
    _check_slots(slots)
    source = str(path)
    reader = csv.DictReader(_read_text(path).splitlines())
    need = {"worker", "time", "batch_time_norm"}
    if reader.fieldnames is None or not need <= set(reader.fieldnames):
        raise InputError(source, "header", "expected columns worker,time,batch_time_norm")
    series: dict[int, list[tuple[int, float]]] = {}
    for line_no, rec in enumerate(reader, start=2):
        try:
            w, t, bt = int(rec["worker"]), int(rec["time"]), float(rec["batch_time_norm"])
        except (TypeError, ValueError):
            raise InputError(source, f"row {line_no}", "expected integers and a number") from None
        series.setdefault(w, []).append((t, max(bt, 1.0)))
    if not series:
        raise InputError(source, "", "expected at least one row")
    workers = sorted(series)
    length = min(len(series[w]) for w in workers)
    times = np.array([[bt for _, bt in sorted(series[w])[:length]] for w in workers])
    factor = np.clip(np.median(times) / times, 0.05, 4.0)  # (W, samples)
    rows: list[TraceRow] = []
    last = np.zeros(len(devices))
    for slot in range(int(slots)):
        sample = slot * max(int(samples_per_slot), 1)
        for i, dev in enumerate(devices):
            w = i % len(workers)
            f = float(factor[w, (sample + (i // len(workers)) * shift_samples) % length])
            if last[i] == 0 or abs(f / last[i] - 1.0) > resolution:
                rows.append(TraceRow(slot=slot, device=dev, speed_factor=f))
                last[i] = f
    return rows


def _iso_seconds(text: str) -> float:
    """Seconds since the epoch of an ISO-8601 UTC time such as ``2020-02-20T22:06:16.000Z``."""
    return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
