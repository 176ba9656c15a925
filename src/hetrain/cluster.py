"""Cluster files (docs/model.md §7) and the numeric cluster state the cost model reads
(docs/model.md §2).

A :class:`ClusterSpec` is what the user writes (YAML/JSON, user units: tflops, GiB, Gbit/s,
USD/hour, ms). A :class:`ClusterState` is the same devices at one slot in SI units, as numpy
arrays indexed by device position in the cluster file; traces (:mod:`hetrain.trace`) change it
slot by slot.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from hetrain._io import MAX_NUMBER, check_finite_tree, check_not_tiny, read_structured
from hetrain.errors import InputError, from_validation_error

GBPS_TO_BYTES_PER_S = 1e9 / 8.0  # 1 Gbit/s = 1.25e8 bytes/s
GIB = float(2**30)

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

Rate = Annotated[float, AfterValidator(check_not_tiny)]
"""A speed or bandwidth: > 0 (the Field) and not below ``MIN_POSITIVE``."""


class LinksSpec(BaseModel):
    """``links`` of a cluster file: intra-node bandwidth (Gbit/s) and per-link latency (µs)."""

    model_config = _STRICT
    intra_node_gbps: Rate = Field(800.0, gt=0, le=MAX_NUMBER)
    latency_us: float = Field(20.0, ge=0, le=MAX_NUMBER)


_KIND_SUFFIX = re.compile(r"^(.+)-\d+$")


def default_kind(device_id: str) -> str:
    """The device kind of a device without an explicit ``kind`` (docs/model.md §7): its id
    without a trailing ``-<digits>`` (``v100-0`` -> ``v100``, ``A100-40-3`` -> ``A100-40``),
    else the whole id (``w0`` -> ``w0``)."""
    m = _KIND_SUFFIX.match(device_id)
    return m.group(1) if m else device_id


class DeviceSpec(BaseModel):
    """One device of a cluster file (docs/model.md §7). ``node`` defaults to the device's own id;
    ``microbatch_overhead_ms`` (κ, per micro-batch and stage) and ``layer_overhead_ms`` (λ, per
    micro-batch and layer of the stage, docs/model.md (v3)) default to 0; ``kind`` (the device
    kind a profile's measured times are keyed by) defaults to :func:`default_kind` of the id."""

    model_config = _STRICT
    id: str = Field(min_length=1)
    node: str | None = None
    tflops: Rate = Field(gt=0, le=MAX_NUMBER)
    memory_gib: float = Field(gt=0, le=MAX_NUMBER)
    nic_gbps: Rate = Field(gt=0, le=MAX_NUMBER)
    power_w: float = Field(0.0, ge=0, le=MAX_NUMBER)
    price_per_hour: float = Field(0.0, ge=0, le=MAX_NUMBER)
    microbatch_overhead_ms: float = Field(0.0, ge=0, le=MAX_NUMBER)
    layer_overhead_ms: float = Field(0.0, ge=0, le=MAX_NUMBER)
    kind: str | None = Field(None, min_length=1)

    @property
    def node_id(self) -> str:
        return self.node if self.node is not None else self.id

    @property
    def kind_name(self) -> str:
        """``kind``, or :func:`default_kind` of the id when not given."""
        return self.kind if self.kind is not None else default_kind(self.id)


class ClusterSpec(BaseModel):
    """A whole cluster file: ``{"links": {...}, "devices": [...]}`` (docs/model.md §7).

    Raises:
        ValueError (via pydantic): unknown keys, negative or non-finite numbers, no devices,
        duplicate device ids.
    """

    model_config = _STRICT
    links: LinksSpec = Field(default_factory=LinksSpec)
    devices: list[DeviceSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> ClusterSpec:
        seen: dict[str, int] = {}
        for i, d in enumerate(self.devices):
            if d.id in seen:
                raise ValueError(
                    f"devices[{i}].id: duplicate device id {d.id!r} (also devices[{seen[d.id]}])"
                )
            seen[d.id] = i
        return self

    @property
    def ids(self) -> list[str]:
        return [d.id for d in self.devices]

    def state(self) -> ClusterState:
        """The SI-unit :class:`ClusterState` of this cluster with every device available."""
        nodes: dict[str, int] = {}
        node_idx = [nodes.setdefault(d.node_id, len(nodes)) for d in self.devices]
        n = len(self.devices)
        speed = np.array([d.tflops * 1e12 for d in self.devices])
        return ClusterState(
            ids=tuple(self.ids),
            node=np.asarray(node_idx, dtype=np.int64),
            speed_flops=speed,
            memory_bytes=np.array([d.memory_gib * GIB for d in self.devices]),
            nic_bytes_per_s=np.array([d.nic_gbps * GBPS_TO_BYTES_PER_S for d in self.devices]),
            power_w=np.array([d.power_w for d in self.devices]),
            price_per_s=np.array([d.price_per_hour / 3600.0 for d in self.devices]),
            kappa_s=np.array([d.microbatch_overhead_ms * 1e-3 for d in self.devices]),
            layer_overhead_s=np.array([d.layer_overhead_ms * 1e-3 for d in self.devices]),
            available=np.ones(n, dtype=bool),
            intra_node_bytes_per_s=self.links.intra_node_gbps * GBPS_TO_BYTES_PER_S,
            latency_s=self.links.latency_us * 1e-6,
            kinds=tuple(d.kind_name for d in self.devices),
            nominal_speed_flops=speed.copy(),
        )


@dataclass(frozen=True)
class ClusterState:
    """Cluster state at one slot, SI units, arrays of shape ``(D,)`` in cluster-file order.

    Attributes:
        ids: device ids, length D.
        node: node index per device (devices with equal index share a node).
        speed_flops: effective speed ``s_d`` in FLOP/s.
        memory_bytes: memory ``M_d`` in bytes.
        nic_bytes_per_s: NIC bandwidth ``nic_d`` in bytes/s.
        power_w: power ``W_d`` in watts.
        price_per_s: price ``π_d`` in currency per second.
        kappa_s: fixed cost ``κ_d`` per micro-batch and stage, seconds.
        available: whether the device may be used in this slot.
        intra_node_bytes_per_s: bandwidth between two devices of one node, bytes/s.
        latency_s: latency ``lat`` of every link, seconds.
        layer_overhead_s: fixed cost ``λ_d`` per micro-batch and layer of the stage, seconds
            (docs/model.md §2; default zeros).
        kinds: device kind per device (the key of a profile's measured times, docs/model.md
            §7); default :func:`default_kind` of each id.
        nominal_speed_flops: the cluster file's speed per device (FLOP/s); a device whose
            kind has measured times runs them scaled by ``nominal / speed_flops`` (a trace's
            speed factor slows measured times as it slows the FLOP model's; docs/model.md
            §3). Default: ``speed_flops`` (scale 1).
        measured_extra_s: fixed seconds per micro-batch and stage a device whose kind has
            measured times takes beyond those scaled times (``≥ 0``; the controller's fitted
            fixed cost, :class:`hetrain.control.estimates.SpeedEstimates`; docs/model.md §3).
            Default: zeros. FLOP-model devices carry their fixed cost in ``κ_d`` instead.
    """

    ids: tuple[str, ...]
    node: np.ndarray
    speed_flops: np.ndarray
    memory_bytes: np.ndarray
    nic_bytes_per_s: np.ndarray
    power_w: np.ndarray
    price_per_s: np.ndarray
    kappa_s: np.ndarray
    available: np.ndarray
    intra_node_bytes_per_s: float
    latency_s: float
    layer_overhead_s: np.ndarray | None = None
    kinds: tuple[str, ...] | None = None
    nominal_speed_flops: np.ndarray | None = None
    measured_extra_s: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.layer_overhead_s is None:
            object.__setattr__(self, "layer_overhead_s", np.zeros(len(self.ids)))
        if self.kinds is None:
            object.__setattr__(self, "kinds", tuple(default_kind(d) for d in self.ids))
        if self.nominal_speed_flops is None:
            object.__setattr__(self, "nominal_speed_flops", self.speed_flops)
        if self.measured_extra_s is None:
            object.__setattr__(self, "measured_extra_s", np.zeros(len(self.ids)))

    def measured_time_scale(self) -> np.ndarray:
        """``nominal_speed_flops / speed_flops`` per device, shape ``(D,)``: the factor a
        device's measured times are multiplied by in this state (docs/model.md §3)."""
        return np.asarray(self.nominal_speed_flops, dtype=float) / np.asarray(
            self.speed_flops, dtype=float
        )

    @property
    def num_devices(self) -> int:
        return len(self.ids)

    def index(self) -> dict[str, int]:
        """Map device id -> position."""
        return {d: i for i, d in enumerate(self.ids)}

    def link_bandwidth(self, d: int, e: int) -> float:
        """``bw(d, e)`` of docs/model.md §2 in bytes/s: intra-node if ``d`` and ``e`` share a node,
        else
        ``min(nic_d, nic_e)``."""
        if self.node[d] == self.node[e]:
            return float(self.intra_node_bytes_per_s)
        return float(min(self.nic_bytes_per_s[d], self.nic_bytes_per_s[e]))

    def with_changes(self, **arrays: Any) -> ClusterState:
        """A copy with some fields replaced (e.g. ``speed_flops=..., available=...``)."""
        return replace(self, **arrays)


def state_digest(state: ClusterState) -> bytes:
    """A 20-byte SHA-1 digest of every field of ``state``, bit for bit: two states with equal
    digests hold the same bits in every field (barring a SHA-1 collision), so every
    computation on them gives the same result (a cache key, and the test whether a state
    changed).

    "Bit for bit" means: an array field by its dtype (kind, item size and byte order), shape
    and the bytes of its elements in C order (a float32 array differs from a float64 one of
    the same values; a view equals its copy); a scalar field (``intra_node_bytes_per_s``,
    ``latency_s``) as a 0-d array of its numpy type (float64 for a python float; an int
    differs from the float of the same value); a tuple of strings (``ids``, ``kinds``) by its
    length and each string's UTF-8 bytes prefixed by their count. Hence ``-0.0`` and ``0.0``
    differ, a NaN equals a NaN with the same bits (sign and payload) and no other, and ``inf``
    equals ``inf``. Each field is prefixed by its name, so a value cannot stand in for another
    field's.

    Raises:
        TypeError: a field holds objects without a fixed bit pattern (an object array, a
            tuple of non-strings).
    """
    h = hashlib.sha1(usedforsecurity=False)
    for name in _STATE_FIELDS:
        value = getattr(state, name)
        if value is None:
            h.update(f"{name}:none;".encode())
        elif isinstance(value, tuple):
            if not all(isinstance(x, str) for x in value):
                raise TypeError(f"state_digest: field {name} holds a tuple of non-strings")
            h.update(f"{name}:str{len(value)};".encode())
            for x in value:  # each string by its byte length and bytes
                raw = x.encode("utf-8", "surrogatepass")
                h.update(b"%d;" % len(raw) + raw)
        else:
            arr = np.asarray(value)
            if arr.dtype.hasobject:
                raise TypeError(f"state_digest: field {name} holds objects, not numbers")
            h.update(f"{name}:{arr.dtype.str}{arr.shape};".encode())
            h.update(arr.tobytes())
    return h.digest()


_STATE_FIELDS = tuple(f.name for f in fields(ClusterState))


def load_cluster(path: str | Path) -> ClusterSpec:
    """Load and validate a cluster file (YAML or JSON, docs/model.md §7).

    Raises:
        InputError: missing/unreadable file, bad syntax, or any invalid field (one line naming
            the file, the field and the expectation).
    """
    raw = read_structured(path)
    return cluster_from_dict(raw, str(path))


def cluster_from_dict(raw: Any, source: str = "<cluster>") -> ClusterSpec:
    """Validate an already-parsed cluster object; see :func:`load_cluster`."""
    if not isinstance(raw, dict):
        raise InputError(source, "", "expected a mapping with keys 'links' and 'devices'")
    check_finite_tree(source, raw)
    try:
        return ClusterSpec.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(source, exc, ClusterSpec) from None
