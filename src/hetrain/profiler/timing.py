"""Wall-clock timing of each layer's forward and backward on this device, and a fit of the
device's speed ``s`` and per-micro-batch cost ``κ`` (SPEC §3) from it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hetrain.calibration import SpeedFit, fit_speed_kappa
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


def _one_pass(children: list[nn.Module], x: torch.Tensor, device: torch.device):
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
    micro-batch (the SPEC §3 stage = all layers), ``per_layer`` fits every (layer, μ) point
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
