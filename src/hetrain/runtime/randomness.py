"""Plan-invariant randomness: every random draw of the model depends only on the key
``(seed, step, global sample index, module path, call number)`` and the element's index within
the sample, never on the device, the micro-batch or the plan (docs/runtime.md "Randomness";
docs/model.md §5 "Randomness").

Interface (the engine's side):

    rng = InvariantRandomness(model, seed=0, exact=False)   # once; model = the FULL model
    for line in rng.static_problems(): warn or refuse         # start-up (module types)
    with rng.forward(step=t, sample_index=rows):            # around ONE micro-batch forward
        y = stage(x)                                         # rows: LongTensor[n], global rows
    rng.problems                                             # uncovered random ops seen so far

``forward`` pushes a :class:`torch.overrides.TorchFunctionMode` that replaces ``F.dropout``,
``F.dropout1d/2d/3d``, ``F.alpha_dropout``, ``F.feature_alpha_dropout``, ``F.rrelu`` (and the
``torch.dropout`` family) and ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (written
out in torch ops as ATen's math kernel computes it, with a per-sample keep mask of the attention
weights) by draws from a counter-based hash, and global module forward hooks that keep the
innermost module's path (its name in ``model.named_modules()``) and a per-path call counter
(reset for every micro-batch, so a sample's ``c``-th draw in a module has call number ``c``
whatever micro-batch it is in).

Draws: the 64-bit words ``Z(i) = splitmix64(k_s + (i + 1) * φ')`` of sample ``s``, with the
per-sample key ``k_s = splitmix64(key(seed, step, path, call) + s * φ)`` (Steele, Lea, Flood,
*Fast splittable pseudorandom number generators*, OOPSLA 2014), each split into two 32-bit
draws ``V``: of a tensor with ``m`` elements per sample, element ``j < h = ceil(m / 2)`` gets the
high half of ``Z(j)`` and element ``j >= h`` the low half of ``Z(j - h)``; ``u = V * 2^-32`` in
``[0, 1)``. A dropout keep mask ``u >= p`` is computed on the integers as ``V >= ceil(p *
2^32)`` (bool, no floats), for all samples of a micro-batch at once (in cache-sized blocks on
CPU); all on int64 tensors with wrap-around arithmetic and masked logical shifts, in place, so
CPU and GPU give the same numbers. Backward reuses the forward's masks (autograd keeps them).

A micro-batch tensor's dim 0 is its sample dimension: either ``n`` rows (one per sample) or
``n * r`` rows flattened sample-major (``(B*T, H)``); anything else raises :class:`InputError`
naming the module. Draw sites found without a sample dimension when the model is cut
(:func:`batch_free_draw_sites`) draw once per step for the whole tensor. Random ops that are
not intercepted (``torch.rand*``, ``bernoulli``, ``normal_``, ``multinomial``, dropout inside
``nn.MultiheadAttention``, ...) are recorded in
:attr:`InvariantRandomness.problems`: by name when called at the top level of a forward, and in
any case by a change of torch's global generator state during the forward (cheap; also done when
the mode is off).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from hetrain.errors import InputError

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_GOLDEN2 = 0xD1B54A32D192ED03
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_ALPHA_SELU = 1.7580993408473766  # -SELU alpha * scale, as in ATen's alpha_dropout


def _signed(u: int) -> int:
    """uint64 value -> the int64 with the same bits."""
    u &= _M64
    return u - (1 << 64) if u >= 1 << 63 else u


def splitmix64_int(z: int) -> int:
    """The splitmix64 finaliser on a Python int (mod 2^64), the reference for the tensor one."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on an int64 tensor read as uint64 (wrap-around multiply), equal
    bit for bit to :func:`splitmix64_int` on CPU and GPU."""
    z = (z ^ _srl(z, 30)) * _signed(_C1)
    z = (z ^ _srl(z, 27)) * _signed(_C2)
    return z ^ _srl(z, 31)


def path_hash(path: str) -> int:
    """Stable 64-bit hash of a module path (blake2b; Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little")


def draw_key(seed: int, step: int, path: str, call: int) -> int:
    """The 64-bit key of one draw site: ``(seed, step, module path, call number)``."""
    z = splitmix64_int(int(seed) * _GOLDEN + 0x243F6A8885A308D3)
    z = splitmix64_int(z ^ (int(step) * _GOLDEN2 & _M64))
    z = splitmix64_int(z ^ path_hash(path))
    return splitmix64_int(z + int(call) * _GOLDEN)


def _mix_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """:func:`splitmix64` in place on ``z`` (``tmp``: a scratch tensor of ``z``'s shape): the
    same bits, without a new tensor per operation (the draws' cost is memory traffic)."""
    for shift, mult in ((30, _signed(_C1)), (27, _signed(_C2)), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp &= (1 << (64 - shift)) - 1  # logical shift
        z ^= tmp
        if mult is not None:
            z *= mult
    return z


_J_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}
_J_CACHE_MAX_WORDS = 1 << 20  # 8 MiB per entry; longer rows are computed each time


def _element_offsets(count: int, device: torch.device) -> torch.Tensor:
    """``(i + 1) * φ'`` for ``i < count`` (int64, wrap-around), kept per size and device when
    short (a model has a handful of dropout shapes; at most 16 entries of 8 MiB)."""
    key = (count, device)
    out = _J_CACHE.get(key)
    if out is None:
        out = torch.arange(1, count + 1, dtype=torch.int64, device=device)
        out *= _signed(_GOLDEN2)
        if count <= _J_CACHE_MAX_WORDS:
            if len(_J_CACHE) >= 16:
                _J_CACHE.clear()
            _J_CACHE[key] = out
    return out


def _layout(sample_index: torch.Tensor, shape: Sequence[int]) -> tuple[int, int, int]:
    """``(n, m, h)``: samples, draws per sample, 64-bit words per sample (``ceil(m / 2)``).

    Raises:
        InputError: ``shape[0]`` is not a multiple of ``n``.
    """
    n = int(sample_index.numel())
    if not shape or n == 0 or shape[0] % n:
        raise InputError(
            "model",
            "random op",
            f"a tensor of shape {list(shape)} has no sample dimension of {n} rows in dim 0; "
            "hetrain draws randomness per sample",
        )
    m = math.prod(shape) // n
    return n, m, (m + 1) // 2


def words_per_sample(
    key: int, sample_index: torch.Tensor, count: int, device: torch.device | None = None
) -> torch.Tensor:
    """The 64-bit words ``Z(key, s, i) = splitmix64(k_s + (i + 1) * φ')``, ``i < count``, of the
    samples ``s`` in ``sample_index``, with the per-sample key ``k_s = splitmix64(key + s * φ)``
    (one splitmix64 per word, computed in place): int64 ``[n, count]`` holding the uint64 bits."""
    device = device if device is not None else sample_index.device
    ks = _sample_keys(key, sample_index, device)
    z = torch.add(ks[:, None], _element_offsets(count, device)[None, :])
    return _mix_(z, torch.empty_like(z))


def _sample_keys(key: int, sample_index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The per-sample keys ``k_s = splitmix64(key + s * φ)`` of ``sample_index`` (int64
    ``[n]``) on ``device``."""
    rows = sample_index.reshape(-1).to(device=device, dtype=torch.int64)
    return splitmix64(rows * _signed(_GOLDEN) + _signed(key))


def draws_per_sample(
    key: int, sample_index: torch.Tensor, shape: Sequence[int], device: torch.device | None = None
) -> torch.Tensor:
    """The 32-bit draws ``V(key, s, j)`` (int64 in ``[0, 2^32)``) of a tensor of ``shape`` whose
    dim 0 holds the samples ``sample_index`` (``n`` rows, or ``n * r`` rows flattened
    sample-major): element ``j`` (row-major within the sample) of sample ``s``, of ``m`` draws
    per sample, ``h = ceil(m / 2)``, gets the high half of word ``j`` for ``j < h`` and the low
    half of word ``j - h`` otherwise: ``V = Z(key, s, j) >> 32`` or ``Z(key, s, j - h) mod 2^32``
    (:func:`words_per_sample`; one splitmix64 per two draws).

    Raises:
        InputError: ``shape[0]`` is not a multiple of ``n``.
    """
    shape = tuple(int(d) for d in shape)
    n, m, h = _layout(sample_index, shape)
    z = words_per_sample(key, sample_index, h, device)
    out = torch.empty((n, m), dtype=torch.int64, device=z.device)
    torch.bitwise_right_shift(z, 32, out=out[:, :h])
    out[:, :h] &= _M32
    torch.bitwise_and(z[:, : m - h], _M32, out=out[:, h:])
    return out.reshape(shape)


def uniform_per_sample(
    key: int, sample_index: torch.Tensor, shape: Sequence[int], device: torch.device | None = None
) -> torch.Tensor:
    """Uniform ``[0, 1)`` float64 numbers ``U = V * 2^-32`` of ``shape`` (``V``: the draws of
    :func:`draws_per_sample`, same layout).

    Raises:
        InputError: ``shape[0]`` is not a multiple of ``n``.
    """
    return draws_per_sample(key, sample_index, shape, device).to(torch.float64) * 2.0**-32


def keep_threshold(p: float) -> int:
    """The draw threshold ``T(p) = ceil(p * 2^32)``: ``V >= T(p)`` exactly when ``U = V * 2^-32
    >= p``; ``2^32`` (nothing kept) for ``p = 1``."""
    return math.ceil(float(p) * 2.0**32)


#: words per block of :func:`keep_per_sample` on CPU: a block's words and its scratch (2 x 512
#: KiB) stay in the core's L2 cache through the hash's passes
KEEP_BLOCK_WORDS = 1 << 16
_SCRATCH = threading.local()  # per thread: device -> reused int64 scratch of 2 blocks
_FLIP32 = _signed((1 << 63) | (1 << 31))  # the sign bit of both 32-bit halves of a word
# where a word's high and low 32-bit halves sit in its int32 view (low half first on a
# little-endian machine)
_HIGH_HALF, _LOW_HALF = (1, 0) if sys.byteorder == "little" else (0, 1)


def _scratch(words: int, device: torch.device) -> torch.Tensor:
    """An int64 scratch of at least ``2 * words`` elements: on CPU kept per thread and reused
    (a fresh tensor of a few MiB costs its page faults, as much as the hash), elsewhere new
    (the device's caching allocator reuses memory)."""
    if device.type != "cpu":
        return torch.empty(2 * words, dtype=torch.int64, device=device)
    cache = getattr(_SCRATCH, "tensors", None)
    if cache is None:
        cache = _SCRATCH.tensors = {}
    buf = cache.get(device)
    if buf is None or buf.numel() < 2 * words:
        buf = cache[device] = torch.empty(2 * words, dtype=torch.int64, device=device)
    return buf


def _blocks(n: int, h: int, block: int) -> Iterator[tuple[int, int, int, int]]:
    """``(s0, s1, i0, i1)``: samples ``[s0, s1)`` x words ``[i0, i1)`` covering ``n x h`` in
    blocks of at most ``max(block, h)`` words when ``h <= block`` (whole samples), else of at
    most ``block`` words of one sample."""
    if h <= block:
        per = max(1, block // h)
        for s0 in range(0, n, per):
            yield s0, min(n, s0 + per), 0, h
    else:
        for s in range(n):
            for i0 in range(0, h, block):
                yield s, s + 1, i0, min(h, i0 + block)


def keep_per_sample(
    key: int,
    sample_index: torch.Tensor,
    shape: Sequence[int],
    p: float,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The bool keep mask ``U(key, s, j) >= p`` of ``shape`` (dim 0: the samples
    ``sample_index``, as in :func:`draws_per_sample`), computed on the integers as
    ``V >= T(p)`` (:func:`keep_threshold`) straight from the words: the same mask as
    ``uniform_per_sample(...) >= p``, and on CPU cheaper than torch's ``bernoulli_``
    (docs/runtime.md "Randomness and BatchNorm cost").

    All samples at once, in blocks of at most :data:`KEEP_BLOCK_WORDS` words on CPU (one block
    elsewhere): per block, the words :func:`words_per_sample` computes, in place in a reused
    scratch; then both 32-bit halves of every word get their sign bit flipped (one xor), so
    that the signed int32 order of a half equals the unsigned order of ``V``, and the halves,
    read as int32 (in the machine's byte order), are compared with ``T(p) ^ 2^31``: the high
    halves give elements ``j < h``, the low halves elements ``h + j``.

    Raises:
        InputError: ``shape[0]`` is not a multiple of ``n``.
    """
    shape = tuple(int(d) for d in shape)
    n, m, h = _layout(sample_index, shape)
    threshold = keep_threshold(p)
    device = torch.device(device) if device is not None else sample_index.device
    if threshold > _M32 or m == 0:  # p = 1: nothing is kept, no words needed
        return torch.zeros(shape, dtype=torch.bool, device=device)
    ks = _sample_keys(key, sample_index, device)
    offsets = _element_offsets(h, device)
    t32 = threshold ^ (1 << 31)
    t32 = t32 - (1 << 32) if t32 >= 1 << 31 else t32  # as a signed int32
    out = torch.empty((n, m), dtype=torch.bool, device=device)
    block = KEEP_BLOCK_WORDS if device.type == "cpu" else n * h
    buf = _scratch(min(n * h, block), device)
    for s0, s1, i0, i1 in _blocks(n, h, block):
        size = (s1 - s0) * (i1 - i0)
        z = buf[:size].view(s1 - s0, i1 - i0)
        torch.add(ks[s0:s1, None], offsets[None, i0:i1], out=z)
        _mix_(z, buf[size : 2 * size].view(s1 - s0, i1 - i0))
        z ^= _FLIP32
        halves = z.view(torch.int32)  # [k, 2 (i1 - i0)]: both halves of each word
        torch.ge(halves[:, _HIGH_HALF::2], t32, out=out[s0:s1, i0:i1])
        low_end = min(i1, m - h)  # elements h + j exist for j < m - h
        if low_end > i0:
            low = halves[:, _LOW_HALF : 2 * (low_end - i0) : 2]
            torch.ge(low, t32, out=out[s0:s1, h + i0 : h + low_end])
    return out.reshape(shape)


# -------------------------------------------------------------------------------- arguments
def _bind(args: tuple, kwargs: dict, names: Sequence[str], defaults: dict[str, Any]) -> dict:
    out = dict(defaults)
    out.update(zip(names, args, strict=False))
    out.update(kwargs)
    return out


_DROPOUT_NAMES = ("input", "p", "training", "inplace")
_DROPOUT_DEFAULTS = {"p": 0.5, "training": True, "inplace": False}
_TORCH_DROPOUT_NAMES = ("input", "p", "train")

# kind: (feature noise, alpha dropout)
_F_DROPOUTS: dict[Callable, tuple[bool, bool, int | None]] = {
    F.dropout: (False, False, None),
    F.alpha_dropout: (False, True, None),
    F.dropout1d: (True, False, 3),
    F.dropout2d: (True, False, None),
    F.dropout3d: (True, False, 5),
    F.feature_alpha_dropout: (True, True, None),
}
_TORCH_DROPOUTS: dict[Callable, tuple[bool, bool, int | None]] = {
    torch.dropout: (False, False, None),
    torch.alpha_dropout: (False, True, None),
    torch.feature_dropout: (True, False, None),
    torch.feature_alpha_dropout: (True, True, None),
}

_UNCOVERED_NAMES = {
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "randint",
    "randint_like",
    "randperm",
    "bernoulli",
    "bernoulli_",
    "multinomial",
    "normal",
    "normal_",
    "poisson",
    "uniform_",
    "random_",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "native_dropout",
    "rrelu_with_noise",
    "gumbel_softmax",
    "multi_head_attention_forward",
}


def _rng_states() -> list[torch.Tensor]:
    """torch's global generator states (CPU, and the current CUDA device when initialised)."""
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


class _GeneratorWatch:
    """:meth:`InvariantRandomness.watch`: the generator states before the forward, compared
    after it when it returns (not when it raises, as :meth:`InvariantRandomness.forward`)."""

    __slots__ = ("_owner", "_before")

    def __init__(self, owner: InvariantRandomness) -> None:
        self._owner = owner
        self._before: list[torch.Tensor] = []

    def __enter__(self) -> None:
        self._before = _rng_states()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            self._owner._check_states(self._before, [])
        return False


class InvariantRandomness:
    """Plan-invariant random draws for one model (see the module docstring).

    Args:
        model: the full model (or its list of layers); module paths are its ``named_modules``
            names (layer ``l`` of a list is ``"{l}"``), the same on every rank and plan.
        seed: the run's seed (key part).
        exact: refuse uncovered random ops (the engine raises :class:`InputError`) instead of
            warning.
        active: ``True``/``False`` force the interception on/off; ``None`` (default): on when
            some module in training mode has dropout (``_DropoutNd``/``RReLU``/
            ``MultiheadAttention`` with ``p > 0`` or a float attribute named ``*dropout*`` /
            ``*pdrop*`` > 0, as Hugging Face attention modules have), or ``exact``. Off, a
            forward costs only the generator-state check (which finds, but cannot name, an
            uncovered random op).
        batch_free: draw sites ``(module path, call number)`` whose tensors have no sample
            dimension (:func:`batch_free_draw_sites`): one draw per step for the whole
            tensor, the same in every micro-batch.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        *,
        seed: int = 0,
        exact: bool = False,
        active: bool | None = None,
        batch_free: frozenset[tuple[str, int]] = frozenset(),
    ) -> None:
        root = model if isinstance(model, nn.Module) else nn.ModuleList(list(model))
        self.root = root
        self.seed = int(seed)
        self.exact = bool(exact)
        self._force_active = active
        self._paths: dict[int, str] = {}
        for name, module in root.named_modules(remove_duplicate=False):
            self._paths.setdefault(id(module), name)
        # modules that may draw: (module, attributes holding a probability), found once
        self._candidates: list[tuple[nn.Module, tuple[str, ...]]] = []
        for module in root.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                self._candidates.append((module, ("p",)))
            elif isinstance(module, nn.RReLU):
                self._candidates.append((module, ("upper",)))
            else:
                attrs = tuple(
                    k
                    for k, v in vars(module).items()
                    if ("dropout" in k.lower() or "pdrop" in k.lower()) and isinstance(v, float)
                )
                if attrs:
                    self._candidates.append((module, attrs))
        self.problems: list[str] = []
        self.batch_free = frozenset(batch_free)
        self._survey: dict[tuple[str, int], dict[int, int]] | None = None
        # state of the current forward
        self._stack: list[str] = []
        self._calls: dict[str, int] = {}
        self._step = 0
        self._rows: torch.Tensor | None = None

    # ----------------------------------------------------------------------------- start-up
    def is_active(self) -> bool:
        """Whether :meth:`forward` pushes the interception mode (see ``active``)."""
        if self._force_active is not None:
            return self._force_active
        if self.exact:  # refusing needs the op's name: intercept always
            return True
        for module, attrs in self._candidates:
            if module.training and any(
                isinstance(v := getattr(module, a, 0), (int, float)) and v > 0 for a in attrs
            ):
                return True
        return False

    def static_problems(self) -> list[str]:
        """Module types whose random draws cannot be made invariant (in training mode):
        ``nn.MultiheadAttention(dropout > 0)`` (its dropout runs inside
        ``F.multi_head_attention_forward``, out of reach of the mode). One line each."""
        out = []
        for name, module in self.root.named_modules():
            if module.training and isinstance(module, nn.MultiheadAttention) and module.dropout:
                out.append(
                    f"{name or type(module).__name__}: nn.MultiheadAttention(dropout="
                    f"{module.dropout}) draws its attention dropout inside "
                    "F.multi_head_attention_forward, which hetrain cannot make plan-invariant"
                )
        return out

    # ----------------------------------------------------------------------------- forward
    @contextlib.contextmanager
    def forward(self, *, step: int, sample_index: torch.Tensor) -> Iterator[None]:
        """Context for one micro-batch's forward: samples ``sample_index`` (int64 ``[n]``, the
        rows of the global batch, in the order of dim 0) at iteration ``step``."""
        before = _rng_states()
        if not self.is_active():
            yield
            self._check_states(before, [])
            return
        self._step = int(step)
        self._rows = sample_index.reshape(-1).to(torch.int64)
        self._stack = []
        self._calls = {}
        seen: list[str] = []
        mode = _Mode(self, seen)
        pre = nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
        post = nn.modules.module.register_module_forward_hook(self._post_hook, always_call=True)
        try:
            with mode:
                yield
        finally:
            pre.remove()
            post.remove()
            self._stack = []
            self._rows = None
        self._check_states(before, seen)

    def watch(self) -> _GeneratorWatch:
        """Context for one micro-batch's forward while :meth:`is_active` is false: what
        :meth:`forward` then does (the check of torch's global generator states, recorded in
        :attr:`problems`), without its sample rows."""
        return _GeneratorWatch(self)

    def _check_states(self, before: list[torch.Tensor], seen: list[str]) -> None:
        after = _rng_states()
        changed = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        for item in seen:
            if item not in self.problems:
                self.problems.append(item)
        if changed and not seen:
            what = "a random op hetrain does not intercept drew from torch's global generator"
            if what not in self.problems:
                self.problems.append(what)

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        path = self._paths.get(id(module))
        if path is None:
            parent = self._stack[-1] if self._stack else ""
            path = f"{parent}/{type(module).__name__}"
        self._stack.append(path)

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def current_path(self) -> str:
        return self._stack[-1] if self._stack else ""

    def next_key(self) -> tuple[int, str]:
        """Key of the next draw in the innermost module (advances its call counter)."""
        key, path, _ = self._next_site()
        return key, path

    def _next_site(self) -> tuple[int, str, int]:
        path = self.current_path()
        call = self._calls.get(path, 0)
        self._calls[path] = call + 1
        return draw_key(self.seed, self._step, path, call), path, call

    def _site_rows(self, shape: Sequence[int]) -> tuple[int, str, torch.Tensor | None]:
        """``(key, path, rows)`` of the next draw site: the micro-batch's sample rows, or the
        single row :data:`NO_SAMPLE` at a batch-free site; rows None while surveying (the
        site's dim 0 is recorded instead)."""
        assert self._rows is not None
        key, path, call = self._next_site()
        if self._survey is not None:
            n = int(self._rows.numel())
            self._survey.setdefault((path, call), {})[n] = int(shape[0]) if shape else -1
            return key, path, None
        if (path, call) in self.batch_free:
            return key, path, NO_SAMPLE
        return key, path, self._rows

    def uniform(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        """Uniform ``[0, 1)`` float64 draws of ``shape`` for the next draw site."""
        key, path, rows = self._site_rows(shape)
        if rows is None:
            return torch.full(tuple(shape), 0.5, dtype=torch.float64, device=device)
        try:
            return uniform_per_sample(key, rows, shape, device)
        except InputError as exc:
            raise InputError("model", path or "<root>", exc.expected) from None

    def keep(self, shape: Sequence[int], p: float, device: torch.device) -> torch.Tensor:
        """The bool keep mask ``u >= p`` of ``shape`` for the next draw site (the same mask as
        ``uniform(shape, device) >= p``, see :func:`keep_per_sample`)."""
        key, path, rows = self._site_rows(shape)
        if rows is None:
            return torch.ones(tuple(shape), dtype=torch.bool, device=device)
        try:
            return keep_per_sample(key, rows, shape, p, device)
        except InputError as exc:
            raise InputError("model", path or "<root>", exc.expected) from None


NO_SAMPLE = torch.tensor([-1], dtype=torch.int64)
"""The sample index of a batch-free draw site: the whole tensor is one "sample" whose key no
sample of the data set has."""

SURVEY_ROWS = (2, 4)
"""Micro-batch sizes of :func:`batch_free_draw_sites` (copies of one sample; two rows so that
BatchNorm in training mode has more than one value per channel)."""


def batch_free_draw_sites(
    model: nn.Module, example_inputs: Any, call: Callable[[nn.Module, Any], Any]
) -> frozenset[tuple[str, int]]:
    """The draw sites ``(module path, call number)`` of ``model``'s forward whose tensor has no
    sample dimension (e.g. DeBERTa-v2's dropout on its relative-position table, ``[2 buckets,
    hidden]``): ``call(model, x)`` runs on the first sample of ``example_inputs`` (a tensor or
    a pytree of tensors with rows in dim 0) repeated ``n`` times for each ``n`` of
    :data:`SURVEY_ROWS`, under :class:`InvariantRandomness` with the draws replaced by
    constants; a site whose dim 0 is the same at every ``n`` has no sample dimension (one
    with ``n · r`` rows has). Such a site then draws once per step for the whole tensor, the
    same in every micro-batch, as one device's single forward per step draws once.

    ``model`` is left exactly as it was (:func:`hetrain.runtime.startup.unchanged`). Empty when
    no module draws in training mode, the inputs have no rows, or the forward fails (then
    every site keeps per-sample draws).
    """
    from torch.utils._pytree import tree_flatten, tree_map_only

    from hetrain.runtime.startup import unchanged

    rng = InvariantRandomness(model)
    leaves = [t for t in tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor)]
    if not rng.is_active() or not leaves or any(t.dim() == 0 or t.shape[0] < 1 for t in leaves):
        return frozenset()
    seen: dict[tuple[str, int], dict[int, int]] = {}
    rng._survey = seen
    try:
        with unchanged(model), torch.no_grad():
            for n in SURVEY_ROWS:
                x = tree_map_only(
                    torch.Tensor, lambda t, n=n: t[:1].expand(n, *t.shape[1:]).clone(),
                    example_inputs,
                )  # fmt: skip
                with rng.forward(step=0, sample_index=torch.arange(n)):
                    call(model, x)
    except Exception:  # noqa: BLE001  (a model that cannot run here keeps per-sample draws)
        return frozenset()
    # the same positive dim 0 at every survey size: no sample dimension
    return frozenset(
        site
        for site, rows in seen.items()
        if len(rows) == len(SURVEY_ROWS) and len(set(rows.values())) == 1 and min(rows.values()) > 0
    )


def _dropout(
    rng: InvariantRandomness,
    x: torch.Tensor,
    p: float,
    training: bool,
    inplace: bool,
    feature: bool,
    alpha: bool,
) -> torch.Tensor:
    """Dropout as ATen's ``_dropout_impl`` (same scaling, alpha-dropout affine correction), with
    the keep mask ``u >= p`` from :meth:`InvariantRandomness.keep`."""
    if p < 0 or p > 1:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0 or x.numel() == 0:
        return x
    shape = tuple(x.shape[:2]) + (1,) * (x.dim() - 2) if feature else tuple(x.shape)
    keep = rng.keep(shape, p, x.device)
    if p == 1:
        return x.mul_(0) if inplace else x * 0
    noise = keep.to(x.dtype)
    if alpha:
        a = 1.0 / math.sqrt((_ALPHA_SELU**2 * p + 1) * (1 - p))
        b = (noise - 1) * (_ALPHA_SELU * a) + _ALPHA_SELU * a * p
        noise = noise * a
        return x.mul_(noise).add_(b) if inplace else x * noise + b
    noise.div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


_SDPA_NAMES = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)
_SDPA_DEFAULTS = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def _sdpa(rng: InvariantRandomness, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """``scaled_dot_product_attention`` with ``dropout_p = p > 0``: ``(softmax(q k^T * scale +
    mask) * keep) @ (v / (1 - p))`` with the per-sample keep mask of the attention weights'
    shape ``(*q.shape[:-1], S)`` (:meth:`InvariantRandomness.keep`), written out in torch ops
    as ATen's math kernel (``_scaled_dot_product_attention_math``, the reference the fused
    kernels are tested against) computes it, and as cheap as it can be on CPU:

    - grouped-query attention (``enable_gqa``, ``Hk`` key/value heads for ``Hq = r * Hk``
      query heads) repeats each key/value head ``r`` times (``repeat_interleave``, as the
      math kernel);
    - the scale multiplies ``q`` (``L x E``, not the ``L x S`` scores);
    - the causal mask (``is_causal``: key ``i <= `` query ``i``) or ``attn_mask`` (bool: keep
      where True; float: added) is added to the scores in place; with ``attn_mask``, rows
      masked entirely get weights 0 (``_safe_softmax``, as the math kernel); causal rows
      always keep a key, so they take the plain softmax (the same numbers);
    - the weights are multiplied by the bool keep mask (nothing kept for ``p = 1``).

    ``attn_mask`` together with ``is_causal`` is torch's error, raised by torch."""
    a = _bind(args, kwargs, _SDPA_NAMES, _SDPA_DEFAULTS)
    p = float(a["dropout_p"])
    mask = a["attn_mask"]
    if p <= 0 or (mask is not None and a["is_causal"]):
        return func(*args, **kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    length, source = q.shape[-2], k.shape[-2]
    keep = rng.keep((*q.shape[:-1], source), p, q.device)
    if a["enable_gqa"] and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        repeats = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(repeats, -3)
        v = v.repeat_interleave(repeats, -3)
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    if a["is_causal"]:
        above = torch.ones((length, source), dtype=torch.bool, device=q.device).triu_(1)
        mask = torch.zeros((), dtype=scores.dtype, device=q.device).masked_fill(
            above, float("-inf")
        )
    elif mask is not None and mask.dtype == torch.bool:  # as SDPA's convert_boolean_attn_mask
        mask = torch.zeros((), dtype=scores.dtype, device=q.device).masked_fill(
            mask.logical_not(), float("-inf")
        )
    if mask is not None:
        if torch.broadcast_shapes(mask.shape, scores.shape) == scores.shape:
            scores.add_(mask)
        else:
            scores = scores + mask
    if mask is None or a["is_causal"]:
        weights = torch.softmax(scores, -1)
    else:
        weights = torch.ops.aten._safe_softmax(scores, -1)
    return torch.matmul(weights * keep, v * (1.0 / (1.0 - p) if p < 1 else 0.0))


def _rrelu(rng: InvariantRandomness, args: tuple, kwargs: dict) -> torch.Tensor:
    """``F.rrelu`` in training: negative inputs times ``a ~ U(lower, upper)`` per element."""
    a = _bind(
        args,
        kwargs,
        ("input", "lower", "upper", "training", "inplace"),
        {"lower": 1.0 / 8, "upper": 1.0 / 3, "training": False, "inplace": False},
    )
    x = a["input"]
    if not a["training"]:
        slope = (a["lower"] + a["upper"]) / 2
        return F.leaky_relu(x, slope, a["inplace"])
    u = rng.uniform(tuple(x.shape), x.device)
    slope = (a["lower"] + (a["upper"] - a["lower"]) * u).to(x.dtype)
    out = torch.where(x >= 0, x, x * slope)
    return x.copy_(out) if a["inplace"] else out


class _Mode(TorchFunctionMode):
    """Replaces the random functions for one micro-batch forward (see module docstring)."""

    def __init__(self, rng: InvariantRandomness, seen: list[str]) -> None:
        super().__init__()
        self.rng = rng
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        # every torch call of the forward comes here: one dict look-up for the few replaced
        # functions, one set look-up of the name for the uncovered ones, else the call
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(self.rng, func, args, kwargs or {})
        if getattr(func, "__name__", "") in _UNCOVERED_NAMES:
            self._uncovered(func, args, kwargs or {})
        return func(*args, **kwargs) if kwargs else func(*args)

    def _uncovered(self, func: Callable, args: tuple, kwargs: dict) -> None:
        name = func.__name__
        if name != "multi_head_attention_forward" or _mha(args, kwargs):
            where = self.rng.current_path() or "<root>"
            self.seen.append(
                f"{where}: {name} draws random numbers hetrain cannot make plan-invariant"
            )


def _f_dropout(rng: InvariantRandomness, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.dropout`` and its feature / alpha variants (:data:`_F_DROPOUTS`)."""
    feature, alpha, batched_ndim = _F_DROPOUTS[func]
    a = _bind(args, kwargs, _DROPOUT_NAMES, _DROPOUT_DEFAULTS)
    x = a["input"]
    if feature and x.dim() < (batched_ndim or 3):
        raise InputError(
            "model",
            rng.current_path() or "<root>",
            f"{func.__name__} on an unbatched input of shape {list(x.shape)}; "
            "hetrain draws randomness per sample",
        )
    return _dropout(rng, x, a["p"], a["training"], a["inplace"], feature, alpha)


def _torch_dropout(rng: InvariantRandomness, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.dropout`` and its feature / alpha variants (:data:`_TORCH_DROPOUTS`)."""
    feature, alpha, _ = _TORCH_DROPOUTS[func]
    a = _bind(args, kwargs, _TORCH_DROPOUT_NAMES, {})
    return _dropout(rng, a["input"], a["p"], a["train"], False, feature, alpha)


#: the replaced functions: func -> handler(rng, func, args, kwargs)
_HANDLERS: dict[Callable, Callable[[InvariantRandomness, Callable, tuple, dict], Any]] = {
    **dict.fromkeys(_F_DROPOUTS, _f_dropout),
    **dict.fromkeys(_TORCH_DROPOUTS, _torch_dropout),
    F.scaled_dot_product_attention: _sdpa,
    F.rrelu: lambda rng, func, args, kwargs: _rrelu(rng, args, kwargs),
    torch.rrelu: lambda rng, func, args, kwargs: _rrelu(rng, args, kwargs),
}


def _mha(args: tuple, kwargs: dict) -> bool:
    """Whether an ``F.multi_head_attention_forward`` call draws dropout (``dropout_p`` is
    argument 10, ``training`` argument 13)."""
    p = kwargs.get("dropout_p", args[10] if len(args) > 10 else 0.0)
    training = kwargs.get("training", args[13] if len(args) > 13 else True)
    return bool(training) and float(p) > 0
