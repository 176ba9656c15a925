"""Migration cost of a plan change (docs/model.md §4: "bytes moved / bandwidth between old and new
owner,
paid in that slot").

A device of an *active* group (``b_g > 0``) of the new plan must hold, before the slot starts,
the current parameters and optimizer state of every layer of its stage. It already has them when
it held that layer in an active group of the old plan (replicas of a data-parallel layer are
identical after the all-reduce); otherwise the layer's ``p_l (1 + o)`` bytes (parameters plus
optimizer state; gradients are recomputed and not moved) are copied from an old owner, chosen as
the one with the highest bandwidth ``bw(old, new)`` (docs/model.md §2). A device that sat idle (its
group
had ``b_g = 0``) holds stale weights and counts as holding nothing.

Receivers copy in parallel and each one receives its layers one source after the other, so the
migration time is ``max_d Σ_src (bytes_src→d / bw(src, d) + lat)``. Contention at a sender that
serves several receivers is not modelled (a choice where docs/model.md is silent; see
docs/controller.md).
"""

from __future__ import annotations

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.plan import Plan
from hetrain.profile import ProfileArrays


def layer_owners(plan: Plan, num_layers: int) -> list[list[str]]:
    """For each layer ``l`` (0-based), the devices of active groups that hold it.

    Returns:
        a list of length ``L``; entry ``l`` lists device ids (plan order).
    """
    owners: list[list[str]] = [[] for _ in range(num_layers)]
    for group in plan.groups:
        if group.batch <= 0:
            continue
        for dev, (start, end) in zip(group.devices, group.stages, strict=True):
            for layer in range(start, min(end, num_layers)):
                owners[layer].append(dev)
    return owners


def migration_bytes(
    old: Plan | None, new: Plan, profile: ProfileArrays, optimizer_state_factor: float
) -> dict[str, float]:
    """Bytes each device of the new plan must receive, ``{device_id: bytes}`` (devices that
    receive nothing are left out). ``old=None`` (the first slot) moves nothing: the initial
    placement is not charged.

    A layer moves ``p_l (1 + o)`` bytes (parameters and optimizer state, ``o`` = optimizer state
    factor of docs/model.md §2).
    """
    if old is None:
        return {}
    num_layers = profile.num_layers
    per_layer = profile.param_bytes * (1.0 + float(optimizer_state_factor))
    held = _held_layers(old, num_layers)
    out: dict[str, float] = {}
    for group in new.groups:
        if group.batch <= 0:
            continue
        for dev, (start, end) in zip(group.devices, group.stages, strict=True):
            have = held.get(dev)
            need = np.zeros(num_layers, dtype=bool)
            need[start:end] = True
            if have is not None:
                need &= ~have
            moved = float(per_layer[need].sum())
            if need.any():
                out[dev] = moved
    return out


def migration_time_s(
    old: Plan | None,
    new: Plan,
    state: ClusterState,
    profile: ProfileArrays,
    optimizer_state_factor: float,
) -> float:
    """Seconds the plan change ``old -> new`` costs in the slot that applies it (0 when nothing
    moves or ``old`` is None).

    Each receiving device ``d`` gets every missing layer from the old owner with the highest
    ``bw(owner, d)`` (docs/model.md §2 link bandwidth of ``state``: an owner on ``d``'s node if
    there is
    one, else the owner with the fastest NIC); its time is ``Σ_src bytes_src / bw(src, d) + lat``
    per distinct source; the migration time is the max over receivers (they copy in parallel).
    Vectorised over (receiver, layer) pairs.

    Raises:
        KeyError: a plan names a device that is not in ``state``.
    """
    if old is None:
        return 0.0
    index = state.index()
    num_layers = profile.num_layers
    per_layer = np.asarray(profile.param_bytes, dtype=float) * (1.0 + float(optimizer_state_factor))
    node = np.asarray(state.node, dtype=np.int64)
    nic = np.asarray(state.nic_bytes_per_s, dtype=float)
    num_nodes = int(node.max()) + 1 if len(node) else 1
    old_start = np.full(len(state.ids), -1, dtype=np.int64)
    old_end = np.full(len(state.ids), -1, dtype=np.int64)
    own_dev: list[np.ndarray] = []
    own_layer: list[np.ndarray] = []
    for group in old.groups:
        if group.batch <= 0:
            continue
        for dev, (start, end) in zip(group.devices, group.stages, strict=True):
            i = index[dev]
            old_start[i], old_end[i] = start, end
            own_layer.append(np.arange(start, end, dtype=np.int64))
            own_dev.append(np.full(end - start, i, dtype=np.int64))
    if not own_dev:
        return 0.0
    o_dev = np.concatenate(own_dev)
    o_layer = np.concatenate(own_layer)
    # per layer: the owner with the fastest NIC (first on ties)
    order = np.lexsort((-nic[o_dev], o_layer))
    first = np.ones(len(order), dtype=bool)
    first[1:] = o_layer[order][1:] != o_layer[order][:-1]
    best_owner = np.full(num_layers, -1, dtype=np.int64)
    best_owner[o_layer[order][first]] = o_dev[order][first]
    # per (layer, node): the first owner on that node
    key = o_layer * num_nodes + node[o_dev]
    uniq, pos = np.unique(key, return_index=True)
    node_owner = o_dev[pos]
    # receiver/layer pairs of the new plan that are not held already
    r_dev: list[np.ndarray] = []
    r_layer: list[np.ndarray] = []
    for group in new.groups:
        if group.batch <= 0:
            continue
        for dev, (start, end) in zip(group.devices, group.stages, strict=True):
            i = index[dev]
            layers = np.arange(start, end, dtype=np.int64)
            missing = layers[(layers < old_start[i]) | (layers >= old_end[i])]
            if missing.size:
                r_layer.append(missing)
                r_dev.append(np.full(missing.size, i, dtype=np.int64))
    if not r_dev:
        return 0.0
    d = np.concatenate(r_dev)
    layer = np.concatenate(r_layer)
    keep = (per_layer[layer] > 0) & (best_owner[layer] >= 0)
    d, layer = d[keep], layer[keep]
    if d.size == 0:
        return 0.0
    want = layer * num_nodes + node[d]
    at = np.clip(np.searchsorted(uniq, want), 0, len(uniq) - 1)
    local = uniq[at] == want
    src = np.where(local, node_owner[at], best_owner[layer])
    bw = np.where(
        local, float(state.intra_node_bytes_per_s), np.minimum(nic[best_owner[layer]], nic[d])
    )
    seconds = np.bincount(d, weights=per_layer[layer] / bw, minlength=len(state.ids))
    pairs = np.unique(d * len(state.ids) + src)
    sources = np.bincount(pairs // len(state.ids), minlength=len(state.ids))
    total = seconds + sources * float(state.latency_s)
    return float(total.max())


def _held_layers(plan: Plan, num_layers: int) -> dict[str, np.ndarray]:
    """``{device: bool mask (L,)}`` of the layers each device of an active group holds."""
    held: dict[str, np.ndarray] = {}
    for group in plan.groups:
        if group.batch <= 0:
            continue
        for dev, (start, end) in zip(group.devices, group.stages, strict=True):
            mask = np.zeros(num_layers, dtype=bool)
            mask[start : min(end, num_layers)] = True
            held[dev] = mask
    return held


def align_plan(candidate: Plan, current: Plan | None, state: ClusterState) -> Plan:
    """``candidate`` with interchangeable devices permuted so that as many stages as possible
    stay on the device that already holds them in ``current`` (fewer bytes to migrate).

    Two devices are interchangeable when they share node, memory and NIC bandwidth and their
    speeds differ by less than 5%: swapping them changes no figure of docs/model.md §3 by more than
    that
    (the caller re-evaluates the aligned plan anyway). Shares, stages and micro-batch sizes are
    kept; only which device sits at which position changes. Returns ``candidate`` itself when
    nothing moves.
    """
    if current is None:
        return candidate
    index = state.index()
    held: dict[str, tuple[int, int]] = {}
    for group in current.groups:
        if group.batch > 0:
            for dev, stage in zip(group.devices, group.stages, strict=True):
                held[dev] = tuple(stage)

    named = [dev for group in candidate.groups for dev in group.devices]
    classes: dict[tuple, list[str]] = {}
    for dev in named:
        i = index[dev]
        attrs = (int(state.node[i]), float(state.memory_bytes[i]), float(state.nic_bytes_per_s[i]))
        classes.setdefault(attrs, []).append(dev)
    class_of: dict[str, tuple] = {}
    for attrs, devs in classes.items():
        devs.sort(key=lambda d: float(state.speed_flops[index[d]]))
        start, label = float(state.speed_flops[index[devs[0]]]), 0
        for dev in devs:
            speed = float(state.speed_flops[index[dev]])
            if speed > 1.05 * start:
                start, label = speed, label + 1
            class_of[dev] = (*attrs, label)
    positions: dict[tuple, list[tuple[int, int]]] = {}
    for g, group in enumerate(candidate.groups):
        for k, dev in enumerate(group.devices):
            positions.setdefault(class_of[dev], []).append((g, k))
    new_devices = [list(group.devices) for group in candidate.groups]
    changed = False
    for slots in positions.values():
        if len(slots) < 2:
            continue
        pool = [candidate.groups[g].devices[k] for g, k in slots]
        free = list(pool)
        assigned: dict[tuple[int, int], str] = {}
        # first pass: a device that already holds exactly this stage stays with it
        for g, k in slots:
            stage = tuple(candidate.groups[g].stages[k])
            match = next((d for d in free if held.get(d) == stage), None)
            if match is not None:
                assigned[(g, k)] = match
                free.remove(match)
        # second pass: keep the planner's device where it is still free, else any free one
        for g, k in slots:
            if (g, k) in assigned:
                continue
            own = candidate.groups[g].devices[k]
            pick = own if own in free else free[0]
            assigned[(g, k)] = pick
            free.remove(pick)
        for (g, k), dev in assigned.items():
            if new_devices[g][k] != dev:
                new_devices[g][k] = dev
                changed = True
    if not changed:
        return candidate
    groups = tuple(
        group.model_copy(update={"devices": tuple(devs)})
        for group, devs in zip(candidate.groups, new_devices, strict=True)
    )
    return candidate.model_copy(update={"groups": groups})
