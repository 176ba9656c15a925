"""Pipeline dimension: point-to-point activation/gradient messages and the 1F1B and GPipe
schedules of one stage (docs/model.md §1, §5).

A pytree of tensors between neighbouring stages travels as one message (its tensors' bytes
and a trailer) whenever it is described like the previous message on that link direction;
a description (dtypes, shapes, requires-grad flags, the structure of a non-tensor tree)
travels first when it changes (:class:`P2P`), so any chain works (int64 token ids at the
first stage, bf16 under autocast, a smaller last micro-batch) without shape inference. Sends
are non-blocking (``isend``, waited at the end of the step); each receive of a known size is
posted ahead (``irecv``, :meth:`P2P.post_recv`) as soon as the previous message of its channel
is read; with every stage issuing its forward messages and its backward messages in
micro-batch order, 1F1B and GPipe cannot deadlock (Narayanan et al., *PipeDream-Flush /
Megatron-LM 1F1B*, SC'21). Each direction of a link has its own two-rank process group
(``GroupCache.pipeline_channels``), so with NCCL a queued activation send never blocks the
gradient receive coming the other way.

The wire format (tensor descriptions, a pytree's JSON structure, packed message layout) and its
validation are in :mod:`hetrain.runtime.stagewire`: nothing received is unpickled, and a
malformed message is a one-line :class:`~hetrain.runtime.stagewire.StageMessageError` that
changes nothing.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from hetrain.runtime.emulation import Emulation, sleep_s, slow_down
from hetrain.runtime.stagewire import (
    _DTYPES,
    HEADER_LEN,
    MAX_STRUCTURE_BYTES,
    MAX_TREE_TENSORS,
    TAG_PAYLOAD,
    TRAILER,
    StageMessageError,
    _aligned,
    _header,
    _packed_size,
    _valid_header,
    decode_structure,
    encode_structure,
)


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


_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
"""The wire dtypes numpy has (all but bfloat16), by torch dtype."""


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a 1-d tensor of stride 1, conjugate and negative bits resolved (a
    view of ``t`` where one exists; a size-1 dimension may keep any stride, so a "contiguous"
    tensor can still need a copy)."""
    a = t.detach()
    if a.is_conj() or a.is_neg():
        a = a.resolve_conj().resolve_neg()
    flat = a.reshape(-1)
    if flat.numel() == 0 or flat.stride(0) == 1:
        return flat
    return flat.clone(memory_format=torch.contiguous_format)


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a flat ``uint8`` numpy array (a view when it can be)."""
    flat = _flat(t)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    if flat.dtype in _NUMPY:
        return flat.numpy().view(np.uint8)
    return flat.view(torch.uint8).numpy()


def _trailer(buf: torch.Tensor, host: np.ndarray | None = None) -> tuple[int, int]:
    """``(flag, send time ns)`` of a packed message: read from ``host`` (``buf``'s bytes as
    numpy, a CPU buffer) when given, else one device-to-host read of ``buf``'s tail."""
    if host is not None:
        flag, sent_ns = host[host.size - TRAILER * 8 :].view(np.int64).tolist()
    else:
        flag, sent_ns = buf[buf.numel() - TRAILER * 8 :].view(torch.int64).tolist()
    return int(flag), int(sent_ns)


def _host_view(buf: torch.Tensor) -> np.ndarray | None:
    """A CPU buffer's bytes as a numpy array (a view), None on another device."""
    return buf.numpy() if buf.device.type == "cpu" else None


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors of a pytree, in ``tree_flatten`` order; a plain ``torch.Tensor`` (the
    usual activation, gradient and input) is its own single leaf, without a pytree walk."""
    if type(obj) is torch.Tensor:
        return [obj]
    return [a for a in tree_flatten(obj)[0] if isinstance(a, torch.Tensor)]


SEND_POOL_BYTES = 64 * 2**20
"""Most bytes of host send buffers a :class:`P2P` pool keeps between steps."""


class P2P:
    """Messages between pipeline neighbours, with per-link bandwidth emulation.

    Wire format (one channel = one direction of one link): a pytree of tensors travels as ONE
    message when it looks like the previous one on that channel (same structure, dtypes,
    shapes and requires-grad flags: every micro-batch of a step but a smaller last one): the
    tensors' bytes, each aligned to 16 bytes, then a trailer ``int64[flag, send time ns]``.
    Both sides keep the last *description* per channel (:attr:`cache`, kept across steps by
    the engine and cleared on a plan change), so the receiver knows the size. When the
    description changes, the sender first sends a message of the size the receiver expects
    with flag 1, then the new description (``int64[plain, blob bytes, tensors]``, one int64
    header ``(dtype, ndim, requires grad, dims...)`` per tensor, and the JSON structure of a
    non-tensor tree, :func:`encode_structure`), then the data message; a channel's first
    message is a description. One message per activation and per gradient, as torch's
    pipelining sends (each gloo message costs a round trip of ~1 ms on a loaded 2-core host).
    A received description is validated (:class:`StageMessageError` otherwise).

    Link emulation: the trailer carries the sender's wall-clock send time; the receiver sleeps
    until ``max(send time, link free) + n / bw + latency`` (one link = one FIFO pipe per
    direction), so emulated transfers overlap with the sender's compute as docs/model.md §3
    assumes. Send times are compared across processes with ``time.time_ns`` (one machine, or
    synchronised clocks).

    Send buffers (CPU): a packed message is written into a host buffer of its size taken from
    :attr:`send_buffers` (``size -> free buffers``, kept across steps by the engine like
    :attr:`cache`) or newly allocated; :meth:`wait_sends` puts the step's buffers back once
    their sends completed (up to :data:`SEND_POOL_BYTES` in all), so a steady pipeline
    allocates no send buffer per message.
    """

    def __init__(
        self,
        device: torch.device,
        devices: tuple[str, ...],
        rank: int,
        timers: Timers,
        emulation: Emulation | None,
        channels: dict[tuple[int, int], Any] | None = None,
        cache: dict[tuple[int, int], Any] | None = None,
        send_buffers: dict[int, list[np.ndarray]] | None = None,
    ) -> None:
        self.device = device
        self.devices = devices
        self.rank = rank
        self.timers = timers
        self.emulation = emulation
        self.channels = channels or {}
        self.cache: dict[tuple[int, int], Any] = {} if cache is None else cache
        self.send_buffers: dict[int, list[np.ndarray]] = (
            {} if send_buffers is None else send_buffers
        )
        self._in_flight: list[np.ndarray] = []  # this step's send buffers (CPU)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # src -> its next message
        self._link_free_ns: dict[int, int] = {}
        self._idle: tuple[int, Callable[[], None]] | None = None

    def when_waiting_for(self, src: int, work: Callable[[], None]) -> None:
        """Run ``work`` once, right before the next :meth:`recv_tree` from ``src`` waits (a
        point where this rank waits for its neighbour anyway: bookkeeping that need not be on
        the step's critical path, e.g. reading the previous step's sums)."""
        self._idle = (src, work)

    # -- raw messages
    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        group = self.channels.get((self.rank, dst))
        self._pending.append((dist.isend(tensor, dst, group=group, tag=TAG_PAYLOAD), tensor))

    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(tensor, src, group=self.channels.get((src, self.rank)), tag=TAG_PAYLOAD)
        return tensor

    def post_recv(self, src: int) -> None:
        """Post now (non-blocking) the receive of the next message from ``src``, when its size
        is known (a description of that channel is cached) and none is posted yet; the next
        :meth:`recv_tree` from ``src`` takes it. Only call it when a message from ``src`` is
        due later in the step (the receive must be matched).

        Gloo's TCP transport sends a message's payload only once the receiver has posted its
        receive (until then the sender's side only announces it, and the payload waits for a
        round trip through the sender's transport thread): a receive posted before the
        sender's send makes the transfer one-way, as ``torch.distributed.pipelining`` posts
        its receives ahead (batched with its sends)."""
        if src in self._posted:
            return
        cached = self.cache.get((src, self.rank))
        if cached is None:
            return
        buf = torch.empty(cached[1], dtype=torch.uint8, device=self.device)
        group = self.channels.get((src, self.rank))
        self._posted[src] = (dist.irecv(buf, src, group=group, tag=TAG_PAYLOAD), buf)

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _pack(self, tensors: list[torch.Tensor], flag: int, size: int | None = None):
        size = size if size is not None else _packed_size(tuple(_header(t) for t in tensors))
        if self.device.type == "cpu":
            # through numpy: one copy per tensor, no tensor slicing (each torch call here
            # costs microseconds of dispatch, on every message), into a reused buffer
            free = self.send_buffers.get(size)
            out = free.pop() if free else np.empty(size, dtype=np.uint8)
            self._in_flight.append(out)
            offset = 0
            for t in tensors:
                raw = _host_bytes(t)
                out[offset : offset + raw.size] = raw
                offset += _aligned(raw.size)
            out[size - TRAILER * 8 :].view(np.int64)[:] = (flag, time.time_ns())
            return torch.from_numpy(out)
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        offset = 0
        for t in tensors:
            if t.numel() == 0:
                continue
            raw = _flat(t).view(torch.uint8)
            buf[offset : offset + raw.numel()] = raw
            offset += _aligned(raw.numel())
        # one host-to-device copy
        trailer = torch.tensor([flag, time.time_ns()], dtype=torch.int64).view(torch.uint8)
        buf[size - TRAILER * 8 :].copy_(trailer)
        return buf

    # -- trees
    def send_tree(self, obj: Any, dst: int) -> None:
        """Non-blocking send of a pytree of tensors (tensor, tuple, dict, ``ModelOutput``...;
        any dtype, ``ndim <= 8``); a gradient comes back for each tensor that requires grad."""
        t0 = time.perf_counter()
        blob = b""
        if type(obj) is torch.Tensor:  # the usual message: no pytree walk
            plain, tensors = True, [obj]
        else:
            flat, spec = tree_flatten(obj)
            plain = isinstance(obj, torch.Tensor)
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            if not plain:
                mask = [isinstance(a, torch.Tensor) for a in flat]
                blob = encode_structure(spec, flat, mask)
        headers = tuple(_header(t) for t in tensors)
        desc = (plain, blob, headers)
        key = (self.rank, dst)
        cached = self.cache.get(key)
        if cached is None or cached[0] != desc:
            if cached is not None:  # the receiver expects data of the old size: say "changed"
                self._isend(self._pack([], 1, cached[1]), dst)
            self._isend(self._ints([int(plain), len(blob), len(headers)]), dst)
            if headers:
                rows = [list(h) + [0] * (HEADER_LEN - len(h)) for h in headers]
                self._isend(self._ints([v for row in rows for v in row]), dst)
            if blob:
                self._isend(
                    torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device), dst
                )
            cached = (desc, _packed_size(headers), None)
            self.cache[key] = cached
        self._isend(self._pack(tensors, 0, cached[1]), dst)
        self.timers.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        self.timers.send_recv_time_s += time.perf_counter() - t0

    def recv_tree(self, src: int) -> tuple[Any, list[bool]]:
        """Blocking receive of a pytree sent by :meth:`send_tree` (then emulated link delay);
        returns it and, per tensor leaf, whether the sender's tensor required grad (the
        receiver then marks it ``requires_grad``)."""
        t0 = time.perf_counter()
        key = (src, self.rank)
        cached = self.cache.get(key)
        buf = None
        if self._idle is not None and self._idle[0] == src:
            work, self._idle = self._idle[1], None
            work()
        posted = self._posted.pop(src, None)
        if posted is not None:  # of the cached size: the description has not changed since
            posted[0].wait()
            buf = posted[1]
        elif cached is not None:
            buf = self._recv(torch.empty(cached[1], dtype=torch.uint8, device=self.device), src)
        host = _host_view(buf) if buf is not None else None
        trailer = _trailer(buf, host) if buf is not None else None
        if trailer is not None and trailer[0] != 0:  # the description changed
            buf = None
        if buf is None:
            plain, length, count = self._recv(
                torch.empty(3, dtype=torch.int64, device=self.device), src
            ).tolist()
            source = f"stage message from rank {src}"
            if (
                plain not in (0, 1)
                or not 0 <= length <= MAX_STRUCTURE_BYTES
                or not 0 <= count <= MAX_TREE_TENSORS
                or (plain and (count != 1 or length != 0))
                or (not plain and length == 0)
            ):
                raise StageMessageError(f"{source}: malformed description")
            headers: tuple[tuple[int, ...], ...] = ()
            if count:
                rows = (
                    self._recv(
                        torch.empty(count * HEADER_LEN, dtype=torch.int64, device=self.device), src
                    )
                    .view(count, HEADER_LEN)
                    .tolist()
                )
                if not all(_valid_header(r) for r in rows):
                    raise StageMessageError(f"{source}: malformed tensor header")
                headers = tuple(tuple(r[: 3 + r[1]]) for r in rows)
            struct = None
            blob = b""
            if length > 0:
                data = self._recv(torch.empty(length, dtype=torch.uint8, device=self.device), src)
                blob = data.cpu().numpy().tobytes()
                with warnings.catch_warnings():
                    # torch's TreeSpec building trips its own LeafSpec deprecation (a FutureWarning
                    # printed once per pipeline stage on the user's console)
                    warnings.filterwarnings("ignore", ".*LeafSpec.* is deprecated", FutureWarning)
                    struct = decode_structure(blob, source)
                if sum(struct[2]) != count:
                    raise StageMessageError(
                        f"{source}: structure has {sum(struct[2])} tensors, message {count}"
                    )
            cached = ((bool(plain), blob, headers), _packed_size(headers), struct)
            self.cache[key] = cached
            buf = self._recv(torch.empty(cached[1], dtype=torch.uint8, device=self.device), src)
            host = _host_view(buf)
            trailer = _trailer(buf, host)
        (plain, _, headers), size, struct = cached
        tensors, flags = [], []
        offset = 0
        num_bytes = 0
        for h in headers:
            dtype, shape = _DTYPES[h[0]], h[3:]
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            np_dtype = _NUMPY.get(dtype) if host is not None else None
            if np_dtype is not None:  # one torch call (see _pack)
                part = host[offset : offset + nbytes].view(np_dtype).reshape(shape)
                tensors.append(torch.from_numpy(part))
            else:
                tensors.append(buf[offset : offset + nbytes].view(dtype).view(shape))
            flags.append(bool(h[2]))
            offset += _aligned(nbytes)
            num_bytes += nbytes
        em = self.emulation
        if em is not None and em.limits_links():
            sent_ns = trailer[1]
            start_ns = max(sent_ns, self._link_free_ns.get(src, 0))
            busy_s = em.transfer_time_s(self.devices[src], self.devices[self.rank], num_bytes)
            arrival_ns = start_ns + int(busy_s * 1e9)
            self._link_free_ns[src] = arrival_ns - int(em.latency_s * 1e9)
            sleep_s((arrival_ns - time.time_ns()) / 1e9)
        self.timers.bytes_received += num_bytes
        dt = time.perf_counter() - t0
        self.timers.send_recv_time_s += dt
        peer = self.devices[src]
        self.timers.link_time_s[peer] = self.timers.link_time_s.get(peer, 0.0) + dt
        if plain:
            return tensors[0], flags
        spec, flat, mask = struct
        flat = list(flat)
        it = iter(tensors)
        for k, is_tensor in enumerate(mask):
            if is_tensor:
                flat[k] = next(it)
        return tree_unflatten(flat, spec), flags

    def wait_sends(self) -> None:
        """Wait for all pending sends of this step (time counted as send/recv time)."""
        t0 = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        pooled = sum(b.size for free in self.send_buffers.values() for b in free)
        for out in self._in_flight:  # sent: free for the next messages of their size
            if pooled + out.size <= SEND_POOL_BYTES:
                self.send_buffers.setdefault(out.size, []).append(out)
                pooled += out.size
        self._in_flight.clear()
        self.timers.send_recv_time_s += time.perf_counter() - t0


def _slice_rows(obj: Any, start: int, end: int) -> Any:
    """Rows ``[start, end)`` of every tensor of a pytree of model inputs."""
    if type(obj) is torch.Tensor:
        return obj[start:end]
    flat, spec = tree_flatten(obj)
    return tree_unflatten([a[start:end] if isinstance(a, torch.Tensor) else a for a in flat], spec)


def _float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _no_clock() -> float:
    return 0.0


_NO_AUTOCAST = contextlib.nullcontext()


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
    # the thread's CPU clock only when the emulation uses it (a system call per read)
    thread_cpu = emulation is not None and emulation.compute_clock == "thread_cpu"
    cpu_clock = time.thread_time if thread_cpu else _no_clock
    # the forward runs under ``torch.autocast`` with bf16, or with autocast disabled when the
    # caller's code enabled it; with neither, entering a disabled autocast changes nothing
    use_autocast = autocast_dtype is not None or torch.is_autocast_enabled(device.type)
    saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count_sum = torch.zeros((), dtype=torch.float64, device=device)
    sum_mode = False
    last_backward = max((n for n, (op, _) in enumerate(ops) if op == "B"), default=-1)
    # messages due later in this step on each incoming channel: a receive is posted ahead for
    # the next one as soon as the previous one is read (P2P.post_recv)
    forwards_due = 0 if first else sum(1 for op, _ in ops if op == "F")
    gradients_due = 0  # backwards whose forward sent a tensor that requires grad
    if forwards_due:
        p2p.post_recv(prev_rank)
    for n, (op, i) in enumerate(ops):
        start, end = microbatches[i]
        if op == "F":
            x = None
            grad_in: list[torch.Tensor] = []
            if not first:
                x, flags = p2p.recv_tree(prev_rank)
                forwards_due -= 1
                if forwards_due:
                    p2p.post_recv(prev_rank)
                for t, flag in zip(tensor_leaves(x), flags, strict=True):
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
            t0, c0 = time.perf_counter(), cpu_clock()
            bookkeeping_s = bookkeeping_cpu_s = 0.0
            amp = _NO_AUTOCAST
            if use_autocast:
                amp = torch.autocast(
                    device_type=device.type,
                    dtype=autocast_dtype or torch.bfloat16,
                    enabled=autocast_dtype is not None,
                )
            with amp:
                if ctx is not None:
                    try:
                        y = stage_forward(x, mb_inputs)
                    except BaseException as exc:
                        ctx.__exit__(type(exc), exc, exc.__traceback__)
                        raise
                    e0, ec0 = time.perf_counter(), cpu_clock()
                    ctx.__exit__(None, None, None)
                    bookkeeping_s = time.perf_counter() - e0
                    bookkeeping_cpu_s = cpu_clock() - ec0
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
            cpu = cpu_clock() - c0 - bookkeeping_cpu_s
            slept = slow_down(emulation, device_id, dt, microbatch=True, cpu_s=cpu)
            timers.emulated_compute_s += slept
            timers.forward_time_s += dt + slept
            if last:
                loss_sum += y.detach().to(torch.float64)
                outs = [y]
            else:
                p2p.send_tree(y, next_rank)
                outs = [t for t in tensor_leaves(y) if t.requires_grad]
                if outs:
                    gradients_due += 1
                    p2p.post_recv(next_rank)
            saved[i] = (grad_in, outs)
            del x, y
        else:
            grad_in, outs = saved.pop(i)
            grads = None
            if not last and outs:  # one message: the tensor, or a tuple of them
                received, _ = p2p.recv_tree(next_rank)
                gradients_due -= 1
                if gradients_due:
                    p2p.post_recv(next_rank)
                grads = [received] if len(outs) == 1 else list(received)
            if n == last_backward and before_last_backward is not None:
                before_last_backward(loss_sum, count_sum, sum_mode)
            _sync(device)
            t0, c0 = time.perf_counter(), cpu_clock()
            if outs and outs[0].requires_grad:
                torch.autograd.backward(outs, grads)
            _sync(device)
            dt, cpu = time.perf_counter() - t0, cpu_clock() - c0
            slept = slow_down(emulation, device_id, dt, cpu_s=cpu)
            timers.emulated_compute_s += slept
            timers.backward_time_s += dt + slept
            if grad_in:
                sent = [t.grad if t.grad is not None else torch.zeros_like(t) for t in grad_in]
                p2p.send_tree(sent[0] if len(sent) == 1 else tuple(sent), prev_rank)
            del grad_in, outs
    return loss_sum, count_sum, sum_mode
