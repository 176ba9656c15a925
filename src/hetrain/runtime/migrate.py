"""Plan changes: move layers with their parameters, buffers and optimizer state to their new
owners between iterations (docs/model.md §5), and gather layers on one rank (export).

A layer travels as one ``torch.save`` byte string (module ``state_dict`` + the per-layer
optimizer ``state_dict``) sent point-to-point from one old owner (all replicas are identical).
All ranks walk the same global list of transfers in the same order with blocking send/recv:
the earliest unfinished transfer always has both of its ranks waiting on it, so the walk cannot
deadlock.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hetrain.runtime.layout import Layout


@dataclass(frozen=True)
class Transfer:
    """Layer ``layer`` goes from rank ``src`` (an old owner) to rank ``dst`` (a new owner)."""

    layer: int
    src: int
    dst: int


def plan_transfers(old: Layout, new: Layout) -> list[Transfer]:
    """Transfers needed to go from ``old`` to ``new``: every new owner of a layer that does not
    hold it yet receives it from an old owner; sources are spread over the old owners (the one
    with the fewest sends so far, ties by plan order). Deterministic (same on every rank)."""
    sends: dict[int, int] = {}
    out: list[Transfer] = []
    for layer in range(new.num_layers):
        have = old.owners[layer]
        for dst in sorted(set(new.owners[layer]) - set(have)):
            src = min(have, key=lambda r: (sends.get(r, 0), have.index(r)))
            sends[src] = sends.get(src, 0) + 1
            out.append(Transfer(layer, src, dst))
    return out


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def send_object(obj: Any, dst: int, device: torch.device) -> int:
    """Blocking send of a picklable object of tensors to rank ``dst`` (``torch.save`` bytes);
    returns the number of payload bytes."""
    buf = io.BytesIO()
    torch.save(_to_cpu(obj), buf)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.send(size, dst)
    dist.send(data, dst)
    return int(data.numel())


def recv_object(src: int, device: torch.device) -> tuple[Any, int]:
    """Blocking receive of an object sent by :func:`send_object` from rank ``src``; returns
    the object (tensors on CPU) and the number of payload bytes."""
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(data, src)
    obj = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)
    return obj, int(data.numel())
