"""Pipeline dimension: point-to-point activation/gradient messages and the 1F1B and GPipe
schedules of one stage (SPEC §1, §5).

Every message between neighbouring stages is a small int64 header (dtype, shape, send time)
followed by the payload, so any chain works (int64 token ids at the first stage, bf16 under
autocast, a smaller last micro-batch) without shape inference. Sends are non-blocking
(``isend``, waited at the end of the step) and receives blocking; with every stage issuing its
forward messages and its backward messages in micro-batch order, 1F1B and GPipe cannot
deadlock (Narayanan et al., *PipeDream-Flush / Megatron-LM 1F1B*, SC'21). Each direction of a
link has its own two-rank process group (``GroupCache.pipeline_channels``), so with NCCL a
queued activation send never blocks the gradient receive coming the other way.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.runtime.emulation import Emulation, sleep_s, slow_down

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
MAX_NDIM = 8
HEADER_LEN = 3 + MAX_NDIM  # dtype code, ndim, send time (ns), dims
TAG_HEADER = 1
TAG_PAYLOAD = 2


def schedule_ops(
    schedule: str, num_stages: int, stage: int, num_microbatches: int
) -> list[tuple[str, int]]:
    """Order of ``("F", i)`` / ``("B", i)`` operations of stage ``stage`` (0-based) of a
    pipeline of ``num_stages`` stages over ``num_microbatches`` micro-batches.

    GPipe: all forwards, then all backwards. 1F1B (PipeDream-Flush): ``min(K - k - 1, n)``
    warm-up forwards, then alternate one forward and one backward, then the remaining
    backwards; at most ``K - k`` micro-batches are alive on stage ``k`` (SPEC §3 ``h_k``).

    Raises:
        ValueError: unknown schedule.
    """
    n = num_microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(n)] + [("B", i) for i in range(n)]
    if schedule != "1f1b":
        raise ValueError(f"schedule: expected '1f1b' or 'gpipe', got {schedule!r}")
    warm = min(num_stages - stage - 1, n)
    ops = [("F", i) for i in range(warm)]
    for i in range(n - warm):
        ops += [("F", warm + i), ("B", i)]
    ops += [("B", i) for i in range(n - warm, n)]
    return ops


@dataclass
class Timers:
    """Measurements of one rank in one step (seconds, bytes)."""

    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    emulated_compute_s: float = 0.0
    send_recv_time_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    link_time_s: dict[str, float] = field(default_factory=dict)  # peer device -> blocked time

    @property
    def compute_time_s(self) -> float:
        return self.forward_time_s + self.backward_time_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class P2P:
    """Messages between pipeline neighbours, with per-link bandwidth emulation.

    The header carries the sender's wall-clock send time; the receiver sleeps until
    ``max(send time, link free) + n / bw + latency`` (one link = one FIFO pipe per direction),
    so emulated transfers overlap with the sender's compute as SPEC §3 assumes. Send times are
    compared across processes with ``time.time_ns`` (one machine, or synchronised clocks).
    """

    def __init__(
        self,
        device: torch.device,
        devices: tuple[str, ...],
        rank: int,
        timers: Timers,
        emulation: Emulation | None,
        channels: dict[tuple[int, int], Any] | None = None,
    ) -> None:
        self.device = device
        self.devices = devices
        self.rank = rank
        self.timers = timers
        self.emulation = emulation
        self.channels = channels or {}
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._link_free_ns: dict[int, int] = {}

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Non-blocking send of ``tensor`` (any dtype, ``ndim <= 8``) to rank ``dst``."""
        t0 = time.perf_counter()
        tensor = tensor.detach().contiguous()
        if tensor.dim() > MAX_NDIM:
            raise ValueError(f"activation with {tensor.dim()} dims: at most {MAX_NDIM} supported")
        header = [_CODE[tensor.dtype], tensor.dim(), time.time_ns(), *tensor.shape]
        header += [0] * (HEADER_LEN - len(header))
        htensor = torch.tensor(header, dtype=torch.int64, device=self.device)
        group = self.channels.get((self.rank, dst))
        self._pending.append((dist.isend(htensor, dst, group=group, tag=TAG_HEADER), htensor))
        self._pending.append((dist.isend(tensor, dst, group=group, tag=TAG_PAYLOAD), tensor))
        self.timers.bytes_sent += tensor.numel() * tensor.element_size()
        self.timers.send_recv_time_s += time.perf_counter() - t0

    def recv(self, src: int) -> torch.Tensor:
        """Blocking receive of the next tensor from rank ``src`` (then emulated link delay)."""
        t0 = time.perf_counter()
        htensor = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        group = self.channels.get((src, self.rank))
        dist.recv(htensor, src, group=group, tag=TAG_HEADER)
        header = htensor.tolist()
        dtype = _DTYPES[header[0]]
        shape = header[3 : 3 + header[1]]
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src, group=group, tag=TAG_PAYLOAD)
        num_bytes = out.numel() * out.element_size()
        em = self.emulation
        if em is not None and em.limits_links():
            start_ns = max(header[2], self._link_free_ns.get(src, 0))
            busy_s = em.transfer_time_s(self.devices[src], self.devices[self.rank], num_bytes)
            arrival_ns = start_ns + int(busy_s * 1e9)
            self._link_free_ns[src] = arrival_ns - int(em.latency_s * 1e9)
            sleep_s((arrival_ns - time.time_ns()) / 1e9)
        self.timers.bytes_received += num_bytes
        dt = time.perf_counter() - t0
        self.timers.send_recv_time_s += dt
        peer = self.devices[src]
        self.timers.link_time_s[peer] = self.timers.link_time_s.get(peer, 0.0) + dt
        return out

    def wait_sends(self) -> None:
        """Wait for all pending sends of this step (time counted as send/recv time)."""
        t0 = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        self.timers.send_recv_time_s += time.perf_counter() - t0


def run_stage(
    *,
    stage_module: nn.Module,
    ops: list[tuple[str, int]],
    microbatches: list[tuple[int, int]],
    inputs: torch.Tensor | None,
    targets: torch.Tensor | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    global_batch: int,
    prev_rank: int | None,
    next_rank: int | None,
    p2p: P2P,
    timers: Timers,
    device: torch.device,
    device_id: str,
    emulation: Emulation | None,
    autocast_dtype: torch.dtype | None,
    before_last_backward: Callable[[], None] | None = None,
    forward_context: Callable[[int, int], Any] | None = None,
) -> torch.Tensor:
    """Run one stage's forward/backward operations of one step; return the sum of the scaled
    micro-batch losses (a 0-dim float64 tensor, 0 except on the last stage).

    Each micro-batch loss is ``loss_fn(output, target) * rows / B``: with ``loss_fn`` a mean
    over the micro-batch's samples, gradients accumulate to the gradient of the mean over the
    whole global batch ``B`` (the group contributes its rows; groups are summed afterwards).
    Gradients accumulate into ``.grad`` of the stage's parameters; ``before_last_backward``
    is called right before the last backward (to start gradient all-reduces during it);
    ``forward_context(start, end)`` (a context manager, rows relative to the group) wraps each
    micro-batch's forward (plan-invariant randomness and ghost BatchNorm, engine.py).
    """
    first = prev_rank is None
    last = next_rank is None
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    last_backward = max((n for n, (op, _) in enumerate(ops) if op == "B"), default=-1)
    for n, (op, i) in enumerate(ops):
        start, end = microbatches[i]
        if op == "F":
            if first:
                x = inputs[start:end]
            else:
                x = p2p.recv(prev_rank)
                if x.is_floating_point() or x.is_complex():
                    x.requires_grad_(True)
            _sync(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            with torch.autocast(
                device_type=device.type,
                dtype=autocast_dtype or torch.bfloat16,
                enabled=autocast_dtype is not None,
            ):
                with forward_context(start, end) if forward_context else contextlib.nullcontext():
                    y = stage_module(x)
                if last:
                    y = loss_fn(y, targets[start:end]) * ((end - start) / global_batch)
            _sync(device)
            dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
            slept = slow_down(emulation, device_id, dt, microbatch=True, cpu_s=cpu)
            timers.emulated_compute_s += slept
            timers.forward_time_s += dt + slept
            if last:
                loss_sum += y.detach().to(torch.float64)
            else:
                p2p.send(y, next_rank)
            saved[i] = (x, y)
        else:
            x, y = saved.pop(i)
            grad = None
            if not last and (y.is_floating_point() or y.is_complex()):
                grad = p2p.recv(next_rank)
            if n == last_backward and before_last_backward is not None:
                before_last_backward()
            _sync(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            if y.requires_grad and (last or grad is not None):
                torch.autograd.backward(y, grad)
            _sync(device)
            dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
            slept = slow_down(emulation, device_id, dt, cpu_s=cpu)
            timers.emulated_compute_s += slept
            timers.backward_time_s += dt + slept
            if not first and x.requires_grad:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                p2p.send(gx, prev_rank)
            del x, y
    return loss_sum
