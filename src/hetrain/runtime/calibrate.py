"""The runtime's start-up calibration (collective: every rank calls it at once, before the
first step): this rank's speed ``s``, per-micro-batch overhead ``κ``, per-layer overhead ``λ``
and jitter ``σ`` (:func:`_measure_device`, fitted by :func:`_fit_device`), the weight
update's seconds per parameter byte ``ω`` (:func:`_measure_update_s_per_byte`), and the
forward and backward seconds of every layer on this rank's device
(:func:`measure_layer_times`), which :func:`with_layer_times` hands to the controller as the
measured times of the device's kind (docs/model.md §3 "Measured times", docs/runtime.md
"Start-up calibration")."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hetrain.cluster import ClusterState
from hetrain.profile import MeasuredTimes, ProfileArrays
from hetrain.runtime.data import Task, call_model, cast_inputs
from hetrain.runtime.optim import OptimizerSpec

CALIBRATION_REPEATS = 5  # start-up measurements per micro-batch size (median)


def _to_device(obj: Any, device: torch.device) -> Any:
    """Tensors of ``obj`` (a tensor or a pytree) copied to ``device``; other values unchanged."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(device), obj)


def calibration_sizes(batch: int, sample_unit: int = 1) -> list[int]:
    """The micro-batch sizes the start-up calibration runs (samples, increasing): ``u``,
    ``4u`` and ``16u`` (``u = sample_unit``, at most ``batch``), each capped at ``batch`` and
    rounded down to a multiple of ``u``; duplicates dropped."""
    unit = max(1, min(int(sample_unit), int(batch)))
    return sorted({max(unit, min(k * unit, batch) // unit * unit) for k in (1, 4, 16)})


def layer_timing_sizes(batch: int, sample_unit: int = 1, cap: int | None = None) -> list[int]:
    """The micro-batch sizes the start-up calibration times every layer at (samples,
    increasing): ``u 4^k`` up to ``m = min(batch, cap)`` and ``m`` itself, rounded down to
    multiples of ``u`` (``u = sample_unit``): the range of micro-batch sizes the planner
    searches (docs/planner.md), so that measured times are interpolated between measured
    sizes instead of extrapolated from small ones (on CPUs per-sample times at 1-16 samples
    are mostly overhead: a line through them put 128 samples at a fifth of their time)."""
    unit = max(1, min(int(sample_unit), int(batch)))
    top = max(unit, min(int(batch), int(cap) if cap is not None else int(batch)) // unit * unit)
    sizes = {top}
    k = unit
    while k < top:
        sizes.add(k)
        k *= 4
    return sorted(sizes)


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

    sizes = calibration_sizes(len(indices), sample_unit)
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


@dataclasses.dataclass(frozen=True)
class RankLayerTimes:
    """Measured per-layer times of one rank's device (emulated slow-down included):
    ``microbatch_sizes`` (shape ``(m,)``, samples, increasing) and ``fwd_s``, ``bwd_s`` (shape
    ``(m, L)``, seconds per micro-batch of each size, per layer); ``hardware``: the device's
    hardware kind (:func:`hardware_kind`; empty: unknown) and ``factor``: the emulated
    slow-down (>= 1) the times include."""

    microbatch_sizes: np.ndarray
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    hardware: str = ""
    factor: float = 1.0


def hardware_kind(device: torch.device) -> str:
    """The hardware kind of ``device``: a CUDA device's name (``torch.cuda.get_device_name``),
    else the CPU's model name (``/proc/cpuinfo``'s ``model name``, else
    ``platform.processor()``), prefixed ``cpu:``; ``"cpu"`` when neither names it."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    import platform

    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor()
    return f"cpu:{name}" if name else "cpu"


def measure_layer_times(
    task: Task,
    chain: Any,
    dtype: torch.dtype,
    indices: np.ndarray,
    factor: float,
    *,
    device: torch.device | None = None,
    sample_unit: int = 1,
    activation_bytes_per_sample: float = 0.0,
    repeats: int = 3,
    warmup: int = 1,
) -> list[RankLayerTimes]:
    """Forward and backward seconds of every layer of ``chain`` (a
    :class:`~hetrain.runtime.cutting.Chain`, layer ``l`` run as the stage ``[l, l + 1)`` as in
    training) on this rank's device, at the micro-batch sizes :func:`layer_timing_sizes` of
    ``len(indices)`` (the global batch) and ``sample_unit`` (samples taken from ``indices``,
    the sampler's first global batch), gathered from every rank (collective: every rank calls
    it; the same sizes and layers everywhere). On a CUDA device the sizes stop where the whole
    model's saved activations (``activation_bytes_per_sample`` x size, the profile's
    ``Σ m_l``) would take more than half of the device's free memory (the smallest such cap
    over the ranks).

    Timing is :func:`hetrain.profiler.timing.time_layers` (what ``hetrain profile --measure``
    writes): ``warmup`` untimed passes, then the median of ``repeats`` per layer and size;
    a barrier starts every pass, so all ranks time their layers at once, as they compute in
    training. The emulated slow-down ``factor`` (>= 1) multiplies the times: the engine
    stretches every compute operation of the device to ``factor`` x its measured time
    (docs/model.md §5). A layer's time at a size is at most its time at any larger size (the
    minimum over the larger sizes: a smaller micro-batch is never slower, so a larger time is
    load from other processes). Uses the rank's current torch threads.

    Returns:
        One :class:`RankLayerTimes` per rank, index = rank.
    """
    from hetrain.profiler.timing import time_layers

    device = device or torch.device("cpu")
    coll = device if device.type == "cuda" else torch.device("cpu")
    cap = len(indices)
    if device.type == "cuda" and activation_bytes_per_sample > 0:
        free_bytes, _ = torch.cuda.mem_get_info(device)
        cap = max(1, min(cap, int(0.5 * free_bytes / activation_bytes_per_sample)))
    box = torch.tensor([cap], dtype=torch.int64, device=coll)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    sizes = layer_timing_sizes(len(indices), sample_unit, int(box.item()))
    inputs = {}
    for mu in sizes:
        x, _ = task.train.batch(np.asarray(indices[:mu]))
        inputs[mu] = _to_device(cast_inputs(x, dtype), device)
    times = time_layers(
        chain,
        inputs.__getitem__,
        sizes,
        warmup=warmup,
        repeats=repeats,
        threads=None,
        before_pass=dist.barrier,
    )
    mine = np.stack([times.fwd_s, times.bwd_s]) * float(factor)  # (2, m, L)
    # a layer never takes longer on fewer samples: a time above a larger size's is load from
    # other processes (seen: 4x at 16 samples over 64 on a shared 2-core machine)
    mine = np.ascontiguousarray(np.minimum.accumulate(mine[:, ::-1], axis=1)[:, ::-1])
    local = torch.as_tensor(mine, dtype=torch.float64, device=coll)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    kinds: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(kinds, (hardware_kind(device), float(factor)))
    sizes_arr = np.asarray(sizes, dtype=float)
    return [
        RankLayerTimes(sizes_arr, t[0].cpu().numpy().copy(), t[1].cpu().numpy().copy(), *k)
        for t, k in zip(gathered, kinds, strict=True)
    ]


def with_layer_times(
    state: ClusterState,
    profile: ProfileArrays,
    devices: Sequence[str],
    times: Sequence[RankLayerTimes],
    *,
    own_kinds: bool,
) -> tuple[ClusterState, ProfileArrays]:
    """The start-up state and profile the controller plans with, given every rank's measured
    layer times (docs/model.md §3 "Measured times", docs/runtime.md "Start-up calibration").

    Kinds: with ``own_kinds`` (local ranks, no cluster file) a device's kind is its
    hardware (:attr:`RankLayerTimes.hardware`; its id where that is empty); else the kinds of
    ``state`` (the cluster file's ``kind``, default its id's prefix). The times of a kind are
    the per-layer, per-size median over its measured devices of their times with the emulated
    slow-down divided out (:attr:`RankLayerTimes.factor`). A device runs its kind's times
    scaled by ``r`` (``ClusterState.measured_time_scale``, through ``nominal_speed_flops =
    speed_flops x r``), from where the controller's speed estimates scale them on:
    - hardware kinds: ``r`` is the device's emulated factor. Ranks of one hardware kind are
      the same device; what their start-up times differ by beyond the factor is contention
      between ranks timing at once (two equal ranks measured 0.70-1.0 of each other on a
      shared 2-core machine), which the median removes, so equal ranks start equal. Their
      fitted ``speed_flops`` likewise become the kind's median of ``s_d x f_d`` divided by
      each device's factor ``f_d``;
    - a cluster file's kinds: ``r`` is the ratio of the device's own total time (all layers,
      forward + backward, at the largest size, its emulated factor included) to its kind's
      total, so that at start-up it runs its own measured total (its factor for a device
      alone in its kind).
    Measured times the profile already has for other kinds are kept; those of a measured kind
    are replaced.

    Args:
        state: the start-up cluster state (measured ``speed_flops``; every id of ``devices``
            in it).
        profile: the model's profile (``L`` layers).
        devices: device id of every rank (index = rank), aligned with ``times``.
        times: :func:`measure_layer_times` of every rank (same sizes, ``L`` layers each).

    Returns:
        ``(state, profile)``: ``state`` with ``kinds`` and ``nominal_speed_flops`` set (and
        ``speed_flops`` with ``own_kinds``),
        ``profile`` with one :class:`~hetrain.profile.MeasuredTimes` per measured kind.

    Raises:
        ValueError: ``devices`` and ``times`` of different lengths, a device not in
            ``state``, times of another number of layers or other sizes than the first, or a
            factor below 1.
    """
    if len(devices) != len(times):
        raise ValueError(f"with_layer_times: {len(devices)} devices but {len(times)} times")
    idx = state.index()
    missing = [d for d in devices if d not in idx]
    if missing:
        raise ValueError(f"with_layer_times: devices {missing} are not in the state")
    kinds = list(state.kinds)
    if own_kinds:
        for d, t in zip(devices, times, strict=True):
            kinds[idx[d]] = t.hardware or d
    sizes = np.asarray(times[0].microbatch_sizes, dtype=float) if times else np.zeros(0)
    for d, t in zip(devices, times, strict=True):
        if t.fwd_s.shape != (len(sizes), profile.num_layers) or t.bwd_s.shape != t.fwd_s.shape:
            raise ValueError(
                f"with_layer_times: times of {d} have shape {t.fwd_s.shape}, expected "
                f"{(len(sizes), profile.num_layers)}"
            )
        if not np.array_equal(np.asarray(t.microbatch_sizes, dtype=float), sizes):
            raise ValueError(f"with_layer_times: times of {d} at other micro-batch sizes")
        if not t.factor >= 1.0:
            raise ValueError(f"with_layer_times: emulated factor {t.factor} of {d} is below 1")
    by_kind: dict[str, list[int]] = {}
    for r, d in enumerate(devices):
        by_kind.setdefault(kinds[idx[d]].lower(), []).append(r)
    measured: dict[str, MeasuredTimes] = {}
    nominal = np.asarray(state.nominal_speed_flops, dtype=float).copy()
    speed = np.asarray(state.speed_flops, dtype=float).copy()
    for key, ranks in by_kind.items():
        fwd = np.median(np.stack([times[r].fwd_s / times[r].factor for r in ranks]), axis=0)
        bwd = np.median(np.stack([times[r].bwd_s / times[r].factor for r in ranks]), axis=0)
        kind = kinds[idx[devices[ranks[0]]]]
        measured[key] = MeasuredTimes(kind, sizes.copy(), fwd, bwd)
        kind_total = float(fwd[-1].sum() + bwd[-1].sum())
        for i in range(state.num_devices):
            if kinds[i].lower() == key:
                nominal[i] = float(speed[i])
        if own_kinds:  # one device: one fitted speed too (factor-free median, then / factor)
            kind_speed = float(np.median([speed[idx[devices[r]]] * times[r].factor for r in ranks]))
            for r in ranks:
                speed[idx[devices[r]]] = kind_speed / times[r].factor
                nominal[idx[devices[r]]] = kind_speed
            continue
        for r in ranks:
            own = float(times[r].fwd_s[-1].sum() + times[r].bwd_s[-1].sum())
            ratio = own / kind_total if kind_total > 0 and own > 0 else times[r].factor
            nominal[idx[devices[r]]] = float(speed[idx[devices[r]]]) * ratio
    kept = tuple(m for m in profile.measured if m.kind.lower() not in measured)
    profile = dataclasses.replace(profile, measured=kept + tuple(measured.values()))
    state = state.with_changes(kinds=tuple(kinds), nominal_speed_flops=nominal, speed_flops=speed)
    return state, profile
