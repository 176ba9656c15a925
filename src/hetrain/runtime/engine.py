"""The runtime engine: one :class:`Worker` per rank executes any SPEC §7 plan exactly.

Every rank builds the full model from the same seed and passes it to :class:`Worker`, which
keeps only the rank's layers (the others become shape-only ``meta`` modules, materialised when
a plan change moves a layer here). One step = the rank's group runs its pipeline over its rows
of the global batch (1F1B or GPipe, :mod:`hetrain.runtime.stages`), gradients are combined per
layer across the groups (:mod:`hetrain.runtime.data_parallel`), the global gradient norm is
clipped, and the per-layer optimizers step. See ``docs/runtime.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.errors import InputError
from hetrain.plan import Plan
from hetrain.runtime.data_parallel import GradientSync, GroupCache, build_buckets
from hetrain.runtime.emulation import Emulation, sleep_s
from hetrain.runtime.layout import Layout, build_layout
from hetrain.runtime.migrate import plan_transfers, recv_object, send_object
from hetrain.runtime.norm import NormBlocks, batchnorm_modules, check_plan_norm_block
from hetrain.runtime.optim import OptimizerSpec, clip_coefficient, set_lr
from hetrain.runtime.randomness import InvariantRandomness
from hetrain.runtime.stages import P2P, Timers, run_stage, schedule_ops


@dataclass
class StepResult:
    """What one rank measured in one step (seconds and bytes).

    Attributes:
        loss: mean loss over the global batch ``B`` (identical on every rank).
        grad_norm: global L2 norm of the combined gradient before clipping (every layer counted
            once).
        compute_time_s: forward + backward time of this rank's stage over all its
            micro-batches, emulated slow-down included (``emulated_compute_time_s`` of it, the
            time actually slept; ``compute_time_s - emulated_compute_time_s`` is the real
            compute, which the sleeps are ``factor - 1`` times).
        send_recv_time_s: time blocked in pipeline send/recv (emulated link delay included).
        link_time_s: peer device -> time blocked receiving from it.
        sync_time_s: gradient all-reduce/broadcast time; ``sync_bytes`` all-reduced.
        iteration_time_s: wall time of the whole step on this rank.
        group_index / stage_index / stage: this rank's place in the plan (None if unused);
        batch: ``b_g``; microbatch_size: ``μ_g``; num_microbatches: ``n_g``.
    """

    step: int
    rank: int
    device_id: str
    plan_id: int | None
    loss: float
    grad_norm: float
    iteration_time_s: float
    compute_time_s: float
    forward_time_s: float
    backward_time_s: float
    emulated_compute_time_s: float
    send_recv_time_s: float
    sync_time_s: float
    sync_bytes: int
    optimizer_time_s: float
    bytes_sent: int
    bytes_received: int
    group_index: int | None
    stage_index: int | None
    stage: tuple[int, int] | None
    batch: int
    microbatch_size: int
    num_microbatches: int
    link_time_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MigrationResult:
    """What :meth:`Worker.apply_plan` moved: ``transfers`` layer copies in all (every rank),
    of which this rank sent ``bytes_sent`` and received ``bytes_received`` payload bytes
    (parameters, buffers and optimizer state, serialised), in ``time_s`` seconds (emulated
    link time included)."""

    transfers: int
    bytes_sent: int
    bytes_received: int
    time_s: float


def check_exact_layers(layers: nn.Sequential) -> None:
    """Refuse parameters shared by two layers (tied weights cannot live on two stages).
    Dropout and BatchNorm are accepted: :mod:`hetrain.runtime.randomness` makes random draws
    plan-invariant and :mod:`hetrain.runtime.norm` handles BatchNorm (docs/runtime.md).

    Raises:
        ValueError: naming the layer index and the tensor's name.
    """
    owner: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
            first = owner.setdefault(id(tensor), index)
            if first != index:
                raise ValueError(
                    f"layer {index} ({name}) shares a tensor with layer {first}: tied weights "
                    "across layers cannot be split into stages; untie them"
                )


def _plan_digest(plan: Plan) -> str:
    """Hash of what the engine executes (groups, stages, shares, micro-batches, schedule)."""
    body = json.dumps([plan.schedule, [g.model_dump(mode="json") for g in plan.groups]])
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _structure_digest(layers: nn.Sequential) -> str:
    """Hash of the chain's layer count, parameter/buffer names, shapes and dtypes."""
    items = [
        (i, k, tuple(v.shape), str(v.dtype))
        for i, layer in enumerate(layers)
        for k, v in layer.state_dict().items()
    ]
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def _check_agreement(gathered: list[Any], mine: tuple, names: tuple[str, ...]) -> None:
    """Raise the same ``ValueError`` on every rank when the ranks were given different plans
    or models (``gathered[r] = (device_id, digest, ...)``), instead of hanging later."""
    for position, name in enumerate(names, start=1):
        values = {g[position] for g in gathered}
        if len(values) > 1:
            by_rank = ", ".join(f"rank {r} ({g[0]}): {g[position]}" for r, g in enumerate(gathered))
            raise ValueError(
                f"ranks were given different {name}s ({by_rank}); every rank "
                f"must pass the same {name}"
            )


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Worker:
    """One rank of a hybrid data/pipeline-parallel run (SPEC §1, §5).

    Args:
        layers: the full model chain (``nn.Sequential`` or a list of modules, layer ``l`` =
            child ``l``), built identically (same seed) on every rank; the worker takes it over
            (converts it to ``dtype``; layers it does not hold become ``meta``).
        plan: the SPEC §7 plan; it must name every rank's device exactly once.
        device_id: this rank's device id in the plan (all ranks exchange theirs).
        loss_fn: ``(output, target) -> scalar``, the mean over the micro-batch's samples (e.g.
            ``F.cross_entropy``); the engine scales it by ``rows / B``.
        optimizer: :class:`OptimizerSpec`, built per layer.
        schedule: ``"1f1b"`` or ``"gpipe"``; None = the plan's ``schedule``.
        emulation: slow-down and link emulation (settable later via :attr:`emulation`).
        dtype: parameter dtype; floating inputs are cast to it.
        grad_clip_norm: clip the global gradient L2 norm to this (None = no clipping).
        autocast_bf16: run forward passes under ``torch.autocast(dtype=bfloat16)``.
        device: torch device of this rank (default: CPU for gloo, the current CUDA device for
            NCCL).
        allow_unused_ranks: accept ranks whose device the plan does not name (e.g. a device
            that joins later); they hold nothing until a plan uses them. Default False: the
            plan must name every rank (world size = the plan's device count).
        bucket_cap_bytes: largest gradient bucket all-reduced at once (a bucket of
            consecutive layers with the same owners is split at layer boundaries above it).
        overlap_grad_sync: start a bucket's all-reduce during the stage's last backward as
            soon as its gradients are final (same arithmetic; False = after the backward).
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
        ValueError: tied layers (:func:`check_exact_layers`), bad options.
    """

    def __init__(
        self,
        layers: nn.Sequential | Sequence[nn.Module],
        plan: Plan,
        device_id: str,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
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
        if not isinstance(layers, nn.Sequential):
            layers = nn.Sequential(*layers)
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
        mine = (str(device_id), _plan_digest(plan), _structure_digest(layers))
        dist.all_gather_object(gathered, mine)
        _check_agreement(gathered, mine, ("plan", "model structure"))
        gathered = [g[0] for g in gathered]
        self.device_id = str(device_id)
        check_exact_layers(layers)
        if bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes: expected > 0, got {bucket_cap_bytes}")
        self.bucket_cap_bytes = int(bucket_cap_bytes)
        self.overlap_grad_sync = bool(overlap_grad_sync)
        self.layout: Layout = build_layout(
            plan, tuple(gathered), len(layers), require_all=not allow_unused_ranks
        )
        # --- plan-invariant randomness and BatchNorm (randomness.py, norm.py) ---
        self.exact = bool(exact)
        self.randomness = InvariantRandomness(layers, seed=seed, exact=exact)
        self.norm = NormBlocks(layers, norm_block)
        self._norm_layers = [i for i, layer in enumerate(layers) if batchnorm_modules(layer)]
        self._random_reported = False
        _check_norm_plan(self.layout, norm_block)
        static = self.randomness.static_problems()
        if static and self.exact:
            raise InputError("model", "random op", f"{static[0]} (--exact)")
        if self.rank == 0:
            for line in static[:1] + [self.norm.startup_message() or ""]:
                if line:
                    print(f"hetrain: warning: {line}", file=sys.stderr, flush=True)
        self.layers = layers.to(dtype=dtype)
        self.dtype = dtype
        self.loss_fn = loss_fn
        self.optimizer_spec = optimizer
        self._schedule = schedule
        self.emulation = emulation
        self.grad_clip_norm = grad_clip_norm
        self.autocast_dtype = torch.bfloat16 if autocast_bf16 else None
        owned = set(self.owned_layers)
        self.optimizers: dict[int, torch.optim.Optimizer | None] = {}
        for index, layer in enumerate(self.layers):
            if index in owned:
                layer.to(self.device)
                self.optimizers[index] = self._build_optimizer(layer)
            else:
                layer.to("meta")
        self._groups = GroupCache()
        self._layer_bytes = [
            sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in self.layers
        ]
        self._buckets = build_buckets(self.layout, self._layer_bytes, self.bucket_cap_bytes)
        self._groups.ensure(self._buckets)
        self._channels = self._groups.pipeline_channels(self.layout)
        self._norm_sets = self._norm_owner_sets()

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
            modules = [self.layers[i] for i in indices]
            flat = self.norm.step_tensor(modules, active=active).to(self.device)
            if len(ranks) > 1:
                dist.all_reduce(flat, group=self._groups.get(ranks, "norm"))
            self.norm.apply_step(modules, flat)

    def _forward_context(self, offset: int, step: int) -> Callable[[int, int], Any]:
        """Per micro-batch forward context: rows ``[offset + start, offset + end)`` of the
        global batch at iteration ``step`` (plan-invariant randomness, ghost BatchNorm)."""

        def enter(start: int, end: int) -> contextlib.ExitStack:
            rows = torch.arange(offset + start, offset + end, dtype=torch.int64)
            stack = contextlib.ExitStack()
            stack.enter_context(self.randomness.forward(step=step, sample_index=rows))
            stack.enter_context(self.norm.forward())
            return stack

        return enter

    def _build_optimizer(self, layer: nn.Module) -> torch.optim.Optimizer | None:
        """The layer's own optimizer (None for a layer without parameters)."""
        params = list(layer.parameters())
        return self.optimizer_spec.build(params) if params else None

    # ----------------------------------------------------------------------------- properties
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
    def step(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> StepResult:
        """Train one iteration on the global batch.

        Args:
            inputs: the whole global batch ``(B, ...)``, identical on every rank; group ``g``
                uses rows ``[offset_g, offset_g + b_g)`` (groups in plan order).
            targets: ``(B, ...)`` targets for ``loss_fn``, identical on every rank.
            step: iteration index (drives the learning-rate schedule).

        Raises:
            ValueError: ``inputs``/``targets`` with a first dimension other than ``B``.
        """
        t_start = time.perf_counter()
        batch = self.layout.global_batch
        if inputs.shape[0] != batch or targets.shape[0] != batch:
            raise ValueError(
                f"inputs/targets: expected the global batch of {batch} rows, got "
                f"{inputs.shape[0]} and {targets.shape[0]}"
            )
        for index in self.owned_layers:
            for p in self.layers[index].parameters():
                p.grad = None
        timers = Timers()
        p2p = P2P(
            self.device, self.layout.devices, self.rank, timers, self.emulation, self._channels
        )
        grad_sync = GradientSync(
            layout=self.layout,
            buckets=self._buckets,
            groups=self._groups,
            rank=self.rank,
            layers=self.layers,
            device=self.device,
            emulation=self.emulation,
        )
        pos = self.layout.position(self.rank)
        loss_part = torch.zeros((), dtype=torch.float64, device=self.device)
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
                x = y = None
                if k == 0:
                    x = inputs[rows].to(self.device)
                    if x.is_floating_point():
                        x = x.to(self.dtype)
                if k == len(group.ranks) - 1:
                    y = targets[rows].to(self.device)
                try:
                    loss_part = run_stage(
                        stage_module=self.layers[stage[0] : stage[1]],
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
                        before_last_backward=grad_sync.arm if self.overlap_grad_sync else None,
                        forward_context=self._forward_context(group.offset, step),
                    )
                except BaseException:
                    grad_sync.disarm()  # no stale hooks if the step fails
                    raise
        p2p.wait_sends()
        sync_time_s, sync_bytes = grad_sync.finish()
        self._sync_norm_stats(group is not None and group.active)
        t_opt = time.perf_counter()
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for index in self.owned_layers:
            if self.layout.canonical[index] == self.rank:
                for p in self.layers[index].parameters():
                    if p.grad is not None:
                        sq += p.grad.detach().to(torch.float64).pow(2).sum()
        random_problem = float(bool(self.randomness.problems) and not self._random_reported)
        flag = torch.tensor(random_problem, dtype=torch.float64, device=self.device)
        reduced = torch.stack([loss_part, sq, flag])
        dist.all_reduce(reduced)
        loss, sqnorm, random_problems = reduced.tolist()
        if random_problems > 0:
            self._report_random_problems()
        grad_norm = math.sqrt(sqnorm)
        coef = clip_coefficient(grad_norm, self.grad_clip_norm)
        lr = self.optimizer_spec.lr_at(step)
        for index, opt in self.optimizers.items():
            if opt is None:
                continue
            if self.grad_clip_norm is not None:
                for p in self.layers[index].parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
            set_lr(opt, lr)
            opt.step()
        end = time.perf_counter()
        return StepResult(
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
        )

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

    # ----------------------------------------------------------------------------- plan change
    def apply_plan(self, plan: Plan) -> MigrationResult:
        """Switch to ``plan`` between steps (collective: call on every rank with the same plan).

        Layers move with their parameters, buffers and optimizer state from an old owner to
        each new owner; layers no longer held are released. The new plan may leave ranks out
        (they hold nothing and only join the collectives) but must use only known devices.

        Raises:
            InputError: the plan names unknown devices or does not cover the layers.
        """
        t0 = time.perf_counter()
        digests: list[Any] = [None] * self.world_size
        dist.all_gather_object(digests, (self.device_id, _plan_digest(plan)))
        _check_agreement(digests, (self.device_id, _plan_digest(plan)), ("plan",))
        new = build_layout(plan, self.layout.devices, self.layout.num_layers, require_all=False)
        _check_norm_plan(new, self.norm.norm_block)
        old = self.layout
        transfers = plan_transfers(old, new)
        sent = received = 0
        for t in transfers:
            if t.src == self.rank:
                payload = {
                    "module": self.layers[t.layer].state_dict(),
                    # non-persistent buffers (e.g. attention masks) are not in state_dict
                    "buffers": dict(self.layers[t.layer].named_buffers()),
                    "optim": None if (o := self.optimizers[t.layer]) is None else o.state_dict(),
                }
                sent += send_object(payload, t.dst, self.device)
            elif t.dst == self.rank:
                t_recv = time.perf_counter()
                payload, nbytes = recv_object(t.src, self.device)
                received += nbytes
                if self.emulation is not None and self.emulation.limits_links():
                    link = (self.layout.devices[t.src], self.device_id)
                    duration = self.emulation.transfer_time_s(*link, nbytes)
                    sleep_s(duration - (time.perf_counter() - t_recv))
                layer = self.layers[t.layer].to_empty(device=self.device)
                layer.load_state_dict(payload["module"])
                with torch.no_grad():
                    for name, buf in layer.named_buffers():
                        buf.copy_(payload["buffers"][name])
                opt = self._build_optimizer(layer)
                if opt is not None:
                    opt.load_state_dict(payload["optim"])
                self.optimizers[t.layer] = opt
        now_owned = set(new.owned_layers(self.rank))
        for index in old.owned_layers(self.rank):
            if index not in now_owned:
                self.layers[index].to("meta")
                del self.optimizers[index]
        self.layout = new
        self._buckets = build_buckets(new, self._layer_bytes, self.bucket_cap_bytes)
        self._groups.ensure(self._buckets)
        self._channels = self._groups.pipeline_channels(new)
        self._norm_sets = self._norm_owner_sets()
        return MigrationResult(len(transfers), sent, received, time.perf_counter() - t0)

    # ----------------------------------------------------------------------------- state
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gather the whole model on rank 0 (collective): a plain ``state_dict`` with the keys of
        the original ``nn.Sequential`` (``"{layer}.{name}"``), CPU tensors in the worker's
        dtype; loads into the original module without hetrain. None on other ranks."""
        out: dict[str, torch.Tensor] = {}
        for index in range(self.layout.num_layers):
            src = self.layout.canonical[index]
            if src == self.rank and self.rank == 0:
                sd = {
                    k: v.detach().cpu().clone() for k, v in self.layers[index].state_dict().items()
                }
            elif src == self.rank:
                send_object(self.layers[index].state_dict(), 0, self.device)
                continue
            elif self.rank == 0:
                sd, _ = recv_object(src, self.device)
            else:
                continue
            out.update({f"{index}.{k}": v for k, v in sd.items()})
        return out if self.rank == 0 else None

    def layer_state_dict(self, *, replicas: bool = False) -> dict[str, torch.Tensor]:
        """This rank's layers as flat tensors for checkpoints: ``"layers.{l}.{name}"`` (module
        state) and ``"optim.{l}.{param}.{state}"`` (optimizer state, e.g. ``exp_avg``, ``step``,
        ``momentum_buffer``; absent before the first step).

        Args:
            replicas: False (default): only layers whose canonical owner is this rank (each
                layer once across the world, for saving); True: every layer held here (a
                template for loading under this plan).
        """
        out: dict[str, torch.Tensor] = {}
        for index in self.owned_layers:
            if not replicas and self.layout.canonical[index] != self.rank:
                continue
            layer = self.layers[index]
            for k, v in layer.state_dict().items():
                out[f"layers.{index}.{k}"] = v
            opt = self.optimizers[index]
            if opt is None:
                continue
            names = [n for n, _ in layer.named_parameters()]
            state = opt.state_dict()["state"]
            for pidx, pstate in state.items():
                for key, value in pstate.items():
                    if isinstance(value, torch.Tensor):
                        out[f"optim.{index}.{names[pidx]}.{key}"] = value
        return out

    def load_layer_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load this rank's layers (and their optimizer state when present) from a dict in the
        :meth:`layer_state_dict` format; entries of other layers are ignored.

        Raises:
            KeyError: a held layer's module state is missing.
        """
        for index in self.owned_layers:
            layer = self.layers[index]
            prefix = f"layers.{index}."
            sd = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
            missing = set(layer.state_dict()) - set(sd)
            if missing:
                raise KeyError(f"layer_state_dict: layer {index} lacks {sorted(missing)}")
            layer.load_state_dict(sd)
            names = {n: i for i, (n, _) in enumerate(layer.named_parameters())}
            oprefix = f"optim.{index}."
            ostate: dict[int, dict[str, torch.Tensor]] = {}
            for k, v in state_dict.items():
                if k.startswith(oprefix):
                    pname, key = k[len(oprefix) :].rsplit(".", 1)
                    ostate.setdefault(names[pname], {})[key] = v
            opt = self._build_optimizer(layer)
            if ostate and opt is not None:
                groups = opt.state_dict()["param_groups"]
                opt.load_state_dict({"state": ostate, "param_groups": groups})
            self.optimizers[index] = opt


def _check_norm_plan(layout: Layout, norm_block: int | None) -> None:
    """InputError (every rank) if a group's share or micro-batch size is not a multiple of the
    norm block (:func:`hetrain.runtime.norm.check_plan_norm_block`)."""
    groups = [(g.index, g.batch, g.microbatch_size) for g in layout.groups]
    check_plan_norm_block(groups, norm_block)


def gather_measurements(result: StepResult) -> list[dict[str, Any]]:
    """All-gather every rank's :class:`StepResult` (collective); returns one dict per rank
    (index = rank) on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, result.to_dict())
    return out
