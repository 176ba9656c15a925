"""The wire format of messages between pipeline stages (:class:`hetrain.runtime.stages.P2P`):
tensor descriptions, the JSON structure of a pytree, and the layout of a packed message.

Nothing received is unpickled: a pytree's structure travels as JSON (torch's
``treespec_dumps``/``treespec_loads``, which rebuild only registered container types) with its
non-tensor leaves as plain JSON values (:func:`encode_structure`, :func:`decode_structure`);
tensors travel as validated descriptions (one int64 header ``(dtype code, ndim, requires grad,
dims...)`` per tensor, :func:`_header`, :func:`_valid_header`) plus raw bytes, each aligned to
:data:`ALIGN` bytes and followed by a :data:`TRAILER` (:func:`_packed_size`). A malformed
message (bad JSON, an unknown container type, counts that disagree, an unknown dtype code, a
negative or oversized length) is a one-line :class:`StageMessageError` and changes nothing.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, treespec_dumps, treespec_loads

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
MAX_NDIM = 8
HEADER_LEN = 4 + MAX_NDIM  # a tensor's description: dtype code, ndim, requires grad, dims
TAG_PAYLOAD = 2
STRUCTURE_FORMAT = 1
MAX_STRUCTURE_BYTES = 1 << 20
"""Largest encoded pytree structure a stage accepts (bytes): far above any model's (a few KB)."""
_PLAIN = (type(None), bool, int, float, str)


class StageMessageError(ValueError):
    """A message between pipeline stages that is not what the protocol allows (one line, naming
    the sending rank and what is wrong); nothing of it was used."""


def encode_structure(spec: TreeSpec, leaves: list[Any], mask: list[bool]) -> bytes:
    """JSON bytes of a pytree's structure: ``spec`` (``treespec_dumps``), the non-tensor leaves
    (``None``, bool, int, float, str; ``None`` in the places of tensors) and the tensor mask.

    Raises:
        TypeError: a non-tensor leaf of another type, or a container type that torch cannot
            serialise (e.g. an unregistered ``namedtuple``): stage outputs must be tensors,
            plain values and registered containers.
    """
    plain = []
    for leaf, is_tensor in zip(leaves, mask, strict=True):
        if is_tensor:
            plain.append(None)
        elif isinstance(leaf, _PLAIN):
            plain.append(leaf)
        else:
            raise TypeError(
                f"stage output leaf of type {type(leaf).__name__}: only tensors, None, bool, "
                "int, float and str cross a stage boundary"
            )
    try:
        spec_text = treespec_dumps(spec)
    except (NotImplementedError, TypeError, ValueError) as exc:
        raise TypeError(f"stage output structure cannot be sent as data: {exc}") from None
    return json.dumps(
        {"format": STRUCTURE_FORMAT, "spec": spec_text, "leaves": plain, "mask": mask}
    ).encode("utf-8")


def decode_structure(blob: bytes, source: str) -> tuple[TreeSpec, list[Any], list[bool]]:
    """Inverse of :func:`encode_structure`, validating everything (no code runs: JSON, then
    ``treespec_loads`` of registered container types only).

    Raises:
        StageMessageError: ``source`` (e.g. ``"stage message from rank 1"``) and the fault:
            not UTF-8 JSON, wrong format or fields, an unknown container type, a leaf count
            other than the spec's, non-plain leaves.
    """
    try:
        data = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise StageMessageError(f"{source}: malformed structure (not UTF-8 JSON)") from None
    if not isinstance(data, dict) or data.get("format") != STRUCTURE_FORMAT:
        raise StageMessageError(f"{source}: malformed structure (expected format 1)")
    spec_text, leaves, mask = data.get("spec"), data.get("leaves"), data.get("mask")
    if (
        not isinstance(spec_text, str)
        or not isinstance(leaves, list)
        or not isinstance(mask, list)
        or len(leaves) != len(mask)
        or not all(type(m) is bool for m in mask)
        or not all(isinstance(v, _PLAIN) for v in leaves)
        or any(m and v is not None for v, m in zip(leaves, mask, strict=True))
    ):
        raise StageMessageError(f"{source}: malformed structure (spec, leaves, mask)")
    try:
        spec = treespec_loads(spec_text)
    except Exception as exc:  # noqa: BLE001 - any failure of a hostile spec is one line
        why = " ".join(str(exc).split())[:120]
        raise StageMessageError(
            f"{source}: malformed structure spec ({type(exc).__name__}: {why})"
        ) from None
    if spec.num_leaves != len(mask):
        raise StageMessageError(
            f"{source}: structure has {spec.num_leaves} leaves, message {len(mask)}"
        )
    return spec, leaves, mask


ALIGN = 16  # bytes: each tensor of a packed message starts at a multiple (dtype views)
TRAILER = (
    2  # int64 at the end of a packed message: flag (0 data, 1 a description follows), send time
)


def _header(t: torch.Tensor) -> tuple[int, ...]:
    if t.dim() > MAX_NDIM:
        raise ValueError(f"activation with {t.dim()} dims: at most {MAX_NDIM} supported")
    return (_CODE[t.dtype], t.dim(), int(t.requires_grad), *t.shape)


MAX_TREE_TENSORS = 1 << 16
"""Most tensors one stage message may carry (far above any model's boundary)."""
MAX_TENSOR_BYTES = 1 << 40
"""Largest tensor a stage message may describe (bytes)."""


def _valid_header(row: list[int]) -> bool:
    """Whether a received tensor description ``(dtype code, ndim, requires grad, dims...)``
    names a known dtype, at most :data:`MAX_NDIM` non-negative dims and at most
    :data:`MAX_TENSOR_BYTES` bytes."""
    if not (0 <= row[0] < len(_DTYPES) and 0 <= row[1] <= MAX_NDIM and row[2] in (0, 1)):
        return False
    dims = row[3 : 3 + row[1]]
    numel = 1
    for d in dims:
        if d < 0:
            return False
        numel *= d
    return numel * _DTYPES[row[0]].itemsize <= MAX_TENSOR_BYTES


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _packed_size(headers: tuple[tuple[int, ...], ...]) -> int:
    total = 0
    for h in headers:
        numel = 1
        for d in h[3:]:
            numel *= d
        total += _aligned(numel * _DTYPES[h[0]].itemsize)
    return total + TRAILER * 8
