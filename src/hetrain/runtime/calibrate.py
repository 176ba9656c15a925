"""The runtime's start-up calibration (collective: every rank calls it at once, before the
first step): this rank's speed ``s``, per-micro-batch overhead ``κ``, per-layer overhead ``λ``
and jitter ``σ`` (:func:`_measure_device`, fitted by :func:`_fit_device`), and the weight
update's seconds per parameter byte ``ω`` (:func:`_measure_update_s_per_byte`)
(docs/model.md §3, docs/profiling.md §6)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hetrain.runtime.data import Task, call_model, cast_inputs
from hetrain.runtime.optim import OptimizerSpec

CALIBRATION_REPEATS = 5  # start-up measurements per micro-batch size (median)


def _to_device(obj: Any, device: torch.device) -> Any:
    """Tensors of ``obj`` (a tensor or a pytree) copied to ``device``; other values unchanged."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(device), obj)


def _measure_update_s_per_byte(model: nn.Module, spec: OptimizerSpec) -> float:
    """``ω`` of ``TrainingConfig.update_time_s_per_param_byte`` (s per trainable parameter
    byte; docs/profiling.md §6): the second step of the optimizer ``spec`` over the whole model
    with learning rate 0 (same arithmetic, weights unchanged; a temporary optimizer, so no
    state is kept), divided by the trainable bytes. 0 when the model has no parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    if not params or nbytes == 0:
        return 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = spec.build(params)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()  # allocates the state
    t0 = time.perf_counter()
    opt.step()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt / nbytes


def _measure_device(
    task: Task,
    model: nn.Module,
    dtype,
    layer_flops: np.ndarray,
    indices: np.ndarray,
    factor: float,
    repeats: int = CALIBRATION_REPEATS,
    device: torch.device | None = None,
    overhead_weights: np.ndarray | None = None,
    sample_unit: int = 1,
) -> tuple[float, float, float, float]:
    """Speed ``s`` (FLOP/s), per-micro-batch overhead ``κ`` (s), per-layer overhead ``λ`` (s)
    and relative jitter ``σ`` of this rank (collective: every rank calls it).

    Forward + backward of the whole model, and of its first ``⌈L/2⌉`` layers when the model is
    an ``nn.Sequential`` whose half chain has one differentiable output (chains of two lengths
    tell ``λ`` from ``κ``, docs/model.md §2), on micro-batches of ``u``, ``4u`` and ``16u``
    samples (``u = sample_unit``: the norm block, or 2 for a model with BatchNorm, which one
    sample cannot train; sizes at most the global batch and multiples of ``u``) taken from
    ``indices`` (the sampler's first global batch, so a data set smaller than the batch wraps
    as in training). Every measurement starts after a barrier, so
    all ranks compute at once, as they do in training (a rank measured while the others wait
    would see the machine to itself); each point is measured ``repeats`` times and summarised
    by the median. The emulated ``factor`` is applied by sleeping ``(factor - 1)`` x the
    measured time (docs/model.md §5). ``overhead_weights``: the profile's ν_l, shape ``(L,)``
    (default ones); a chain's ``|S|`` below is its layer units ``Σ ν_l`` (docs/model.md §3).
    Fitted to ``t = μ F / s + κ + λ |S|`` by
    :func:`hetrain.calibration.fit_stage_overheads` (``t = μ F / s + κ`` by ``fit_speed_kappa``
    when the half chain cannot be timed alone), else the two-point line. ``σ`` is
    :func:`hetrain.calibration.relative_jitter` of the repeats
    (``TrainingConfig.group_time_jitter``, docs/profiling.md §6)."""
    from hetrain.calibration import relative_jitter

    batch = len(indices)
    unit = max(1, min(int(sample_unit), batch))
    sizes = sorted({max(unit, min(k * unit, batch) // unit * unit) for k in (1, 4, 16)})
    num_layers = len(model) if isinstance(model, nn.Sequential) else 1
    half = -(-num_layers // 2)
    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    inputs = {}
    for mu in sizes:
        x, y = task.train.batch(np.asarray(indices[:mu]))
        inputs[mu] = (_to_device(cast_inputs(x, dtype), device), _to_device(y, device))
    lengths = [num_layers]
    if 1 <= half < num_layers:  # same model on every rank: the same choice everywhere
        with torch.no_grad():
            out = model[:half](inputs[sizes[0]][0])
        if torch.is_tensor(out) and out.is_floating_point():
            lengths.append(half)
    samples: dict[tuple[int, int], list[float]] = {(mu, n): [] for mu in sizes for n in lengths}
    for _ in range(repeats):
        for mu in sizes:
            x, y = inputs[mu]
            for n_layers in lengths:
                dist.barrier()
                t0 = time.perf_counter()
                if n_layers == num_layers:
                    loss = task.loss_fn(call_model(model, x), y)
                    if isinstance(loss, tuple):  # (sum, count) losses
                        loss = loss[0] / max(float(loss[1]), 1.0)
                    loss.backward()
                else:
                    model[:n_layers](x).float().square().mean().backward()
                if cuda:
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                time.sleep((factor - 1.0) * dt)
                samples[(mu, n_layers)].append(dt * factor)
    model.zero_grad(set_to_none=True)
    nu = np.ones(num_layers) if overhead_weights is None else np.asarray(overhead_weights, float)
    if len(nu) != num_layers:  # a profile of another cut: plain layer counts
        nu = np.ones(num_layers)
    points = [
        (
            mu,
            float(np.sum(layer_flops[:n])),
            float(np.sum(nu[:n])),
            float(np.median(samples[mu, n])),
        )
        for mu in sizes
        for n in lengths
    ]
    times = [float(np.median(samples[(mu, num_layers)])) for mu in sizes]
    jitter = relative_jitter(list(samples.values()))
    s, k, lam = _fit_device(points, times, sizes, float(np.sum(layer_flops)), float(np.sum(nu)))
    return s, k, lam, jitter


def _sample_unit(model: nn.Module, norm_block: int | None) -> int:
    """Smallest micro-batch the calibration runs: the norm block ``G`` when given, 2 for a
    model with BatchNorm (training BatchNorm on one sample fails), else 1."""
    from hetrain.runtime.norm import batchnorm_modules

    if norm_block is not None:
        return int(norm_block)
    return 2 if batchnorm_modules(model) else 1


def _fit_device(points, times, sizes, flops_per_sample, num_layers) -> tuple[float, float, float]:
    """Speed, κ and λ of :func:`_measure_device`'s points (see there)."""
    from hetrain.calibration import fit_speed_kappa, fit_stage_overheads

    cap = 0.5 * times[0]  # κ + λ L must not exceed what the smallest micro-batch took (noise)
    if len({p[2] for p in points}) > 1 and len(points) >= 3:
        try:
            fit = fit_stage_overheads(*zip(*points, strict=True))
            if fit.kappa_s + fit.layer_overhead_s * num_layers <= cap:
                return float(fit.speed_flops), float(fit.kappa_s), float(fit.layer_overhead_s)
        except ValueError:
            pass
    if len(sizes) == 1:
        return flops_per_sample / times[0], 0.0, 0.0
    try:
        fit2 = fit_speed_kappa(sizes, flops_per_sample, times)
        if fit2.kappa_s <= cap:
            return float(fit2.speed_flops), float(fit2.kappa_s), 0.0
    except ValueError:
        pass
    kappa = min(cap, max(times[0] - (times[-1] - times[0]) / (sizes[-1] - sizes[0]), 0.0))
    return flops_per_sample * sizes[-1] / max(times[-1] - kappa, 1e-9), kappa, 0.0
