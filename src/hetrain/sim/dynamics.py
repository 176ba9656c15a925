"""Seeded generators of cluster dynamics as docs/model.md §7 trace rows.

Each generator returns a list of :class:`~hetrain.trace.TraceRow` (one row per change) for the
devices it is given; :func:`generate_trace` merges several and sorts them by slot (stable), ready
for :func:`hetrain.trace.write_trace` or :class:`hetrain.trace.Trace`. All randomness comes from a
``numpy.random.Generator`` so a seed fixes the trace.

* :func:`drift_rows` — slow drift: a mean-reverting (Ornstein–Uhlenbeck) log speed factor per
  device, emitted when it moves by more than ``resolution``;
* :func:`straggler_rows` — straggler spikes: each slot a device starts a spike with probability
  ``rate``, runs at ``slowdown`` of its speed for a geometric number of slots, then recovers;
* :func:`preemption_rows` — devices leave (``available`` 0) with probability ``rate`` per slot and
  return after a geometric downtime, keeping at least ``min_available`` devices up;
* :func:`price_rows` — spot prices: a mean-reverting log price per device with jumps;
* :func:`link_rows` — link degradation: each slot a device's NIC starts an episode with
  probability ``rate``, runs at ``factor`` of its bandwidth for a geometric number of slots, then
  recovers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hetrain.trace import TraceRow


def _check_prob(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise ValueError(f"{name}: expected a probability in [0, 1], got {value!r}")


def drift_rows(
    devices: Sequence[str],
    slots: int,
    rng: np.random.Generator,
    *,
    sigma: float = 0.02,
    reversion: float = 0.02,
    resolution: float = 0.01,
) -> list[TraceRow]:
    """Slow speed drift: ``x_{t+1} = (1 − reversion) x_t + sigma ε``, ``speed_factor = e^{x}``.

    Args:
        devices: device ids.
        slots: number of slots.
        sigma: per-slot standard deviation of the log speed factor.
        reversion: pull towards 0 per slot (0: random walk).
        resolution: a row is emitted when the factor moved by more than this (relative).

    Raises:
        ValueError: negative ``sigma``/``resolution`` or ``reversion`` outside [0, 1].
    """
    if sigma < 0 or resolution < 0:
        raise ValueError("sigma and resolution: expected numbers >= 0")
    _check_prob("reversion", reversion)
    n = len(devices)
    x = np.zeros(n)
    last = np.ones(n)
    rows: list[TraceRow] = []
    for t in range(1, slots):
        x = (1.0 - reversion) * x + sigma * rng.standard_normal(n)
        factor = np.exp(x)
        moved = np.abs(factor / last - 1.0) > resolution
        for j in np.flatnonzero(moved):
            rows.append(TraceRow(slot=t, device=devices[j], speed_factor=float(factor[j])))
            last[j] = factor[j]
    return rows


def straggler_rows(
    devices: Sequence[str],
    slots: int,
    rng: np.random.Generator,
    *,
    rate: float = 0.01,
    slowdown: float = 0.3,
    mean_duration_slots: float = 20.0,
) -> list[TraceRow]:
    """Straggler spikes: a device runs at ``slowdown`` × its speed for a while.

    Args:
        rate: probability per slot and device that a spike starts.
        slowdown: speed factor during a spike, in (0, 1].
        mean_duration_slots: mean spike length (geometric).

    Raises:
        ValueError: ``rate`` not in [0, 1], ``slowdown`` not in (0, 1], duration < 1.
    """
    _check_prob("rate", rate)
    if not (0 < slowdown <= 1):
        raise ValueError(f"slowdown: expected a number in (0, 1], got {slowdown!r}")
    if mean_duration_slots < 1:
        raise ValueError(f"mean_duration_slots: expected >= 1, got {mean_duration_slots!r}")
    rows: list[TraceRow] = []
    for dev in devices:
        t = 0
        while t < slots:
            if rng.random() < rate:
                length = int(rng.geometric(1.0 / mean_duration_slots))
                rows.append(TraceRow(slot=t, device=dev, speed_factor=float(slowdown)))
                end = t + length
                if end < slots:
                    rows.append(TraceRow(slot=end, device=dev, speed_factor=1.0))
                t = end + 1
            else:
                t += 1
    rows.sort(key=lambda r: r.slot)
    return rows


def preemption_rows(
    devices: Sequence[str],
    slots: int,
    rng: np.random.Generator,
    *,
    rate: float = 0.005,
    mean_downtime_slots: float = 50.0,
    min_available: int = 1,
) -> list[TraceRow]:
    """Preemption and return: each up device leaves with probability ``rate`` per slot (never
    below ``min_available`` up devices) and returns after a geometric downtime.

    Raises:
        ValueError: ``rate`` not in [0, 1], downtime < 1, ``min_available`` < 0.
    """
    _check_prob("rate", rate)
    if mean_downtime_slots < 1:
        raise ValueError(f"mean_downtime_slots: expected >= 1, got {mean_downtime_slots!r}")
    if min_available < 0:
        raise ValueError(f"min_available: expected >= 0, got {min_available!r}")
    n = len(devices)
    back_at = np.full(n, -1)  # slot a down device returns; -1 when up
    rows: list[TraceRow] = []
    for t in range(1, slots):
        for j in np.flatnonzero(back_at == t):
            rows.append(TraceRow(slot=t, device=devices[j], available=True))
            back_at[j] = -1
        up = np.flatnonzero(back_at < 0)
        leaving = up[rng.random(len(up)) < rate]
        room = len(up) - int(min_available)
        for j in leaving[: max(room, 0)]:
            rows.append(TraceRow(slot=t, device=devices[j], available=False))
            back_at[j] = t + int(rng.geometric(1.0 / mean_downtime_slots))
    return rows


def price_rows(
    devices: Sequence[str],
    base_price_per_hour: Sequence[float],
    slots: int,
    rng: np.random.Generator,
    *,
    sigma: float = 0.03,
    reversion: float = 0.05,
    jump_rate: float = 0.01,
    jump_sigma: float = 0.3,
    resolution: float = 0.01,
) -> list[TraceRow]:
    """Spot prices: log price ``x`` mean-reverting to 0 with Gaussian jumps;
    ``price = base · e^{x}`` (currency/hour), emitted when it moved more than ``resolution``.

    Raises:
        ValueError: lengths differ, negative base price or sigmas, rates outside [0, 1].
    """
    if len(base_price_per_hour) != len(devices):
        raise ValueError("base_price_per_hour: expected one price per device")
    base = np.asarray(base_price_per_hour, dtype=float)
    if np.any(base < 0) or sigma < 0 or jump_sigma < 0:
        raise ValueError("prices and sigmas: expected numbers >= 0")
    _check_prob("reversion", reversion)
    _check_prob("jump_rate", jump_rate)
    n = len(devices)
    x = np.zeros(n)
    last = np.ones(n)
    rows: list[TraceRow] = []
    for t in range(1, slots):
        jumps = (rng.random(n) < jump_rate) * jump_sigma * rng.standard_normal(n)
        x = (1.0 - reversion) * x + sigma * rng.standard_normal(n) + jumps
        factor = np.exp(x)
        moved = np.abs(factor / last - 1.0) > resolution
        for j in np.flatnonzero(moved):
            price = float(base[j] * factor[j])
            rows.append(TraceRow(slot=t, device=devices[j], price_per_hour=price))
            last[j] = factor[j]
    return rows


def link_rows(
    devices: Sequence[str],
    base_nic_gbps: Sequence[float],
    slots: int,
    rng: np.random.Generator,
    *,
    rate: float = 0.01,
    factor: float = 0.1,
    mean_duration_slots: float = 20.0,
) -> list[TraceRow]:
    """Link degradation episodes: a device's NIC falls to ``factor × base_nic_gbps`` (Gbit/s)
    for a geometric number of slots of mean ``mean_duration_slots``, started with probability
    ``rate`` per slot while healthy (a congested or rerouted link).

    Raises:
        ValueError: lengths differ, ``factor`` outside (0, 1], ``rate`` outside [0, 1] or
            ``mean_duration_slots < 1``.
    """
    if len(base_nic_gbps) != len(devices):
        raise ValueError("base_nic_gbps: expected one bandwidth per device")
    _check_prob("rate", rate)
    if not (0 < factor <= 1):
        raise ValueError(f"factor: expected a number in (0, 1], got {factor!r}")
    if not (mean_duration_slots >= 1):
        raise ValueError(f"mean_duration_slots: expected >= 1, got {mean_duration_slots!r}")
    end_p = 1.0 / float(mean_duration_slots)
    rows: list[TraceRow] = []
    for j, dev in enumerate(devices):
        base = float(base_nic_gbps[j])
        degraded = False
        for t in range(1, slots):
            if not degraded and rng.random() < rate:
                degraded = True
                rows.append(TraceRow(slot=t, device=dev, nic_gbps=base * factor))
            elif degraded and rng.random() < end_p:
                degraded = False
                rows.append(TraceRow(slot=t, device=dev, nic_gbps=base))
    rows.sort(key=lambda r: r.slot)
    return rows


def generate_trace(
    devices: Sequence[str],
    slots: int,
    seed: int,
    *,
    drift: dict | None = None,
    stragglers: dict | None = None,
    preemption: dict | None = None,
    prices: dict | None = None,
    links: dict | None = None,
) -> list[TraceRow]:
    """Merge the generators enabled by a keyword dict each (their keyword arguments; ``prices``
    needs ``base_price_per_hour``, ``links`` ``base_nic_gbps``), seeded by ``seed``, sorted by
    slot (stable).

    Raises:
        ValueError: bad generator arguments.
    """
    rng = np.random.default_rng(seed)
    rows: list[TraceRow] = []
    if drift is not None:
        rows += drift_rows(devices, slots, rng, **drift)
    if stragglers is not None:
        rows += straggler_rows(devices, slots, rng, **stragglers)
    if preemption is not None:
        rows += preemption_rows(devices, slots, rng, **preemption)
    if prices is not None:
        p = dict(prices)
        base = p.pop("base_price_per_hour")
        rows += price_rows(devices, base, slots, rng, **p)
    if links is not None:
        p = dict(links)
        base = p.pop("base_nic_gbps")
        rows += link_rows(devices, base, slots, rng, **p)
    rows.sort(key=lambda r: r.slot)
    return rows
