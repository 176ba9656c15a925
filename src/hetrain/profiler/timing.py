"""Wall-clock timing of each layer's forward and backward on this device, of stages (chains of
consecutive layers) of several lengths, and fits of the device's speed ``s``, per-micro-batch
cost ``κ`` and per-layer cost ``λ`` (docs/model.md §3) from them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from hetrain.calibration import SpeedFit, StageOverheadFit, fit_speed_kappa, fit_stage_overheads
from hetrain.profile import ModelProfile

if TYPE_CHECKING:
    from hetrain.runtime.cutting import Chain


@dataclass(frozen=True)
class LayerTimes:
    """Median times, shape ``(len(microbatch_sizes), L)``, seconds per micro-batch."""

    microbatch_sizes: tuple[int, ...]
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    threads: int

    @property
    def train_s(self) -> np.ndarray:
        """Forward + backward, shape ``(len(microbatch_sizes), L)``."""
        return self.fwd_s + self.bwd_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layers(
    model: nn.Sequential | Chain,
    make_input: Callable[[int], Any],
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    *,
    warmup: int = 2,
    repeats: int = 5,
    threads: int | None = 1,
    progress: Callable[[int], None] | None = None,
    before_pass: Callable[[], None] | None = None,
) -> LayerTimes:
    """Time every layer's forward and backward, per micro-batch size: ``warmup`` untimed
    rounds, then the median of ``repeats`` timed ones (a round = one pass per size, sizes
    interleaved so that they see the same background load) (``time.perf_counter``; CUDA is
    synchronised around each layer).

    ``model`` is an ``nn.Sequential`` (layer ``l`` = child ``l``) or a
    :class:`~hetrain.runtime.cutting.Chain` of any module (layer ``l`` runs as the stage
    ``[l, l + 1)``, as in training); ``make_input(n)`` returns the model's inputs for ``n``
    samples (a tensor or a pytree). A pass runs the layers in order, each on the detached
    output of the previous one (input gradients on for floating-point tensors, as inside a
    pipeline), then the backward of each layer in reverse order with the gradient the next
    layer produced (ones for the last). ``threads`` sets ``torch.set_num_threads`` for the
    measurement (1 = what one local rank gets) and restores it afterwards.
    ``progress(samples)`` is called after every pass with its micro-batch size (a progress
    bar whose remaining time follows the work done). ``before_pass()`` is called before every
    pass (the runtime's start-up calibration puts a barrier there, so that all ranks time
    their layers at once, as they compute in training).

    Raises:
        ValueError: empty ``microbatch_sizes``, a size < 1, ``repeats < 1`` or ``warmup < 0``.
    """
    if not microbatch_sizes or min(microbatch_sizes) < 1:
        raise ValueError("time_layers: expected micro-batch sizes >= 1")
    if repeats < 1 or warmup < 0:
        raise ValueError("time_layers: expected repeats >= 1 and warmup >= 0")
    chain = _as_chain(model)
    stages = [(a, a + 1) for a in range(chain.num_layers)]
    device = _device_of(chain)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        fwd = np.zeros((len(microbatch_sizes), len(stages)))
        bwd = np.zeros_like(fwd)
        runs_f = [[[] for _ in stages] for _ in microbatch_sizes]
        runs_b = [[[] for _ in stages] for _ in microbatch_sizes]
        # sizes interleaved within each repeat: on a shared machine all sizes see the same load
        for rep in range(warmup + repeats):
            for i, mu in enumerate(microbatch_sizes):
                inputs = make_input(mu)
                if before_pass is not None:
                    before_pass()
                f_s, b_s = _one_pass(chain, stages, inputs, device)
                if progress is not None:
                    progress(int(mu))
                if rep >= warmup:
                    for l_idx in range(len(stages)):
                        runs_f[i][l_idx].append(f_s[l_idx])
                        runs_b[i][l_idx].append(b_s[l_idx])
        for i in range(len(microbatch_sizes)):
            fwd[i] = [statistics.median(r) for r in runs_f[i]]
            bwd[i] = [statistics.median(r) for r in runs_b[i]]
        chain.module.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(old_threads)
    used = threads or old_threads
    return LayerTimes(tuple(int(m) for m in microbatch_sizes), fwd, bwd, used)


def _as_chain(model: Any) -> Chain:
    from hetrain.runtime.cutting import Chain, cut_module

    return model if isinstance(model, Chain) else cut_module(model)


def _device_of(chain: Chain) -> torch.device:
    first = next(iter(chain.tensors.values()), None)
    return first.device if first is not None else torch.device("cpu")


def _float_leaves(obj: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    flat = tree_flatten(obj)[0]
    return [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _one_pass(
    chain: Chain, stages: Sequence[tuple[int, int]], inputs: Any, device: torch.device
) -> tuple[list[float], list[float]]:
    """Forward then backward of the consecutive ``stages`` ``[a, b)`` of ``chain`` on one
    micro-batch ``inputs``, each timed (seconds)."""
    from hetrain.profiler.chain import _detach_for_next

    f_s, b_s = [0.0] * len(stages), [0.0] * len(stages)
    ins: list[Any] = []
    outs: list[Any] = []
    x: Any = None
    for idx, (a, b) in enumerate(stages):
        xin = None if idx == 0 else _detach_for_next(x, requires_grad=True)
        _sync(device)
        t0 = time.perf_counter()
        y = chain.stage_forward(a, b, xin, inputs)
        _sync(device)
        f_s[idx] = time.perf_counter() - t0
        ins.append(xin)
        outs.append(y)
        x = y
    last = len(stages) - 1
    for idx in range(last, -1, -1):
        out = _float_leaves(outs[idx])
        if idx == last:
            pairs = [(t, torch.ones_like(t)) for t in out if t.requires_grad]
        else:
            received = _float_leaves(ins[idx + 1])
            pairs = [
                (t, r.grad)
                for t, r in zip(out, received, strict=True)
                if t.requires_grad and r.grad is not None
            ]
        _sync(device)
        t0 = time.perf_counter()
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        _sync(device)
        b_s[idx] = time.perf_counter() - t0
    return f_s, b_s


@dataclass(frozen=True)
class DeviceFit:
    """Speed and κ of this device for one model: ``chain`` fits the whole chain's time per
    micro-batch (the docs/model.md §3 stage = all layers), ``per_layer`` fits every (layer, μ) point
    with one shared speed and intercept (the overhead of a one-layer stage)."""

    chain: SpeedFit
    per_layer: SpeedFit
    layer_speed_flops: tuple[float, ...]


def fit_device(profile: ModelProfile, times: LayerTimes) -> DeviceFit:
    """Fit ``t = μ·F/s + κ`` (:func:`hetrain.calibration.fit_speed_kappa`) on measured layer
    times: the chain (``F = Σ_l (f_l + w_l)``, ``t = Σ_l t_l``) and all layers jointly; also
    each layer's own effective speed ``μ_max (f_l + w_l) / t_l`` at the largest μ (0 for
    layers without FLOPs).

    Raises:
        ValueError: as :func:`fit_speed_kappa` (e.g. fewer than 2 micro-batch sizes).
    """
    arrays = profile.arrays()
    flops = arrays.train_flops
    mus = np.array(times.microbatch_sizes, dtype=float)
    chain = fit_speed_kappa(mus, float(flops.sum()), times.train_s.sum(axis=1))
    mask = flops > 0
    mu_grid = np.repeat(mus[:, None], flops.size, axis=1)[:, mask]
    per_layer = fit_speed_kappa(
        mu_grid.ravel(),
        np.broadcast_to(flops[mask], mu_grid.shape).ravel(),
        times.train_s[:, mask].ravel(),
    )
    last = times.train_s[-1]
    layer_speed = tuple(
        float(mus[-1] * f / t) if f > 0 else 0.0 for f, t in zip(flops, last, strict=True)
    )
    return DeviceFit(chain=chain, per_layer=per_layer, layer_speed_flops=layer_speed)


@dataclass(frozen=True)
class StageTimes:
    """Median forward + backward time of every stage ``[start, end)`` of every tiling,
    ``train_s`` shape ``(len(microbatch_sizes), len(stages))``, seconds per micro-batch."""

    microbatch_sizes: tuple[int, ...]
    stages: tuple[tuple[int, int], ...]
    train_s: np.ndarray
    threads: int


def default_stage_lengths(num_layers: int) -> tuple[int, ...]:
    """Lengths of the chains :func:`time_stages` times by default: 1, 2, ``⌈L/2⌉`` and ``L``
    layers (those ``<= L``, distinct)."""
    return tuple(sorted({n for n in (1, 2, -(-num_layers // 2), num_layers) if n <= num_layers}))


def time_stages(
    model: nn.Sequential | Chain,
    make_input: Callable[[int], Any],
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    lengths: Sequence[int] | None = None,
    *,
    warmup: int = 2,
    repeats: int = 5,
    threads: int | None = 1,
    progress: Callable[[int], None] | None = None,
) -> StageTimes:
    """Time stages (chains of consecutive layers) of several lengths, each stage's forward and
    backward as one unit as a pipeline stage runs them: for each length ``n`` in ``lengths``
    (default :func:`default_stage_lengths`) the chain is cut into consecutive stages of ``n``
    layers (the last one shorter when ``n`` does not divide ``L``) and a pass runs them in
    order as :func:`time_layers` runs single layers (``model`` and ``make_input`` as there).
    ``warmup`` untimed rounds, then the median of ``repeats`` (a round = one pass per size and
    length, interleaved); ``progress(samples)`` after every pass, as in :func:`time_layers`.

    The times feed :func:`fit_device`'s ``stages`` fit of ``t = μ F / s + κ + λ |S|``: the
    overhead that grows with the layers of a stage (``λ``) is told from the one per stage
    (``κ``) by the different lengths.

    Raises:
        ValueError: empty ``microbatch_sizes``, a size < 1, a length outside ``1..L``,
            ``repeats < 1`` or ``warmup < 0``.
    """
    if not microbatch_sizes or min(microbatch_sizes) < 1:
        raise ValueError("time_stages: expected micro-batch sizes >= 1")
    if repeats < 1 or warmup < 0:
        raise ValueError("time_stages: expected repeats >= 1 and warmup >= 0")
    chain = _as_chain(model)
    num_layers = chain.num_layers
    lengths = tuple(lengths) if lengths is not None else default_stage_lengths(num_layers)
    if not lengths or min(lengths) < 1 or max(lengths) > num_layers:
        raise ValueError(f"time_stages: expected stage lengths in 1..{num_layers}, got {lengths}")
    tilings = [
        [(a, min(a + n, num_layers)) for a in range(0, num_layers, n)] for n in sorted(set(lengths))
    ]
    stages = tuple(st for tiling in tilings for st in tiling)
    device = _device_of(chain)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        runs = [[[] for _ in stages] for _ in microbatch_sizes]
        for rep in range(warmup + repeats):
            for i, mu in enumerate(microbatch_sizes):
                col = 0
                for tiling in tilings:
                    f_s, b_s = _one_pass(chain, tiling, make_input(mu), device)
                    if progress is not None:
                        progress(int(mu))
                    if rep >= warmup:
                        for j in range(len(tiling)):
                            runs[i][col + j].append(f_s[j] + b_s[j])
                    col += len(tiling)
        train = np.array([[statistics.median(r) for r in row] for row in runs])
        chain.module.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(old_threads)
    used = threads or old_threads
    return StageTimes(tuple(int(m) for m in microbatch_sizes), stages, train, used)


def fit_stages(
    profile: ModelProfile, times: StageTimes, layer_times: LayerTimes | None = None
) -> StageOverheadFit:
    """Fit ``t = μ F / s + κ + λ |S|`` (docs/model.md §3,
    :func:`hetrain.calibration.fit_stage_overheads`) to :func:`time_stages`' times, and to
    :func:`time_layers`' one-layer stages when given (forward + backward, their own sizes):
    one point per (micro-batch size, stage), ``F = Σ_{l∈S} (f_l + w_l)`` and ``|S|`` the stage's
    layer units ``Σ_{l∈S} ν_l`` (the profile's per-layer overhead weights, docs/model.md §3).

    Raises:
        ValueError: as :func:`fit_stage_overheads` (e.g. stages of one length only).
    """
    arrays = profile.arrays()
    flops = np.concatenate(([0.0], np.cumsum(arrays.train_flops)))
    mus, fl, n, t = [], [], [], []
    sources = [(times.microbatch_sizes, times.stages, times.train_s)]
    if layer_times is not None:
        num_layers = layer_times.train_s.shape[1]
        singles = tuple((a, a + 1) for a in range(num_layers))
        sources.append((layer_times.microbatch_sizes, singles, layer_times.train_s))
    for sizes, stages, train_s in sources:
        for i, mu in enumerate(sizes):
            for j, (a, b) in enumerate(stages):
                mus.append(mu)
                fl.append(flops[b] - flops[a])
                n.append(arrays.layer_units(a, b))
                t.append(train_s[i, j])
    return fit_stage_overheads(mus, fl, n, t)
