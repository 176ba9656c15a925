"""Where everything of a plan lives: ranks of groups, stages, shares, owners of each layer.

Pure Python (no torch): every rank computes the same :class:`Layout` from the plan and the
device of every rank, so collective calls are issued in the same order everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetrain._text import plural
from hetrain.errors import InputError
from hetrain.plan import Plan


@dataclass(frozen=True)
class GroupLayout:
    """One data-parallel group: ``ranks[k]`` holds layers ``stages[k] = [start, end)``; the group
    reads rows ``[offset, offset + batch)`` of the global batch in micro-batches of
    ``microbatch_size`` rows (the last one may be smaller)."""

    index: int
    ranks: tuple[int, ...]
    devices: tuple[str, ...]
    stages: tuple[tuple[int, int], ...]
    offset: int
    batch: int
    microbatch_size: int

    @property
    def active(self) -> bool:
        return self.batch > 0

    def microbatches(self) -> list[tuple[int, int]]:
        """Row ranges ``[start, end)`` of the global batch, one per micro-batch
        (``n_g = ceil(b_g / μ_g)``, docs/model.md §3)."""
        out = []
        start = self.offset
        stop = self.offset + self.batch
        while start < stop:
            out.append((start, min(start + self.microbatch_size, stop)))
            start += self.microbatch_size
        return out


@dataclass(frozen=True)
class Layout:
    """A plan resolved to ranks.

    Attributes:
        plan: the plan.
        num_layers: L.
        devices: device id of every rank (index = rank).
        groups: one :class:`GroupLayout` per plan group, in plan order.
        owners: per layer, the rank holding it in each group (plan order).
        active_owners: per layer, the owners in groups with ``b_g > 0`` (plan order).
        canonical: per layer, the owner in the first active group (its copy is the one
            counted for the gradient norm, saved and exported).
    """

    plan: Plan
    num_layers: int
    devices: tuple[str, ...]
    groups: tuple[GroupLayout, ...]
    owners: tuple[tuple[int, ...], ...]
    active_owners: tuple[tuple[int, ...], ...]
    canonical: tuple[int, ...]

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    def position(self, rank: int) -> tuple[int, int] | None:
        """``(group index, stage index)`` of ``rank``, or None when the plan does not use it."""
        for g in self.groups:
            if rank in g.ranks:
                return g.index, g.ranks.index(rank)
        return None

    def owned_layers(self, rank: int) -> tuple[int, ...]:
        """Layers held by ``rank`` (empty when the plan does not use it)."""
        pos = self.position(rank)
        if pos is None:
            return ()
        start, end = self.groups[pos[0]].stages[pos[1]]
        return tuple(range(start, end))


def build_layout(
    plan: Plan,
    devices: tuple[str, ...] | list[str],
    num_layers: int,
    *,
    require_all: bool = True,
    source: str = "plan",
) -> Layout:
    """Resolve ``plan`` for ranks whose device ids are ``devices`` (index = rank).

    Args:
        require_all: if True, every rank must be named by the plan (the world size equals the
            plan's device count); a re-plan may leave ranks out (they then hold nothing).

    Raises:
        InputError: duplicate device ids among ranks, a plan device that is no rank, stages
            not covering ``[0, num_layers)``, a world size different from the plan's device
            count (``require_all``), or a global batch of 0.
    """
    devices = tuple(devices)
    if len(set(devices)) != len(devices):
        dup = sorted({d for d in devices if devices.count(d) > 1})
        raise InputError("workers", "device_id", f"expected one rank per device, {dup} repeat")
    plan.validate_for(devices, num_layers, plan.global_batch, source)
    if require_all and len(plan.devices) != len(devices):
        raise InputError(
            source,
            "groups[].devices",
            f"expected the plan to name all {plural(len(devices), 'rank')} of the world "
            f"(world size {len(devices)}), it names {plural(len(plan.devices), 'device')}",
        )
    if plan.global_batch <= 0:
        raise InputError(source, "groups[].batch", "expected a global batch > 0, got 0")
    rank_of = {d: r for r, d in enumerate(devices)}
    groups = []
    offset = 0
    for i, g in enumerate(plan.groups):
        groups.append(
            GroupLayout(
                index=i,
                ranks=tuple(rank_of[d] for d in g.devices),
                devices=tuple(g.devices),
                stages=tuple(tuple(s) for s in g.stages),
                offset=offset,
                batch=g.batch,
                microbatch_size=g.microbatch_size,
            )
        )
        offset += g.batch
    owners = []
    active = []
    for layer in range(num_layers):
        row = []
        act = []
        for g in groups:
            for k, (start, end) in enumerate(g.stages):
                if start <= layer < end:
                    row.append(g.ranks[k])
                    if g.active:
                        act.append(g.ranks[k])
        owners.append(tuple(row))
        active.append(tuple(act))
    return Layout(
        plan=plan,
        num_layers=num_layers,
        devices=devices,
        groups=tuple(groups),
        owners=tuple(owners),
        active_owners=tuple(active),
        canonical=tuple(a[0] for a in active),
    )
