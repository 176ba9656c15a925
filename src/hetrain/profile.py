"""Model profiles (SPEC §2, §7): a chain of layers with per-sample FLOPs and bytes.

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
    (m_l, kept for backward, default ``a_l``), and ``param_bytes`` (p_l)."""

    model_config = _STRICT
    name: str = ""
    fwd_flops: float = Field(ge=0, le=MAX_NUMBER)
    bwd_flops: float | None = Field(None, ge=0, le=MAX_NUMBER)
    activation_bytes: float = Field(ge=0, le=MAX_NUMBER)
    activation_memory_bytes: float | None = Field(None, ge=0, le=MAX_NUMBER)
    param_bytes: float = Field(0.0, ge=0, le=MAX_NUMBER)

    @model_validator(mode="after")
    def _defaults(self) -> LayerProfile:
        if self.bwd_flops is None:
            self.bwd_flops = 2.0 * self.fwd_flops
        if self.activation_memory_bytes is None:
            self.activation_memory_bytes = self.activation_bytes
        return self


class ModelProfile(BaseModel):
    """A model profile file ``{"name": ..., "layers": [...]}`` (SPEC §7), layers in execution
    order (0-based indices in plans)."""

    model_config = _STRICT
    name: str = "model"
    layers: list[LayerProfile] = Field(min_length=1)

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
        )

    def to_json_dict(self) -> dict[str, Any]:
        """The SPEC §7 JSON object (defaults filled in)."""
        return self.model_dump(mode="json")


@dataclass(frozen=True)
class ProfileArrays:
    """Per-layer vectors, shape ``(L,)``: ``fwd_flops`` f_l and ``bwd_flops`` w_l (FLOP per
    sample), ``activation_bytes`` a_l and ``activation_memory_bytes`` m_l (bytes per sample),
    ``param_bytes`` p_l (bytes)."""

    names: tuple[str, ...]
    fwd_flops: np.ndarray
    bwd_flops: np.ndarray
    activation_bytes: np.ndarray
    activation_memory_bytes: np.ndarray
    param_bytes: np.ndarray

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @property
    def train_flops(self) -> np.ndarray:
        """``f_l + w_l`` per sample, shape ``(L,)``."""
        return self.fwd_flops + self.bwd_flops


def load_profile(path: str | Path) -> ModelProfile:
    """Load and validate a model profile (JSON or YAML, SPEC §7).

    Raises:
        InputError: missing file, bad syntax, or an invalid field.
    """
    raw = read_structured(path)
    return profile_from_dict(raw, str(path))


def profile_from_dict(raw: Any, source: str = "<profile>") -> ModelProfile:
    """Validate an already-parsed profile object; see :func:`load_profile`."""
    if not isinstance(raw, dict):
        raise InputError(source, "", "expected a mapping with keys 'name' and 'layers'")
    check_finite_tree(source, raw)
    try:
        return ModelProfile.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(source, exc) from None
