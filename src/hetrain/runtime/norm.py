"""BatchNorm under any plan: ghost batch norm with a norm block ``G`` (docs/runtime.md
"BatchNorm"; docs/model.md §5 "BatchNorm").

With ``G``: in training, every ``torch.nn.modules.batchnorm._BatchNorm`` normalises each aligned
block of ``G`` consecutive samples of the global batch with that block's statistics (Hoffer,
Hubara, Soudry, *Train longer, generalize better*, NeurIPS 2017, "ghost batch norm"); since
every share ``b_g`` and micro-batch size ``μ_g`` is a multiple of ``G`` (checked by
:func:`check_plan_norm_block`), a micro-batch always holds whole blocks and the outputs do not
depend on the plan. Running statistics are updated ONCE per step from the pooled statistics of
all blocks of the global batch:

    mean = Σ_b Σ_i x / M,   var = Σ_b Σ_i (x - mean_b)^2 / (M - #blocks)   (pooled within-block,
    unbiased; M = elements per channel in the global batch), then
    running = (1 - m) running + m stat   (m = momentum, or 1/num_batches_tracked if None)

which for ``G = B`` is exactly torch's BatchNorm on the whole batch. In eval mode the running
statistics are used as usual. Without ``G``: torch's BatchNorm per micro-batch (as GPipe), and
the running statistics (and ``num_batches_tracked``) are averaged over the replicas of the layer
in active groups every step; results then depend on the plan.

Interface (the engine's side):

    norm = NormBlocks(model, norm_block=G)              # G None: per micro-batch
    norm.startup_message()                               # None, or one line for the user
    check_plan_norm_block(groups, G)                     # InputError naming the group
    with norm.forward():                                 # around ONE micro-batch forward
        y = stage(x)
    t = norm.step_tensor(modules, active=group_active)   # float64, SUM-all-reduce it among the
    dist.all_reduce(t, group=owners_of_those_modules)    # owners (all groups, idle included)
    norm.apply_step(modules, t)                          # running stats updated once
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hetrain.errors import InputError


def batchnorm_modules(module: nn.Module) -> list[_BatchNorm]:
    """Every BatchNorm (``_BatchNorm`` subclass) inside ``module``, in ``modules()`` order."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm)]


def check_plan_norm_block(groups: Iterable[tuple[int, int, int]], norm_block: int | None) -> None:
    """Runtime check of a plan against the norm block ``G``.

    Args:
        groups: ``(group index, b_g, μ_g)`` per group of the plan.
        norm_block: ``G`` (None: nothing to check).

    Raises:
        InputError: an active group whose share or micro-batch size is not a multiple of ``G``
            (``plan: groups[i]: ...``).
    """
    if norm_block is None:
        return
    for index, batch, microbatch in groups:
        if batch > 0 and (batch % norm_block or microbatch % norm_block):
            raise InputError(
                "plan",
                f"groups[{index}]",
                f"share {batch} and micro-batch size {microbatch} must be multiples of the "
                f"norm block {norm_block} (--norm-block)",
            )


class NormBlocks:
    """BatchNorm statistics of one model under any plan (see the module docstring).

    Args:
        model: the model (or a list of its layers); only its BatchNorm modules matter.
        norm_block: ``G`` >= 1, or None for per-micro-batch statistics.

    Raises:
        InputError: ``norm_block`` < 1.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], norm_block: int | None) -> None:
        if norm_block is not None and (int(norm_block) != norm_block or norm_block < 1):
            raise InputError("--norm-block", "", f"expected an integer >= 1, got {norm_block}")
        root = model if isinstance(model, nn.Module) else nn.ModuleList(list(model))
        self.norm_block = None if norm_block is None else int(norm_block)
        self.modules = batchnorm_modules(root)
        self._paths = {id(m): n for n, m in root.named_modules() if isinstance(m, _BatchNorm)}
        # per BatchNorm (id): [Σx (C,), Σ within-block (x - mean_b)^2 (C,), M, #blocks]
        self._acc: dict[int, list[torch.Tensor]] = {}

    @property
    def has_batchnorm(self) -> bool:
        return bool(self.modules)

    def startup_message(self) -> str | None:
        """The one-line notice for a model with BatchNorm and no norm block (else None)."""
        if not self.modules or self.norm_block is not None:
            return None
        return (
            f"the model has {len(self.modules)} BatchNorm layer(s) and no --norm-block: batch "
            "statistics are per micro-batch, so training results depend on the plan "
            "(give --norm-block G for plan-independent ghost batch norm)"
        )

    # ----------------------------------------------------------------------------- forward
    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Context for one micro-batch forward: with a norm block, BatchNorm modules in
        training mode run ghost batch norm and accumulate their block statistics."""
        if self.norm_block is None or not self.modules:
            yield
            return
        patched = []
        for m in self.modules:
            if m.training or not m.track_running_stats:
                m.forward = _GhostForward(self, m)  # instance attribute shadows the class's
                patched.append(m)
        try:
            yield
        finally:
            for m in patched:
                del m.forward

    def _ghost(self, m: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
        g = self.norm_block
        assert g is not None
        m._check_input_dim(x)
        n = x.shape[0]
        if n % g:
            raise InputError(
                "model",
                self._paths.get(id(m), type(m).__name__),
                f"a micro-batch of {n} rows is not a multiple of the norm block {g}",
            )
        c = x.shape[1]
        xb = x.reshape(n // g, g, c, -1)
        per_block = g * xb.shape[-1]
        if per_block < 2:
            raise InputError(
                "--norm-block",
                "",
                f"{g}: BatchNorm needs more than 1 value per channel in a block",
            )
        mean = xb.mean(dim=(1, 3))  # (blocks, C)
        centred = xb - mean[:, None, :, None]
        sq = centred.square().sum(dim=(1, 3))  # (blocks, C)
        var = sq / per_block
        y = centred * torch.rsqrt(var + m.eps)[:, None, :, None]
        if m.affine:
            y = y * m.weight[None, None, :, None] + m.bias[None, None, :, None]
        # (meta: a layer before this rank's stage replayed for shapes, cutting.py)
        if m.training and m.track_running_stats and x.device.type != "meta":
            with torch.no_grad():
                s1 = (mean.detach() * per_block).sum(0).to(torch.float64)
                ss = sq.detach().sum(0).to(torch.float64)
                extra = torch.tensor(
                    [per_block * (n // g), n // g], dtype=torch.float64, device=x.device
                )
                acc = self._acc.get(id(m))
                if acc is None:
                    self._acc[id(m)] = [s1, ss, extra]
                else:
                    acc[0] += s1
                    acc[1] += ss
                    acc[2] += extra
        return y.reshape(x.shape)

    # ----------------------------------------------------------------------------- step end
    def step_tensor(self, modules: Sequence[nn.Module], *, active: bool) -> torch.Tensor:
        """Flat float64 tensor to SUM-all-reduce among all owners of ``modules`` (the layers of
        one owner set, every group, idle ones included), then pass to :meth:`apply_step`.

        With a norm block: ``[Σx, Σ(x - mean_b)^2, M, #blocks]`` per tracked BatchNorm (zeros
        when this rank ran no forward). Without: ``[w·running_mean, w·running_var,
        w·num_batches_tracked, w]`` with ``w = 1`` if ``active`` (the rank's group ran the
        step) else 0, i.e. the average over the active replicas.
        """
        parts: list[torch.Tensor] = []
        for m in self._tracked(modules):
            device = m.running_mean.device
            if self.norm_block is not None:
                acc = self._acc.get(id(m))
                if acc is None:
                    c = m.running_mean.numel()
                    parts.append(torch.zeros(2 * c + 2, dtype=torch.float64, device=device))
                else:
                    parts.extend(acc)
            else:
                w = 1.0 if active else 0.0
                parts += [
                    m.running_mean.detach().to(torch.float64) * w,
                    m.running_var.detach().to(torch.float64) * w,
                    torch.tensor(
                        [float(m.num_batches_tracked) * w, w], dtype=torch.float64, device=device
                    ),
                ]
        if not parts:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([p.reshape(-1) for p in parts])

    def apply_step(self, modules: Sequence[nn.Module], reduced: torch.Tensor) -> None:
        """Update the running statistics of ``modules`` from the all-reduced
        :meth:`step_tensor` (once per step), and clear this step's block statistics."""
        offset = 0
        with torch.no_grad():
            for m in self._tracked(modules):
                c = m.running_mean.numel()
                s1 = reduced[offset : offset + c]
                s2 = reduced[offset + c : offset + 2 * c]
                a, b = reduced[offset + 2 * c : offset + 2 * c + 2].tolist()
                offset += 2 * c + 2
                self._acc.pop(id(m), None)
                if self.norm_block is None:
                    if b > 0:
                        m.running_mean.copy_(s1 / b)
                        m.running_var.copy_(s2 / b)
                        m.num_batches_tracked.fill_(round(a / b))
                    continue
                count, blocks = a, b
                if count <= 0:
                    continue
                mean = s1 / count
                var = s2 / (count - blocks)
                m.num_batches_tracked.add_(1)
                if m.momentum is None:
                    factor = 1.0 / float(m.num_batches_tracked)
                else:
                    factor = float(m.momentum)
                m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype) * factor)
                m.running_var.mul_(1 - factor).add_(var.to(m.running_var.dtype) * factor)

    @staticmethod
    def _tracked(modules: Sequence[nn.Module]) -> list[_BatchNorm]:
        out = []
        for module in modules:
            out += [m for m in batchnorm_modules(module) if m.track_running_stats]
        return out


class _GhostForward:
    """Bound replacement of one BatchNorm's ``forward`` inside :meth:`NormBlocks.forward`."""

    def __init__(self, owner: NormBlocks, module: _BatchNorm) -> None:
        self.owner = owner
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner._ghost(self.module, x)
