"""Device catalog and cluster builders from measured public data (pure Python + numpy).

Every number of :data:`DEVICE_KINDS` states its source in :attr:`DeviceKind.sources`. Speeds
are *effective* training speeds (docs/model.md §2 ``s_d``), not datasheet peaks:

* sailor kinds (A100-40, A100-80, GH200, V100, RTX 2080, RTX 3090, Titan RTX): least-squares
  fit (:func:`hetrain.calibration.fit_speed_kappa`) of sailor's measured OPT-350M per-layer
  forward+backward times (summed over the 26 layers, tensor-parallel degree 1, every profiled
  micro-batch size) against the FLOPs of :func:`hetrain.converters.sailor_model_profile`. The
  intercept is ``κ`` of the whole chain per micro-batch (see ``docs/profiling.md``).
* gavel kinds (K80, P100): V100's sailor speed times the geometric mean over gavel's 26 job
  types of the isolated single-GPU throughput ratio K80/V100 (resp. P100/V100); ``κ`` scaled the
  same way.

:func:`derive_sailor_speeds` and :func:`derive_gavel_ratios` recompute the numbers from
``../shared/data``; tests check that the constants here equal them. Nothing is read at import.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetrain.cluster import ClusterSpec, cluster_from_dict

#: Default location of the shared data sets (``$HETRAIN_SHARED_DATA`` overrides it).
DEFAULT_DATA_DIR = Path(os.environ.get("HETRAIN_SHARED_DATA", "/work/shared/data"))

_SAILOR = "sailor OPT-350M per-layer fwd+bwd times, least-squares fit (catalog docstring)"
_SAILOR_MEM = "sailor/basic_cluster_config.json mem_per_gpu"
_SAILOR_NIC = (
    "sailor/multizone_bandwidths_het.json us-central1-a same-zone, same kind, 1 GPU: max_bw"
)
_SAILOR_INTRA = "sailor/intra_node_bandwidths.json max_bw at the largest n_gpus profiled"
_GAVEL = "V100 speed x gavel geometric-mean throughput ratio (simulation_throughputs.json)"
_TDP = "NVIDIA datasheet board power (TDP)"
_AWS_OD = "AWS EC2 on-demand list price, us-east-1"
_SPOT = "median spot price, spot-prices-aws/us-east-1 (Dec 2019 - Feb 2020)"


@dataclass(frozen=True)
class DeviceKind:
    """One kind of accelerator with the docs/model.md §7 device fields in file units.

    Attributes:
        name: kind name, e.g. ``"V100-16"``.
        tflops: effective training speed (1e12 FLOP/s) for transformer training (OPT-350M).
        memory_gib: device memory (2^30 bytes).
        nic_gbps: a typical network bandwidth per device between nodes (1e9 bit/s).
        intra_node_gbps: bandwidth between two devices of one node (1e9 bit/s).
        power_w: board power (W).
        price_per_hour: on-demand price of one device (USD/hour; 0 where no cloud sells it).
        spot_price_per_hour: median spot price (USD/hour) where the shared data has one.
        microbatch_overhead_ms: ``κ`` (ms) of the whole OPT-350M chain per micro-batch.
        devices_per_node: devices per node of the usual server (sailor's cluster config or
            the AWS instance).
        sources: where each number comes from (field -> text).
    """

    name: str
    tflops: float
    memory_gib: float
    nic_gbps: float
    intra_node_gbps: float
    power_w: float
    price_per_hour: float
    spot_price_per_hour: float | None
    microbatch_overhead_ms: float
    devices_per_node: int
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)


def _sailor_kind(
    name: str,
    row: tuple[float, float, float, float, float, float, float, int],
    price_src: str,
    spot: tuple[float, str] | None = None,
    intra_src: str = _SAILOR_INTRA,
) -> DeviceKind:
    tflops, kappa_ms, mem_bytes, nic_bps, intra_bps, power, price, per_node = row
    sources = {
        "tflops": _SAILOR,
        "microbatch_overhead_ms": _SAILOR,
        "memory_gib": _SAILOR_MEM,
        "nic_gbps": _SAILOR_NIC,
        "intra_node_gbps": intra_src,
        "power_w": _TDP,
        "price_per_hour": price_src,
        "devices_per_node": "sailor/basic_cluster_config.json gpus_per_node",
    }
    if spot is not None:
        sources["spot_price_per_hour"] = spot[1]
    return DeviceKind(
        name=name,
        tflops=tflops,
        memory_gib=mem_bytes / 2**30,
        nic_gbps=nic_bps * 8 / 1e9,
        intra_node_gbps=intra_bps * 8 / 1e9,
        power_w=power,
        price_per_hour=price,
        spot_price_per_hour=spot[0] if spot else None,
        microbatch_overhead_ms=kappa_ms,
        devices_per_node=per_node,
        sources=sources,
    )


#: gavel isolated-throughput ratios vs V100, geometric mean over 26 job types at 1 GPU
#: (printed by :func:`derive_gavel_ratios`, rounded to 4 digits).
GAVEL_RATIO_TO_V100: dict[str, float] = {"k80": 0.2972, "p100": 0.9430}
_NOT_SOLD = "not sold by the large clouds: 0 (docs/model.md default)"
# (tflops, kappa_ms) printed by derive_sailor_speeds() (4 digits); memory, NIC and intra-node
# bandwidth (bytes/s) copied from the sailor files named in the sources; W; USD/h; per node.
_V100_ROW = (8.752, 0.0, 17179869184, 1719640629.44, 68172954066.0, 300.0, 3.06, 4)

DEVICE_KINDS: dict[str, DeviceKind] = {
    k.name: k
    for k in (
        _sailor_kind(
            "A100-40",
            (29.53, 17.56, 42338615296, 2420367713.52, 243214602913.5, 400.0, 4.0966, 4),
            _AWS_OD + ": p4d.24xlarge 32.7726 / 8 GPUs",
        ),
        _sailor_kind(
            "A100-80",
            (33.14, 30.05, 85899345920, 2420367713.52, 243214602913.5, 400.0, 5.1207, 4),
            _AWS_OD + ": p4de.24xlarge 40.9657 / 8 GPUs; NIC as A100-40 (no own fit)",
        ),
        _sailor_kind(
            "GH-96",
            (63.28, 7.078, 102625181696, 22934533176.5, 250558342885.7, 1000.0, 1.49, 4),
            "Lambda on-demand GH200 list price (2024)",
        ),
        _sailor_kind(
            "V100-16", _V100_ROW, _AWS_OD + ": p3.2xlarge", (0.9408, _SPOT + ", p3.2xlarge")
        ),
        _sailor_kind(
            "RTX-2080",
            (7.328, 3.723, 11811160064, 2855813401.68, 24551701788.1, 215.0, 0.0, 8),
            _NOT_SOLD,
        ),
        _sailor_kind(
            "RTX-3090",
            (13.41, 0.0, 25769803776, 115701787.81, 5326931791.9, 350.0, 0.0, 8),
            _NOT_SOLD,
        ),
        _sailor_kind(
            "Titan-RTX",
            (7.804, 6.503, 25769803776, 2856544700.72, 24304314860.6, 280.0, 0.0, 8),
            _NOT_SOLD,
        ),
        DeviceKind(
            name="K80",
            tflops=round(_V100_ROW[0] * GAVEL_RATIO_TO_V100["k80"], 4),
            memory_gib=12.0,
            nic_gbps=10.0,
            intra_node_gbps=80.0,
            power_w=150.0,
            price_per_hour=0.90,
            spot_price_per_hour=0.3785,
            microbatch_overhead_ms=0.0,
            devices_per_node=8,
            sources={
                "tflops": _GAVEL,
                "microbatch_overhead_ms": "as V100 (gavel has no per-micro-batch data)",
                "memory_gib": "NVIDIA K80 datasheet: 24 GB per board = 12 GB per GPU die",
                "nic_gbps": "assumed 10 Gbit/s (AWS lists p2.xlarge networking as 'High')",
                "intra_node_gbps": "PCIe 3.0 x16, about 10 GB/s (p2.8xlarge has no NVLink)",
                "power_w": _TDP + ": 300 W per board of 2 GPU dies",
                "price_per_hour": _AWS_OD + ": p2.xlarge (1 K80 die)",
                "spot_price_per_hour": _SPOT + ", p2.xlarge",
                "devices_per_node": "AWS p2.8xlarge: 8 GPU dies",
            },
        ),
        DeviceKind(
            name="P100",
            tflops=round(_V100_ROW[0] * GAVEL_RATIO_TO_V100["p100"], 4),
            memory_gib=16.0,
            nic_gbps=16.0,
            intra_node_gbps=80.0,
            power_w=250.0,
            price_per_hour=1.46,
            spot_price_per_hour=None,
            microbatch_overhead_ms=0.0,
            devices_per_node=4,
            sources={
                "tflops": _GAVEL,
                "microbatch_overhead_ms": "as V100 (gavel has no per-micro-batch data)",
                "memory_gib": "NVIDIA P100 datasheet: 16 GB HBM2",
                "nic_gbps": "GCP egress limit of an 8-vCPU VM: 16 Gbit/s",
                "intra_node_gbps": "PCIe 3.0 x16, about 10 GB/s",
                "power_w": _TDP + " (PCIe card)",
                "price_per_hour": "GCP on-demand P100 GPU list price (us-central1)",
                "devices_per_node": "GCP: up to 4 P100 per VM",
            },
        ),
    )
}

#: Kinds mixed by :func:`make_mixed_cluster` by default (old to new, data-center GPUs).
DEFAULT_MIX: tuple[str, ...] = ("K80", "P100", "V100-16", "A100-40", "A100-80", "GH-96")


def make_cluster(
    kind_counts: Mapping[str, int] | Sequence[tuple[str, int]],
    *,
    devices_per_node: int | None = None,
    nic_gbps: float | None = None,
    intra_node_gbps: float | None = None,
    latency_us: float = 20.0,
    spot: bool = False,
    speed_jitter: float = 0.0,
    seed: int | None = None,
) -> ClusterSpec:
    """Build a validated :class:`~hetrain.cluster.ClusterSpec` from catalog kinds.

    Devices are numbered per kind (``"v100-16-0"``, ...) in the order of ``kind_counts``;
    each kind fills its own nodes of ``devices_per_node`` devices (the kind's usual server
    size when ``None``), named ``"n0", "n1", ...``. The cluster's single ``intra_node_gbps``
    is the smallest of the kinds used (docs/model.md §7 has one intra-node bandwidth) unless given.

    Args:
        kind_counts: ``{"V100-16": 4, "K80": 8}`` (or pairs); names of :data:`DEVICE_KINDS`.
        devices_per_node: devices per node for every kind, ``>= 1``.
        nic_gbps: override every device's NIC bandwidth (Gbit/s), e.g. slow inter-node links.
        intra_node_gbps: override the intra-node bandwidth (Gbit/s).
        latency_us: latency of every link (µs).
        spot: use the spot price where the catalog has one (else the on-demand price).
        speed_jitter: multiply each device's speed by ``1 + U(-j, j)`` (``0 <= j < 1``), drawn
            with ``numpy.random.default_rng(seed)``: devices of one kind are rarely identical.
        seed: random seed for the jitter.

    Raises:
        ValueError: unknown kind, a count ``< 0``, no devices, or an option out of range.
    """
    pairs = list(kind_counts.items()) if isinstance(kind_counts, Mapping) else list(kind_counts)
    for kind, count in pairs:
        if kind not in DEVICE_KINDS:
            raise ValueError(
                f"unknown device kind {kind!r}; expected one of {sorted(DEVICE_KINDS)}"
            )
        if int(count) != count or count < 0:
            raise ValueError(f"count of {kind!r}: expected an integer >= 0, got {count}")
    if sum(c for _, c in pairs) < 1:
        raise ValueError("make_cluster: expected at least one device")
    if devices_per_node is not None and devices_per_node < 1:
        raise ValueError(f"devices_per_node: expected >= 1, got {devices_per_node}")
    if not 0 <= speed_jitter < 1:
        raise ValueError(f"speed_jitter: expected 0 <= j < 1, got {speed_jitter}")
    rng = np.random.default_rng(seed)
    devices, node_no = [], 0
    used = [k for k, c in pairs if c > 0]
    for kind, count in pairs:
        spec = DEVICE_KINDS[kind]
        per_node = devices_per_node or spec.devices_per_node
        for i in range(int(count)):
            if i % per_node == 0 and i > 0:
                node_no += 1
            factor = 1.0 + (rng.uniform(-speed_jitter, speed_jitter) if speed_jitter else 0.0)
            price = spec.price_per_hour
            if spot and spec.spot_price_per_hour is not None:
                price = spec.spot_price_per_hour
            devices.append(
                {
                    "id": f"{kind.lower()}-{i}",
                    "node": f"n{node_no}",
                    "tflops": round(spec.tflops * factor, 6),
                    "memory_gib": round(spec.memory_gib, 4),
                    "nic_gbps": round(nic_gbps if nic_gbps is not None else spec.nic_gbps, 4),
                    "power_w": spec.power_w,
                    "price_per_hour": price,
                    "microbatch_overhead_ms": spec.microbatch_overhead_ms,
                }
            )
        if count > 0:
            node_no += 1
    if intra_node_gbps is None:
        intra_node_gbps = min(DEVICE_KINDS[k].intra_node_gbps for k in used)
    links = {"intra_node_gbps": round(intra_node_gbps, 3), "latency_us": latency_us}
    return cluster_from_dict({"links": links, "devices": devices}, "<catalog>")


def mixed_kind_counts(
    num_devices: int, kinds: Sequence[str] = DEFAULT_MIX, seed: int | None = None
) -> dict[str, int]:
    """Split ``num_devices`` among ``kinds`` as evenly as possible (the remainder goes to
    randomly chosen kinds when ``seed`` is given, else to the first kinds).

    Raises:
        ValueError: ``num_devices < 1`` or no kinds.
    """
    if num_devices < 1 or not kinds:
        raise ValueError("mixed_kind_counts: expected num_devices >= 1 and at least one kind")
    base, rest = divmod(num_devices, len(kinds))
    counts = dict.fromkeys(kinds, base)
    extra = list(kinds)
    if seed is not None:
        np.random.default_rng(seed).shuffle(extra)
    for k in extra[:rest]:
        counts[k] += 1
    return {k: c for k, c in counts.items() if c > 0}


def make_mixed_cluster(
    num_devices: int, kinds: Sequence[str] = DEFAULT_MIX, *, seed: int | None = 0, **kwargs
) -> ClusterSpec:
    """``make_cluster(mixed_kind_counts(num_devices, kinds, seed), seed=seed, **kwargs)``: a
    mixed cluster of any size (4 ... 1024 devices) for benchmarks and scenarios."""
    return make_cluster(mixed_kind_counts(num_devices, kinds, seed), seed=seed, **kwargs)


# ---------------------------------------------------------------------------------------------
# derivations from ../shared/data (used by tests and by examples/build_examples.py)
# ---------------------------------------------------------------------------------------------


def derive_sailor_speeds(
    data_dir: str | Path = DEFAULT_DATA_DIR, model: str = "OPT-350"
) -> dict[str, tuple[float, float, float]]:
    """Fit ``(tflops, kappa_ms, rms_rel_error)`` per GPU kind from sailor's per-layer times of
    ``model`` (TP 1, all micro-batch sizes profiled with every layer).

    Raises:
        InputError: the sailor files are missing.
    """
    from hetrain.calibration import fit_speed_kappa
    from hetrain.converters import (
        load_json,
        sailor_layer_times,
        sailor_model_profile,
        total_train_flops,
    )

    base = Path(data_dir) / "sailor"
    prof = sailor_model_profile(load_json(base / "llm_info.json"), model)
    flops = total_train_flops(prof)
    out = {}
    for path in sorted(glob.glob(str(base / "profiles" / model / "*" / "profile.json"))):
        pj = load_json(path)
        mus, times = [], []
        for mb in sorted(pj, key=int):
            if "1" in pj[mb] and len(pj[mb]["1"]) == prof.num_layers:
                fwd, bwd = sailor_layer_times(pj, int(mb))
                mus.append(int(mb))
                times.append(float(fwd.sum() + bwd.sum()))
        if len(mus) >= 2:
            fit = fit_speed_kappa(mus, flops, times)
            out[Path(path).parent.name] = (
                fit.speed_flops / 1e12,
                fit.kappa_s * 1e3,
                fit.rms_rel_error,
            )
    return out


def derive_gavel_ratios(data_dir: str | Path = DEFAULT_DATA_DIR) -> dict[str, float]:
    """Geometric mean over gavel job types (1 GPU, isolated) of throughput(kind)/throughput(v100)
    for ``k80`` and ``p100``.

    Raises:
        InputError: the gavel file is missing.
    """
    from hetrain.converters import load_json

    thr = load_json(Path(data_dir) / "gavel" / "simulation_throughputs.json")
    out = {}
    for kind in ("k80", "p100"):
        logs = [
            math.log(thr[kind][job]["null"] / thr["v100"][job]["null"])
            for job in thr["v100"]
            if job.endswith(", 1)") and thr[kind].get(job, {}).get("null", 0) > 0
        ]
        out[kind] = math.exp(sum(logs) / len(logs))
    return out
