"""Model profiles (docs/model.md §2, §7): a chain of layers with per-sample FLOPs and bytes.

:class:`ModelProfile` is the validated file; :meth:`ModelProfile.arrays` gives the numpy vectors
the cost model and the planner read. Measuring a profile from a real ``torch.nn.Module`` lives in
:mod:`hetrain.profiler` (it needs torch); this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
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


class ModelProfile(BaseModel):
    """A model profile file ``{"name": ..., "layers": [...], "shared": [...]}`` (docs/model.md §7),
    layers in execution order (0-based indices in plans), shared tensors optional.

    Raises:
        ValueError (via pydantic): a shared tensor naming a layer outside ``[0, L)`` or the
            same layer twice, or two shared tensors with one name.
    """

    model_config = _STRICT
    name: str = "model"
    layers: list[LayerProfile] = Field(min_length=1)
    shared: list[SharedTensorProfile] = Field(default_factory=list)

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
        )

    def to_json_dict(self) -> dict[str, Any]:
        """The docs/model.md §7 JSON object (defaults filled in)."""
        return self.model_dump(mode="json")


@dataclass(frozen=True)
class SharedTensor:
    """A shared (tied) tensor (docs/model.md §2): ``bytes`` of it, the sorted 0-based ``layers``
    that use it, ``frozen`` (no gradient: never synced, weights only in memory)."""

    name: str
    bytes: float
    layers: tuple[int, ...]
    frozen: bool = False


@dataclass(frozen=True)
class ProfileArrays:
    """Per-layer vectors, shape ``(L,)``: ``fwd_flops`` f_l and ``bwd_flops`` w_l (FLOP per
    sample), ``activation_bytes`` a_l and ``activation_memory_bytes`` m_l (bytes per sample),
    ``param_bytes`` p_l (trainable bytes, shared tensors excluded) and ``frozen_param_bytes``
    p^frozen_l (bytes; default zeros); ``overhead_weights`` ν_l (dimensionless, the layer's share
    of the per-layer fixed cost λ; default ones, docs/model.md §3); ``shared``: the shared
    tensors (docs/model.md §2)."""

    names: tuple[str, ...]
    fwd_flops: np.ndarray
    bwd_flops: np.ndarray
    activation_bytes: np.ndarray
    activation_memory_bytes: np.ndarray
    param_bytes: np.ndarray
    frozen_param_bytes: np.ndarray | None = None
    shared: tuple[SharedTensor, ...] = ()
    overhead_weights: np.ndarray | None = None

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
