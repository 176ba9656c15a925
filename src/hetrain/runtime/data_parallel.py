"""Data-parallel dimension: combine each layer's gradient across the groups holding it
(SPEC §1, §3 "sync time").

Layer ``l`` is held by one rank per group (its *owners*). Consecutive layers with the same
owners form a *bucket*; a bucket's gradients are flattened and summed with one all-reduce among
the owners in active groups (``b_g > 0``), so every rank moves only the bytes of the parameters
it holds (a ring all-reduce among the owners of the same layers, SPEC §3). Owners in idle groups
(``b_g = 0``) then *receive* the combined gradient by a broadcast from the first active owner
and step their optimizer with it, so that every replica stays identical.

Every rank creates the same process groups in the same order (``torch.distributed.new_group``
is collective over the whole world); groups are cached by their sorted rank tuple.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hetrain.runtime.emulation import Emulation, sleep_s
from hetrain.runtime.layout import Layout


@dataclass(frozen=True)
class Bucket:
    """Consecutive ``layers`` with the same owners: ``active`` (plan order, ``active[0]`` is
    the canonical owner) and ``idle``; ``active + idle`` is every owner."""

    layers: tuple[int, ...]
    active: tuple[int, ...]
    idle: tuple[int, ...]

    @property
    def reduce_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.active))

    @property
    def broadcast_ranks(self) -> tuple[int, ...]:
        return tuple(sorted((self.active[0], *self.idle)))


def build_buckets(
    layout: Layout, layer_bytes: list[int] | None = None, cap_bytes: int | None = None
) -> list[Bucket]:
    """Buckets of ``layout``: maximal runs of consecutive layers whose owners (active and idle)
    are equal, split at layer boundaries so that a bucket exceeds ``cap_bytes`` (of
    ``layer_bytes[l]`` parameter bytes per layer) only when one layer does."""
    buckets: list[Bucket] = []
    size = 0
    for layer in range(layout.num_layers):
        active = layout.active_owners[layer]
        idle = tuple(r for r in layout.owners[layer] if r not in active)
        nbytes = 0 if layer_bytes is None else layer_bytes[layer]
        fits = cap_bytes is None or size + nbytes <= cap_bytes
        if buckets and buckets[-1].active == active and buckets[-1].idle == idle and fits:
            size += nbytes
            prev = buckets[-1]
            buckets[-1] = Bucket(prev.layers + (layer,), active, idle)
        else:
            buckets.append(Bucket((layer,), active, idle))
            size = nbytes
    return buckets


class GroupCache:
    """Process groups by ``(tag, sorted ranks)``; :meth:`ensure` and :meth:`pipeline_channels`
    must be called on every rank with the same layout (``new_group`` is collective over the
    world and must be called in the same order everywhere)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}

    def ensure(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            if len(b.active) > 1:
                self.get(b.reduce_ranks)
            if b.idle:
                self.get(b.broadcast_ranks)

    def get(self, ranks: tuple[int, ...], tag: str = "") -> dist.ProcessGroup:
        key = (tag, ranks)
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(ranks))
        return self._groups[key]

    def pipeline_channels(self, layout: Layout) -> dict[tuple[int, int], dist.ProcessGroup]:
        """One two-rank process group per *directed* pipeline link ``(src, dst)`` of every
        group: activations and gradients between two stages travel on different
        communicators, so a queued send one way never blocks a receive the other way (NCCL
        runs a communicator's point-to-point operations in order on one stream)."""
        channels: dict[tuple[int, int], dist.ProcessGroup] = {}
        for g in layout.groups:
            for a, b in zip(g.ranks[:-1], g.ranks[1:], strict=True):
                pair = (min(a, b), max(a, b))
                channels[(a, b)] = self.get(pair, f"p2p {a}->{b}")
                channels[(b, a)] = self.get(pair, f"p2p {b}->{a}")
        return channels


def _flat_grads(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    if not parts:
        return torch.zeros(0, device=device)
    return torch.cat(parts)


def _unflatten_into(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        chunk = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        offset += n


def sync_gradients(
    *,
    layout: Layout,
    buckets: list[Bucket],
    groups: GroupCache,
    rank: int,
    layers: nn.Sequential,
    device: torch.device,
    emulation: Emulation | None,
) -> tuple[float, int]:
    """Sum each bucket's gradient over its active owners, then broadcast it to idle owners.

    Emulated links: after a bucket's all-reduce the rank sleeps until
    ``2 (G'-1) lat + 2 (G'-1)/G' · bytes / β`` has elapsed (SPEC §3 ring all-reduce, ``β`` the
    slowest emulated link from this rank to another owner).

    Returns:
        ``(time_s, bytes)``: wall time spent and gradient bytes this rank all-reduced.
    """
    t0 = time.perf_counter()
    total_bytes = 0
    me = layout.devices[rank]
    for b in buckets:
        if rank not in b.active and rank not in b.idle:
            continue
        params = [p for layer in b.layers for p in layers[layer].parameters()]
        if not params:
            continue
        flat = _flat_grads(params, device)
        nbytes = flat.numel() * flat.element_size()
        if len(b.active) > 1 and rank in b.active:
            t_b = time.perf_counter()
            dist.all_reduce(flat, group=groups.get(b.reduce_ranks))
            total_bytes += nbytes
            if emulation is not None and emulation.limits_links():
                g = len(b.active)
                bw = min(
                    emulation.link_bandwidth(me, layout.devices[r]) for r in b.active if r != rank
                )
                target = 2 * (g - 1) * emulation.latency_s + 2 * (g - 1) / g * nbytes / bw
                sleep_s(target - (time.perf_counter() - t_b))
        if b.idle and rank in b.broadcast_ranks:
            dist.broadcast(flat, src=b.active[0], group=groups.get(b.broadcast_ranks))
        _unflatten_into(flat, params)
    return time.perf_counter() - t0, total_bytes
