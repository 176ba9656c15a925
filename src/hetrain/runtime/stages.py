"""Pipeline dimension: point-to-point activation/gradient messages and the 1F1B and GPipe
schedules of one stage (docs/model.md §1, §5).

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

import pickle
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

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
HEADER_LEN = 4 + MAX_NDIM  # dtype code, ndim, send time (ns), requires grad, dims
TAG_HEADER = 1
TAG_PAYLOAD = 2
TAG_TREE = 3


def schedule_ops(
    schedule: str, num_stages: int, stage: int, num_microbatches: int
) -> list[tuple[str, int]]:
    """Order of ``("F", i)`` / ``("B", i)`` operations of stage ``stage`` (0-based) of a
    pipeline of ``num_stages`` stages over ``num_microbatches`` micro-batches.

    GPipe: all forwards, then all backwards. 1F1B (PipeDream-Flush): ``min(K - k - 1, n)``
    warm-up forwards, then alternate one forward and one backward, then the remaining
    backwards; at most ``K - k`` micro-batches are alive on stage ``k`` (docs/model.md §3 ``h_k``).

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
    so emulated transfers overlap with the sender's compute as docs/model.md §3 assumes. Send times
    are
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
        self._sent_struct: dict[int, bytes] = {}
        self._recv_struct: dict[int, Any] = {}
        self.last_requires_grad = False

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Non-blocking send of ``tensor`` (any dtype, ``ndim <= 8``) to rank ``dst``; the
        header says whether it requires grad (a gradient comes back for it)."""
        t0 = time.perf_counter()
        requires_grad = int(tensor.requires_grad)
        tensor = tensor.detach().contiguous()
        if tensor.dim() > MAX_NDIM:
            raise ValueError(f"activation with {tensor.dim()} dims: at most {MAX_NDIM} supported")
        header = [_CODE[tensor.dtype], tensor.dim(), time.time_ns(), requires_grad, *tensor.shape]
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
        shape = header[4 : 4 + header[1]]
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self.last_requires_grad = bool(header[3])
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

    def send_tree(self, obj: Any, dst: int) -> None:
        """Send a pytree of tensors (tensor, tuple, dict, ``ModelOutput``...): its structure and
        non-tensor leaves (pickled, only when they differ from the last tree sent to ``dst``
        in this step), then each tensor with :meth:`send`."""
        flat, spec = tree_flatten(obj)
        mask = [isinstance(a, torch.Tensor) for a in flat]
        struct = (spec, [None if m else a for a, m in zip(flat, mask, strict=True)], mask)
        blob = b"" if isinstance(obj, torch.Tensor) else pickle.dumps(struct)
        changed = blob != self._sent_struct.get(dst, b"")
        self._sent_struct[dst] = blob
        group = self.channels.get((self.rank, dst))
        meta = torch.tensor(
            [len(blob) if changed else -1, int(isinstance(obj, torch.Tensor))],
            dtype=torch.int64,
            device=self.device,
        )
        self._pending.append((dist.isend(meta, dst, group=group, tag=TAG_TREE), meta))
        if changed and blob:
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
            self._pending.append((dist.isend(data, dst, group=group, tag=TAG_TREE), data))
        for a in flat:
            if isinstance(a, torch.Tensor):
                self.send(a, dst)

    def recv_tree(self, src: int) -> tuple[Any, list[bool]]:
        """Receive a pytree sent by :meth:`send_tree`; returns it and, per tensor leaf, whether
        the sender's tensor required grad (the receiver then marks it ``requires_grad``)."""
        group = self.channels.get((src, self.rank))
        meta = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.recv(meta, src, group=group, tag=TAG_TREE)
        length, plain = meta.tolist()
        if length > 0:
            data = torch.empty(length, dtype=torch.uint8, device=self.device)
            dist.recv(data, src, group=group, tag=TAG_TREE)
            with warnings.catch_warnings():
                # torch 2.13's own unpickling of a TreeSpec trips its LeafSpec deprecation
                # (a FutureWarning printed once per pipeline stage on the user's console)
                warnings.filterwarnings("ignore", ".*LeafSpec.* is deprecated", FutureWarning)
                self._recv_struct[src] = pickle.loads(data.cpu().numpy().tobytes())
        elif length == 0:
            self._recv_struct[src] = None
        if plain:
            t = self.recv(src)
            return t, [self.last_requires_grad]
        spec, flat, mask = self._recv_struct[src]
        flat = list(flat)
        flags = []
        for k, is_tensor in enumerate(mask):
            if is_tensor:
                flat[k] = self.recv(src)
                flags.append(self.last_requires_grad)
        return tree_unflatten(flat, spec), flags

    def wait_sends(self) -> None:
        """Wait for all pending sends of this step (time counted as send/recv time)."""
        t0 = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        self.timers.send_recv_time_s += time.perf_counter() - t0


def _slice_rows(obj: Any, start: int, end: int) -> Any:
    """Rows ``[start, end)`` of every tensor of a pytree of model inputs."""
    flat, spec = tree_flatten(obj)
    return tree_unflatten([a[start:end] if isinstance(a, torch.Tensor) else a for a in flat], spec)


def _float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def split_loss(value: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``loss_fn``'s result as ``(loss, count)``: a scalar is a per-sample mean (count None);
    a pair ``(sum, count)`` is a sum over ``count`` counted items (tokens), docs/model.md §5.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value, None
    if isinstance(value, tuple | list) and len(value) == 2:
        total, count = value
        if isinstance(total, torch.Tensor) and total.dim() == 0:
            return total, torch.as_tensor(count).detach().reshape(())
    raise ValueError(
        "loss_fn: expected a scalar mean over the samples or a pair (sum, count), got "
        f"{type(value).__name__}"
    )


def run_stage(
    *,
    stage_forward: Callable[[Any, Any], Any],
    ops: list[tuple[str, int]],
    microbatches: list[tuple[int, int]],
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], Any],
    global_batch: int,
    prev_rank: int | None,
    next_rank: int | None,
    p2p: P2P,
    timers: Timers,
    device: torch.device,
    device_id: str,
    emulation: Emulation | None,
    autocast_dtype: torch.dtype | None,
    before_last_backward: Callable[[torch.Tensor, torch.Tensor, bool], None] | None = None,
    forward_context: Callable[[int, int], Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Run one stage's forward/backward operations of one step.

    ``stage_forward(x, inputs_mb)`` runs the stage's layers on one micro-batch (``x`` what the
    previous stage sent, a pytree of tensors; ``inputs_mb`` the micro-batch's rows of the model
    inputs, given to every stage). Activations between stages are any pytree of tensors; a
    gradient goes back for each tensor that required grad when it was sent.

    Returns ``(loss_sum, count_sum, sum_mode)`` (0-dim float64 tensors, zero except on the last
    stage). Per-sample means (``loss_fn`` returns a scalar): each micro-batch loss is scaled by
    ``rows / B`` before backward, so gradients sum to the gradient of the mean over ``B``.
    ``(sum, count)`` losses (docs/model.md §5): the sum is back-propagated unscaled and the engine
    divides
    every gradient by the global batch's count (one all-reduce) afterwards. Gradients accumulate
    into ``.grad``; ``before_last_backward(loss_sum, count_sum, sum_mode)`` is called right
    before the last backward (every forward has run: the values are final) to start gradient
    all-reduces during it; ``forward_context(start, end)`` (a context manager, rows
    relative to the group) wraps each micro-batch's forward (plan-invariant randomness and ghost
    BatchNorm, engine.py).
    """
    first = prev_rank is None
    last = next_rank is None
    saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count_sum = torch.zeros((), dtype=torch.float64, device=device)
    sum_mode = False
    last_backward = max((n for n, (op, _) in enumerate(ops) if op == "B"), default=-1)
    for n, (op, i) in enumerate(ops):
        start, end = microbatches[i]
        if op == "F":
            x = None
            grad_in: list[torch.Tensor] = []
            if not first:
                x, flags = p2p.recv_tree(prev_rank)
                xs = [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]
                for t, flag in zip(xs, flags, strict=True):
                    if flag and _float(t):
                        t.requires_grad_(True)
                        grad_in.append(t)
            mb_inputs = _slice_rows(inputs, start, end)
            target_mb = _slice_rows(targets, start, end) if last else None
            # the forward context (plan-invariant randomness, ghost BatchNorm: host-side
            # bookkeeping, no device compute) is entered before the timed window and the time
            # of leaving it is taken out, so the emulation's (factor - 1) x sleep does not
            # multiply it (docs/training.md, issue 10); the loss stays outside it, as before
            ctx = forward_context(start, end) if forward_context is not None else None
            if ctx is not None:
                ctx.__enter__()
            _sync(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            bookkeeping_s = bookkeeping_cpu_s = 0.0
            with torch.autocast(
                device_type=device.type,
                dtype=autocast_dtype or torch.bfloat16,
                enabled=autocast_dtype is not None,
            ):
                if ctx is not None:
                    try:
                        y = stage_forward(x, mb_inputs)
                    except BaseException as exc:
                        ctx.__exit__(type(exc), exc, exc.__traceback__)
                        raise
                    e0, ec0 = time.perf_counter(), time.thread_time()
                    ctx.__exit__(None, None, None)
                    bookkeeping_s = time.perf_counter() - e0
                    bookkeeping_cpu_s = time.thread_time() - ec0
                else:
                    y = stage_forward(x, mb_inputs)
                if last:
                    value, count = split_loss(loss_fn(y, target_mb))
                    if count is None:
                        y = value * ((end - start) / global_batch)
                    else:
                        sum_mode = True
                        count_sum += count.to(device=device, dtype=torch.float64)
                        y = value
            _sync(device)
            dt = time.perf_counter() - t0 - bookkeeping_s
            cpu = time.thread_time() - c0 - bookkeeping_cpu_s
            slept = slow_down(emulation, device_id, dt, microbatch=True, cpu_s=cpu)
            timers.emulated_compute_s += slept
            timers.forward_time_s += dt + slept
            if last:
                loss_sum += y.detach().to(torch.float64)
                outs = [y]
            else:
                p2p.send_tree(y, next_rank)
                outs = [t for t in tree_flatten(y)[0] if isinstance(t, torch.Tensor)]
                outs = [t for t in outs if t.requires_grad]
            saved[i] = (grad_in, outs)
            del x, y
        else:
            grad_in, outs = saved.pop(i)
            grads = None
            if not last:
                grads = [p2p.recv(next_rank) for _ in outs]
            if n == last_backward and before_last_backward is not None:
                before_last_backward(loss_sum, count_sum, sum_mode)
            _sync(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            if outs and outs[0].requires_grad:
                torch.autograd.backward(outs, grads)
            _sync(device)
            dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
            slept = slow_down(emulation, device_id, dt, cpu_s=cpu)
            timers.emulated_compute_s += slept
            timers.backward_time_s += dt + slept
            for t in grad_in:
                p2p.send(t.grad if t.grad is not None else torch.zeros_like(t), prev_rank)
            del grad_in, outs
    return loss_sum, count_sum, sum_mode
