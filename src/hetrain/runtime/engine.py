"""The runtime engine: one :class:`Worker` per rank executes any docs/model.md §7 plan exactly.

Every rank builds the full model from the same seed and passes it to :class:`Worker`, which
keeps only the rank's layers (the others become shape-only ``meta`` modules, materialised when
a plan change moves a layer here). One step = the rank's group runs its pipeline over its rows
of the global batch (1F1B or GPipe, :mod:`hetrain.runtime.stages`), gradients are combined per
layer across the groups (:mod:`hetrain.runtime.data_parallel`), the global gradient norm is
clipped, and the per-layer optimizers step. See ``docs/runtime.md``.

The step and the set-up live here; the rank's tensors, their optimizers, plan changes and
state dicts in :mod:`hetrain.runtime.worker_state`; the per-step sums (loss, gradient norm,
got-gradient flags) in :mod:`hetrain.runtime.worker_sums`; the step's and the plan change's
results in :mod:`hetrain.runtime.step_result` (all importable from here).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.errors import InputError
from hetrain.plan import Plan
from hetrain.runtime.cutting import Chain, cut_module
from hetrain.runtime.data_parallel import (
    Bucket,
    GradientSync,
    GroupCache,
    build_buckets,
    shared_buckets,
)
from hetrain.runtime.emulation import Emulation
from hetrain.runtime.layout import Layout, build_layout
from hetrain.runtime.norm import NormBlocks, batchnorm_modules
from hetrain.runtime.optim import (
    OptimizerSpec,
    clip_coefficient,
    set_lr_factor,
)
from hetrain.runtime.randomness import InvariantRandomness
from hetrain.runtime.stages import P2P, Timers, run_stage, schedule_ops
from hetrain.runtime.step_result import (
    _SUMS_HEAD,
    MigrationResult,
    StepResult,
    StoreSums,
    _LateSums,
    _rows,
    gather_measurements,
)
from hetrain.runtime.worker_state import (
    LayerState,
    Unit,
    _check_agreement,
    _check_norm_plan,
    _plan_digest,
)
from hetrain.runtime.worker_sums import StepSums

__all__ = [
    "MigrationResult",
    "StepResult",
    "Worker",
    "check_exact_layers",
    "gather_measurements",
]


def check_exact_layers(layers: nn.Sequential | Chain) -> Chain:
    """Check that ``layers`` can be trained exactly and return its chain. Dropout and
    BatchNorm are accepted (:mod:`hetrain.runtime.randomness` makes random draws
    plan-invariant, :mod:`hetrain.runtime.norm` handles BatchNorm) and so are tied tensors
    (docs/model.md §2: a shared tensor lives on every stage that uses it).

    Raises:
        InputError: not a module or an empty chain.
    """
    return layers if isinstance(layers, Chain) else cut_module(layers)


_WORKERS = itertools.count()
"""Workers made in this process, in order: every rank makes its workers in the same order
(the constructor is collective), so the n-th worker has the same store keys on every rank."""


def _store_sums(rank: int, world: int) -> StoreSums | None:
    """The late step sums' channel through the default process group's store (None when
    torch gives no access to it: the sums then travel in a non-blocking all-reduce)."""
    index = next(_WORKERS)
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        store = getter() if getter is not None else None
    except (RuntimeError, ValueError):
        store = None
    if store is None:
        return None
    timeout_s = store.timeout.total_seconds() if hasattr(store, "timeout") else 1800.0
    return StoreSums(store, f"hetrain/step-sums/{index}", rank, world, timeout_s)


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Worker(LayerState, StepSums):
    """One rank of a hybrid data/pipeline-parallel run (docs/model.md §1, §5).

    Args:
        layers: the model: an ``nn.Sequential`` or a list of modules (layer ``l`` = child
            ``l``), or a :class:`~hetrain.runtime.cutting.Chain` of any module
            (:func:`~hetrain.runtime.cutting.cut_module`), built identically (same seed) on
            every rank; the worker takes it over (converts it to ``dtype``; tensors of layers
            it does not hold become ``meta``).
        plan: the docs/model.md §7 plan; it must name every rank's device exactly once.
        device_id: this rank's device id in the plan (all ranks exchange theirs).
        loss_fn: ``(output, target) -> scalar`` mean over the micro-batch's samples (e.g.
            ``F.cross_entropy``; the engine scales it by ``rows / B``), or ``-> (sum, count)``
            (e.g. masked tokens: the engine divides by the global batch's count, docs/model.md §5).
        optimizer: :class:`OptimizerSpec`, built per layer and per shared tensor.
        schedule: ``"1f1b"`` or ``"gpipe"``; None = the plan's ``schedule``.
        emulation: slow-down and link emulation (settable later via :attr:`emulation`).
        dtype: parameter dtype; floating inputs are cast to it.
        grad_clip_norm: clip the global gradient L2 norm to this (None = no clipping); each
            shared tensor counted once.
        autocast_bf16: run forward passes under ``torch.autocast(dtype=bfloat16)``.
        device: torch device of this rank (default: CPU for gloo, the current CUDA device for
            NCCL).
        allow_unused_ranks: accept ranks whose device the plan does not name.
        bucket_cap_bytes: largest gradient bucket all-reduced at once.
        overlap_grad_sync: start a bucket's all-reduce during the stage's last backward.
        seed: key of the plan-invariant random draws (:mod:`hetrain.runtime.randomness`).
        norm_block: BatchNorm norm block ``G`` (ghost batch norm, :mod:`hetrain.runtime.norm`);
            None = statistics per micro-batch (results depend on the plan).
        exact: refuse (``InputError``) random ops that cannot be made plan-invariant instead
            of warning once.

    Raises:
        RuntimeError: ``torch.distributed`` not initialised.
        InputError: the plan names unknown devices, does not cover the layers, or its device
            count differs from the world size (raised on every rank, no hang).
        InputError: a share or micro-batch size not a multiple of ``norm_block``; with
            ``exact``, a random op that cannot be made plan-invariant.
        ValueError: bad options, ranks given different plans or models.
    """

    def __init__(
        self,
        layers: nn.Sequential | Sequence[nn.Module] | Chain,
        plan: Plan,
        device_id: str,
        loss_fn: Callable[[Any, Any], Any],
        optimizer: OptimizerSpec,
        *,
        schedule: str | None = None,
        emulation: Emulation | None = None,
        dtype: torch.dtype = torch.float32,
        grad_clip_norm: float | None = None,
        autocast_bf16: bool = False,
        device: torch.device | str | None = None,
        allow_unused_ranks: bool = False,
        bucket_cap_bytes: int = 64 * 2**20,
        overlap_grad_sync: bool = True,
        seed: int = 0,
        norm_block: int | None = None,
        exact: bool = False,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Worker needs torch.distributed initialised (init_process_group)")
        chain = layers if isinstance(layers, Chain) else cut_module(list(layers))
        if schedule not in (None, "1f1b", "gpipe"):
            raise ValueError(f"schedule: expected '1f1b' or 'gpipe', got {schedule!r}")
        if grad_clip_norm is not None and not (
            math.isfinite(grad_clip_norm) and grad_clip_norm > 0
        ):
            raise ValueError(f"grad_clip_norm: expected a finite number > 0, got {grad_clip_norm}")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device(device) if device is not None else _default_device()
        gathered: list[Any] = [None] * self.world_size
        mine = (str(device_id), _plan_digest(plan), chain.structure_digest())
        dist.all_gather_object(gathered, mine)
        _check_agreement(gathered, mine, ("plan", "model structure"))
        gathered = [g[0] for g in gathered]
        self.device_id = str(device_id)
        if bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes: expected > 0, got {bucket_cap_bytes}")
        self.bucket_cap_bytes = int(bucket_cap_bytes)
        self.overlap_grad_sync = bool(overlap_grad_sync)
        self.layout: Layout = build_layout(
            plan, tuple(gathered), chain.num_layers, require_all=not allow_unused_ranks
        )
        self.chain = chain
        # --- plan-invariant randomness and BatchNorm (randomness.py, norm.py) ---
        self.exact = bool(exact)
        self.randomness = InvariantRandomness(
            chain.module, seed=seed, exact=exact, batch_free=chain.batch_free_draws
        )
        self.norm = NormBlocks(chain.module, norm_block)
        self._norm_layers = [
            i
            for i in range(chain.num_layers)
            if any(batchnorm_modules(m) for m in chain.layer_modules(i))
        ]
        self._random_reported = False
        _check_norm_plan(self.layout, norm_block)
        static = self.randomness.static_problems()
        if static and self.exact:
            raise InputError("model", "random op", f"{static[0]} (--exact)")
        if self.rank == 0:
            for line in static[:1] + [self.norm.startup_message() or ""]:
                if line:
                    print(f"hetrain: warning: {line}", file=sys.stderr, flush=True)
        self.module = chain.module.to(dtype=dtype)
        # keep the tensor index current (``.to`` keeps parameter objects; buffers may change)
        chain._index_tensors()
        # the optimizer's parameter group of each trainable tensor (by the module's names)
        named = dict(self.module.named_parameters(remove_duplicate=False))
        self._group_of = {
            chain._name_of[id(named[n])]: index
            for index, (names, _) in enumerate(optimizer.param_groups)
            for n in names
        }
        self.dtype = dtype
        self.loss_fn = loss_fn
        self.optimizer_spec = optimizer
        self._schedule = schedule
        self.emulation = emulation
        self.grad_clip_norm = grad_clip_norm
        self.autocast_dtype = torch.bfloat16 if autocast_bf16 else None
        self.shared = chain.shared  # name -> layers using it
        self._private: list[list[str]] = [
            [n for n in names if n not in self.shared] for names in chain.layer_tensors
        ]
        self._held: set[str] = set()
        # trainable tensors in one order on every rank: which of them got a gradient this step
        # anywhere (a parameter without one is not stepped, as torch.optim skips it)
        self._grad_index = {
            n: i for i, n in enumerate(n for n in chain.tensors if not chain.frozen(n))
        }
        self.optimizers: dict[Unit, torch.optim.Optimizer | None] = {}
        held = self._held_names(self.layout)
        for name, t in chain.tensors.items():
            if name in held:
                self._materialize(name, t.detach().to(self.device))
            else:
                self._release(name)
        for unit in self._units(self.layout):
            self.optimizers[unit] = self._build_optimizer(unit)
        self._groups = GroupCache()
        self._late: _LateSums | None = None
        self._store_sums = _store_sums(self.rank, self.world_size)
        self._steps_run = 0  # Worker.step calls so far (the same count on every rank)
        self._report: Callable[[], Sequence[float]] | None = None
        self._step_sums: tuple[Any, Any, bool] | None = None
        self._sum_mode: bool | None = None  # the loss kind, once a step told every rank
        self._layer_bytes = [
            sum(self._nbytes(n) for n in names if not chain.frozen(n)) for names in self._private
        ]
        self._setup_buckets()

    # ----------------------------------------------------------------------------- tensors
    def _setup_buckets(self) -> None:
        layer_buckets = build_buckets(self.layout, self._layer_bytes, self.bucket_cap_bytes)
        trainable_shared = {n: ls for n, ls in self.shared.items() if not self.chain.frozen(n)}
        # shared buckets first: they are launched last (their gradient is final only when the
        # whole backward of the stage is done, e.g. a tied embedding)
        self._buckets: list[Bucket] = shared_buckets(self.layout, trainable_shared) + layer_buckets
        self._groups.ensure(self._buckets)
        self._channels = self._groups.pipeline_channels(self.layout)
        self._p2p_cache: dict[tuple[int, int], Any] = {}  # message descriptions (stages.P2P)
        self._p2p_send_buffers: dict[int, list[Any]] = {}  # free host send buffers (stages.P2P)
        self._norm_sets = self._norm_owner_sets()
        everyone = tuple(range(self.world_size))
        # every trainable tensor has one active owner and no idle replica (no gradient
        # combination at all): this rank's got-gradient flags are the step's, so the sums may
        # travel late; an idle replica gets its gradients broadcast and must learn now which
        # got one, or its optimizer skips them and the replica goes stale
        self._grads_single_owner = not any(
            len(b.active) > 1 or b.idle for b in self._buckets if self._bucket_trainable(b)
        )
        self._sums_in_gradients = (
            self.world_size > 1
            and any(len(b.active) > 1 for b in self._buckets if self._bucket_trainable(b))
            and all(tuple(sorted(b.active)) == everyone and not b.idle for b in self._buckets)
        )

    def _bucket_trainable(self, bucket: Bucket) -> bool:
        if bucket.shared is not None:
            return True
        return any(self._layer_bytes[layer] > 0 for layer in bucket.layers)

    def _norm_modules(self, indices: Sequence[int]) -> list[nn.Module]:
        return [m for i in indices for m in self.chain.layer_modules(i)]

    def _norm_owner_sets(self) -> list[tuple[tuple[int, ...], list[int]]]:
        """BatchNorm layers grouped by their owners (all groups, idle included), in layer
        order; their process groups are created here, in the same order on every rank."""
        sets: dict[tuple[int, ...], list[int]] = {}
        for index in self._norm_layers:
            sets.setdefault(tuple(sorted(self.layout.owners[index])), []).append(index)
        for ranks in sets:
            if len(ranks) > 1:
                self._groups.get(ranks, "norm")
        return list(sets.items())

    def _sync_norm_stats(self, active: bool) -> None:
        """Update BatchNorm running statistics once per step from the statistics of all
        groups (:meth:`NormBlocks.step_tensor` summed among each layer's owners)."""
        for ranks, indices in self._norm_sets:
            if self.rank not in ranks:
                continue
            modules = self._norm_modules(indices)
            flat = self.norm.step_tensor(modules, active=active).to(self.device)
            if len(ranks) > 1:
                dist.all_reduce(flat, group=self._groups.get(ranks, "norm"))
            self.norm.apply_step(modules, flat)

    def _forward_context(self, offset: int, step: int) -> Callable[[int, int], Any]:
        """Per micro-batch forward context: rows ``[offset + start, offset + end)`` of the
        global batch at iteration ``step`` (plan-invariant randomness, ghost BatchNorm)."""

        plain_norm = self.norm.norm_block is None or not self.norm.has_batchnorm

        def enter(start: int, end: int) -> Any:
            if plain_norm and not self.randomness.is_active():
                return self.randomness.watch()  # no draws to key, no ghost BatchNorm
            rows = torch.arange(offset + start, offset + end, dtype=torch.int64)
            stack = contextlib.ExitStack()
            stack.enter_context(self.randomness.forward(step=step, sample_index=rows))
            stack.enter_context(self.norm.forward())
            return stack

        return enter

    def _report_random_problems(self) -> None:
        """A random op that is not plan-invariant ran on some rank this step: warn once (each
        rank that saw it), or with ``exact`` raise the same InputError on every rank."""
        self._random_reported = True
        mine = self.randomness.problems
        if self.exact:
            what = mine[0] if mine else "another rank ran a random op hetrain cannot make invariant"
            raise InputError("model", "random op", f"{what} (--exact)")
        if mine:
            print(f"hetrain: warning: {mine[0]}; results depend on the plan", file=sys.stderr)

    def _bucket_params(self) -> list[list[nn.Parameter]]:
        out = []
        for b in self._buckets:
            if b.shared is not None:
                out.append(self._unit_params(b.shared) if b.shared in self._held else [])
            else:
                held = self.rank in b.active or self.rank in b.idle
                out.append(
                    [p for layer in b.layers for p in self._unit_params(layer)] if held else []
                )
        return out

    # ----------------------------------------------------------------------------- properties
    @property
    def layers(self) -> Chain:
        return self.chain

    @property
    def plan(self) -> Plan:
        return self.layout.plan

    @property
    def schedule(self) -> str:
        return self._schedule or self.plan.schedule

    @property
    def owned_layers(self) -> tuple[int, ...]:
        """Layer indices this rank holds under the current plan."""
        return self.layout.owned_layers(self.rank)

    # ----------------------------------------------------------------------------- step
    def step(
        self,
        inputs: Any,
        targets: Any,
        step: int,
        *,
        report: Callable[[], Sequence[float]] | None = None,
    ) -> StepResult:
        """Train one iteration on the global batch.

        Args:
            inputs: the whole global batch of model inputs (a tensor ``(B, ...)`` or a pytree
                of them), identical on every rank; group ``g`` uses rows ``[offset_g, offset_g
                + b_g)`` (groups in plan order).
            targets: ``(B, ...)`` targets for ``loss_fn`` (or a pytree), identical on every
                rank.
            step: iteration index (drives the learning-rate schedule and randomness).
            report: called once per step on every rank, returns this rank's row of floats
                (the same length on every rank); every rank's row comes back in
                ``StepResult.report`` through the step's own combination (no collective of
                its own; with :attr:`StepResult.late`, a step later). It is called during
                the step (at the launch of the last gradient bucket, or at the end), so it
                must not raise and must not run collectives.

        Raises:
            ValueError: ``inputs``/``targets`` with a first dimension other than ``B``;
                ``loss_fn`` returned ``(sum, count)`` after a step where it returned a mean
                (on a plan whose sums travel late, see :attr:`StepResult.late`).
        """
        from torch.utils._pytree import tree_flatten, tree_map_only

        t_start = time.perf_counter()
        batch = self.layout.global_batch
        rows_in = [t.shape[0] for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
        rows_t = [t.shape[0] for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor)]
        if any(r != batch for r in rows_in + rows_t):
            raise ValueError(
                f"inputs/targets: expected the global batch of {batch} rows, got "
                f"{rows_in[:1] or '?'} and {rows_t[:1] or '?'}"
            )
        for name in self._held:
            self.chain.tensors[name].grad = None
        timers = Timers()
        p2p = P2P(
            self.device,
            self.layout.devices,
            self.rank,
            timers,
            self.emulation,
            self._channels,
            self._p2p_cache,
            self._p2p_send_buffers,
        )
        grad_sync = GradientSync(
            layout=self.layout,
            buckets=self._buckets,
            groups=self._groups,
            rank=self.rank,
            bucket_params=self._bucket_params(),
            device=self.device,
            emulation=self.emulation,
            extra=self._carried_sums if self._sums_in_gradients else None,
        )
        self._report = report
        self._step_sums = None
        pos = self.layout.position(self.rank)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        loss_part, count_part, sum_mode = zero, zero, False
        group = stage = None
        num_mb = 0
        if pos is not None:
            group = self.layout.groups[pos[0]]
            k = pos[1]
            stage = group.stages[k]
            microbatches = [(s - group.offset, e - group.offset) for s, e in group.microbatches()]
            num_mb = len(microbatches)
            if group.active:
                rows = slice(group.offset, group.offset + group.batch)

                def cast(t: torch.Tensor) -> torch.Tensor:
                    t = t[rows].to(self.device)
                    return t.to(self.dtype) if t.is_floating_point() else t

                x = tree_map_only(torch.Tensor, cast, inputs)
                y = None
                if k == len(group.ranks) - 1:
                    y = tree_map_only(torch.Tensor, lambda t: t[rows].to(self.device), targets)
                s0, s1 = stage
                if self._late is not None and k + 1 < len(group.ranks):
                    # the previous step's sums are read while this stage waits for its first
                    # gradient, not on the step's tail: every rank posts them before its first
                    # forward of this step, and that gradient follows every rank's first
                    # forward (the later stages' finished their previous step first)
                    p2p.when_waiting_for(group.ranks[k + 1], self._late.prefetch)
                try:
                    loss_part, count_part, sum_mode = run_stage(
                        stage_forward=lambda xin, mb: self.chain.stage_forward(s0, s1, xin, mb),
                        ops=schedule_ops(self.schedule, len(group.ranks), k, num_mb),
                        microbatches=microbatches,
                        inputs=x,
                        targets=y,
                        loss_fn=self.loss_fn,
                        global_batch=batch,
                        prev_rank=group.ranks[k - 1] if k > 0 else None,
                        next_rank=group.ranks[k + 1] if k + 1 < len(group.ranks) else None,
                        p2p=p2p,
                        timers=timers,
                        device=self.device,
                        device_id=self.device_id,
                        emulation=self.emulation,
                        autocast_dtype=self.autocast_dtype,
                        before_last_backward=self._arm(grad_sync),
                        forward_context=self._forward_context(group.offset, step),
                    )
                except BaseException:
                    grad_sync.disarm()  # no stale hooks if the step fails
                    raise
        p2p.wait_sends()
        # which tensors got a gradient here, read before the sync fills zeros; under pure data
        # parallelism the last bucket carries them (:meth:`_carried_sums`)
        got_grad = None if self._sums_in_gradients else self._local_grad_flags()
        self._step_sums = (loss_part, count_part, sum_mode)
        sync_time_s, sync_bytes = grad_sync.finish()
        self._sync_norm_stats(group is not None and group.active)
        t_opt = time.perf_counter()
        late_sums: torch.Tensor | None = None
        if grad_sync.extra_result is not None:
            # every rank holds every layer: the sums came with the gradients, and the norm is
            # the same sum on every rank over the combined gradients
            values = grad_sync.extra_result.tolist()
            local_sq = values[1] = self._local_sqnorm()
        else:
            local_sq = self._sqnorm_canonical()
            if got_grad is None:  # no bucket carried them: nothing was filled in
                got_grad = self._local_grad_flags()
            sums = self._sums_vector(loss_part, count_part, sum_mode, local_sq, got_grad)
            if self.world_size > 1 and (
                self.grad_clip_norm is not None
                or self._sum_mode is not False
                or not self._grads_single_owner
            ):
                # the optimizer step needs the norm, the count, or which tensors got a
                # gradient on another owner now
                dist.all_reduce(sums)
            elif self.world_size > 1:
                if sum_mode:
                    raise ValueError(
                        "loss_fn: returned (sum, count) after a step where it returned a mean; "
                        "it must return the same kind at every step"
                    )
                late_sums = sums  # reported late: a non-blocking all-reduce (below)
            values = sums.tolist()
        loss, sqnorm, count, mode, random_problems = values[:_SUMS_HEAD]
        num_flags = len(self._grad_index)
        # which tensors got a gradient on any rank (in the late path this rank's own flags:
        # there every trainable tensor has a single owner, so they are exact)
        self._drop_absent_grads(values[_SUMS_HEAD : _SUMS_HEAD + num_flags])
        if late_sums is None:
            self._sum_mode = mode > 0
            if random_problems > 0:
                self._report_random_problems()
        scale = 1.0
        if mode > 0:  # (sum, count) losses: divide by the count of the whole global batch
            if count <= 0:
                raise ValueError("loss_fn: the global batch counts no items (count 0)")
            scale = 1.0 / count
            loss *= scale
        grad_norm = math.sqrt(max(sqnorm, 0.0)) * scale
        # a non-finite loss or gradient norm: no update (on every rank alike where the values
        # were combined before the update; in the late path on the stages where it shows)
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        here = skipped and not (math.isfinite(float(loss_part)) and math.isfinite(local_sq))
        coef = clip_coefficient(grad_norm, self.grad_clip_norm) * scale
        lr_factor = self.optimizer_spec.lr_factor(step)
        for unit, opt in self.optimizers.items():
            if opt is None or skipped:
                continue
            if coef != 1.0:
                for p in self._unit_params(unit):
                    if p.grad is not None:
                        p.grad.mul_(coef)
            set_lr_factor(opt, lr_factor)
            opt.step()
        self._finish_late()  # the previous step's late sums (long done) on every rank
        end = time.perf_counter()
        result = StepResult(
            step=step,
            rank=self.rank,
            device_id=self.device_id,
            plan_id=self.plan.plan_id,
            loss=loss,
            grad_norm=grad_norm,
            iteration_time_s=end - t_start,
            compute_time_s=timers.compute_time_s,
            forward_time_s=timers.forward_time_s,
            backward_time_s=timers.backward_time_s,
            emulated_compute_time_s=timers.emulated_compute_s,
            send_recv_time_s=timers.send_recv_time_s,
            sync_time_s=sync_time_s,
            sync_bytes=sync_bytes,
            optimizer_time_s=end - t_opt,
            bytes_sent=timers.bytes_sent,
            bytes_received=timers.bytes_received,
            group_index=None if pos is None else pos[0],
            stage_index=None if pos is None else pos[1],
            stage=stage,
            batch=0 if group is None else group.batch,
            microbatch_size=0 if group is None else group.microbatch_size,
            num_microbatches=num_mb,
            link_time_s=dict(timers.link_time_s),
            skipped=skipped,
            nonfinite_here=here,
            report=_rows(values[_SUMS_HEAD + num_flags :], self.world_size),
            late=late_sums is not None,
        )
        if late_sums is not None:
            if self._store_sums is not None:
                fetch = self._store_sums.post(self._steps_run, late_sums)
            else:
                work = dist.all_reduce(late_sums, async_op=True)

                def fetch(work=work, sums=late_sums) -> list[float]:
                    work.wait()
                    return sums.tolist()

            self._late = _LateSums(fetch, result, self.world_size, num_flags)
            object.__setattr__(result, "_pending", self._late)
        self._steps_run += 1
        return result
