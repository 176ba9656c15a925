"""The planning model of docs/model.md §3: time, memory and cost of one training iteration.

Everything here is plain numpy (no torch) and is shared by ``hetrain evaluate``, the planner
(:mod:`hetrain.planner`), the controller and the simulator.

Notation (docs/model.md §2-§3, 1-based in formulas, 0-based in code and files). A group ``g`` has
ordered
devices ``d_1..d_K``, contiguous stages ``S_1..S_K`` (layer ranges ``[start, end)``), micro-batch
size ``μ_g`` and share ``b_g``:

* compute per sample at stage k: ``c_k = Σ_{l∈S_k} (f_l + w_l) / s_{d_k}``  (seconds)
* stage time per micro-batch: ``C_k = μ_g c_k + κ_{d_k} + λ_{d_k} |S_k|`` (v3: ``λ`` per layer)
* boundary k→k+1 per micro-batch: ``E_k = μ_g · 2 a_{last(S_k)} / bw(d_k, d_{k+1}) + 2 lat``
* micro-batches ``n_g = ceil(b_g / μ_g)``
* group time ``T_g = A_g + (n_g − 1) M_g``, ``A_g = Σ_k C_k + Σ_{k<K} E_k``,
  ``M_g = max(max_k C_k, max_{k<K} E_k)``; ``T_g = 0`` when ``b_g = 0``
* sync: ``t_d = 2 (G'−1) lat + 2 (G'−1)/G' · θ_d / β_d`` for devices of active groups
  (``θ_d``: trainable bytes of d's layers, frozen and shared tensors excluded), plus per
  trainable shared tensor ``s`` that d holds ``2 (n_s−1) lat + 2 (n_s−1)/n_s · bytes_s /
  β_{d,s}`` (v3; ``n_s`` holders in active groups); ``T_sync = max_d t_d``
* ``T = max_g T_g + T_sync``
* memory ``θ'_{d_k} (2 + o) + φ_{d_k} + h_k μ_g Σ_{l∈S_k} m_l`` (``θ'`` = θ plus the trainable
  shared tensors held, ``φ`` the frozen bytes held, shared or not) with
  ``h_k = min(n_g, K − k + 1)`` (1F1B) or ``h_k = n_g`` (GPipe)
* money ``y_money = T Σ_{d used} π_d``, energy ``y_energy = T Σ_{d used} W_d``
* lower bound ``T_LB = B Σ_l (f_l + w_l) / Σ_{d available} s_d``

Opt-in refinement (``TrainingConfig.sync_overlap``, default off = docs/model.md §3 exactly): the
gradient all-reduce overlapped with the last micro-batch's backward, bucket by bucket, as the
runtime engine (:class:`hetrain.runtime.data_parallel.GradientSync`) and PyTorch DDP do (Li et
al., "PyTorch Distributed", VLDB 2020); see :func:`overlapped_sync_s`. Then
``T = max_g T_g + T_exposed`` instead of ``max_g T_g + T_sync``; shared tensors' all-reduces
(v3) are added to ``T_exposed`` in full (not overlapped).

Opt-in refinement (``TrainingConfig.update_time_s_per_param_byte`` ``ω`` and
``group_time_jitter`` ``σ``, both default 0 = docs/model.md §3 exactly; docs/profiling.md §6): the
weight update after the sync and the straggler of data parallelism; see
:func:`refined_iteration_time_s`. Then ``T = E[max_g T_g] + T_sync (or T_exposed) + max_d ω θ'_d``.
Opt-in ``TrainingConfig.step_overhead_s`` ``F`` (default 0; docs/profiling.md §6): the loop's
fixed time per iteration, added to ``T`` by :func:`evaluate_plan`.

Choices where docs/model.md §3 is silent (see docs/planner.md): devices of an idle group (``b_g =
0``)
are reported with the memory of their parameters, gradients and optimizer state (``h_k = 0``)
and count towards ``fits``; they are neither used nor charged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetrain.cluster import ClusterState
from hetrain.errors import InputError
from hetrain.plan import Plan
from hetrain.profile import MeasuredTimes, ProfileArrays

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class TrainingConfig:
    """docs/model.md §2 "Training": global batch ``B`` (samples per iteration), optimizer state
    factor
    ``o`` (bytes of optimizer state per parameter byte: 2 Adam, 1 SGD+momentum, 0 SGD) and the
    pipeline schedule (``"1f1b"`` or ``"gpipe"``; it only changes the memory term ``h_k``).

    ``sync_overlap`` (not in docs/model.md §3, default False = docs/model.md §3 exactly): charge
    only the part of
    the gradient all-reduce that the bucketed overlap with the last backward leaves exposed
    (:func:`overlapped_sync_s`), for engines that overlap (hetrain's runtime, PyTorch DDP).
    ``sync_bucket_cap_bytes``: the engine's gradient bucket cap (bytes; the runtime's
    ``Worker(bucket_cap_bytes=...)`` default, 64 MiB), used only with ``sync_overlap``.

    ``norm_block`` (``G``, docs/model.md §5, default None): a BatchNorm norm block; plans keep every
    share ``b_g`` and micro-batch size ``μ_g`` a multiple of ``G`` (the planner and the
    baselines; :func:`hetrain.plan.check_norm_block` checks a given plan), and ``B`` must be a
    multiple of ``G``.

    ``update_time_s_per_param_byte`` (``ω``, s per trainable parameter byte, default 0) and
    ``group_time_jitter`` (``σ``, relative standard deviation of a group's time from one
    iteration to the next, default 0): the refinement of :func:`refined_iteration_time_s`
    (not in docs/model.md §3; 0 and 0 = docs/model.md §3 exactly; docs/profiling.md §6). Measured by
    :func:`hetrain.calibration.fit_update_time` and
    :func:`hetrain.calibration.relative_jitter`.

    ``step_overhead_s`` (``F``, s per iteration, default 0): the refinement's fixed time of an
    iteration outside its modelled compute, sync and update (the training loop's own work:
    batch slicing, the loss and gradient-norm all-reduces, zeroing gradients, the per-step
    measurement; for a pipeline also the send/recv calls on the critical path), the same for
    every plan; added to ``T`` (not in docs/model.md §3; docs/profiling.md §6). Measured by
    :func:`hetrain.calibration.fit_step_overhead` (start-up) and
    :meth:`hetrain.calibration.ClusterEstimator.observe_iteration` (online).

    Raises:
        ValueError: ``batch < 1``, negative or non-finite ``optimizer_state_factor``, unknown
            schedule, ``sync_overlap`` not a bool, ``sync_bucket_cap_bytes`` not finite > 0,
            ``update_time_s_per_param_byte``, ``group_time_jitter`` or ``step_overhead_s``
            negative or not finite.
        InputError: ``norm_block`` not an integer >= 1, or ``batch`` not a multiple of it
            (names ``--norm-block`` and the batch).
    """

    batch: int
    optimizer_state_factor: float = 2.0
    schedule: str = "1f1b"
    sync_overlap: bool = False
    sync_bucket_cap_bytes: float = 64 * 2**20
    norm_block: int | None = None
    update_time_s_per_param_byte: float = 0.0
    group_time_jitter: float = 0.0
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("update_time_s_per_param_byte", "group_time_jitter", "step_overhead_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (np.isfinite(float(v)) and float(v) >= 0):
                raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
        if isinstance(self.batch, bool) or int(self.batch) != self.batch or self.batch < 1:
            raise ValueError(f"batch: expected an integer >= 1, got {self.batch!r}")
        o = float(self.optimizer_state_factor)
        if not np.isfinite(o) or o < 0:
            raise ValueError(f"optimizer_state_factor: expected a finite number >= 0, got {o!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.sync_overlap, bool | np.bool_):
            raise ValueError(f"sync_overlap: expected a bool, got {self.sync_overlap!r}")
        cap = self.sync_bucket_cap_bytes
        if isinstance(cap, bool) or not (np.isfinite(float(cap)) and float(cap) > 0):
            raise ValueError(f"sync_bucket_cap_bytes: expected a finite number > 0, got {cap!r}")
        g = self.norm_block
        if g is not None:
            if isinstance(g, bool) or not isinstance(g, int | np.integer) or g < 1:
                raise InputError("--norm-block", "", f"expected an integer >= 1, got {g!r}")
            if self.batch % g:
                raise InputError(
                    "--norm-block",
                    "",
                    f"expected a norm block that divides the global batch {self.batch} "
                    f"(--batch), got norm block {g}",
                )


# ---------------------------------------------------------------------------------------------
# Profile prefix sums (shared by the cost model and the partitioner)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfilePrefix:
    """Prefix sums of a profile, shape ``(L + 1,)`` each, so that a stage ``[i, j)`` sums as
    ``x[j] - x[i]``: ``train_flops`` (f+w, FLOP/sample), ``act_mem_bytes`` (m, bytes/sample),
    ``param_bytes`` (p, trainable bytes, shared tensors excluded), ``frozen_bytes`` (p^frozen,
    bytes); plus ``boundary_bytes`` (shape ``(L,)``): ``2 a_l`` per sample, what crosses a
    stage boundary after layer ``l`` (activation forward, gradient backward); ``layer_units``
    (shape ``(L + 1,)``): prefix sums of the per-layer overhead weights ν_l, so that stage
    ``[i, j)`` pays ``λ (layer_units[j] − layer_units[i])`` per micro-batch (``j − i`` when every
    ν_l is 1, docs/model.md §3).

    Shared tensors (docs/model.md §2), ``S`` of them: ``shared_bytes`` (shape ``(S,)``),
    ``shared_frozen`` (``(S,)`` bool) and ``shared_uses`` (``(S, L + 1)``: the number of layers
    below ``x`` that use tensor ``s``, so that stage ``[i, j)`` holds ``s`` iff
    ``shared_uses[s, j] > shared_uses[s, i]``)."""

    train_flops: np.ndarray
    act_mem_bytes: np.ndarray
    param_bytes: np.ndarray
    boundary_bytes: np.ndarray
    frozen_bytes: np.ndarray | None = None
    shared_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    shared_frozen: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    shared_uses: np.ndarray | None = None
    layer_units: np.ndarray | None = None
    measured: tuple[MeasuredTimes, ...] = ()
    bwd_flops: np.ndarray | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.frozen_bytes is None:
            object.__setattr__(self, "frozen_bytes", np.zeros_like(self.param_bytes))
        if self.layer_units is None:
            object.__setattr__(self, "layer_units", np.arange(len(self.param_bytes), dtype=float))
        if self.shared_uses is None:
            object.__setattr__(self, "shared_uses", np.zeros((0, len(self.param_bytes))))
        if self.bwd_flops is None:
            object.__setattr__(self, "bwd_flops", self.train_flops * (2.0 / 3.0))

    # --- measured times (docs/model.md §3 "Measured times") ---------------------------------

    def kind_index(self, state: ClusterState) -> np.ndarray:
        """Per device of ``state``, the index of its kind in :attr:`measured` (kinds compared
        without regard to case), or -1 when the profile has no measured times for it (the
        FLOP model); shape ``(D,)``, int64."""
        if not self.measured:
            return np.full(state.num_devices, -1, dtype=np.int64)
        last = self._cache.get("kind-index-last")
        if last is not None and last[0] is state:  # the same state object: no hashing
            return last[1]
        out = self._kind_index_of(state.kinds)
        self._cache["kind-index-last"] = (state, out, state.measured_time_scale())
        return out

    def time_scale(self, state: ClusterState) -> np.ndarray:
        """:meth:`ClusterState.measured_time_scale` of ``state``, shape ``(D,)``, cached for the
        last state asked (the planner asks thousands of times for one state)."""
        if not self.measured:
            return state.measured_time_scale()
        last = self._cache.get("kind-index-last")
        if last is None or last[0] is not state:
            self.kind_index(state)
            last = self._cache["kind-index-last"]
        return last[2]

    def device_kinds(self, state: ClusterState, devices: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, float]:  # fmt: skip
        """For the devices ``devices`` (int64 array, any shape) of ``state``: their
        :meth:`kind_index` and :meth:`time_scale` (``devices``' shape each) and the fraction
        with measured times, as a float that is exactly 0.0 or 1.0 when none or all have them.
        Kept per device array contents (and shape) for the last state object asked (the
        planner times the same groups many times); read-only arrays."""
        last = self._cache.get("device-kinds-last")
        if last is None or last[0] is not state:
            last = self._cache["device-kinds-last"] = (state, {})
        key = (devices.tobytes(), devices.shape)
        out = last[1].get(key)
        if out is None:
            # (arrays also for a 0-d index, whose gather is a scalar)
            kind = np.array(self.kind_index(state)[devices])
            scale = np.array(self.time_scale(state)[devices])
            mine = kind >= 0
            share = 1.0 if bool(mine.all()) else (0.0 if not bool(mine.any()) else 0.5)
            kind.flags.writeable = False
            scale.flags.writeable = False
            out = last[1][key] = (kind, scale, share)
        return out

    def _kind_index_of(self, kinds: tuple[str, ...]) -> np.ndarray:
        key = ("kind-index", kinds)
        out = self._cache.get(key)
        if out is None:
            names = {m.kind.casefold(): i for i, m in enumerate(self.measured)}
            out = np.array([names.get(k.casefold(), -1) for k in kinds], dtype=np.int64)
            self._cache[key] = out
        return out

    def measured_prefix_s(self, microbatch_sizes: np.ndarray, part: str = "train") -> np.ndarray:
        """Prefix sums over layers of the measured times (:meth:`MeasuredTimes.prefix_s`) of
        every kind at each micro-batch size of ``microbatch_sizes`` (shape ``(U,)``), shape
        ``(N_kinds, U, L + 1)``, seconds per micro-batch; so that stage ``[i, j)`` of kind
        ``q`` at size ``u`` takes ``P[q, u, j] − P[q, u, i]``. Cached per size and part."""
        sizes = np.asarray(microbatch_sizes, dtype=float).ravel().tolist()
        per_size = []
        for mu in sizes:
            key = ("measured-prefix", part, mu)
            out = self._cache.get(key)
            if out is None:
                out = np.array([table.prefix_s(mu, part) for table in self.measured]).reshape(
                    len(self.measured), self.num_layers + 1
                )
                self._cache[key] = out
            per_size.append(out)
        if len(per_size) <= 1:
            return (per_size[0][:, None, :] if per_size
                    else np.zeros((len(self.measured), 0, self.num_layers + 1)))  # fmt: skip
        return np.stack(per_size, axis=1).reshape(len(self.measured), len(sizes),
                                                  self.num_layers + 1)  # fmt: skip

    def measured_prefix_by_size_s(self, sizes: np.ndarray, part: str = "train") -> np.ndarray:
        """:meth:`measured_prefix_s` of every whole size from 0 to at least ``max(sizes)``,
        shape ``(N_kinds, S, L + 1)`` with row ``u`` the size ``u`` (rows of sizes not asked
        for yet are zeros): indexed by the sizes themselves, no lookup per call. ``sizes``:
        whole numbers ``≥ 1`` (int array). The same values as :meth:`measured_prefix_s`;
        grown and filled as sizes are asked for, cached per part."""
        key = ("measured-prefix-by-size", part)
        dense, filled = self._cache.get(key, (None, None))
        top = int(sizes.max(initial=0))
        if dense is None or dense.shape[1] <= top:
            width = max(top + 1, 2 * (0 if dense is None else dense.shape[1]), 17)
            grown = np.zeros((len(self.measured), width, self.num_layers + 1))
            grown_filled = np.zeros(width, dtype=bool)
            if dense is not None:
                # (the marks before the rows: a row is written before its mark, so a mark
                # copied here always comes with its row, also if another thread planning
                # with the same profile fills a row meanwhile)
                grown_filled[: len(filled)] = filled
                grown[:, : dense.shape[1]] = dense
            dense, filled = grown, grown_filled
            self._cache[key] = (dense, filled)
        if not filled[sizes].all():
            for mu in np.unique(sizes[~filled[sizes]]).tolist():
                dense[:, mu] = self.measured_prefix_s(np.array([mu]), part)[:, 0]
                filled[mu] = True
        return dense

    def measured_rate_prefix_s(self, max_microbatch_size: int) -> np.ndarray:
        """Per kind, :meth:`MeasuredTimes.rate_prefix_s`: prefix sums over layers of a lower
        bound on each layer's seconds per sample at every micro-batch size ``1..max``, shape
        ``(N_kinds, L + 1)``."""
        return np.array(
            [table.rate_prefix_s(max_microbatch_size) for table in self.measured]
        ).reshape(len(self.measured), self.num_layers + 1)

    @property
    def num_layers(self) -> int:
        return len(self.boundary_bytes)

    @property
    def has_shared(self) -> bool:
        """Whether the profile lists any shared tensor."""
        return len(self.shared_bytes) > 0

    def shared_held(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Whether stage ``[starts, ends)`` holds each shared tensor: bool, shape
        ``starts.shape + (S,)`` (broadcast of ``starts`` and ``ends``)."""
        starts = np.asarray(starts, dtype=np.int64)
        ends = np.asarray(ends, dtype=np.int64)
        uses = self.shared_uses  # (S, L+1)
        return np.moveaxis(uses[:, ends] > uses[:, starts], 0, -1)

    def fixed_memory_bytes(
        self, starts: np.ndarray, ends: np.ndarray, optimizer_state_factor: float
    ) -> np.ndarray:
        """docs/model.md §3's memory of a stage ``[starts, ends)`` that does not depend on the
        micro-batches: ``θ' (2 + o) + φ`` bytes — trainable parameters (the layers' own and the
        trainable shared tensors the stage holds) with their gradients and optimizer state,
        plus frozen weights (the layers' own and the frozen shared tensors it holds; weights
        only). Broadcast shape of ``starts`` and ``ends``."""
        starts = np.asarray(starts, dtype=np.int64)
        ends = np.asarray(ends, dtype=np.int64)
        factor = 2.0 + float(optimizer_state_factor)
        out = (self.param_bytes[ends] - self.param_bytes[starts]) * factor
        if self.frozen_bytes[-1] > 0:
            out = out + (self.frozen_bytes[ends] - self.frozen_bytes[starts])
        if self.has_shared:
            per = np.where(self.shared_frozen, 1.0, factor) * self.shared_bytes
            out = out + self.shared_held(starts, ends).astype(float) @ per
        return out

    def total_fixed_memory_bytes(self, optimizer_state_factor: float) -> float:
        """:meth:`fixed_memory_bytes` of the whole model on one device (bytes)."""
        return float(self.fixed_memory_bytes(np.array(0), np.array(self.num_layers),
                                             optimizer_state_factor))  # fmt: skip


def profile_prefix(profile: ProfileArrays) -> ProfilePrefix:
    """Prefix sums of ``profile`` (see :class:`ProfilePrefix`). Built once per profile object
    and kept in its ``_cache`` (a :class:`~hetrain.profile.ProfileArrays` is frozen and its
    arrays are never written), so the planner, its baselines and :func:`evaluate_plan` share
    one prefix and its caches (kind index, measured prefix sums, bound speeds); profile-like
    objects without a ``_cache`` get a new one per call."""
    cache = getattr(profile, "_cache", None)
    if isinstance(cache, dict):
        out = cache.get("prefix")
        if out is None:
            out = cache["prefix"] = _build_prefix(profile)
        return out
    return _build_prefix(profile)


def _build_prefix(profile: ProfileArrays) -> ProfilePrefix:
    """:func:`profile_prefix` without the cache."""

    def cum(x: np.ndarray) -> np.ndarray:
        return np.concatenate(([0.0], np.cumsum(np.asarray(x, dtype=float))))

    num_layers = profile.num_layers
    shared = tuple(getattr(profile, "shared", ()) or ())
    uses = np.zeros((len(shared), num_layers + 1))
    for s, tensor in enumerate(shared):
        mark = np.zeros(num_layers)
        mark[list(tensor.layers)] = 1.0
        uses[s, 1:] = np.cumsum(mark)
    frozen = getattr(profile, "frozen_param_bytes", None)
    weights = getattr(profile, "overhead_weights", None)
    return ProfilePrefix(
        measured=tuple(getattr(profile, "measured", ()) or ()),
        bwd_flops=cum(profile.bwd_flops),
        layer_units=cum(weights if weights is not None else np.ones(num_layers)),
        train_flops=cum(profile.train_flops),
        act_mem_bytes=cum(profile.activation_memory_bytes),
        param_bytes=cum(profile.param_bytes),
        boundary_bytes=2.0 * np.asarray(profile.activation_bytes, dtype=float),
        frozen_bytes=cum(frozen if frozen is not None else np.zeros(num_layers)),
        shared_bytes=np.array([float(t.bytes) for t in shared], dtype=float),
        shared_frozen=np.array([bool(t.frozen) for t in shared], dtype=bool),
        shared_uses=uses,
    )


# ---------------------------------------------------------------------------------------------
# Per-group primitives
# ---------------------------------------------------------------------------------------------


def stage_compute_s(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    microbatch_size: int | np.ndarray,
    part: str = "train",
) -> np.ndarray:
    """Seconds per micro-batch of a stage: layers ``[start, end)`` on ``device`` with
    micro-batches of ``microbatch_size`` samples (docs/model.md §3). The one place the cost
    model, the partitioner and the search compute a stage's compute time.

    All four inputs are integer (``microbatch_size`` also float) arrays broadcast together; the
    result has the broadcast shape. A device whose kind (``state.kinds``) has measured times in
    the profile takes ``(P_q(μ)[end] − P_q(μ)[start]) · nominal_d / s_d``
    (:meth:`ProfilePrefix.measured_prefix_s`, :meth:`ClusterState.measured_time_scale`; κ and
    λ are not charged: the measured times include them) plus its
    ``ClusterState.measured_extra_s`` per micro-batch (``part="train"``); any other device
    takes the FLOP model ``μ Σ(f_l + w_l)/s_d + κ_d + λ_d Σ ν_l``. ``part="bwd"`` gives the
    backward pass only (``μ Σ w_l / s_d`` without κ and λ, or the measured backward times).

    Raises:
        ValueError: unknown ``part``.
    """
    devices = np.asarray(devices, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if part not in ("train", "bwd"):
        raise ValueError(f"part: expected 'train' or 'bwd', got {part!r}")
    kind = mine = None
    some = False
    if prefix.measured:
        kind, scale, share = prefix.device_kinds(state, devices)
        if share == 1:
            out = _measured_stage_s(prefix, kind, scale, starts, ends, microbatch_size, part)
            extra = state.measured_extra_s
            if part == "train" and np.any(extra):
                out = out + extra[devices]
            return out
        some = share > 0
        mine = kind >= 0
    if part == "train":
        flops = prefix.train_flops[ends] - prefix.train_flops[starts]
        out = microbatch_size * flops / state.speed_flops[devices] + state.kappa_s[devices]
        lam = state.layer_overhead_s[devices]
        if np.any(lam):
            out = out + lam * (prefix.layer_units[ends] - prefix.layer_units[starts])
    else:
        flops = prefix.bwd_flops[ends] - prefix.bwd_flops[starts]
        out = microbatch_size * flops / state.speed_flops[devices]
    if not some:
        return out
    measured = _measured_stage_s(prefix, np.maximum(kind, 0), scale, starts, ends,
                                 microbatch_size, part)  # fmt: skip
    if part == "train" and np.any(state.measured_extra_s):
        measured = measured + state.measured_extra_s[devices]
    return np.where(mine, measured, out)


def _measured_stage_s(
    prefix: ProfilePrefix,
    q: np.ndarray,
    scale: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    microbatch_size: int | np.ndarray,
    part: str,
) -> np.ndarray:
    """:func:`stage_compute_s` of measured-time devices: ``q`` the index of each device's
    kind in ``prefix.measured`` (``≥ 0``; the caller replaces the entries of FLOP-model
    devices), ``scale`` its :meth:`ClusterState.measured_time_scale`, both of the devices'
    shape. Broadcast shape of the inputs, seconds."""
    sizes = np.asarray(microbatch_size)
    # (the scale multiplies the gathered prefix sums before the difference: the gathers
    # are smaller than the result when starts and ends broadcast against each other)
    if sizes.size == 1:  # one size (the common case): no per-element size index
        mu = sizes.astype(float)
        table = prefix.measured_prefix_s(mu.reshape(1), part)[:, 0]  # (N_kinds, L + 1)
        measured = table[q, ends] * scale - table[q, starts] * scale
        if mu.ndim <= measured.ndim:  # (a size-1 array adds no axis: the shape is final)
            return measured
        return np.broadcast_to(measured, np.broadcast_shapes(measured.shape, mu.shape)).copy()
    if sizes.dtype.kind in "iu":  # integers (the partitioner's and search's): whole as given
        whole = sizes
        is_whole = whole.min(initial=1) >= 1
    else:
        mu = sizes.astype(float)
        whole = mu.astype(np.int64)
        is_whole = bool((whole == mu).all()) and whole.min(initial=1) >= 1
    if is_whole:
        # whole sizes (the planner's): the table's row is the size itself
        which = whole
        table = prefix.measured_prefix_by_size_s(whole, part)  # (N_kinds, S, L + 1)
    else:
        mu = sizes.astype(float)
        unique = np.unique(mu)
        which = np.searchsorted(unique, mu)  # (the index of each size in `unique`, mu's shape)
        table = prefix.measured_prefix_s(unique, part)  # (N_kinds, U, L + 1)
    # (mu's shape is in the index, so the result has the broadcast shape of all inputs)
    return table[q, which, ends] * scale - table[q, which, starts] * scale


def _last_state_cached(prefix: ProfilePrefix, name: str, state: ClusterState, batch: int,
                       compute) -> np.ndarray:  # fmt: skip
    """``compute(state, prefix, batch)``, kept in ``prefix``'s cache for the last ``state``
    object and ``batch`` asked (read-only: callers share it)."""
    last = prefix._cache.get(name)
    if last is not None and last[0] is state and last[1] == batch:
        return last[2]
    out = compute(state, prefix, batch)
    out.flags.writeable = False
    prefix._cache[name] = (state, batch, out)
    return out


def bound_speed_flops(state: ClusterState, prefix: ProfilePrefix, batch: int) -> np.ndarray:
    """Per device, a speed ``ŝ_d`` (FLOP/s, shape ``(D,)``) with ``C ≥ μ Σ_{l∈S}(f_l+w_l)/ŝ_d``
    for every stage ``S`` and ``μ ≤ batch``: ``s_d`` under the FLOP model; for a device with
    measured times ``max_l (f_l + w_l) / r_l`` (``r_l`` the per-sample lower bound of
    :meth:`ProfilePrefix.measured_rate_prefix_s`, times the state's scale), inf where some
    layer with FLOPs takes no time. So ``B Σ(f+w) / Σ_d ŝ_d`` stays a lower bound on the
    iteration time of any plan of those devices (docs/model.md §3 ``T_LB``; the search prunes
    with it). Read-only; cached for the last state object and batch."""
    return _last_state_cached(prefix, "bound-speed-last", state, int(batch), _bound_speed_flops)


def _bound_speed_flops(state: ClusterState, prefix: ProfilePrefix, batch: int) -> np.ndarray:
    speed = np.asarray(state.speed_flops, dtype=float).copy()
    kind = prefix.kind_index(state)
    if not np.any(kind >= 0):
        return speed
    flops = np.diff(prefix.train_flops)
    rates = np.diff(prefix.measured_rate_prefix_s(batch), axis=1)  # (N_kinds, L)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(flops > 0, flops / rates, 0.0)
    per_kind = np.max(ratio, axis=1) if ratio.shape[1] else np.zeros(len(rates))
    # no layer with FLOPs: any speed satisfies the inequality (inf: T_LB's term is 0)
    per_kind = np.where(per_kind > 0, per_kind, np.inf)
    mine = kind >= 0
    speed[mine] = per_kind[kind[mine]] / state.measured_time_scale()[mine]
    return speed


def effective_speed_flops(state: ClusterState, prefix: ProfilePrefix, batch: int) -> np.ndarray:
    """Per device, the FLOP/s it reaches on the whole chain (shape ``(D,)``): ``s_d`` under the
    FLOP model; for a device with measured times ``μ Σ(f+w) / C_chain(μ)`` at ``μ`` = the
    smaller of ``batch`` and the kind's largest measured size. For orderings and proportional
    shares (heuristics and baselines), never for times. Read-only; cached for the last state
    object and batch."""
    return _last_state_cached(prefix, "effective-speed-last", state, int(batch),
                              _effective_speed_flops)  # fmt: skip


def _effective_speed_flops(state: ClusterState, prefix: ProfilePrefix, batch: int) -> np.ndarray:
    speed = np.asarray(state.speed_flops, dtype=float).copy()
    kind = prefix.kind_index(state)
    if not np.any(kind >= 0):
        return speed
    # (a profile without FLOPs: 1 "FLOP" per sample, so the measured kinds still rank by
    # samples per second; devices of the FLOP model then take no time at all)
    total = float(prefix.train_flops[-1]) or 1.0
    per_kind = np.empty(len(prefix.measured))
    for q, table in enumerate(prefix.measured):
        mu = float(min(batch, table.microbatch_sizes[-1]))
        t = float(table.prefix_s(mu)[-1])
        per_kind[q] = mu * total / t if t > 0 else np.inf
    mine = kind >= 0
    speed[mine] = per_kind[kind[mine]] / state.measured_time_scale()[mine]
    return speed


def link_bandwidths_bytes_per_s(state: ClusterState, devices: np.ndarray) -> np.ndarray:
    """``bw(d_k, d_{k+1})`` for consecutive devices of a pipeline, shape ``(K − 1,)``, bytes/s
    (docs/model.md §2: intra-node bandwidth on one node, else ``min(nic_d, nic_e)``).
    ``devices`` may have leading axes (several pipelines of ``K`` devices, shape ``(..., K)``;
    result ``(..., K − 1)``)."""
    devices = np.asarray(devices, dtype=np.int64)
    a, b = devices[..., :-1], devices[..., 1:]
    nic = np.minimum(state.nic_bytes_per_s[a], state.nic_bytes_per_s[b])
    return np.where(state.node[a] == state.node[b], state.intra_node_bytes_per_s, nic)


def stage_times_s(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: Sequence[int] | np.ndarray,
    bounds: Sequence[int] | np.ndarray,
    microbatch_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per micro-batch stage times ``C_k`` (shape ``(K,)``) and boundary times ``E_k`` (shape
    ``(K − 1,)``) in seconds of one group (docs/model.md §3).

    Args:
        devices: device indices ``d_1..d_K`` in pipeline order, shape ``(K,)``.
        bounds: stage boundaries ``0 = x_0 < x_1 < ... < x_K = L``, shape ``(K + 1,)``; stage k
            is layers ``[x_k, x_{k+1})``.
        microbatch_size: ``μ_g`` samples.

    Formulas: ``C_k`` of :func:`stage_compute_s` (the FLOP model ``μ Σ_{l∈S_k}(f_l+w_l)/s_{d_k}
    + κ_{d_k} + λ_{d_k} Σ_{l∈S_k} ν_l``, docs/model.md (v3), with the per-layer overhead weights
    ν_l of §3: ``|S_k|`` when all are 1; or the kind's measured times);
    ``E_k = μ · 2 a_{last(S_k)} / bw(d_k, d_{k+1}) + 2 lat``.
    """
    devices = np.asarray(devices, dtype=np.int64)
    bounds = np.asarray(bounds, dtype=np.int64)
    compute_s = stage_compute_s(state, prefix, devices, bounds[:-1], bounds[1:], microbatch_size)
    if len(devices) == 1:
        return compute_s, np.zeros(0)
    last = bounds[1:-1] - 1
    bw = link_bandwidths_bytes_per_s(state, devices)
    transfer_s = microbatch_size * prefix.boundary_bytes[last] / bw + 2.0 * state.latency_s
    return compute_s, transfer_s


def group_fill_and_bottleneck_s(
    compute_s: np.ndarray, transfer_s: np.ndarray
) -> tuple[float, float]:
    """``(A_g, M_g)`` from stage times: ``A_g = Σ C_k + Σ E_k`` (one micro-batch through the
    pipeline) and ``M_g = max(max C_k, max E_k)`` (the bottleneck), seconds (docs/model.md §3)."""
    fill = float(np.sum(compute_s) + np.sum(transfer_s))
    bottleneck = float(max(np.max(compute_s), np.max(transfer_s) if len(transfer_s) else 0.0))
    return fill, bottleneck


def num_microbatches(batch: int, microbatch_size: int) -> int:
    """``n_g = ceil(b_g / μ_g)`` (docs/model.md §3; the last, partial micro-batch is charged in
    full)."""
    return -(-int(batch) // int(microbatch_size))


def group_time_s(fill_s: float, bottleneck_s: float, n_microbatches: int) -> float:
    """``T_g = A_g + (n_g − 1) M_g`` seconds, 0 when ``n_g = 0`` (idle group; docs/model.md §3)."""
    if n_microbatches <= 0:
        return 0.0
    return fill_s + (n_microbatches - 1) * bottleneck_s


def micro_batches_alive(num_stages: int, n_microbatches: int, schedule: str) -> np.ndarray:
    """``h_k`` for stages ``k = 1..K`` (shape ``(K,)``): ``min(n_g, K − k + 1)`` under 1F1B,
    ``n_g`` under GPipe (docs/model.md §3)."""
    k = np.arange(1, num_stages + 1)
    if schedule == "gpipe":
        return np.full(num_stages, max(n_microbatches, 0), dtype=np.int64)
    return np.minimum(max(n_microbatches, 0), num_stages - k + 1)


def stage_memory_bytes(
    prefix: ProfilePrefix,
    bounds: Sequence[int] | np.ndarray,
    microbatch_size: int,
    n_microbatches: int,
    optimizer_state_factor: float,
    schedule: str,
) -> np.ndarray:
    """Memory per stage device, shape ``(K,)``, bytes (docs/model.md §3, v3):
    ``θ'_{d_k} (2 + o) + φ_{d_k} + h_k μ Σ_{l∈S_k} m_l`` — trainable parameters (shared ones
    the stage holds included), gradients, optimizer state, frozen weights
    (:meth:`ProfilePrefix.fixed_memory_bytes`) and the activations of the ``h_k``
    micro-batches held alive."""
    bounds = np.asarray(bounds, dtype=np.int64)
    fixed = prefix.fixed_memory_bytes(bounds[:-1], bounds[1:], optimizer_state_factor)
    act = prefix.act_mem_bytes[bounds[1:]] - prefix.act_mem_bytes[bounds[:-1]]
    alive = micro_batches_alive(len(bounds) - 1, n_microbatches, schedule)
    return fixed + alive * microbatch_size * act


def sync_times_s(
    state: ClusterState,
    prefix: ProfilePrefix,
    groups: Sequence[tuple[np.ndarray, np.ndarray]],
) -> list[np.ndarray]:
    """Gradient all-reduce time ``t_d`` of every device of the **active** groups (docs/model.md §3).

    Args:
        groups: one ``(devices (K_g,), bounds (K_g + 1,))`` pair per active group.

    Returns:
        per group, ``t_d`` of its devices, seconds, shape ``(K_g,)``:
        ``t_d = 2 (G'−1) lat + 2 (G'−1)/G' · θ_d / β_d`` with ``β_d`` the intra-node bandwidth
        if every device of the other active groups holding any of ``d``'s layers is on ``d``'s
        node, else ``nic_d`` (0 when ``G' ≤ 1``); plus, per trainable shared tensor ``d``
        holds (docs/model.md (v3)), the ring all-reduce among its ``n_s`` holders
        (:func:`shared_sync_times_s`). See :func:`flat_sync_times_s` (the same on flat arrays).
    """
    if not groups:
        return []
    devs, starts, ends, sizes = _flatten_groups(groups)
    t = flat_sync_times_s(state, prefix, devs, starts, ends, len(groups))
    return np.split(t, np.cumsum(sizes)[:-1])


def _flatten_groups(
    groups: Sequence[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(devices, starts, ends, sizes)`` of ``(devices, bounds)`` pairs, concatenated in
    group then stage order (shapes ``(Σ_g K_g,)``; ``sizes``: ``K_g``, shape ``(G',)``)."""
    bounds_list = [np.asarray(b, dtype=np.int64) for _, b in groups]
    devs = np.concatenate([np.asarray(d, dtype=np.int64) for d, _ in groups])
    starts = np.concatenate([b[:-1] for b in bounds_list])
    ends = np.concatenate([b[1:] for b in bounds_list])
    sizes = np.array([len(b) - 1 for b in bounds_list], dtype=np.int64)
    return devs, starts, ends, sizes


def flat_sync_times_s(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    num_active: int,
) -> np.ndarray:
    """:func:`sync_times_s` on flat arrays: ``t_d`` (seconds) of every stage of the
    ``num_active`` active groups, shape ``(Σ_g K_g,)``.

    Args:
        devices: device index of each stage, group then stage order, shape ``(Σ_g K_g,)``.
        starts / ends: each stage's layer range ``[start, end)``; every group's stages cover
            ``[0, L)`` in order (so a stage with ``start == 0`` begins a group).
        num_active: ``G'``.

    Implementation: per layer l the node of its owner in every active group, shape
    ``(G', L)``; a layer is "node-local to n" when all its owners are on node n; ``β_d`` is
    intra-node iff every layer of ``d`` is node-local to ``d``'s node. ``O(L G')``.
    """
    devices = np.asarray(devices, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    shared = flat_shared_sync_times_s(state, prefix, devices, starts, ends)
    if num_active <= 1:
        return shared
    beta = flat_sync_bandwidths_bytes_per_s(state, prefix, devices, starts, ends, num_active)
    theta = prefix.param_bytes[ends] - prefix.param_bytes[starts]
    scale = 2.0 * (num_active - 1) / num_active
    t = 2.0 * (num_active - 1) * state.latency_s + scale * theta / beta
    return t + shared


def shared_sync_times_s(
    state: ClusterState,
    prefix: ProfilePrefix,
    groups: Sequence[tuple[np.ndarray, np.ndarray]],
) -> list[np.ndarray]:
    """The shared-tensor part of ``t_d`` (docs/model.md §3), per active group, shape ``(K_g,)``,
    seconds: for each trainable shared tensor ``s`` that device ``d`` holds,
    ``2 (n_s−1) lat + 2 (n_s−1)/n_s · bytes_s / β_{d,s}``, where ``n_s`` is the number of
    devices of the active groups whose stage uses ``s`` (same group or not), and ``β_{d,s}``
    is the intra-node bandwidth if every other holder of ``s`` is on ``d``'s node, else
    ``nic_d``. Frozen shared tensors are never synced. Zeros without shared tensors or when
    ``n_s ≤ 1``. ``O(S Σ_g K_g)``."""
    sizes = [len(np.asarray(d)) for d, _ in groups]
    if not prefix.has_shared or not groups:
        return [np.zeros(k) for k in sizes]
    devs, starts, ends, sizes_arr = _flatten_groups(groups)
    t = flat_shared_sync_times_s(state, prefix, devs, starts, ends)
    return np.split(t, np.cumsum(sizes_arr)[:-1])


def flat_shared_sync_times_s(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
) -> np.ndarray:
    """:func:`shared_sync_times_s` on flat arrays (see :func:`flat_sync_times_s`), shape
    ``(Σ_g K_g,)``, seconds."""
    devs = np.asarray(devices, dtype=np.int64)
    t = np.zeros(len(devs))
    if not prefix.has_shared or len(devs) == 0:
        return t
    held = prefix.shared_held(starts, ends)  # (D', S)
    held &= ~prefix.shared_frozen[None, :]
    held &= prefix.shared_bytes[None, :] > 0
    count = held.sum(axis=0)  # n_s
    node = state.node[devs]
    for s in np.flatnonzero(count >= 2):
        holders = np.flatnonzero(held[:, s])
        n_s = len(holders)
        nodes = node[holders]
        local = np.all(nodes[None, :] == nodes[:, None], axis=1)  # every other holder local
        beta = np.where(local, state.intra_node_bytes_per_s, state.nic_bytes_per_s[devs[holders]])
        t[holders] += (
            2.0 * (n_s - 1) * state.latency_s
            + 2.0 * (n_s - 1) / n_s * prefix.shared_bytes[s] / beta
        )
    return t


def sync_bandwidths_bytes_per_s(
    state: ClusterState,
    prefix: ProfilePrefix,
    groups: Sequence[tuple[np.ndarray, np.ndarray]],
) -> np.ndarray:
    """``β_d`` of docs/model.md §3's sync term for every device of the given **active** groups,
    concatenated in group then stage order, shape ``(Σ_g K_g,)``, bytes/s: the intra-node
    bandwidth if every device of the other active groups holding any of ``d``'s layers is on
    ``d``'s node, else ``nic_d`` (see :func:`sync_times_s`)."""
    devs, starts, ends, _ = _flatten_groups(groups)
    return flat_sync_bandwidths_bytes_per_s(state, prefix, devs, starts, ends, len(groups))


def flat_sync_bandwidths_bytes_per_s(
    state: ClusterState,
    prefix: ProfilePrefix,
    devices: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    num_active: int,
) -> np.ndarray:
    """:func:`sync_bandwidths_bytes_per_s` on flat arrays (see :func:`flat_sync_times_s`),
    shape ``(Σ_g K_g,)``, bytes/s."""
    num_layers = prefix.num_layers
    devs_all = np.asarray(devices, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    # owner_node[g, l]: node of the device of active group g that holds layer l
    owner_node = state.node[devs_all].repeat(ends - starts).reshape(num_active, num_layers)
    # same[l]: all owners of layer l on one node; a stage's owner of l is then on that node
    # too, so d's layers are all node-local to d's node iff `same` holds on all of them
    same = (owner_node == owner_node[:1]).all(axis=0)
    local = np.concatenate(([0], np.cumsum(same)))
    all_local = (local[ends] - local[starts]) == (ends - starts)
    return np.where(all_local, state.intra_node_bytes_per_s, state.nic_bytes_per_s[devs_all])


def sync_bucket_edges(
    prefix: ProfilePrefix, stage_bounds: Sequence[np.ndarray], cap_bytes: float
) -> np.ndarray:
    """Gradient buckets as the runtime engine forms them
    (:func:`hetrain.runtime.data_parallel.build_buckets`): maximal runs of consecutive layers
    with the same owners — so a bucket never crosses a stage boundary of any group of the
    plan, idle ones included — split greedily, in increasing layer order, where adding the
    next layer's parameter bytes ``p_l`` would exceed ``cap_bytes``.

    Returns:
        edges ``0 = y_0 < y_1 < ... < y_J = L`` (shape ``(J + 1,)``); bucket j is layers
        ``[y_j, y_{j+1})``.
    """
    num_layers = prefix.num_layers
    cuts = np.zeros(num_layers + 1, dtype=bool)
    for b in stage_bounds:
        cuts[np.asarray(b, dtype=np.int64)] = True
    p = np.diff(prefix.param_bytes)
    edges = [0]
    size = 0.0
    for layer in range(num_layers):
        if layer > 0 and (cuts[layer] or size + p[layer] > cap_bytes):
            edges.append(layer)
            size = 0.0
        size += p[layer]
    edges.append(num_layers)
    return np.asarray(edges, dtype=np.int64)


@dataclass(frozen=True)
class SyncGroup:
    """What :func:`overlapped_sync_s` needs of one **active** group: ``devices`` (shape
    ``(K,)``), stage ``bounds`` (``(K + 1,)``), micro-batch size ``μ`` (samples), boundary
    times ``E_k`` (``(K − 1,)``, seconds per micro-batch) and group time ``T_g`` (seconds)."""

    devices: np.ndarray
    bounds: np.ndarray
    microbatch_size: int
    transfer_s: np.ndarray
    group_time_s: float


def overlapped_sync_s(
    state: ClusterState,
    prefix: ProfilePrefix,
    groups: Sequence[SyncGroup],
    bucket_edges: np.ndarray,
) -> float:
    """Exposed gradient all-reduce time ``T_exposed`` (seconds) when each bucket's all-reduce
    overlaps the last micro-batch's backward (``TrainingConfig.sync_overlap``; not docs/model.md
    §3).

    Source: docs/model.md §3's ring all-reduce time and β rule, applied per gradient bucket, with
    the
    bucketed overlap of the runtime engine (``GradientSync``) and of PyTorch DDP (Li et al.,
    "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020):
    a bucket's all-reduce starts once its gradients are final, buckets go in decreasing layer
    order, and the buckets of one device share its link (one after the other).

    All groups start the iteration at time 0. In active group g (``G'`` active groups), the
    last micro-batch's backward leaves stage k at ``end_k = T_g − Σ_{j<k} (W_j + E_j)`` with
    ``W_j = μ_g Σ_{l∈S_j} w_l / s_{d_j}`` (or the kind's measured backward times:
    :func:`stage_compute_s` with ``part="bwd"``; the backward pass drains toward stage 1). Bucket
    ``b = [y_b, y_{b+1})`` (:func:`sync_bucket_edges`; inside one stage k of every group) is
    ready in g at ``r_{b,g} = end_k − μ_g Σ_{l∈S_k, l<y_b} w_l / s_{d_k}`` and needs
    ``dur_{b,g} = 2 (G'−1) lat + 2 (G'−1)/G' · θ_b / β_{d_k}`` (``θ_b`` its parameter bytes,
    ``β`` of :func:`sync_bandwidths_bytes_per_s`). The all-reduce is a collective of one owner
    per active group: it starts when the last owner is ready, ``r_b = max_g r_{b,g}``, moves
    at its slowest member, ``dur_b = max_g dur_{b,g}``, and an owner whose stage also holds
    bucket ``b+1`` reduces that one first (its link is busy):
    ``F_b = max(r_b, F_{b+1} if some group holds b and b+1 on one device) + dur_b``.
    ``T_exposed = max(0, max_b F_b − max_g T_g)``, and ``T = max_g T_g + T_exposed``.

    A bucket without parameters costs nothing (the engine skips it). 0 when ``G' ≤ 1``.
    With identical groups this is, per device, the recurrence ``f_i = max(f_{i−1}, r_i) +
    dur_i`` over its buckets measured from its group's end. ``O(J G')``, a Python loop over the
    ``J ≤ L`` buckets for the recurrence.
    """
    num_active = len(groups)
    if num_active <= 1:
        return 0.0
    edges = np.asarray(bucket_edges, dtype=np.int64)
    lo, hi = edges[:-1], edges[1:]
    theta = prefix.param_bytes[hi] - prefix.param_bytes[lo]
    beta_all = sync_bandwidths_bytes_per_s(
        state, prefix, [(gr.devices, gr.bounds) for gr in groups]
    )
    scale = 2.0 * (num_active - 1) / num_active
    latency_s = 2.0 * (num_active - 1) * state.latency_s
    ready = np.full(len(lo), -np.inf)
    dur = np.zeros(len(lo))
    chained = np.zeros(len(lo), dtype=bool)
    offset = 0
    for gr in groups:
        devs = np.asarray(gr.devices, dtype=np.int64)
        bounds = np.asarray(gr.bounds, dtype=np.int64)
        mu = gr.microbatch_size
        bwd_s = stage_compute_s(state, prefix, devs, bounds[:-1], bounds[1:], mu, "bwd")
        drain_s = np.concatenate(([0.0], np.cumsum(bwd_s[:-1] + np.asarray(gr.transfer_s))))
        stage = np.searchsorted(bounds, lo, side="right") - 1
        end_s = gr.group_time_s - drain_s[stage]
        r = end_s - stage_compute_s(state, prefix, devs[stage], bounds[stage], lo, mu, "bwd")
        ready = np.maximum(ready, r)
        beta = beta_all[offset + stage]
        dur = np.maximum(dur, latency_s + scale * theta / beta)
        chained |= hi < bounds[stage + 1]
        offset += len(devs)
    has_params = theta > 0
    ready = np.where(has_params, ready, -np.inf)
    dur = np.where(has_params, dur, 0.0)
    finish = -np.inf
    last_s = -np.inf
    for b in range(len(lo) - 1, -1, -1):
        finish = max(ready[b], finish if chained[b] else -np.inf) + dur[b]
        last_s = max(last_s, finish)
    return max(0.0, last_s - max(gr.group_time_s for gr in groups))


# ---------------------------------------------------------------------------------------------
# Refinement (not docs/model.md §3): weight update and the straggler of data parallelism
# ---------------------------------------------------------------------------------------------

# E[max of G standard normals], G = 1..8 (Harter, "Expected values of normal order
# statistics", Biometrika 48, 1961); beyond 8 computed by integration
_EXPECTED_MAX_NORMAL = (0.0, 0.5642, 0.8463, 1.0294, 1.1630, 1.2672, 1.3522, 1.4236)


def expected_max_normal(times_s: Sequence[float], jitter: float) -> float:
    """``E[max_g X_g]`` (seconds) of independent ``X_g ~ N(T_g, (σ T_g)²)``: the expected
    time of the slowest of ``G'`` groups whose times jitter by ``σ`` (relative standard
    deviation) from one iteration to the next.

    ``max_g T_g`` when ``σ = 0`` or one time; equal times give ``T (1 + σ e_G)`` with ``e_G``
    the expected maximum of ``G`` standard normals (Harter 1961: 0.564 for 2, 1.029 for 4);
    otherwise ``a + ∫_a^b (1 − Π_g Φ((x − T_g)/(σ T_g))) dx`` with ``a = max_g T_g (1 − 8σ)``
    (below it the slowest-starting group is slower than ``x`` with probability ``1 − 10⁻¹⁵``,
    so the integrand is 1) and ``b = max_g T_g (1 + 8σ)``, over the groups with
    ``T_g (1 + 8σ) > a`` (the others are faster than ``a`` with that probability: their
    ``Φ`` is 1 on ``[a, b]``), by the trapezoidal rule on 257 points, which converges
    geometrically on such smooth, flat-ended integrands (Trefethen & Weideman, *SIAM Review*
    56(3), 2014): within 1e-12 (relative) of adaptive quadrature on random instances of 2-40
    groups and ``σ`` in 0.005-0.12 (``tests/test_costmodel_refinement.py``). The mass below 0 is
    neglected: ``σ < 1/8``. Times of 0 (idle groups) are left out.

    Raises:
        ValueError: ``jitter`` negative or not finite.
    """
    if not (np.isfinite(jitter) and jitter >= 0):
        raise ValueError(f"group_time_jitter: expected a finite number >= 0, got {jitter!r}")
    t = np.asarray([x for x in times_s if x > 0], dtype=float)
    if t.size == 0:
        return 0.0
    top = float(t.max())
    if jitter == 0 or t.size == 1:
        return top
    if np.all(t == top) and t.size <= len(_EXPECTED_MAX_NORMAL):
        return top * (1.0 + jitter * _EXPECTED_MAX_NORMAL[t.size - 1])
    from scipy.special import ndtr  # Φ, vectorised (np.vectorize(math.erf) was ~10x slower)

    sd = jitter * t
    lo = max(0.0, float(np.max(t - 8 * sd)))
    near = t + 8 * sd > lo
    t, sd = t[near], sd[near]
    if t.size == 1:
        return top
    hi = float(np.max(t + 8 * sd))
    x = np.linspace(lo, hi, 257)
    cdf = np.prod(ndtr((x[:, None] - t[None, :]) / sd[None, :]), axis=1)
    tail = 1.0 - cdf
    return float(lo + np.sum((tail[1:] + tail[:-1]) * np.diff(x)) / 2.0)


def update_times_s(
    prefix: ProfilePrefix,
    groups: Sequence[tuple[np.ndarray, np.ndarray]],
    time_s_per_param_byte: float,
) -> list[np.ndarray]:
    """Weight-update time ``u_d = ω θ'_d`` (seconds) of every device of the given active
    groups, per group, shape ``(K_g,)``: ``θ'_d`` the trainable parameter bytes ``d`` holds
    (its layers' and the trainable shared tensors', docs/model.md §3), ``ω`` seconds per byte
    (:attr:`TrainingConfig.update_time_s_per_param_byte`)."""
    out = []
    for _, bounds in groups:
        b = np.asarray(bounds, dtype=np.int64)
        starts, ends = b[:-1], b[1:]
        theta = prefix.param_bytes[ends] - prefix.param_bytes[starts]
        if prefix.has_shared:
            held = prefix.shared_held(starts, ends)  # (K, S)
            theta = theta + held.astype(float) @ (prefix.shared_bytes * ~prefix.shared_frozen)
        out.append(time_s_per_param_byte * theta)
    return out


def refined_iteration_time_s(
    group_times_s: Sequence[float],
    sync_charged_s: float,
    update_times_s: Sequence[np.ndarray],
    jitter: float,
) -> float:
    """Iteration time with the refinement of ``TrainingConfig.update_time_s_per_param_byte``
    and ``group_time_jitter`` (not in docs/model.md §3; docs/profiling.md §6), seconds:

    ``T = E[max_g T_g] + T_charged + max_{d used} ω θ'_d``

    * ``E[max_g T_g]`` (:func:`expected_max_normal`): a step waits for the slowest active
      group, and group times jitter from one iteration to the next (``σ``, measured as the
      relative spread of a device's compute time per iteration): the expected maximum of
      ``G'`` jittered times exceeds the largest mean, the more the more groups (the straggler
      effect of synchronous data parallelism; Chen et al., "Revisiting Distributed
      Synchronous SGD", 2016; Dutta et al., AISTATS 2018, model step times as random and the
      step as their maximum).
    * ``ω θ'_d`` (:func:`update_times_s`): after the sync every device updates the weights it
      holds (optimizer step, gradient-norm and gradient copies: passes over its ``θ'_d``
      trainable bytes, memory-bound), before the next iteration starts.
    * ``T_charged``: docs/model.md §3's ``T_sync``, or ``T_exposed`` with ``sync_overlap``.

    With ``σ = 0`` and ``ω = 0`` this is docs/model.md §3's ``max_g T_g + T_charged``.
    """
    slowest = expected_max_normal(group_times_s, jitter)
    update = max((float(np.max(u)) for u in update_times_s if len(u)), default=0.0)
    return slowest + sync_charged_s + update


def lower_bound_s(state: ClusterState, profile: ProfileArrays, batch: int) -> float:
    """``T_LB = B Σ_l (f_l + w_l) / Σ_{d available} s_d`` seconds (docs/model.md §3: perfect
    balance,
    fractional shares, no communication).

    With measured times the speeds are :func:`bound_speed_flops` (still a lower bound).

    Raises:
        ValueError: no device is available.
    """
    speeds = state.speed_flops
    if getattr(profile, "measured", ()):
        speeds = bound_speed_flops(state, profile_prefix(profile), batch)
    speed = float(np.sum(speeds[np.asarray(state.available, dtype=bool)]))
    if speed <= 0:
        raise ValueError("lower_bound_s: no device is available")
    return float(batch * np.sum(profile.train_flops) / speed)


# ---------------------------------------------------------------------------------------------
# Whole plans
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanEvaluation:
    """docs/model.md §3's figures of one plan in one cluster state.

    Attributes:
        iteration_time_s: ``T = max_g T_g + T_sync``; with ``TrainingConfig.sync_overlap``
            ``T = max_g T_g + T_exposed``.
        lower_bound_s: ``T_LB`` of the state (all available devices).
        sync_time_s: ``T_sync`` (docs/model.md §3, no overlap; also with ``sync_overlap``).
        group_times_s: ``T_g`` per group in plan order (0 for idle groups).
        cost: ``{"money": currency/iteration, "energy": J/iteration}``.
        fits: every device named by the plan is within its memory.
        memory_bytes / memory_limit_bytes: per device id named by the plan, bytes.
        stage_compute_s / stage_transfer_s: ``C_k`` and ``E_k`` per group (seconds per
            micro-batch), for reports and the simulator.
        sync_times_s: ``t_d`` per device id of the active groups.
        exposed_sync_time_s: ``T_exposed`` of :func:`overlapped_sync_s` (seconds) with
            ``TrainingConfig.sync_overlap``, else None.
    """

    iteration_time_s: float
    lower_bound_s: float
    sync_time_s: float
    group_times_s: tuple[float, ...]
    cost: dict[str, float]
    fits: bool
    memory_bytes: dict[str, float]
    memory_limit_bytes: dict[str, float]
    stage_compute_s: tuple[tuple[float, ...], ...] = field(default=())
    stage_transfer_s: tuple[tuple[float, ...], ...] = field(default=())
    sync_times_s: dict[str, float] = field(default_factory=dict)
    exposed_sync_time_s: float | None = None

    @property
    def out_of_memory(self) -> list[str]:
        """Ids of devices whose memory use exceeds their limit."""
        return [d for d, m in self.memory_bytes.items() if m > self.memory_limit_bytes[d]]

    @property
    def ratio_to_lower_bound(self) -> float:
        """``T / T_LB``."""
        return self.iteration_time_s / self.lower_bound_s if self.lower_bound_s > 0 else np.inf

    def objective(self, v: float = 1.0, queues: dict[str, float] | None = None) -> float:
        """Drift-plus-penalty objective ``V·T + Σ_j Q_j y_j`` (docs/model.md §4)."""
        total = v * self.iteration_time_s
        for name, q in (queues or {}).items():
            total += q * self.cost[name]
        return float(total)

    def to_json_dict(self) -> dict[str, Any]:
        """The ``hetrain evaluate --json`` object of docs/model.md §7 (plus ``exposed_sync_time_s``
        with
        ``sync_overlap``)."""
        out = {
            "iteration_time_s": self.iteration_time_s,
            "lower_bound_s": self.lower_bound_s,
            "sync_time_s": self.sync_time_s,
            "group_times_s": list(self.group_times_s),
            "cost": dict(self.cost),
            "fits": self.fits,
            "devices": {
                d: {
                    "memory_bytes": self.memory_bytes[d],
                    "memory_limit_bytes": self.memory_limit_bytes[d],
                }
                for d in self.memory_bytes
            },
        }
        if self.exposed_sync_time_s is not None:
            out["exposed_sync_time_s"] = self.exposed_sync_time_s
        return out


@dataclass(frozen=True)
class _GroupFigures:
    """One group's figures in :func:`evaluate_plan`: ``C_k``, ``E_k`` (seconds per
    micro-batch), ``T_g`` (seconds) and memory per stage device (bytes)."""

    compute_s: tuple[float, ...]
    transfer_s: tuple[float, ...]
    group_time_s: float
    memory_bytes: list[float]


def _group_figures(
    state: ClusterState,
    prefix: ProfilePrefix,
    plan: Plan,
    devices: Sequence[Sequence[int]],
    bounds: Sequence[Sequence[int]],
    optimizer_state_factor: float,
) -> list[_GroupFigures]:
    """Per group of ``plan`` (``devices[g]``, shape ``(K_g,)``; ``bounds[g]``, ``(K_g + 1,)``),
    :func:`stage_times_s`, :func:`group_fill_and_bottleneck_s`, :func:`group_time_s` and
    :func:`stage_memory_bytes`, in plan order. Groups with the same number of stages are
    computed together, one numpy pass for all of them (the same elementwise operations and
    per-row reductions as the one-group functions, so the same values)."""
    by_depth: dict[int, list[int]] = {}
    for g, devs in enumerate(devices):
        by_depth.setdefault(len(devs), []).append(g)
    out: list[_GroupFigures | None] = [None] * len(devices)
    for k_stages, members in by_depth.items():
        devs = np.array([devices[g] for g in members], dtype=np.int64)  # (m, K)
        bnd = np.array([bounds[g] for g in members], dtype=np.int64)  # (m, K + 1)
        mu = np.array([plan.groups[g].microbatch_size for g in members], dtype=np.int64)
        n = np.array([plan.groups[g].num_microbatches for g in members], dtype=np.int64)
        compute = stage_compute_s(state, prefix, devs, bnd[:, :-1], bnd[:, 1:], mu[:, None])
        compute = np.broadcast_to(compute, devs.shape)
        fill = compute.sum(axis=1)
        bottleneck = compute.max(axis=1)
        if k_stages > 1:
            bw = link_bandwidths_bytes_per_s(state, devs)
            transfer = (
                mu[:, None] * prefix.boundary_bytes[bnd[:, 1:-1] - 1] / bw + 2.0 * state.latency_s
            )
            fill = fill + transfer.sum(axis=1)
            bottleneck = np.maximum(bottleneck, transfer.max(axis=1))
        else:
            transfer = np.zeros((len(members), 0))
            fill = fill + 0.0
            bottleneck = np.maximum(bottleneck, 0.0)
        times = np.where(n > 0, fill + (n - 1) * bottleneck, 0.0)
        fixed = prefix.fixed_memory_bytes(bnd[:, :-1], bnd[:, 1:], optimizer_state_factor)
        act = prefix.act_mem_bytes[bnd[:, 1:]] - prefix.act_mem_bytes[bnd[:, :-1]]
        alive = np.maximum(n, 0)[:, None]
        if plan.schedule != "gpipe":
            alive = np.minimum(alive, k_stages - np.arange(k_stages))
        memory = fixed + (alive * mu[:, None]) * act
        rows = zip(members, compute.tolist(), transfer.tolist(), times.tolist(),
                   memory.tolist(), strict=True)  # fmt: skip
        for g, c, e, t, m in rows:
            out[g] = _GroupFigures(tuple(c), tuple(e), t, m)
    return out  # type: ignore[return-value]


def evaluate_plan(
    plan: Plan, state: ClusterState, profile: ProfileArrays, config: TrainingConfig
) -> PlanEvaluation:
    """Evaluate ``plan`` with docs/model.md §3 (see the module docstring for every formula).

    The schedule is the plan's own ``schedule`` (``config.schedule`` is the planner's default).
    With ``config.sync_overlap`` the iteration time charges only the exposed sync
    (:func:`overlapped_sync_s`) instead of ``T_sync``.
    The plan's shares need not sum to ``config.batch`` here (commands validate that with
    :meth:`Plan.validate_for`); ``T_LB`` uses ``config.batch``.

    Raises:
        ValueError: the plan names a device that is not in ``state``, a device of an active
            group is unavailable, or stages do not cover ``[0, L)``.
    """
    index = state.index()
    prefix = profile_prefix(profile)
    num_layers = prefix.num_layers
    o = float(config.optimizer_state_factor)
    devs_of: list[list[int]] = []
    all_bounds: list[list[int]] = []
    available = state.available.tolist()
    for g, group in enumerate(plan.groups):
        try:
            devs = [index[d] for d in group.devices]
        except KeyError as exc:
            raise ValueError(f"groups[{g}].devices: unknown device {exc.args[0]!r}") from None
        bounds = [s for s, _ in group.stages] + [group.stages[-1][1]]
        if bounds[-1] != num_layers:
            raise ValueError(
                f"groups[{g}].stages: expected stages covering [0, {num_layers}), "
                f"last ends at {bounds[-1]}"
            )
        if group.batch > 0:
            unavailable = [d for d, i in zip(group.devices, devs, strict=True) if not available[i]]
            if unavailable:
                raise ValueError(f"groups[{g}].devices: device {unavailable[0]!r} is not available")
        devs_of.append(devs)
        all_bounds.append(bounds)
    figures = _group_figures(state, prefix, plan, devs_of, all_bounds, o)
    group_times = [f.group_time_s for f in figures]
    limit_of = state.memory_bytes.tolist()
    memory: dict[str, float] = {}
    limit: dict[str, float] = {}
    active_g: list[int] = []  # the active groups (b_g > 0), plan order
    for g, (group, devs, fig) in enumerate(zip(plan.groups, devs_of, figures, strict=True)):
        memory.update(zip(group.devices, fig.memory_bytes, strict=True))
        limit.update((d, limit_of[i]) for d, i in zip(group.devices, devs, strict=True))
        if group.batch > 0:
            active_g.append(g)
    refined = config.update_time_s_per_param_byte > 0 or config.group_time_jitter > 0
    active = [
        (np.array(devs_of[g], dtype=np.int64), np.array(all_bounds[g], dtype=np.int64))
        for g in (active_g if config.sync_overlap or refined else ())
    ]
    used = [i for g in active_g for i in devs_of[g]]
    compute_all = [f.compute_s for f in figures]
    transfer_all = [f.transfer_s for f in figures]
    # t_d of every stage of the active groups, flat in group then stage order (sync_times_s)
    sync_by_id: dict[str, float] = {}
    if active_g:
        starts = [x for g in active_g for x in all_bounds[g][:-1]]
        ends = [x for g in active_g for x in all_bounds[g][1:]]
        t = flat_sync_times_s(state, prefix, np.array(used, dtype=np.int64),
                              np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64),
                              len(active_g))  # fmt: skip
        ids = [d for g in active_g for d in plan.groups[g].devices]
        sync_by_id.update(zip(ids, t.tolist(), strict=True))
    sync_time = max(sync_by_id.values(), default=0.0)
    exposed = None
    if config.sync_overlap:
        sync_groups = [
            SyncGroup(devs, bounds, plan.groups[g].microbatch_size,
                      np.asarray(figures[g].transfer_s), figures[g].group_time_s)
            for g, (devs, bounds) in zip(active_g, active, strict=True)
        ]  # fmt: skip
        edges = sync_bucket_edges(prefix, [np.asarray(b, dtype=np.int64) for b in all_bounds],
                                  float(config.sync_bucket_cap_bytes))  # fmt: skip
        exposed = overlapped_sync_s(state, prefix, sync_groups, edges)
        # shared tensors (docs/model.md (v3)): their all-reduces are charged in full after the layer
        # buckets (not overlapped; docs/planner.md)
        shared = shared_sync_times_s(state, prefix, active)
        exposed += max((float(np.max(t)) for t in shared if len(t)), default=0.0)
    charged = sync_time if exposed is None else exposed
    iteration = (max(group_times) if group_times else 0.0) + charged
    if refined:
        # refinement (not docs/model.md §3): straggler of G' groups and the weight update
        updates = update_times_s(prefix, active, float(config.update_time_s_per_param_byte))
        iteration = refined_iteration_time_s(
            group_times, charged, updates, float(config.group_time_jitter)
        )
    if active_g:
        # refinement (not docs/model.md §3): the loop's fixed time per iteration
        iteration += float(config.step_overhead_s)
    used_arr = np.asarray(used, dtype=np.int64)
    cost = {
        "money": float(iteration * np.sum(state.price_per_s[used_arr])),
        "energy": float(iteration * np.sum(state.power_w[used_arr])),
    }
    fits = all(memory[d] <= limit[d] for d in memory)
    return PlanEvaluation(
        iteration_time_s=float(iteration),
        lower_bound_s=lower_bound_s(state, profile, config.batch),
        sync_time_s=float(sync_time),
        group_times_s=tuple(group_times),
        cost=cost,
        fits=fits,
        memory_bytes=memory,
        memory_limit_bytes=limit,
        stage_compute_s=tuple(compute_all),
        stage_transfer_s=tuple(transfer_all),
        sync_times_s=sync_by_id,
        exposed_sync_time_s=exposed,
    )
