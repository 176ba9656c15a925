"""Incremental re-planning: keep a plan's structure (groups, device order, stages, micro-batch
sizes) and re-solve only the shares ``b_g`` for a new cluster state.

With ``μ_g`` and the stages fixed, docs/model.md §3 (v3) gives each active group a staircase
``T_g(b) = A_g + (⌈b/μ_g⌉ − 1) M_g``; group ``g`` can take ``μ_g (⌊(T − A_g)/M_g⌋ + 1)`` samples
by time ``T``, so the smallest ``T`` with enough capacity for ``B`` samples is found by bisection
(docs/model.md §4, "shares"). The sync time depends only on which groups are active, so it does not
move
the optimum among shares of the same active set and is left to :func:`hetrain.costmodel
.evaluate_plan`. Memory caps the number of micro-batches of a group under GPipe (``h_k = n_g``)
and under 1F1B when ``n_g < K`` (``h_k = min(n_g, K−k+1)``).

Everything is vectorised over the stages of all groups (a flat array of shape ``(S,)``), so a
1024-group plan is re-balanced in well under a millisecond; the arrays that depend only on the
structure are built once per structure (:class:`StructureArrays`). The formulas are
:mod:`hetrain.costmodel`'s (per-layer overhead ``λ``, frozen bytes and shared tensors of
docs/model.md
v3 included): memory through :meth:`hetrain.costmodel.ProfilePrefix.fixed_memory_bytes` and sync
through :func:`hetrain.costmodel.flat_sync_times_s`, so :func:`evaluate_fast` equals
:func:`hetrain.costmodel.evaluate_plan` (tests/control/test_incremental.py).

With a norm block ``G`` (``TrainingConfig.norm_block``, docs/model.md §5) every share and every
micro-batch size of a re-balanced plan is a multiple of ``G`` (:func:`rebalance_shares`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.control.shares import solve_shares
from hetrain.costmodel import ProfilePrefix, flat_sync_times_s, profile_prefix, stage_compute_s
from hetrain.plan import GroupPlan, Plan
from hetrain.profile import ProfileArrays


@dataclass(frozen=True)
class StructureArrays:
    """Flat per-stage arrays of a plan's active groups (shape ``(S,)`` unless noted).

    Attributes:
        group_index: positions in ``plan.groups`` of the active groups, shape ``(G,)``.
        microbatch: ``μ_g`` per active group, shape ``(G,)``.
        stage_group: group (0..G-1) of each stage.
        stage_device: device position (in the state's ids) of each stage.
        next_device: device of the next stage, ``-1`` for the last stage of a group.
        stage_train_flops: ``Σ_{l∈S_k} (f_l + w_l)`` FLOP per sample.
        boundary_bytes: ``2 a_{last(S_k)}`` bytes per sample crossing to the next stage (0 last).
        stage_param_bytes: ``θ_{d_k}`` bytes.
        stage_act_mem_bytes: ``Σ_{l∈S_k} m_l`` bytes per sample.
        stages_after: ``K − k + 1`` (1-based k), the 1F1B in-flight micro-batch count.
        stage_start / stage_end: the stage's layer range ``[start, end)``.
        num_layers: ``L``.
        prefix: the profile's prefix sums (:class:`hetrain.costmodel.ProfilePrefix`: frozen
            bytes and shared tensors, for memory and sync).
    """

    group_index: np.ndarray
    microbatch: np.ndarray
    stage_group: np.ndarray
    stage_device: np.ndarray
    next_device: np.ndarray
    stage_train_flops: np.ndarray
    boundary_bytes: np.ndarray
    stage_param_bytes: np.ndarray
    stage_act_mem_bytes: np.ndarray
    stages_after: np.ndarray
    stage_start: np.ndarray
    stage_end: np.ndarray
    num_layers: int
    prefix: ProfilePrefix

    @property
    def num_groups(self) -> int:
        """Number of active groups ``G'``."""
        return len(self.group_index)

    @property
    def stage_layer_units(self) -> np.ndarray:
        """``Σ_{l∈S_k} ν_l`` per stage (the per-layer overhead units, docs/model.md §3)."""
        units = self.prefix.layer_units
        return units[self.stage_end] - units[self.stage_start]

    @classmethod
    def build(cls, plan: Plan, ids: tuple[str, ...], profile: ProfileArrays) -> StructureArrays:
        """Flatten the active groups of ``plan`` (device ids resolved against ``ids``).

        Raises:
            KeyError: the plan names a device not in ``ids``.
        """
        index = {d: i for i, d in enumerate(ids)}
        prefix = profile_prefix(profile)
        flops_cum = prefix.train_flops
        param_cum = prefix.param_bytes
        mem_cum = prefix.act_mem_bytes
        act = profile.activation_bytes
        gi, mb, sg, sd, nd, fl, bb, pb, mm, sa, ss, se = ([] for _ in range(12))
        for pos, group in enumerate(plan.groups):
            if group.batch <= 0:
                continue
            g = len(gi)
            gi.append(pos)
            mb.append(group.microbatch_size)
            k_total = len(group.devices)
            for k, (dev, (start, end)) in enumerate(zip(group.devices, group.stages, strict=True)):
                sg.append(g)
                sd.append(index[dev])
                last = k == k_total - 1
                nd.append(-1 if last else index[group.devices[k + 1]])
                fl.append(flops_cum[end] - flops_cum[start])
                bb.append(0.0 if last else 2.0 * act[end - 1])
                pb.append(param_cum[end] - param_cum[start])
                mm.append(mem_cum[end] - mem_cum[start])
                sa.append(k_total - k)
                ss.append(start)
                se.append(end)
        return cls(
            group_index=np.asarray(gi, dtype=np.int64),
            microbatch=np.asarray(mb, dtype=np.int64),
            stage_group=np.asarray(sg, dtype=np.int64),
            stage_device=np.asarray(sd, dtype=np.int64),
            next_device=np.asarray(nd, dtype=np.int64),
            stage_train_flops=np.asarray(fl, dtype=float),
            boundary_bytes=np.asarray(bb, dtype=float),
            stage_param_bytes=np.asarray(pb, dtype=float),
            stage_act_mem_bytes=np.asarray(mm, dtype=float),
            stages_after=np.asarray(sa, dtype=np.int64),
            stage_start=np.asarray(ss, dtype=np.int64),
            stage_end=np.asarray(se, dtype=np.int64),
            num_layers=int(profile.num_layers),
            prefix=prefix,
        )

    def group_timing(self, state: ClusterState) -> tuple[np.ndarray, np.ndarray]:
        """``(A_g, M_g)`` of docs/model.md §3 per active group in ``state``, seconds, shapes
        ``(G,)``.

        ``A_g = Σ_k C_k + Σ_{k<K} E_k`` and ``M_g = max(max_k C_k, max_{k<K} E_k)`` with
        ``C_k`` of :func:`hetrain.costmodel.stage_compute_s` (``μ_g c_k + κ_{d_k} + λ_{d_k}
        Σ_{l∈S_k} ν_l``, or the kind's measured times) and ``E_k = μ_g 2 a / bw(d_k, d_{k+1}) +
        2 lat`` (as :func:`hetrain.costmodel.stage_times_s`).
        """
        g_count = len(self.group_index)
        mu = self.microbatch[self.stage_group].astype(float)
        dev = self.stage_device
        compute = stage_compute_s(state, self.prefix, dev, self.stage_start, self.stage_end, mu)
        has_next = self.next_device >= 0
        nxt = np.where(has_next, self.next_device, dev)
        same_node = state.node[dev] == state.node[nxt]
        bw = np.where(
            same_node,
            float(state.intra_node_bytes_per_s),
            np.minimum(state.nic_bytes_per_s[dev], state.nic_bytes_per_s[nxt]),
        )
        comm = np.where(has_next, mu * self.boundary_bytes / bw + 2.0 * state.latency_s, 0.0)
        a_g = np.bincount(self.stage_group, weights=compute + comm, minlength=g_count)
        m_g = np.zeros(g_count)
        np.maximum.at(m_g, self.stage_group, np.maximum(compute, comm))
        return a_g, m_g

    def max_microbatches(
        self, state: ClusterState, optimizer_state_factor: float, schedule: str
    ) -> np.ndarray:
        """Largest ``n_g`` whose memory fits on every stage (docs/model.md §3 memory, v3: trainable
        and
        shared parameters with gradients and optimizer state, frozen weights,
        :meth:`hetrain.costmodel.ProfilePrefix.fixed_memory_bytes`), shape ``(G,)``; a large
        number when memory never binds, 0 when even one micro-batch does not fit."""
        g_count = len(self.group_index)
        mu = self.microbatch[self.stage_group].astype(float)
        free = state.memory_bytes[self.stage_device] - self.prefix.fixed_memory_bytes(
            self.stage_start, self.stage_end, optimizer_state_factor
        )
        per_mb = mu * self.stage_act_mem_bytes
        with np.errstate(divide="ignore", invalid="ignore"):
            n_fit = np.where(per_mb > 0, np.floor(free / np.where(per_mb > 0, per_mb, 1.0)), 1e12)
        n_fit = np.where(free < 0, 0.0, n_fit)
        if schedule != "gpipe":
            # under 1F1B at most K-k+1 micro-batches are alive: a stage that holds that many
            # never binds
            n_fit = np.where(n_fit >= self.stages_after, 1e12, n_fit)
        out = np.full(g_count, 1e12)
        np.minimum.at(out, self.stage_group, n_fit)
        return out


def rebalance_shares(
    plan: Plan,
    state: ClusterState,
    structure: StructureArrays,
    batch: int,
    optimizer_state_factor: float = 2.0,
    norm_block: int | None = None,
    one_microbatch_single_stage: bool = False,
    profile: ProfileArrays | None = None,
) -> Plan:
    """The plan with the same groups, stages and micro-batch sizes and integer shares ``b_g``
    (``Σ b_g = batch``) that minimise ``max_g T_g`` in ``state`` among its active groups
    (:func:`hetrain.control.shares.solve_shares`, exact).

    With ``one_microbatch_single_stage`` (the runtime's convention, ``hetrain.runtime.adapt
    .runtime_plan``) a group of one stage runs its share as one micro-batch: its time is
    ``T_g(b) = κ + λΣν + b c`` (docs/model.md §3 ``C_k`` with ``μ_g = b``), its memory caps
    ``b`` through the activations of that one micro-batch, and the returned plan has
    ``μ_g = b_g`` for it (a pipeline group keeps its ``μ_g``); with ``profile`` (the model's
    arrays) the plan's idle single-stage groups are candidates as well, so a device left idle
    can take work again.

    A group whose ``A_g`` exceeds the optimum becomes idle (share 0). Memory caps shares via
    :meth:`StructureArrays.max_microbatches`. Returns ``plan`` unchanged (same object) when no
    share assignment fits. Figures of the returned plan are cleared (``iteration_time_s`` etc.
    are ``None``); evaluate it with :func:`hetrain.costmodel.evaluate_plan`.

    With ``norm_block = G`` (docs/model.md §5) an active group's ``μ_g`` that is not a multiple of
    ``G`` is first rounded down to one (at least ``G``; docs/controller.md), so every share
    (a number of whole micro-batches, or the memory cap ``n_max μ_g``, or ``batch``, all
    multiples of ``G``) is a multiple of ``G``: the plan passes
    :func:`hetrain.plan.check_norm_block`.

    Raises:
        ValueError: ``batch`` is not a multiple of ``norm_block``.
    """
    if norm_block is not None and batch % int(norm_block):
        raise ValueError(f"batch: expected a multiple of the norm block {norm_block}, got {batch}")
    if (
        one_microbatch_single_stage
        and profile is not None
        and any(g.batch <= 0 and g.num_stages == 1 for g in plan.groups)
    ):
        # idle single-device groups are candidates too: one of them may take work again
        # (the controller's gate then charges the weights it must receive)
        probe = plan.model_copy(
            update={
                "groups": tuple(
                    g.model_copy(update={"batch": 1}) if g.batch <= 0 and g.num_stages == 1 else g
                    for g in plan.groups
                )
            }
        )
        structure = StructureArrays.build(probe, state.ids, profile)
    if len(structure.group_index) == 0 or batch <= 0:
        return plan
    if norm_block is not None and int(norm_block) > 1:
        g_size = int(norm_block)
        mu_blocks = np.maximum(structure.microbatch - structure.microbatch % g_size, g_size)
        if not np.array_equal(mu_blocks, structure.microbatch):
            structure = dataclasses.replace(structure, microbatch=mu_blocks.astype(np.int64))
    new_mu = {int(structure.group_index[g]): int(m) for g, m in enumerate(structure.microbatch)}
    a_g, m_g = structure.group_timing(state)
    n_max = structure.max_microbatches(state, optimizer_state_factor, plan.schedule)
    # in units of the norm block (1 without one): every share a multiple of it
    unit = int(norm_block) if norm_block is not None and int(norm_block) > 1 else 1
    mu_units = structure.microbatch // unit
    single = np.bincount(structure.stage_group, minlength=structure.num_groups) == 1
    if one_microbatch_single_stage and single.any():
        # one micro-batch of b samples: T = (κ + λΣν + unit·c) + (b/unit − 1)·unit·c, and its
        # activations are those of b/unit micro-batches of `unit` all alive (GPipe's count)
        one = dataclasses.replace(structure, microbatch=np.full(structure.num_groups, unit))
        a_one, _ = one.group_timing(state)
        two = dataclasses.replace(structure, microbatch=np.full(structure.num_groups, 2 * unit))
        a_two, _ = two.group_timing(state)
        n_one = one.max_microbatches(state, optimizer_state_factor, "gpipe")
        a_g = np.where(single, a_one, a_g)
        m_g = np.where(single, a_two - a_one, m_g)
        n_max = np.where(single, n_one, n_max)
        mu_units = np.where(single, 1, mu_units)
    cap = solve_shares(a_g, m_g, mu_units, n_max, int(batch) // unit)
    if cap is None:
        return plan
    cap = cap * unit
    if one_microbatch_single_stage:
        for g in np.flatnonzero(single & (cap > 0)):
            new_mu[int(structure.group_index[g])] = int(cap[g])
    shares = {int(structure.group_index[g]): int(cap[g]) for g in range(len(cap))}
    groups: list[GroupPlan] = []
    for pos, group in enumerate(plan.groups):
        b = shares.get(pos, 0)
        update: dict = {} if b == group.batch else {"batch": b}
        mu_g = new_mu.get(pos, group.microbatch_size)
        if mu_g != group.microbatch_size:
            update["microbatch_size"] = mu_g
        groups.append(group.model_copy(update=update) if update else group)
    return plan.model_copy(
        update={
            "groups": tuple(groups),
            "iteration_time_s": None,
            "lower_bound_s": None,
            "cost": None,
        }
    )


def structure_key(plan: Plan) -> tuple:
    """Hashable key of a plan's groups ``(devices, stages, μ_g, active)`` in plan order: plans
    with equal keys share one :class:`StructureArrays` (whose ``group_index`` are positions in
    ``plan.groups``)."""
    return tuple((g.devices, g.stages, g.microbatch_size, g.batch > 0) for g in plan.groups)


@dataclass(frozen=True)
class FastEvaluation:
    """docs/model.md §3 figures of a plan computed from its :class:`StructureArrays` (vectorised).

    Attributes:
        iteration_time_s: ``T = max_g T_g + T_sync``.
        sync_time_s: ``T_sync``.
        group_times_s: ``T_g`` of the active groups, shape ``(G',)``.
        cost: ``{"money": T Σ_{d used} π_d, "energy": T Σ_{d used} W_d}`` per iteration.
        fits: every active group's number of micro-batches fits its memory.
    """

    iteration_time_s: float
    sync_time_s: float
    group_times_s: np.ndarray
    cost: dict[str, float]
    fits: bool


def evaluate_fast(
    plan: Plan,
    structure: StructureArrays,
    state: ClusterState,
    optimizer_state_factor: float = 2.0,
) -> FastEvaluation:
    """Iteration time, sync time and cost of ``plan`` in ``state`` (docs/model.md §3), equal to
    :func:`hetrain.costmodel.evaluate_plan` (tested) but vectorised over all stages, so that the
    simulator and the controller can evaluate 1024-device plans every slot.

    ``structure`` must be ``StructureArrays.build`` of a plan with the same
    :func:`structure_key`. Sync (docs/model.md §3, v3): :func:`hetrain.costmodel.flat_sync_times_s`
    (layers' all-reduce among the ``G'`` active groups plus the shared tensors' among their
    holders). The cost-model refinements (``sync_overlap``, ``update_time_s_per_param_byte``,
    ``group_time_jitter``) are not applied here.
    """
    g_count = structure.num_groups
    if g_count == 0:
        return FastEvaluation(0.0, 0.0, np.zeros(0), {"money": 0.0, "energy": 0.0}, True)
    a_g, m_g = structure.group_timing(state)
    shares = np.array([plan.groups[i].batch for i in structure.group_index], dtype=np.int64)
    n = -(-shares // structure.microbatch)
    t_g = np.where(n > 0, a_g + (n - 1) * m_g, 0.0)
    dev = structure.stage_device
    t_d = flat_sync_times_s(
        state, structure.prefix, dev, structure.stage_start, structure.stage_end, g_count
    )
    sync = float(t_d.max())
    iteration = float(t_g.max()) + sync
    n_max = structure.max_microbatches(state, optimizer_state_factor, plan.schedule)
    fits = bool(np.all(n <= n_max))
    return FastEvaluation(
        iteration_time_s=iteration,
        sync_time_s=sync,
        group_times_s=t_g,
        cost={
            "money": iteration * float(np.sum(state.price_per_s[dev])),
            "energy": iteration * float(np.sum(state.power_w[dev])),
        },
        fits=fits,
    )
