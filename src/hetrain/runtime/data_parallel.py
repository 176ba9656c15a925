"""Data-parallel dimension: combine each layer's gradient across the groups holding it
(docs/model.md §1, §3 "sync time").

Layer ``l`` is held by one rank per group (its *owners*). Consecutive layers with the same
owners form a *bucket*; a bucket's gradients are flattened and summed with one all-reduce among
the owners in active groups (``b_g > 0``), so every rank moves only the bytes of the parameters
it holds (a ring all-reduce among the owners of the same layers, docs/model.md §3). Owners in idle
groups
(``b_g = 0``) then *receive* the combined gradient by a broadcast from the first active owner
and step their optimizer with it, so that every replica stays identical.

Every rank creates the same process groups in the same order (``torch.distributed.new_group``
is collective over the whole world); groups are cached by their sorted rank tuple.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    shared: str | None = None  # a shared (tied) tensor's bucket: its holders (docs/model.md §3)

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


def shared_buckets(layout: Layout, shared: dict[str, tuple[int, ...]]) -> list[Bucket]:
    """One bucket per shared tensor (``name -> layers using it``): its owners are every rank
    holding one of those layers (a rank once), active ones those of active groups (docs/model.md §3:
    the gradient is the sum over all uses in all active groups)."""
    out = []
    for name, layers in shared.items():
        owners: list[int] = []
        active: list[int] = []
        for layer in layers:
            for r in layout.owners[layer]:
                if r not in owners:
                    owners.append(r)
            for r in layout.active_owners[layer]:
                if r not in active:
                    active.append(r)
        idle = tuple(r for r in owners if r not in active)
        out.append(Bucket((), tuple(active), idle, name))
    return out


class GradientSync:
    """Combine one step's gradients (docs/model.md §3 sync): all-reduce (sum) of each bucket among
    its
    active owners, then broadcast to its idle owners. Frozen parameters (no gradient) are left
    out: no hooks, no all-reduce.

    Overlap: :meth:`arm` (called just before a stage's last backward) registers
    post-accumulate-grad hooks; a bucket's all-reduce starts asynchronously as soon as all its
    parameters have their final gradient. Buckets start in decreasing layer order on every rank
    (a later bucket waits for the earlier ones), so all members of a process group issue its
    collectives in the same order. :meth:`finish` starts what is left, waits, copies the sums
    back into ``.grad`` and runs the broadcasts. The arithmetic is the same with or without
    overlap.

    Emulated links (when the emulation limits links): bucket ``i`` (launch order) of ``n_i``
    bytes needs ``dur_i = 2 (G'-1) lat + 2 (G'-1)/G' · n_i / β`` (docs/model.md §3 ring all-reduce,
    ``β`` the slowest emulated link from this rank to another owner), and the buckets share
    this rank's link, one after the other: its emulated finish is
    ``f_i = max(r_i, f_{i-1}) + dur_i`` and :meth:`finish` waits until then. ``r_i`` is when
    the emulated device would have the bucket's gradients: the engine runs a backward at full
    speed and then sleeps ``(factor - 1)×`` its duration (:func:`slow_down`), so a bucket
    launched ``τ`` seconds into the real last backward (started at :meth:`arm`) is ready at
    ``arm + factor · τ`` on the emulated device; a bucket launched by :meth:`finish` is ready
    at its launch. Without this the all-reduces would run during the sleep that stands for
    the very compute that produces their gradients.

    Extra values (``extra``, a callable returning a 1-D tensor of the same length on every
    rank): called once, when the bucket launched last (:attr:`carrier`) is launched; its
    values are appended to that bucket's flat gradient (in its dtype), so they are summed
    among the bucket's active owners by the same all-reduce; :attr:`extra_result` (float64)
    holds the sums after :meth:`finish`. The engine uses it when every rank is an active
    owner of every layer (pure data parallelism): the step's loss, item count and
    per-rank report rows then need no collective of their own. None when this rank
    all-reduces no bucket.
    """

    def __init__(
        self,
        *,
        layout: Layout,
        buckets: list[Bucket],
        groups: GroupCache,
        rank: int,
        bucket_params: list[list[nn.Parameter]],
        device: torch.device,
        emulation: Emulation | None,
        extra: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        self.layout = layout
        self.extra = extra
        self.extra_result: torch.Tensor | None = None
        self.groups = groups
        self.rank = rank
        self.device = device
        self.emulation = emulation
        self.mine = [
            (b, [p for p in params if p.requires_grad])
            for b, params in zip(buckets, bucket_params, strict=True)
            if rank in b.active or rank in b.idle
        ]
        self.mine = [(b, params) for b, params in self.mine if params]
        # buckets this rank all-reduces, in launch order (decreasing layers)
        self.order = [
            i
            for i in reversed(range(len(self.mine)))
            if len(self.mine[i][0].active) > 1 and rank in self.mine[i][0].active
        ]
        self._next = 0
        self._works: dict[int, tuple[torch.Tensor, Any, float]] = {}
        self._remaining: dict[int, set[int]] = {}
        self._bucket_of: dict[int, int] = {}
        self._handles: list[Any] = []
        self._armed_at: float | None = None
        self._armed_cpu = 0.0
        self.bytes = 0
        # the bucket launched last carries the caller's extra values (see ``extra``)
        self.carrier = self.order[-1] if self.order and extra is not None else None
        self._extra_len = 0

    def arm(self) -> None:
        """Start each bucket's all-reduce as soon as its gradients are final (call right
        before the last backward of the step)."""
        self._armed_at = time.perf_counter()
        self._armed_cpu = time.thread_time()
        for i in self.order:
            params = self.mine[i][1]
            self._remaining[i] = {id(p) for p in params}
            for p in params:
                self._bucket_of[id(p)] = i
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def disarm(self) -> None:
        """Remove the hooks without launching anything (after a failed step)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._remaining.clear()

    def _on_grad(self, param: torch.Tensor) -> None:
        i = self._bucket_of.get(id(param))
        if i is None or i not in self._remaining:
            return
        self._remaining[i].discard(id(param))
        while self._next < len(self.order) and not self._remaining.get(self.order[self._next]):
            self._launch(self.order[self._next], in_backward=True)
            self._next += 1

    def _launch(self, i: int, in_backward: bool = False) -> None:
        b, params = self.mine[i]
        flat = _flat_grads(params, self.device)
        if i == self.carrier:
            values = self.extra().to(device=self.device, dtype=flat.dtype)
            self._extra_len = values.numel()
            flat = torch.cat([flat, values])
        work = dist.all_reduce(flat, group=self.groups.get(b.reduce_ranks), async_op=True)
        now = time.perf_counter()
        ready = now
        if in_backward and self._armed_at is not None and self.emulation is not None:
            factor = self.emulation.slowdown_of(self.layout.devices[self.rank])
            ready = self._armed_at + factor * (now - self._armed_at)
            if self.emulation.compute_clock == "thread_cpu":  # as slow_down: factor x CPU
                ready = self._armed_at + max(
                    now - self._armed_at, factor * (time.thread_time() - self._armed_cpu)
                )
        self._works[i] = (flat, work, ready)

    def finish(self) -> tuple[float, int]:
        """Finish the step's gradient combination.

        Returns:
            ``(time_s, bytes)``: wall time spent here (the part not hidden behind backward)
            and gradient bytes this rank all-reduced.
        """
        t0 = time.perf_counter()
        self.disarm()
        while self._next < len(self.order):
            self._launch(self.order[self._next])
            self._next += 1
        me = self.layout.devices[self.rank]
        em = self.emulation
        link_free = -math.inf  # emulated finish of the previous bucket on this rank's link
        for i in self.order:
            flat, work, ready = self._works[i]
            work.wait()
            nbytes = flat.numel() * flat.element_size()
            if i == self.carrier:  # gradient bytes only (the few carried values are extra)
                self.extra_result = flat[flat.numel() - self._extra_len :].to(torch.float64)
                nbytes -= self._extra_len * flat.element_size()
            self.bytes += nbytes
            b = self.mine[i][0]
            if em is not None and em.limits_links():
                g = len(b.active)
                bw = min(
                    em.link_bandwidth(me, self.layout.devices[r])
                    for r in b.active
                    if r != self.rank
                )
                dur = 2 * (g - 1) * em.latency_s
                if not math.isinf(bw):
                    dur += 2 * (g - 1) / g * nbytes / bw
                link_free = max(ready, link_free) + dur
                sleep_s(link_free - time.perf_counter())
        for i, (b, params) in enumerate(self.mine):
            flat = self._works[i][0] if i in self._works else None
            if b.idle and self.rank in b.broadcast_ranks:
                if flat is None:
                    flat = _flat_grads(params, self.device)
                dist.broadcast(flat, src=b.active[0], group=self.groups.get(b.broadcast_ranks))
            if flat is not None:
                _unflatten_into(flat, params)
        self._works.clear()
        return time.perf_counter() - t0, self.bytes
