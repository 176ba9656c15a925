"""Point-to-point bandwidth and latency between two local gloo ranks (docs/model.md §2 ``bw``,
``lat``).

Two processes are forked, rendezvous through a :class:`torch.distributed.FileStore` in a
temporary folder (no ports), and play ping-pong with ``send``/``recv`` of several message sizes.
One-way time per size = median round trip / 2; the fit ``t = lat + bytes / bw`` (least squares,
:func:`hetrain.calibration.fit_speed_kappa` with "FLOPs" = bytes) gives ``bw`` and ``lat``
(the LogP/Hockney model: Hockney, "The communication challenge for MPP", Parallel Computing 1994).
When noise hides the growth with size (a loaded machine), latency = the fastest one-way time and
bandwidth = the largest message over its time.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from hetrain.calibration import fit_speed_kappa


@dataclass(frozen=True)
class LinkFit:
    """Measured link: ``bandwidth_bytes_per_s``, ``latency_s``, the fit's RMS relative error,
    and the one-way times ``one_way_s`` per message size ``sizes_bytes``."""

    bandwidth_bytes_per_s: float
    latency_s: float
    rms_rel_error: float
    sizes_bytes: tuple[int, ...]
    one_way_s: tuple[float, ...]


def _rank(rank: int, store_path: str, sizes, repeats, warmup, timeout_s, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, 2)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s)
        )
        result = []
        for size in sizes:
            buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
            times = []
            for rep in range(warmup + repeats):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if rep >= warmup:
                    times.append(time.perf_counter() - t0)
            result.append(statistics.median(times) / 2.0)
        dist.destroy_process_group()
        queue.put((rank, result))
    except Exception as exc:  # reported to the parent, which raises
        queue.put((rank, f"{type(exc).__name__}: {exc}"))


def fit_link(sizes_bytes: Sequence[int], one_way_s: Sequence[float]) -> tuple[float, float, float]:
    """``(bandwidth_bytes_per_s, latency_s, rms_rel_error)`` of ``t = lat + n / bw`` fitted to
    one-way times (relative least squares). When noise hides the growth with size, latency =
    the fastest time and bandwidth = the largest message over its time (a lower bound)."""
    try:
        fit = fit_speed_kappa([1.0] * len(sizes_bytes), list(sizes_bytes), list(one_way_s))
        return fit.speed_flops, fit.kappa_s, fit.rms_rel_error
    except ValueError:
        lat = min(one_way_s)
        big = max(range(len(sizes_bytes)), key=lambda i: sizes_bytes[i])
        bw = sizes_bytes[big] / one_way_s[big]
        rel = [(lat + n / bw - t) / t for n, t in zip(sizes_bytes, one_way_s, strict=True)]
        return bw, lat, float(np.sqrt(np.mean(np.square(rel))))


def measure_p2p(
    sizes_bytes: Sequence[int] = (4, 4096, 65536, 262144, 1 << 20, 4 << 20, 16 << 20),
    *,
    repeats: int = 11,
    warmup: int = 2,
    timeout_s: float = 60.0,
) -> LinkFit:
    """Measure bandwidth and latency between two forked local gloo ranks.

    Raises:
        RuntimeError: a rank failed or did not finish within ``timeout_s``.
        ValueError: fewer than 2 sizes.
    """
    if len(sizes_bytes) < 2:
        raise ValueError("measure_p2p: need at least 2 message sizes")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [
            ctx.Process(
                target=_rank,
                args=(r, store, list(sizes_bytes), repeats, warmup, timeout_s, queue),
            )
            for r in range(2)
        ]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) < 2:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"measure_p2p: ranks did not finish in {timeout_s} s")
                try:
                    rank, res = queue.get(timeout=left)
                except Exception:
                    raise RuntimeError(
                        f"measure_p2p: ranks did not finish in {timeout_s} s"
                    ) from None
                if isinstance(res, str):
                    raise RuntimeError(f"measure_p2p: rank {rank} failed: {res}")
                results[rank] = res
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    one_way = results[0]
    bw, lat, rms = fit_link(sizes_bytes, one_way)
    return LinkFit(
        bandwidth_bytes_per_s=bw,
        latency_s=lat,
        rms_rel_error=rms,
        sizes_bytes=tuple(int(s) for s in sizes_bytes),
        one_way_s=tuple(one_way),
    )
