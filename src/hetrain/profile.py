"""Model profiles (docs/model.md §2, §7): a chain of layers with per-sample FLOPs and bytes.

:class:`ModelProfile` is the validated file; :meth:`ModelProfile.arrays` gives the numpy vectors
the cost model and the planner read. Measuring a profile from a real ``torch.nn.Module`` lives in
:mod:`hetrain.profiler` (it needs torch); this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetrain._io import MAX_NUMBER, check_finite_tree, read_structured
from hetrain.errors import InputError, from_validation_error

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class LayerProfile(BaseModel):
    """One layer: per-sample ``fwd_flops`` (f_l), ``bwd_flops`` (w_l, default ``2 f_l``),
    ``activation_bytes`` (a_l, output crossing a stage boundary), ``activation_memory_bytes``
    (m_l, kept for backward, default ``a_l``), ``param_bytes`` (p_l, trainable) and
    ``frozen_param_bytes`` (p^frozen_l, parameters that take no gradient, default 0; docs/model.md
    (v3)
    §2) and ``overhead_weight`` (ν_l, the layer's share of the per-layer fixed cost λ relative
    to the model's average layer, default 1 = docs/model.md (v3)'s ``λ |S|``; docs/model.md
    §3 "Per-layer overhead weights"). Shared tensors are listed in
    :attr:`ModelProfile.shared`, not here."""

    model_config = _STRICT
    name: str = ""
    fwd_flops: float = Field(ge=0, le=MAX_NUMBER)
    bwd_flops: float | None = Field(None, ge=0, le=MAX_NUMBER)
    activation_bytes: float = Field(ge=0, le=MAX_NUMBER)
    activation_memory_bytes: float | None = Field(None, ge=0, le=MAX_NUMBER)
    param_bytes: float = Field(0.0, ge=0, le=MAX_NUMBER)
    frozen_param_bytes: float = Field(0.0, ge=0, le=MAX_NUMBER)
    overhead_weight: float = Field(1.0, ge=0, le=1e6)

    @model_validator(mode="after")
    def _defaults(self) -> LayerProfile:
        if self.bwd_flops is None:
            self.bwd_flops = 2.0 * self.fwd_flops
        if self.activation_memory_bytes is None:
            self.activation_memory_bytes = self.activation_bytes
        return self


class SharedTensorProfile(BaseModel):
    """A shared (tied) tensor of a profile file (docs/model.md §2, §7): ``name``, ``bytes``, the
    0-based ``layers`` that use it, and whether it is ``frozen`` (default false). It is listed
    once and not counted in the ``param_bytes`` of its layers."""

    model_config = _STRICT
    name: str = Field(min_length=1)
    bytes: float = Field(ge=0, le=MAX_NUMBER)
    layers: list[int] = Field(min_length=1)
    frozen: bool = Field(False, strict=True)


class MeasuredTimesProfile(BaseModel):
    """Measured times of every layer on one device kind (docs/model.md §3, §7): the
    ``microbatch_sizes`` measured (samples, strictly increasing integers >= 1) and, per size, a
    row of ``L`` forward seconds (``fwd_s``) and ``L`` backward seconds (``bwd_s``) per
    micro-batch of that size, in layer order. Rows are checked against the profile's ``L`` by
    :class:`ModelProfile`."""

    model_config = _STRICT
    microbatch_sizes: list[int] = Field(min_length=1)
    fwd_s: list[list[float]] = Field(min_length=1)
    bwd_s: list[list[float]] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_sizes(self) -> MeasuredTimesProfile:
        sizes = self.microbatch_sizes
        for i, mu in enumerate(sizes):
            if isinstance(mu, bool) or mu < 1:
                raise ValueError(f"microbatch_sizes[{i}]: expected an integer >= 1, got {mu!r}")
            if i and mu <= sizes[i - 1]:
                raise ValueError(
                    f"microbatch_sizes[{i}]: expected strictly increasing sizes, got {mu} "
                    f"after {sizes[i - 1]}"
                )
        for key in ("fwd_s", "bwd_s"):
            rows = getattr(self, key)
            if len(rows) != len(sizes):
                raise ValueError(
                    f"{key}: expected one row per micro-batch size ({len(sizes)}), got {len(rows)}"
                )
            for r, row in enumerate(rows):
                for j, t in enumerate(row):
                    if not 0.0 <= t <= MAX_NUMBER:
                        raise ValueError(
                            f"{key}[{r}][{j}]: expected seconds >= 0 and <= {MAX_NUMBER:g}, "
                            f"got {t!r}"
                        )
        return self


class ModelProfile(BaseModel):
    """A model profile file ``{"name": ..., "layers": [...], "shared": [...]}`` (docs/model.md §7),
    layers in execution order (0-based indices in plans), shared tensors optional, and
    optional ``measured_times``: per device kind (a cluster device's ``kind``, docs/model.md
    §7) the measured per-layer times of :class:`MeasuredTimesProfile`.

    Raises:
        ValueError (via pydantic): a shared tensor naming a layer outside ``[0, L)`` or the
            same layer twice, two shared tensors with one name, an empty kind name, or a
            measured-times row without exactly ``L`` entries.
    """

    model_config = _STRICT
    name: str = "model"
    layers: list[LayerProfile] = Field(min_length=1)
    shared: list[SharedTensorProfile] = Field(default_factory=list)
    measured_times: dict[str, MeasuredTimesProfile] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_measured(self) -> ModelProfile:
        num_layers = len(self.layers)
        seen: dict[str, str] = {}
        for kind, table in self.measured_times.items():
            if not kind:
                raise ValueError("measured_times: expected non-empty device kind names")
            if kind.casefold() in seen:
                raise ValueError(
                    f"measured_times.{kind}: expected each device kind once (kinds are "
                    f"compared without regard to case; also {seen[kind.casefold()]!r})"
                )
            seen[kind.casefold()] = kind
            for key in ("fwd_s", "bwd_s"):
                for r, row in enumerate(getattr(table, key)):
                    if len(row) != num_layers:
                        raise ValueError(
                            f"measured_times.{kind}.{key}[{r}]: expected one time per layer "
                            f"({num_layers}), got {len(row)}"
                        )
        return self

    @model_validator(mode="after")
    def _check_shared(self) -> ModelProfile:
        names: dict[str, int] = {}
        for i, tensor in enumerate(self.shared):
            if tensor.name in names:
                raise ValueError(
                    f"shared[{i}].name: duplicate shared tensor name {tensor.name!r} "
                    f"(also shared[{names[tensor.name]}])"
                )
            names[tensor.name] = i
            for j, layer in enumerate(tensor.layers):
                if not 0 <= layer < len(self.layers):
                    raise ValueError(
                        f"shared[{i}].layers[{j}]: expected a layer index in "
                        f"[0, {len(self.layers)}), got {layer}"
                    )
            if len(set(tensor.layers)) != len(tensor.layers):
                raise ValueError(f"shared[{i}].layers: expected each layer once")
        return self

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def arrays(self) -> ProfileArrays:
        """Per-layer numpy vectors of shape ``(L,)``; see :class:`ProfileArrays`."""
        return ProfileArrays(
            names=tuple(ly.name or f"layer{i}" for i, ly in enumerate(self.layers)),
            fwd_flops=np.array([ly.fwd_flops for ly in self.layers], dtype=float),
            bwd_flops=np.array([ly.bwd_flops for ly in self.layers], dtype=float),
            activation_bytes=np.array([ly.activation_bytes for ly in self.layers], dtype=float),
            activation_memory_bytes=np.array(
                [ly.activation_memory_bytes for ly in self.layers], dtype=float
            ),
            param_bytes=np.array([ly.param_bytes for ly in self.layers], dtype=float),
            frozen_param_bytes=np.array([ly.frozen_param_bytes for ly in self.layers], dtype=float),
            overhead_weights=np.array([ly.overhead_weight for ly in self.layers], dtype=float),
            shared=tuple(
                SharedTensor(t.name, float(t.bytes), tuple(sorted(t.layers)), bool(t.frozen))
                for t in self.shared
            ),
            measured=tuple(
                MeasuredTimes(
                    kind,
                    np.asarray(t.microbatch_sizes, dtype=float),
                    np.asarray(t.fwd_s, dtype=float),
                    np.asarray(t.bwd_s, dtype=float),
                )
                for kind, t in sorted(self.measured_times.items())
            ),
        )

    def to_json_dict(self) -> dict[str, Any]:
        """The docs/model.md §7 JSON object (defaults filled in; ``measured_times`` only when
        the profile has some)."""
        out = self.model_dump(mode="json")
        if not out["measured_times"]:
            del out["measured_times"]
        return out


@dataclass(frozen=True)
class SharedTensor:
    """A shared (tied) tensor (docs/model.md §2): ``bytes`` of it, the sorted 0-based ``layers``
    that use it, ``frozen`` (no gradient: never synced, weights only in memory)."""

    name: str
    bytes: float
    layers: tuple[int, ...]
    frozen: bool = False


@dataclass(frozen=True)
class MeasuredTimes:
    """Measured per-layer times of one device ``kind`` (docs/model.md §3 "Measured times"):
    ``microbatch_sizes`` (shape ``(m,)``, samples, strictly increasing), ``fwd_s`` and
    ``bwd_s`` (shape ``(m, L)``): seconds per micro-batch of each size, per layer."""

    kind: str
    microbatch_sizes: np.ndarray
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    _cache: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def prefix_s(self, microbatch_size: float, part: str = "train") -> np.ndarray:
        """Prefix sums over layers of :meth:`layer_times_s`, shape ``(L + 1,)`` (seconds per
        micro-batch; stage ``[i, j)`` takes ``P[j] − P[i]``); cached per size and part."""
        key = ("prefix", float(microbatch_size), part)
        out = self._cache.get(key)
        if out is None:
            out = np.concatenate(([0.0], np.cumsum(self.layer_times_s(microbatch_size, part))))
            self._cache[key] = out
        return out

    def rate_prefix_s(self, max_microbatch_size: float) -> np.ndarray:
        """Prefix sums over layers of ``min_{1≤μ≤max} t_l(μ)/μ`` (a lower bound on each
        layer's seconds per sample), shape ``(L + 1,)``. ``t_l`` is linear between its
        breakpoints (the measured sizes), so ``t_l(μ)/μ`` is monotone on each piece and the
        minimum is at 1, ``max_microbatch_size`` or a measured size in between (0 where
        ``t_l`` reaches 0). Cached per ``max_microbatch_size``."""
        key = ("rate", float(max_microbatch_size))
        out = self._cache.get(key)
        if out is None:
            top = float(max(1.0, max_microbatch_size))
            inside = [float(x) for x in self.microbatch_sizes if 1.0 < x < top]
            points = sorted({1.0, top, *inside})
            per = np.min([self.layer_times_s(mu) / mu for mu in points], axis=0)
            out = np.concatenate(([0.0], np.cumsum(per)))
            self._cache[key] = out
        return out

    def layer_times_s(self, microbatch_size: float, part: str = "train") -> np.ndarray:
        """Per-layer seconds per micro-batch of ``microbatch_size`` samples, shape ``(L,)``
        (docs/model.md §3): piecewise linear in the micro-batch size between the measured
        sizes, extrapolated along the line through the two nearest measured sizes outside
        them, proportional to the size (a line through 0) when one size was measured, and
        never below 0. ``part``: ``"train"`` (forward + backward), ``"fwd"`` or ``"bwd"``.

        Raises:
            ValueError: unknown ``part``.
        """
        if part == "train":
            rows = self._cache.get("train-rows")
            if rows is None:
                rows = self._cache["train-rows"] = self.fwd_s + self.bwd_s
        elif part in ("fwd", "bwd"):
            rows = self.fwd_s if part == "fwd" else self.bwd_s
        else:
            raise ValueError(f"part: expected 'train', 'fwd' or 'bwd', got {part!r}")
        sizes = self.microbatch_sizes
        mu = float(microbatch_size)
        if len(sizes) == 1:
            return np.maximum(rows[0] * (mu / sizes[0]), 0.0)
        i = int(np.clip(np.searchsorted(sizes, mu, side="right") - 1, 0, len(sizes) - 2))
        w = (mu - sizes[i]) / (sizes[i + 1] - sizes[i])
        return np.maximum((1.0 - w) * rows[i] + w * rows[i + 1], 0.0)


@dataclass(frozen=True)
class ProfileArrays:
    """Per-layer vectors, shape ``(L,)``: ``fwd_flops`` f_l and ``bwd_flops`` w_l (FLOP per
    sample), ``activation_bytes`` a_l and ``activation_memory_bytes`` m_l (bytes per sample),
    ``param_bytes`` p_l (trainable bytes, shared tensors excluded) and ``frozen_param_bytes``
    p^frozen_l (bytes; default zeros); ``overhead_weights`` ν_l (dimensionless, the layer's share
    of the per-layer fixed cost λ; default ones, docs/model.md §3); ``shared``: the shared
    tensors (docs/model.md §2); ``measured``: measured per-layer times per device kind
    (:class:`MeasuredTimes`, sorted by kind; default none: the FLOP model everywhere)."""

    names: tuple[str, ...]
    fwd_flops: np.ndarray
    bwd_flops: np.ndarray
    activation_bytes: np.ndarray
    activation_memory_bytes: np.ndarray
    param_bytes: np.ndarray
    frozen_param_bytes: np.ndarray | None = None
    shared: tuple[SharedTensor, ...] = ()
    overhead_weights: np.ndarray | None = None
    measured: tuple[MeasuredTimes, ...] = ()
    # (costmodel.profile_prefix keeps the prefix sums of these arrays here: built once per
    # profile object, not once per planner/cost-model call; the arrays are never written)
    _cache: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.frozen_param_bytes is None:
            object.__setattr__(self, "frozen_param_bytes", np.zeros(len(self.names)))
        if self.overhead_weights is None:
            object.__setattr__(self, "overhead_weights", np.ones(len(self.names)))

    def layer_units(self, start: int, end: int) -> float:
        """``Σ_{l∈[start, end)} ν_l``: the per-layer fixed cost units of stage ``[start, end)``
        (its number of layers when every ν_l is 1; docs/model.md §3)."""
        return float(np.sum(self.overhead_weights[start:end]))

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @property
    def train_flops(self) -> np.ndarray:
        """``f_l + w_l`` per sample, shape ``(L,)``."""
        return self.fwd_flops + self.bwd_flops


#: Relative tolerance within which the per-layer figures of profiles merged by
#: :func:`merge_profiles` must agree (FLOP counts and byte sizes of one model are exact; the
#: tolerance only absorbs rounding of JSON written by other tools).
MERGE_REL_TOL = 1e-6


def merge_profiles(profiles: list[tuple[str, ModelProfile]]) -> ModelProfile:
    """One profile from several profiles of one model (docs/model.md §7), e.g. measured on
    several machines: the first profile's layers, shared tensors and name, and the
    ``measured_times`` of every device kind of all of them.

    Args:
        profiles: ``(source, profile)`` pairs (``source`` names the file in errors), at
            least one.

    Raises:
        InputError: a profile with another number of layers, a layer figure (FLOPs, bytes,
            overhead weight) or shared tensor that differs from the first profile's (beyond
            :data:`MERGE_REL_TOL`), or one device kind in two profiles (kinds compared
            without regard to case).
    """
    if not profiles:
        raise InputError("merge", "", "expected at least one profile")
    first_source, first = profiles[0]
    base = first.to_json_dict()
    measured: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for source, prof in profiles:
        data = prof.to_json_dict()
        if len(data["layers"]) != len(base["layers"]):
            raise InputError(
                source,
                "layers",
                f"expected {len(base['layers'])} layers as in {first_source}, got "
                f"{len(data['layers'])}",
            )
        for i, (mine, ref) in enumerate(zip(data["layers"], base["layers"], strict=True)):
            for key, value in ref.items():
                if key == "name":
                    continue
                other = mine[key]
                if not np.isclose(other, value, rtol=MERGE_REL_TOL, atol=0.0):
                    raise InputError(
                        source,
                        f"layers[{i}].{key}",
                        f"expected {value!r} as in {first_source} (profiles of one model), "
                        f"got {other!r}",
                    )
        if data["shared"] != base["shared"]:
            raise InputError(source, "shared", f"expected the shared tensors of {first_source}")
        for kind, table in data.get("measured_times", {}).items():
            if kind.casefold() in owner:
                raise InputError(
                    source,
                    f"measured_times.{kind}",
                    f"expected each device kind in one profile only (also in "
                    f"{owner[kind.casefold()]})",
                )
            owner[kind.casefold()] = source
            measured[kind] = table
    return profile_from_dict({**base, "measured_times": measured}, "<merged profile>")


def load_profile(path: str | Path) -> ModelProfile:
    """Load and validate a model profile (JSON or YAML, docs/model.md §7).

    Raises:
        InputError: missing file, bad syntax, or an invalid field.
    """
    raw = read_structured(path)
    return profile_from_dict(raw, str(path))


def profile_from_dict(raw: Any, source: str = "<profile>") -> ModelProfile:
    """Validate an already-parsed profile object; see :func:`load_profile`."""
    if not isinstance(raw, dict):
        raise InputError(source, "", "expected a mapping with keys 'name' and 'layers'")
    check_finite_tree(source, raw, bool_keys=("frozen",))
    try:
        return ModelProfile.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(source, exc, ModelProfile) from None
