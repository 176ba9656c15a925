"""Wall-clock timing of each layer's forward and backward on this device, of stages (chains of
consecutive layers) of several lengths, and fits of the device's speed ``s``, per-micro-batch
cost ``κ`` and per-layer cost ``λ`` (docs/model.md §3) from them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hetrain.calibration import SpeedFit, StageOverheadFit, fit_speed_kappa, fit_stage_overheads
from hetrain.profile import ModelProfile


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
    model: nn.Sequential,
    make_input: Callable[[int], torch.Tensor],
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    *,
    warmup: int = 2,
    repeats: int = 5,
    threads: int | None = 1,
    progress: Callable[[int, int], None] | None = None,
) -> LayerTimes:
    """Time every layer's forward and backward, per micro-batch size: ``warmup`` untimed
    rounds, then the median of ``repeats`` timed ones (a round = one pass per size, sizes
    interleaved so that they see the same background load) (``time.perf_counter``; CUDA is
    synchronised around each layer).

    A pass runs the layers in order, each on the detached output of the previous one (input
    gradients on, as inside a pipeline), then the backward of each layer in reverse order with
    the gradient the next layer produced (ones for the last). ``threads`` sets
    ``torch.set_num_threads`` for the measurement (1 = what one local rank gets) and restores
    it afterwards. ``progress(done, total)`` is called after every pass (a progress bar).

    Raises:
        ValueError: empty ``microbatch_sizes``, a size < 1, ``repeats < 1`` or ``warmup < 0``.
    """
    if not microbatch_sizes or min(microbatch_sizes) < 1:
        raise ValueError("time_layers: expected micro-batch sizes >= 1")
    if repeats < 1 or warmup < 0:
        raise ValueError("time_layers: expected repeats >= 1 and warmup >= 0")
    children = list(model)  # not .children(): it skips a module used twice
    device = next(model.parameters()).device
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        fwd = np.zeros((len(microbatch_sizes), len(children)))
        bwd = np.zeros_like(fwd)
        runs_f = [[[] for _ in children] for _ in microbatch_sizes]
        runs_b = [[[] for _ in children] for _ in microbatch_sizes]
        # sizes interleaved within each repeat: on a shared machine all sizes see the same load
        for rep in range(warmup + repeats):
            for i, mu in enumerate(microbatch_sizes):
                f_s, b_s = _one_pass(children, make_input(mu), device)
                if progress is not None:
                    total = (warmup + repeats) * len(microbatch_sizes)
                    progress(rep * len(microbatch_sizes) + i + 1, total)
                if rep >= warmup:
                    for l_idx in range(len(children)):
                        runs_f[i][l_idx].append(f_s[l_idx])
                        runs_b[i][l_idx].append(b_s[l_idx])
        for i in range(len(microbatch_sizes)):
            fwd[i] = [statistics.median(r) for r in runs_f[i]]
            bwd[i] = [statistics.median(r) for r in runs_b[i]]
        model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(old_threads)
    used = threads or old_threads
    return LayerTimes(tuple(int(m) for m in microbatch_sizes), fwd, bwd, used)


def _one_pass(children: Sequence[nn.Module], x: torch.Tensor, device: torch.device):
    """Forward then backward of ``children`` in order, each timed; a child may be an
    ``nn.Sequential`` of several layers (a stage)."""
    f_s, b_s = [0.0] * len(children), [0.0] * len(children)
    ins, outs = [], []
    for idx, child in enumerate(children):
        xin = x.detach()
        if idx > 0 and xin.is_floating_point():
            xin.requires_grad_(True)
        _sync(device)
        t0 = time.perf_counter()
        y = child(xin)
        _sync(device)
        f_s[idx] = time.perf_counter() - t0
        ins.append(xin)
        outs.append(y)
        x = y
    grad = torch.ones_like(outs[-1])
    for idx in range(len(children) - 1, -1, -1):
        _sync(device)
        t0 = time.perf_counter()
        if outs[idx].requires_grad:
            outs[idx].backward(grad)
        _sync(device)
        b_s[idx] = time.perf_counter() - t0
        grad = ins[idx].grad
        if grad is None:
            break
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
    model: nn.Sequential,
    make_input: Callable[[int], torch.Tensor],
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    lengths: Sequence[int] | None = None,
    *,
    warmup: int = 2,
    repeats: int = 5,
    threads: int | None = 1,
) -> StageTimes:
    """Time stages (chains of consecutive layers) of several lengths, each stage's forward and
    backward as one unit as a pipeline stage runs them: for each length ``n`` in ``lengths``
    (default :func:`default_stage_lengths`) the chain is cut into consecutive stages of ``n``
    layers (the last one shorter when ``n`` does not divide ``L``) and a pass runs them in
    order as :func:`time_layers` runs single layers. ``warmup`` untimed rounds, then the median
    of ``repeats`` (a round = one pass per size and length, interleaved).

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
    children = list(model)
    num_layers = len(children)
    lengths = tuple(lengths) if lengths is not None else default_stage_lengths(num_layers)
    if not lengths or min(lengths) < 1 or max(lengths) > num_layers:
        raise ValueError(f"time_stages: expected stage lengths in 1..{num_layers}, got {lengths}")
    tilings = [
        [(a, min(a + n, num_layers)) for a in range(0, num_layers, n)] for n in sorted(set(lengths))
    ]
    stages = tuple(st for tiling in tilings for st in tiling)
    modules = [[nn.Sequential(*children[a:b]) for a, b in tiling] for tiling in tilings]
    device = next(model.parameters()).device
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        runs = [[[] for _ in stages] for _ in microbatch_sizes]
        for rep in range(warmup + repeats):
            for i, mu in enumerate(microbatch_sizes):
                col = 0
                for mods in modules:
                    f_s, b_s = _one_pass(mods, make_input(mu), device)
                    if rep >= warmup:
                        for j in range(len(mods)):
                            runs[i][col + j].append(f_s[j] + b_s[j])
                    col += len(mods)
        train = np.array([[statistics.median(r) for r in row] for row in runs])
        model.zero_grad(set_to_none=True)
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
    one point per (micro-batch size, stage), ``F = Σ_{l∈S} (f_l + w_l)``.

    Raises:
        ValueError: as :func:`fit_stage_overheads` (e.g. stages of one length only).
    """
    flops = np.concatenate(([0.0], np.cumsum(profile.arrays().train_flops)))
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
                n.append(b - a)
                t.append(train_s[i, j])
    return fit_stage_overheads(mus, fl, n, t)
