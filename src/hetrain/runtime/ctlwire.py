"""The messages between the ranks and the controller (:mod:`hetrain.runtime.adapt`) as JSON.

Everything that travels through the controller's ``TCPStore`` is plain JSON data, decoded by
the functions here into the planning types (:class:`~hetrain.cluster.ClusterState`,
:class:`~hetrain.profile.ProfileArrays`, :class:`~hetrain.costmodel.TrainingConfig`,
:class:`~hetrain.plan.Plan`, the runtime's ``Decision``) with every field checked. Nothing
received is unpickled: a store is reachable by any process that can open its port, and
``pickle.loads`` of a crafted value runs code. A value that is not such a message raises
:class:`WireError` (one line); the receiver reports it and ignores the value.

Messages (keys under ``hetrain/ctl/``, see :mod:`hetrain.runtime.adapt`):

- ``init``: ``{"round": str, "world_size": int, "base_state": state, "profile": profile,
  "config": config, "plan": plan, "steps": int, "start_step": int,
  "optimizer_state_factor": float, "checkpoint_dir": str | null, "checkpoint_every": int,
  "log_path": str | null}``;
- ``m/{step}/{rank}``: one rank's measurements of one step, ``{"round": str, "rank": int,
  "device": str, "plan_id": int, "compute_time_s": float, "iteration_time_s": float,
  "send_recv_time_s": float, "sync_time_s": float}`` (seconds);
- ``plan``: ``{"round": str, "decision": decision}``.

Imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.control.decision import state_to_dict
from hetrain.costmodel import TrainingConfig
from hetrain.errors import InputError
from hetrain.plan import Plan, plan_from_dict
from hetrain.profile import MeasuredTimes, ProfileArrays, SharedTensor

MAX_MESSAGE_BYTES = 64 * 2**20
"""Largest message accepted (bytes); a profile of 10^5 layers is about 10 MB."""


class WireError(ValueError):
    """A received value is not a well-formed controller message (one line)."""


# -------------------------------------------------------------------------------- primitives


def _loads(raw: bytes | str, what: str) -> dict[str, Any]:
    if isinstance(raw, str):
        raw = raw.encode()
    if not isinstance(raw, bytes | bytearray):
        raise WireError(f"{what}: expected bytes, got {type(raw).__name__}")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise WireError(f"{what}: {len(raw)} bytes, more than {MAX_MESSAGE_BYTES}")
    try:
        value = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"{what}: not JSON ({type(exc).__name__})") from None
    if not isinstance(value, dict):
        raise WireError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _field(obj: Mapping[str, Any], key: str, what: str) -> Any:
    if key not in obj:
        raise WireError(f"{what}: missing {key!r}")
    return obj[key]


def _float(value: Any, what: str, *, finite: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError(f"{what}: expected a number, got {type(value).__name__}")
    out = float(value)
    if finite and not math.isfinite(out):
        raise WireError(f"{what}: expected a finite number, got {out}")
    return out


def _int(value: Any, what: str, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{what}: expected an integer, got {type(value).__name__}")
    if low is not None and value < low:
        raise WireError(f"{what}: expected an integer >= {low}, got {value}")
    return value


def _str(value: Any, what: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise WireError(f"{what}: expected a string, got {type(value).__name__}")
    return value


def _array(value: Any, n: int, what: str, dtype: Any = float) -> np.ndarray:
    if not isinstance(value, list) or len(value) != n:
        raise WireError(f"{what}: expected a list of {n} numbers")
    if dtype is bool:
        if not all(isinstance(v, bool) for v in value):
            raise WireError(f"{what}: expected booleans")
        return np.asarray(value, dtype=bool)
    if dtype is int:
        return np.asarray([_int(v, what) for v in value], dtype=np.int64)
    return np.asarray([_float(v, what) for v in value], dtype=float)


def _str_list(value: Any, what: str, n: int | None = None) -> list[str]:
    """A non-empty list of strings (of length ``n`` when given), else :class:`WireError`."""
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise WireError(f"{what}: expected a non-empty list of strings")
    if n is not None and len(value) != n:
        raise WireError(f"{what}: expected {n} strings")
    return value


def _number_map(value: Any, what: str, kind: Any = float) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{what}: expected an object")
    conv = _int if kind is int else _float
    return {_str(k, what): conv(v, f"{what}[{k}]") for k, v in value.items()}


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _plan(value: Any, what: str) -> Plan:
    try:
        return plan_from_dict(value, what)
    except InputError as exc:
        raise WireError(str(exc)) from None


# -------------------------------------------------------------------------------- types


def state_to_json(state: ClusterState) -> dict[str, Any]:
    """A :class:`ClusterState` as JSON data (arrays as lists; the controller's own encoding,
    :func:`hetrain.control.decision.state_to_dict`)."""
    return state_to_dict(state)


def state_from_json(value: Any, what: str = "base_state") -> ClusterState:
    """Inverse of :func:`state_to_json`.

    Raises:
        WireError: a missing field or one of the wrong type or length.
    """
    if not isinstance(value, dict):
        raise WireError(f"{what}: expected an object")
    ids = _str_list(_field(value, "ids", what), f"{what}.ids")
    n = len(ids)
    arrays = {
        key: _array(_field(value, key, what), n, f"{what}.{key}")
        for key in (
            "speed_flops",
            "memory_bytes",
            "nic_bytes_per_s",
            "power_w",
            "price_per_s",
            "kappa_s",
            "layer_overhead_s",
        )
    }
    kinds = _str_list(_field(value, "kinds", what), f"{what}.kinds", n)
    nominal = _array(_field(value, "nominal_speed_flops", what), n, f"{what}.nominal_speed_flops")
    return ClusterState(
        ids=tuple(ids),
        kinds=tuple(kinds),
        nominal_speed_flops=nominal,
        node=_array(_field(value, "node", what), n, f"{what}.node", int),
        available=_array(_field(value, "available", what), n, f"{what}.available", bool),
        intra_node_bytes_per_s=_float(
            _field(value, "intra_node_bytes_per_s", what), f"{what}.intra_node_bytes_per_s"
        ),
        latency_s=_float(_field(value, "latency_s", what), f"{what}.latency_s"),
        **arrays,
    )


_PROFILE_ARRAYS = (
    "fwd_flops",
    "bwd_flops",
    "activation_bytes",
    "activation_memory_bytes",
    "param_bytes",
    "frozen_param_bytes",
    "overhead_weights",
)


def profile_to_json(profile: ProfileArrays) -> dict[str, Any]:
    """A :class:`ProfileArrays` as JSON data."""
    out: dict[str, Any] = {"names": list(profile.names)}
    for key in _PROFILE_ARRAYS:
        out[key] = [float(v) for v in getattr(profile, key)]
    out["shared"] = [
        {"name": t.name, "bytes": float(t.bytes), "layers": list(t.layers), "frozen": t.frozen}
        for t in profile.shared
    ]
    out["measured"] = [
        {
            "kind": m.kind,
            "microbatch_sizes": [float(v) for v in m.microbatch_sizes],
            "fwd_s": np.asarray(m.fwd_s, dtype=float).tolist(),
            "bwd_s": np.asarray(m.bwd_s, dtype=float).tolist(),
        }
        for m in profile.measured
    ]
    return out


def profile_from_json(value: Any, what: str = "profile") -> ProfileArrays:
    """Inverse of :func:`profile_to_json`.

    Raises:
        WireError: a missing field or one of the wrong type or length.
    """
    if not isinstance(value, dict):
        raise WireError(f"{what}: expected an object")
    names = _str_list(_field(value, "names", what), f"{what}.names")
    n = len(names)
    arrays = {k: _array(_field(value, k, what), n, f"{what}.{k}") for k in _PROFILE_ARRAYS}
    shared_raw = _field(value, "shared", what)
    if not isinstance(shared_raw, list):
        raise WireError(f"{what}.shared: expected a list")
    shared = []
    for i, t in enumerate(shared_raw):
        w = f"{what}.shared[{i}]"
        if not isinstance(t, dict):
            raise WireError(f"{w}: expected an object")
        layers = _field(t, "layers", w)
        if not isinstance(layers, list):
            raise WireError(f"{w}.layers: expected a list of layer indices")
        layer_ids = tuple(_int(v, f"{w}.layers", low=0) for v in layers)
        if any(v >= n for v in layer_ids):
            raise WireError(f"{w}.layers: expected indices below {n}")
        frozen = _field(t, "frozen", w)
        if not isinstance(frozen, bool):
            raise WireError(f"{w}.frozen: expected a boolean")
        shared.append(
            SharedTensor(
                _str(_field(t, "name", w), f"{w}.name"),
                _float(_field(t, "bytes", w), f"{w}.bytes", finite=True),
                layer_ids,
                frozen,
            )
        )
    measured_raw = _field(value, "measured", what)
    if not isinstance(measured_raw, list):
        raise WireError(f"{what}.measured: expected a list")
    measured = []
    for i, m in enumerate(measured_raw):
        w = f"{what}.measured[{i}]"
        if not isinstance(m, dict):
            raise WireError(f"{w}: expected an object")
        sizes_raw = _field(m, "microbatch_sizes", w)
        if not isinstance(sizes_raw, list) or not sizes_raw:
            raise WireError(f"{w}.microbatch_sizes: expected a non-empty list")
        sizes = _array(sizes_raw, len(sizes_raw), f"{w}.microbatch_sizes")
        rows = {}
        for key in ("fwd_s", "bwd_s"):
            raw = _field(m, key, w)
            if not isinstance(raw, list) or len(raw) != len(sizes):
                raise WireError(f"{w}.{key}: expected one row per micro-batch size")
            rows[key] = np.stack([_array(r, n, f"{w}.{key}") for r in raw])
        kind = _str(_field(m, "kind", w), f"{w}.kind")
        measured.append(MeasuredTimes(kind, sizes, rows["fwd_s"], rows["bwd_s"]))
    return ProfileArrays(
        names=tuple(names), shared=tuple(shared), measured=tuple(measured), **arrays
    )


def config_to_json(config: TrainingConfig) -> dict[str, Any]:
    """A :class:`TrainingConfig` as JSON data (its fields)."""
    return dataclasses.asdict(config)


def config_from_json(value: Any, what: str = "config") -> TrainingConfig:
    """Inverse of :func:`config_to_json` (unknown keys refused; the config checks its values).

    Raises:
        WireError: an unknown key, or a value the config refuses.
    """
    if not isinstance(value, dict):
        raise WireError(f"{what}: expected an object")
    known = {f.name for f in dataclasses.fields(TrainingConfig)}
    for key, v in value.items():
        if key not in known:
            raise WireError(f"{what}: unknown key {key!r}")
        if not (v is None or isinstance(v, bool | int | float | str)):
            raise WireError(f"{what}.{key}: expected a plain value")
    try:
        return TrainingConfig(**value)
    except (TypeError, ValueError) as exc:
        raise WireError(f"{what}: {exc}") from None


# -------------------------------------------------------------------------------- messages


def encode_init(init: Mapping[str, Any]) -> bytes:
    """The round's start (see the module docstring) as JSON bytes."""
    return _dumps(
        {
            "round": init["round"],
            "world_size": int(init["world_size"]),
            "base_state": state_to_json(init["base_state"]),
            "profile": profile_to_json(init["profile"]),
            "config": config_to_json(init["config"]),
            "plan": init["plan"].to_json_dict(),
            "steps": int(init["steps"]),
            "start_step": int(init["start_step"]),
            "optimizer_state_factor": float(init["optimizer_state_factor"]),
            "checkpoint_dir": _optional_str(init["checkpoint_dir"]),
            "checkpoint_every": int(init["checkpoint_every"] or 0),
            "log_path": _optional_str(init["log_path"]),
            "controller_state": init.get("controller_state"),
        }
    )


def decode_init(raw: bytes | str) -> dict[str, Any]:
    """Inverse of :func:`encode_init`: the same keys with the planning types rebuilt.

    Raises:
        WireError: not such a message.
    """
    what = "controller init"
    value = _loads(raw, what)
    state = state_from_json(_field(value, "base_state", what), f"{what}.base_state")
    profile = profile_from_json(_field(value, "profile", what), f"{what}.profile")
    plan = _plan(_field(value, "plan", what), f"{what}.plan")
    if any(d not in state.ids for d in plan.devices):
        raise WireError(f"{what}.plan: names devices that the state does not have")
    if any(end > profile.num_layers for g in plan.groups for _, end in g.stages):
        raise WireError(f"{what}.plan: stages beyond the profile's {profile.num_layers} layers")
    return {
        "round": _str(_field(value, "round", what), f"{what}.round"),
        "world_size": _int(_field(value, "world_size", what), f"{what}.world_size", low=1),
        "base_state": state,
        "profile": profile,
        "config": config_from_json(_field(value, "config", what), f"{what}.config"),
        "plan": plan,
        "steps": _int(_field(value, "steps", what), f"{what}.steps", low=0),
        "start_step": _int(_field(value, "start_step", what), f"{what}.start_step", low=0),
        "optimizer_state_factor": _float(
            _field(value, "optimizer_state_factor", what),
            f"{what}.optimizer_state_factor",
            finite=True,
        ),
        "checkpoint_dir": _str(
            value.get("checkpoint_dir"), f"{what}.checkpoint_dir", optional=True
        ),
        "checkpoint_every": _int(
            _field(value, "checkpoint_every", what), f"{what}.checkpoint_every", low=0
        ),
        "log_path": _str(value.get("log_path"), f"{what}.log_path", optional=True),
        "controller_state": _controller_state(value.get("controller_state"), what),
    }


def _controller_state(value: Any, what: str) -> dict[str, Any] | None:
    """The optional start-up controller state of a round's start (a JSON object or null;
    its fields are checked by ``PlanController.load_state_dict``)."""
    if value is None or isinstance(value, dict):
        return value
    raise WireError(f"{what}.controller_state: expected an object or null")


_RECORD_TIMES = ("compute_time_s", "iteration_time_s", "send_recv_time_s", "sync_time_s")


def encode_record(record: Mapping[str, Any]) -> bytes:
    """One rank's measurements of one step (see the module docstring) as JSON bytes."""
    out = {
        "round": str(record["round"]),
        "rank": int(record["rank"]),
        "device": str(record["device"]),
        "plan_id": int(record["plan_id"]),
    }
    out.update({k: float(record[k]) for k in _RECORD_TIMES})
    return _dumps(out)


def decode_record(raw: bytes | str) -> dict[str, Any]:
    """Inverse of :func:`encode_record`.

    Raises:
        WireError: not such a message (times must be finite and >= 0).
    """
    what = "measurement record"
    value = _loads(raw, what)
    out: dict[str, Any] = {
        "round": _str(_field(value, "round", what), f"{what}.round"),
        "rank": _int(_field(value, "rank", what), f"{what}.rank", low=0),
        "device": _str(_field(value, "device", what), f"{what}.device"),
        "plan_id": _int(_field(value, "plan_id", what), f"{what}.plan_id", low=0),
    }
    for key in _RECORD_TIMES:
        v = _float(_field(value, key, what), f"{what}.{key}", finite=True)
        if v < 0:
            raise WireError(f"{what}.{key}: expected >= 0, got {v}")
        out[key] = v
    return out


def merge_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The step record the controller observes, from every rank's record of one step:
    ``plan_id`` (rank 0's), ``iteration_time_s`` (the slowest rank's) and per device the
    compute, send/recv and sync seconds."""
    ordered = sorted(records, key=lambda r: r["rank"])
    return {
        "plan_id": ordered[0]["plan_id"],
        "iteration_time_s": max(r["iteration_time_s"] for r in ordered),
        "compute_time_s": {r["device"]: r["compute_time_s"] for r in ordered},
        "send_recv_time_s": {r["device"]: r["send_recv_time_s"] for r in ordered},
        "sync_time_s": {r["device"]: r["sync_time_s"] for r in ordered},
    }


def encode_decision(round_id: str, decision: Any) -> bytes:
    """A decision (a dataclass with a ``plan`` field, :class:`hetrain.runtime.ctldecision.Decision`)
    of round ``round_id`` as JSON bytes."""
    body = {}
    for f in dataclasses.fields(decision):
        v = getattr(decision, f.name)
        body[f.name] = v.to_json_dict() if isinstance(v, Plan) else v
    return _dumps({"round": round_id, "decision": body})


def decode_decision(raw: bytes | str, decision_type: Any) -> tuple[str, Any]:
    """Inverse of :func:`encode_decision`: ``(round, decision)``; ``decision_type``'s fields
    are checked by their annotations (``Plan``, ``str``, ``int``, ``float``, ``bool``,
    ``dict[str, float]``, ``dict[str, int]``).

    Raises:
        WireError: not such a message.
    """
    what = "controller decision"
    value = _loads(raw, what)
    round_id = _str(_field(value, "round", what), f"{what}.round")
    body = _field(value, "decision", what)
    if not isinstance(body, dict):
        raise WireError(f"{what}.decision: expected an object")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(decision_type):
        w = f"{what}.{f.name}"
        if f.name not in body:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise WireError(f"{what}: missing {f.name!r}")
        v = body[f.name]
        kind = str(f.type)
        if kind == "Plan":
            kwargs[f.name] = _plan(v, w)
        elif kind == "str":
            kwargs[f.name] = _str(v, w)
        elif kind == "int":
            kwargs[f.name] = _int(v, w)
        elif kind == "float":
            kwargs[f.name] = _float(v, w)
        elif kind == "bool":
            if not isinstance(v, bool):
                raise WireError(f"{w}: expected a boolean")
            kwargs[f.name] = v
        elif kind == "dict[str, int]":
            kwargs[f.name] = _number_map(v, w, int)
        elif kind == "dict[str, float]":
            kwargs[f.name] = _number_map(v, w)
        else:
            raise WireError(f"{w}: field type {kind} cannot travel")
    unknown = set(body) - {f.name for f in dataclasses.fields(decision_type)}
    if unknown:
        raise WireError(f"{what}: unknown key {sorted(unknown)[0]!r}")
    decision = decision_type(**kwargs)
    if decision.plan.plan_id is None:
        raise WireError(f"{what}.plan: expected a plan_id")
    return round_id, decision
