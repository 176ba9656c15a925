"""Emulated heterogeneity on one machine (docs/model.md §5): per-device slow-down and per-link
bandwidth.

Nothing here burns CPU: a slowed device *sleeps* ``(factor - 1) x`` the measured time of each of
its compute operations (forward or backward of one micro-batch on one stage), and a link sleeps
so that a transfer of ``n`` bytes takes at least ``n / bandwidth + latency`` seconds. The
launcher may replace a worker's :class:`Emulation` before any step (e.g. from a trace).
:class:`EmulationSchedule` gives the training loop the :class:`Emulation` of each step
(``--slowdown``, ``--trace``, ``--cluster``); :func:`local_cluster_state` is the nominal
cluster of the local ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hetrain.cluster import ClusterSpec, ClusterState, cluster_from_dict

if TYPE_CHECKING:
    from hetrain.runtime.worker_main import TrainJob


@dataclass(frozen=True)
class Emulation:
    """What to emulate. All fields are optional; an empty ``Emulation()`` emulates nothing.

    Attributes:
        slowdown: device id -> slow-down factor ``>= 1`` (3.0 = the device computes 3x slower).
        nic_bandwidth_bytes_per_s: device id -> NIC bandwidth in bytes/s; the bandwidth of a
            link between two devices of different nodes is ``min(nic_d, nic_e)`` (docs/model.md §2).
            A device not named has unlimited bandwidth.
        node: device id -> node id; devices of one node use ``intra_node_bandwidth_bytes_per_s``
            (a device not named is its own node).
        intra_node_bandwidth_bytes_per_s: bandwidth between devices of one node (None =
            unlimited).
        link_bandwidth_bytes_per_s: explicit ``(d, e) -> bytes/s`` per link (symmetric),
            overriding the rules above.
        latency_s: latency added to every emulated transfer, seconds.
        microbatch_overhead_s: device id -> fixed cost ``κ_d`` (seconds) slept once per
            micro-batch and stage (after its forward), docs/model.md §3 ``C_k = μ c_k + κ``.
        compute_clock: what "measured compute" means for the slow-down: ``"wall"`` (default)
            the op's wall time, so an op lasts ``factor x wall``; ``"thread_cpu"`` the CPU
            time of the calling thread (``time.thread_time``), so an op lasts
            ``max(wall, factor x cpu)``: ranks that share the host's cores (or other jobs on
            it) no longer stretch each other's emulated compute by the factor. Only for CPU
            ranks with one torch thread (the op must run on the calling thread).

    Raises:
        ValueError: a factor < 1, a bandwidth <= 0, a negative latency, or a non-finite number.
    """

    slowdown: Mapping[str, float] = field(default_factory=dict)
    nic_bandwidth_bytes_per_s: Mapping[str, float] = field(default_factory=dict)
    node: Mapping[str, str] = field(default_factory=dict)
    intra_node_bandwidth_bytes_per_s: float | None = None
    link_bandwidth_bytes_per_s: Mapping[tuple[str, str], float] = field(default_factory=dict)
    latency_s: float = 0.0
    microbatch_overhead_s: Mapping[str, float] = field(default_factory=dict)
    compute_clock: str = "wall"

    def __post_init__(self) -> None:
        if self.compute_clock not in ("wall", "thread_cpu"):
            raise ValueError(
                f"emulation.compute_clock: expected 'wall' or 'thread_cpu', "
                f"got {self.compute_clock!r}"
            )
        for d, k in self.microbatch_overhead_s.items():
            if not (math.isfinite(k) and k >= 0):
                raise ValueError(
                    f"emulation.microbatch_overhead_s[{d!r}]: expected a finite "
                    f"number >= 0, got {k!r}"
                )
        for d, f in self.slowdown.items():
            if not (math.isfinite(f) and f >= 1.0):
                raise ValueError(
                    f"emulation.slowdown[{d!r}]: expected a finite factor >= 1, got {f!r}"
                )
        bws: list[tuple[str, Any]] = [
            (f"nic_bandwidth_bytes_per_s[{d!r}]", b)
            for d, b in self.nic_bandwidth_bytes_per_s.items()
        ]
        bws += [
            (f"link_bandwidth_bytes_per_s[{k!r}]", b)
            for k, b in self.link_bandwidth_bytes_per_s.items()
        ]
        if self.intra_node_bandwidth_bytes_per_s is not None:
            bws.append(("intra_node_bandwidth_bytes_per_s", self.intra_node_bandwidth_bytes_per_s))
        for name, b in bws:
            if not (b > 0 and not math.isnan(b)):
                raise ValueError(f"emulation.{name}: expected a bandwidth > 0 bytes/s, got {b!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(
                f"emulation.latency_s: expected a finite number >= 0, got {self.latency_s!r}"
            )

    def overhead_of(self, device: str) -> float:
        """Emulated per-micro-batch fixed cost ``κ`` of ``device`` in seconds (0 when not
        named)."""
        return float(self.microbatch_overhead_s.get(device, 0.0))

    def slowdown_of(self, device: str) -> float:
        """Slow-down factor of ``device`` (1.0 when not named)."""
        return float(self.slowdown.get(device, 1.0))

    def link_bandwidth(self, d: str, e: str) -> float:
        """Emulated bandwidth of link ``(d, e)`` in bytes/s (``inf`` = not limited)."""
        if (d, e) in self.link_bandwidth_bytes_per_s:
            return float(self.link_bandwidth_bytes_per_s[(d, e)])
        if (e, d) in self.link_bandwidth_bytes_per_s:
            return float(self.link_bandwidth_bytes_per_s[(e, d)])
        if self.node.get(d, d) == self.node.get(e, e):
            bw = self.intra_node_bandwidth_bytes_per_s
            return math.inf if bw is None else float(bw)
        return float(
            min(
                self.nic_bandwidth_bytes_per_s.get(d, math.inf),
                self.nic_bandwidth_bytes_per_s.get(e, math.inf),
            )
        )

    def limits_links(self) -> bool:
        """Whether any transfer is slowed (a bandwidth or a latency is set)."""
        return bool(
            self.nic_bandwidth_bytes_per_s
            or self.link_bandwidth_bytes_per_s
            or self.intra_node_bandwidth_bytes_per_s is not None
            or self.latency_s > 0
        )

    def transfer_time_s(self, d: str, e: str, num_bytes: int) -> float:
        """Emulated duration of one transfer of ``num_bytes`` over ``(d, e)``:
        ``num_bytes / bw(d, e) + latency_s`` seconds (docs/model.md §3, one direction)."""
        bw = self.link_bandwidth(d, e)
        return (0.0 if math.isinf(bw) else num_bytes / bw) + self.latency_s

    @classmethod
    def from_cluster_state(
        cls, state: Any, slowdown: Mapping[str, float] | None = None, *, overhead: bool = False
    ) -> Emulation:
        """Links of a :class:`hetrain.cluster.ClusterState` (NIC, nodes, intra-node bandwidth,
        latency) plus the given slow-down factors; with ``overhead`` also each device's
        ``κ_d`` (``kappa_s``) slept per micro-batch."""
        ids = list(state.ids)
        return cls(
            slowdown=dict(slowdown or {}),
            nic_bandwidth_bytes_per_s={
                d: float(state.nic_bytes_per_s[i]) for i, d in enumerate(ids)
            },
            node={d: str(int(state.node[i])) for i, d in enumerate(ids)},
            intra_node_bandwidth_bytes_per_s=float(state.intra_node_bytes_per_s),
            latency_s=float(state.latency_s),
            microbatch_overhead_s=(
                {d: float(state.kappa_s[i]) for i, d in enumerate(ids)} if overhead else {}
            ),
        )


def sleep_s(duration_s: float) -> None:
    """Sleep ``duration_s`` seconds if positive (never busy-waits)."""
    if duration_s > 0:
        time.sleep(duration_s)


def slow_down(
    emulation: Emulation | None,
    device: str,
    measured_s: float,
    microbatch: bool = False,
    cpu_s: float | None = None,
) -> float:
    """Sleep ``(factor - 1) * measured_s`` for ``device``; return the time actually slept (s,
    at least the requested time: ``time.sleep`` never returns early); with ``microbatch``
    also the device's per-micro-batch overhead ``κ``. With ``compute_clock="thread_cpu"``
    and the op's thread CPU time ``cpu_s``: sleep ``factor * cpu_s - measured_s`` instead."""
    if emulation is None:
        return 0.0
    factor = emulation.slowdown_of(device)
    if emulation.compute_clock == "thread_cpu" and cpu_s is not None:
        extra = factor * cpu_s - measured_s
    else:
        extra = (factor - 1.0) * measured_s
    if microbatch:
        extra += emulation.overhead_of(device)
    if extra <= 0:
        return 0.0
    t0 = time.perf_counter()
    sleep_s(extra)
    return time.perf_counter() - t0


def local_cluster_state(devices: list[str], speeds_flops: list[float]) -> ClusterState:
    """A cluster of the local ranks: each its own node (so a trace's ``nic_gbps`` limits its
    links), measured speeds, 16 GiB each, 20 Gbit/s NICs, 20 µs latency (nominal loopback)."""
    spec = cluster_from_dict(
        {
            "links": {"intra_node_gbps": 20.0, "latency_us": 20.0},
            "devices": [
                {"id": d, "tflops": max(s, 1.0) / 1e12, "memory_gib": 16.0, "nic_gbps": 20.0}
                for d, s in zip(devices, speeds_flops, strict=True)
            ],
        },
        "<local ranks>",
    )
    return spec.state()


def base_slowdowns(
    devices: list[str], slowdown: dict[str, float], cluster: ClusterSpec | None
) -> dict[str, float]:
    """``base_d`` of :class:`EmulationSchedule` (dimensionless, ``>= 1`` per device of
    ``devices``): ``--slowdown``'s factor times, with ``--cluster``, ``max_e tflops_e /
    tflops_d`` (the local ranks emulate the cluster's relative speeds)."""
    base = {d: float(slowdown.get(d, 1.0)) for d in devices}
    if cluster is not None:
        top = max(dv.tflops for dv in cluster.devices)
        for dv in cluster.devices:
            if dv.id in base:
                base[dv.id] *= top / dv.tflops
    return base


class EmulationSchedule:
    """Per-step emulation: ``slowdown_d(t) = base_d / speed_factor_d(t)`` and NIC bandwidth from
    the trace (docs/model.md §7: one slot = one step); ``base_d`` from :func:`base_slowdowns`
    (the local ranks emulate the cluster's relative speeds and its links)."""

    def __init__(self, job: TrainJob) -> None:
        """``job``: the run's ``TrainJob`` (``devices``, ``cluster``, ``slowdown``, ``trace_rows``,
        ``steps``)."""
        self.devices = list(job.devices)
        self.cluster: ClusterSpec | None = None
        if job.cluster is not None:
            self.cluster = cluster_from_dict(job.cluster, "--cluster")
        self.base = base_slowdowns(self.devices, dict(job.slowdown), self.cluster)
        self.timeline = None
        if job.trace_rows:
            from hetrain.trace import Trace

            spec = self.cluster or local_cluster_spec(self.devices)
            self.timeline = Trace(tuple(job.trace_rows), "--trace").timeline(spec, job.steps)
        self._key: Any = None
        self._emulation = None

    def factors(self, step: int) -> dict[str, float]:
        """Slow-down factor of every device at ``step``."""
        out = dict(self.base)
        if self.timeline is not None:
            ids = self.timeline.base.ids
            s = min(step, self.timeline.num_slots - 1)
            for i, d in enumerate(ids):
                if d in out and s >= 0:
                    out[d] = out[d] / float(self.timeline.speed_factor[s, i])
        return {d: max(f, 1.0) for d, f in out.items()}

    def emulation(self, step: int) -> Emulation:
        """The engine's ``Emulation`` for ``step`` (the same object while nothing changes)."""
        factors = self.factors(step)
        nic = None
        state = None
        if self.timeline is not None:
            state = self.timeline.state_at(step)
            nic = tuple(float(v) for v in state.nic_bytes_per_s)
        elif self.cluster is not None:
            state = self.cluster.state()
        key = (tuple(sorted(factors.items())), nic)
        if key != self._key:
            self._key = key
            if state is not None and (self.cluster is not None or self._trace_sets_nic()):
                self._emulation = Emulation.from_cluster_state(state, factors)
            else:
                self._emulation = Emulation(slowdown=factors)
        return self._emulation

    def _trace_sets_nic(self) -> bool:
        return self.timeline is not None and bool(
            np.any(self.timeline.nic_bytes_per_s != self.timeline.nic_bytes_per_s[:1])
        )


def local_cluster_spec(devices: list[str]) -> ClusterSpec:
    """The nominal cluster file of the local ranks (see :func:`local_cluster_state`)."""
    return cluster_from_dict(
        {
            "links": {"intra_node_gbps": 20.0, "latency_us": 20.0},
            "devices": [
                {"id": d, "tflops": 1.0, "memory_gib": 16.0, "nic_gbps": 20.0} for d in devices
            ],
        },
        "<local ranks>",
    )
