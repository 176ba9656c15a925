"""How a stage of a :class:`hetrain.runtime.module_cut.ModuleCut` follows the code outside
the cut-point blocks (docs/runtime.md "Any model").

:class:`_Run` is the state of one forward (the recording pass, or one stage of one micro-batch);
:class:`_Track` is the ``TorchFunctionMode`` that gives every tensor made outside the blocks a
key (its producing module call and ordinal), runs the calls before the stage on meta copies
(shapes only) or for real (calls on the micro-batch's inputs alone), and puts the tensors
received from the previous stage in place of their local stand-ins. Importing this module
imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import SUPPORTED_NODES as _PYTREE_NODES
from torch.utils._pytree import tree_flatten, tree_unflatten

from hetrain.runtime.cut_chains import CaptureError, leaves

if TYPE_CHECKING:
    from hetrain.runtime.module_cut import ModuleCut


class _Uncalled(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, names: list[str]) -> None:
        self.names = names


class _Stop(BaseException):  # noqa: N818 - control flow, not an error
    def __init__(self, value: Any) -> None:
        self.value = value


#: functions that write their first argument in place (``Tensor.add_``, ``x[i] = v``)
_IN_PLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
    }
)
#: functions that read a tensor's metadata only (shape, dtype, device), never its values
_METADATA_READS = frozenset(
    {
        "__get__",
        "size",
        "dim",
        "ndimension",
        "stride",
        "numel",
        "nelement",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "get_device",
        "__len__",
    }
)

#: a boundary tensor's key: (phase, module name, depth-0 call number of that module in the
#: phase, ordinal of the producing call in that module call or -1 for the module's own output,
#: leaf index or "w" for a tensor written in place)
Key = tuple


def _func_name(func: Any) -> str:
    return getattr(func, "__name__", "")


def _mutates(func: Any) -> bool:
    name = _func_name(func)
    hit = _MUTATES.get(name)
    if hit is None:
        hit = _MUTATES[name] = name in _IN_PLACE_DUNDERS or (
            name.endswith("_") and not name.startswith("__")
        )
    return hit


_MUTATES: dict[str, bool] = {}


#: leaf types a call's arguments often hold that hold no tensor
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, slice, type(Ellipsis)})


def _scan(obj: Any, tensors: list[torch.Tensor]) -> bool:
    """Append the tensors of the pytree ``obj`` to ``tensors`` (the leaves ``tree_flatten``
    gives, without building its spec: this runs on every call outside the blocks); True when a
    leaf is the meta ``torch.device``."""
    kind = type(obj)
    if kind is tuple or kind is list:
        items: Any = obj
    elif kind is dict:
        items = obj.values()
    else:
        return _scan_leaf(obj, tensors)
    meta = False
    for a in items:
        if isinstance(a, torch.Tensor):
            tensors.append(a)
        elif type(a) not in _PLAIN:
            meta |= _scan(a, tensors)
    return meta


def _scan_leaf(obj: Any, tensors: list[torch.Tensor]) -> bool:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return False
    kind = type(obj)
    if kind is torch.device:
        return obj.type == "meta"
    if kind in _PYTREE_NODES or isinstance(obj, tuple) and hasattr(obj, "_fields"):
        flat = tree_flatten(obj)[0]
        tensors += [a for a in flat if isinstance(a, torch.Tensor)]
        return any(isinstance(a, torch.device) and a.type == "meta" for a in flat)
    return False


#: meta results kept per :class:`ModuleCut` (cleared when full)
_META_CACHE_SIZE = 4096
_PYTHON_FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial)


def _meta_signature(func: Any, flat: list[Any], spec: Any) -> tuple | None:
    """What a meta call's results depend on: the function, the argument structure, each
    tensor's shape, strides, storage offset and dtype, and the other arguments (None when one
    cannot be hashed)."""
    parts: list[Any] = [func, spec]
    for a in flat:
        if isinstance(a, torch.Tensor):
            parts.append((tuple(a.shape), a.stride(), a.storage_offset(), a.dtype))
        elif isinstance(a, torch.device):
            parts.append(_META)
        else:
            try:
                hash(a)
            except TypeError:
                return None
            parts.append((type(a), a))
    return tuple(parts)


def _meta_record(out: Any, meta_flat: list[Any]) -> tuple | None:
    """``(structure, items)`` of a meta call's results: per result ``("alias", i)`` when it is
    input ``i`` itself, else ``("new", shape, strides, dtype, storage offset)``; None when a
    result is not a plain strided tensor (a subclass, sparse, or with a lazy conjugate or
    negation bit: those are computed every time)."""
    outs, out_spec = tree_flatten(out)
    if not outs or not all(
        type(o) is torch.Tensor and o.layout == torch.strided and not (o.is_conj() or o.is_neg())
        for o in outs
    ):
        return None
    items: list[tuple] = []
    for o in outs:
        alias = next((i for i, a in enumerate(meta_flat) if a is o), None)
        if alias is not None:
            items.append(("alias", alias))
        else:
            items.append(("new", tuple(o.shape), o.stride(), o.dtype, o.storage_offset()))
    return out_spec, items


@dataclass
class _Run:
    """One forward of a :class:`ModuleCut`: the recording pass (``record``) or one stage
    ``[start, end)`` of one micro-batch."""

    start: int
    end: int
    record: bool
    received: dict[Key, torch.Tensor]
    device: torch.device
    phase: int = 0
    depth: int = 0  # > 0 inside a cut-point block
    block: int = -1  # the cut-point block being run (depth > 0)
    quiet: bool = False  # a skipped block's stand-in is building its outputs
    light: bool = False  # no tracking mode: the module and block hooks alone name tensors
    suspended: Any = None  # the tracking mode, popped while a closed block runs for real
    frames: list[tuple[str, int, int, int]] = field(default_factory=list)  # name, call,
    # phase and serial at the call
    serial: int = 0  # keys given so far
    serial_of: dict[int, int] = field(default_factory=dict)
    calls: dict[tuple[int, str], int] = field(default_factory=dict)
    ords: dict[tuple[int, str, int, bool], int] = field(default_factory=dict)
    key_of: dict[int, Key] = field(default_factory=dict)
    obj_of: dict[Key, torch.Tensor] = field(default_factory=dict)
    valid: set[Key] = field(default_factory=set)  # keys holding real values
    meta_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    block_args: set[int] = field(default_factory=set)
    inner: dict[int, tuple[Any, int]] = field(default_factory=dict)  # record: id -> (ref, block)
    trace: Any = None  # a last stage recording its suffix (cut_suffix.TraceRecorder)


class _Track(TorchFunctionMode):
    """Follows every tensor made outside the cut-point blocks (a key per tensor) and runs a
    stage: before the stage, calls that read weights, buffers or earlier blocks' results run
    on meta copies (shapes only) and calls on the micro-batch's inputs alone run for real;
    from the stage's first layer on, everything runs for real, with the tensors received from
    the previous stage in place of the meta ones (see :class:`ModuleCut`)."""

    def __init__(self, cut: ModuleCut, run: _Run) -> None:
        super().__init__()
        self.cut = cut
        self.run = run

    # ------------------------------------------------------------------------- helpers
    def rebuildable(self, t: torch.Tensor) -> bool:
        """True for a tensor every rank computes from the micro-batch's inputs alone."""
        k = self.run.key_of.get(id(t))
        if k is not None:
            return isinstance(k[3], tuple) or self.cut._rebuild.get(k, False)
        if id(t) in self.cut._name_of:
            return False
        if self.run.record:
            return self._inner_block(t) is None
        return t.device.type != "meta" or self.cut._meta_model

    def _inner_block(self, t: torch.Tensor) -> int | None:
        hit = self.run.inner.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        return hit[1]

    def to_meta(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            return t
        hit = self.run.meta_of.get(id(t))
        if hit is None:  # (called with the current modes disabled)
            m = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
            hit = self.run.meta_of[id(t)] = (t, m)
        return hit[1]

    def assign(self, t: torch.Tensor, key: Key, real: bool, rebuild: bool) -> None:
        run = self.run
        run.serial += 1
        run.serial_of[id(t)] = run.serial
        run.key_of[id(t)] = key
        run.obj_of[key] = t
        if run.record:
            self.cut._rebuild[key] = rebuild
            self.cut._produced.setdefault(key, run.phase)
            run.inner.pop(id(t), None)
        elif real:
            run.valid.add(key)

    def is_real(self, t: torch.Tensor) -> bool:
        k = self.run.key_of.get(id(t))
        if k is not None:
            return k in self.run.valid or k in self.run.received
        return t.device.type != "meta" or self.cut._meta_model

    def substitute(self, obj: Any, check: str | None) -> Any:
        """``obj`` with every tensor received from the previous stage in place of its local
        stand-in; ``check`` (a function name): raise when a tensor computed before the stage
        and not received is used."""
        run = self.run
        tensors: list[torch.Tensor] = []
        _scan(obj, tensors)
        key_of, received, valid = run.key_of, run.received, run.valid
        for a in tensors:  # is there anything to swap in or to refuse?
            key = key_of.get(id(a))
            if key is None:
                continue
            got = received.get(key)
            if (got is not None and got is not a) or (
                got is None and check is not None and key not in valid
            ):
                break
        else:
            return obj
        flat, spec = tree_flatten(obj)
        changed = False
        for k, a in enumerate(flat):
            if not isinstance(a, torch.Tensor):
                continue
            key = run.key_of.get(id(a))
            if key is None:
                continue
            got = run.received.get(key)
            if got is not None:
                flat[k] = got
                changed = True
            elif check is not None and key not in run.valid:
                raise CaptureError(
                    self.cut.source,
                    "layers",
                    f"cannot run {check} in stage {run.start}-{run.end - 1}: it uses a tensor "
                    f"computed before the stage that was not sent to it ({key[1] or 'model'}); "
                    "name other cut points with layers=[...]",
                )
        return tree_unflatten(flat, spec) if changed else obj

    def _received_or_valid(self, a: torch.Tensor, name: str) -> torch.Tensor:
        run = self.run
        key = run.key_of[id(a)]
        got = run.received.get(key)
        if got is not None:
            return got
        if key not in run.valid:
            raise CaptureError(
                self.cut.source,
                "layers",
                f"cannot run {name} in stage {run.start}-{run.end - 1}: it uses a tensor "
                f"computed before the stage that was not sent to it ({key[1] or 'model'}); "
                "name other cut points with layers=[...]",
            )
        return a

    def key_outputs(
        self, func: Any, args: Any, kwargs: Any, out: Any, real: bool, rebuild: bool
    ) -> None:
        run = self.run
        frames = run.frames
        name, call = frames[-1][:2] if frames else ("", 0)
        outs = [out] if isinstance(out, torch.Tensor) else leaves(out)
        written = None
        if _mutates(func):
            flat = tree_flatten((args, kwargs))[0]
            first = flat[0] if flat else None
            if isinstance(first, torch.Tensor) and not any(first is t for t in outs):
                written = first
        if not outs and written is None:
            return
        # results made from the inputs alone are numbered apart ("r", n): every stage rebuilds
        # them and their count may depend on the micro-batch (HF's mask code branches on the
        # batch size), the numbers of the others may not
        counter = (run.phase, name, call, rebuild)
        o = run.ords.get(counter, 0)
        run.ords[counter] = o + 1
        ordinal: Any = ("r", o) if rebuild else o
        if run.record:
            for j, t in enumerate(outs):
                self.assign(t, (run.phase, name, call, ordinal, j), real, rebuild)
        else:  # assign, inlined
            serial_of, key_of, obj_of, valid = run.serial_of, run.key_of, run.obj_of, run.valid
            for j, t in enumerate(outs):
                key = (run.phase, name, call, ordinal, j)
                run.serial += 1
                serial_of[id(t)] = run.serial
                key_of[id(t)] = key
                obj_of[key] = t
                if real:
                    valid.add(key)
        if written is not None:
            self.assign(written, (run.phase, name, call, ordinal, "w"), real, rebuild)

    # ------------------------------------------------------------------------- events
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        # the hot path of a stage (every torch call outside the blocks): plain loops, few calls
        if kwargs is None:
            kwargs = {}
        run = self.run
        name = getattr(func, "__name__", "")
        if run.quiet or name in _METADATA_READS:
            return func(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        meta_device = _scan(args, tensors)
        if kwargs:
            meta_device |= _scan(kwargs, tensors)
        if run.record:
            return self._record_event(func, name, args, kwargs, tensors)
        key_of = run.key_of
        before = run.phase < run.start and run.depth == 0
        swap = False
        if before:
            if not self._all_real_inputs(tensors):
                return self._meta_call(func, name, args, kwargs)
        else:
            for a in tensors:
                if id(a) in key_of and self._received_or_valid(a, name) is not a:
                    swap = True
                    break
        on_meta = meta_device and not any(a.device.type == "meta" for a in tensors)
        if swap or on_meta:
            flat, spec = tree_flatten((args, kwargs))
            if swap:
                flat = [
                    self._received_or_valid(a, name)
                    if isinstance(a, torch.Tensor) and id(a) in key_of
                    else a
                    for a in flat
                ]
            if on_meta:
                # real tensors (or none) placed on a meta tensor's device: the stage's device
                flat = [_stage_device(a, run.device) for a in flat]
            args, kwargs = tree_unflatten(flat, spec)
        out = func(*args, **kwargs)
        if run.depth == 0:
            rebuild = self._all_rebuildable(tensors)
            self.key_outputs(func, args, kwargs, out, real=True, rebuild=rebuild)
            trace = run.trace
            if (
                trace is not None
                and run.phase == trace.suffix
                and not (run.frames and run.frames[-1][2] == trace.suffix)
            ):
                trace.on_call(func, name, args, kwargs, out, run)
        return out

    def _all_real_inputs(self, tensors: list[torch.Tensor]) -> bool:
        """True when no tensor of a call is a weight, a buffer or a shape-only result (the
        call runs for real before the stage): :meth:`is_real` of each, inlined."""
        run = self.run
        key_of, valid, received = run.key_of, run.valid, run.received
        name_of, meta_model = self.cut._name_of, self.cut._meta_model
        for t in tensors:
            i = id(t)
            if i in name_of:
                return False
            k = key_of.get(i)
            if k is not None:
                if k not in valid and k not in received:
                    return False
            elif t.device.type == "meta" and not meta_model:
                return False
        return True

    def _all_rebuildable(self, tensors: list[torch.Tensor]) -> bool:
        """:meth:`rebuildable` of every tensor of a call of a stage, inlined."""
        key_of, rebuild = self.run.key_of, self.cut._rebuild
        name_of, meta_model = self.cut._name_of, self.cut._meta_model
        for t in tensors:
            i = id(t)
            k = key_of.get(i)
            if k is not None:
                if not (isinstance(k[3], tuple) or rebuild.get(k, False)):
                    return False
            elif i in name_of or (t.device.type == "meta" and not meta_model):
                return False
        return True

    def _meta_call(self, func: Any, name: str, args: Any, kwargs: Any) -> Any:
        """``func`` before the stage on weights or results of earlier layers: on meta copies
        (shapes only), with the current modes (FLOP counters, other function modes) off.
        Meta kernels are pure functions of the inputs' metadata and the other arguments, and
        many run as Python decompositions (hundreds of µs a call): for torch's C functions
        and operators, each result's shape, strides and dtype (or which input it returns) is
        kept per call signature and given again without running the kernel."""
        run = self.run
        flat, spec = tree_flatten((args, kwargs))
        # only torch's own C functions and operators are reused: a Python function may do
        # more than compute (the plan-invariant dropout counts its calls)
        pure = not isinstance(func, _PYTHON_FUNCTIONS) and not _mutates(func)
        sig = _meta_signature(func, flat, spec) if pure else None
        cache = self.cut._meta_cache
        hit = cache.get(sig) if sig is not None else None
        if hit is not None:
            out = self._meta_results(hit, flat)
        else:
            try:
                with torch.no_grad(), _disable_current_modes():
                    flat = [
                        self.to_meta(a)
                        if isinstance(a, torch.Tensor)
                        else _META
                        if isinstance(a, torch.device)
                        else a
                        for a in flat
                    ]
                    margs, mkwargs = tree_unflatten(flat, spec)
                    out = func(*margs, **mkwargs)
            except Exception as exc:
                raise CaptureError(
                    self.cut.source,
                    "layers",
                    f"cannot run {name} before stage {run.start}-{run.end - 1} without tensor "
                    f"values ({str(exc).splitlines()[0][:120]}); name other cut points with "
                    "layers=[...]",
                ) from None
            if sig is not None:
                if len(cache) >= _META_CACHE_SIZE:
                    cache.clear()
                record = _meta_record(out, flat)
                if record is not None:
                    cache[sig] = record
        self.key_outputs(func, args, kwargs, out, real=False, rebuild=False)
        return out

    def _meta_results(self, record: tuple, flat: list[Any]) -> Any:
        """The results of a meta call from its :func:`_meta_record`."""
        out_spec, items = record
        outs = []
        quiet = torch._C._len_torch_function_stack() == 0 and (
            torch._C._len_torch_dispatch_stack() == 0
        )
        with contextlib.nullcontext() if quiet else _disable_current_modes():
            for item in items:
                if item[0] == "alias":  # the call returns one of its inputs
                    outs.append(self.to_meta(flat[item[1]]))
                    continue
                _, shape, stride, dtype, offset = item
                t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                outs.append(t if offset == 0 else t.as_strided(shape, stride, offset))
        return tree_unflatten(outs, out_spec)

    def _record_event(self, func, name, args, kwargs, tensors):  # noqa: ANN001, ANN202
        run = self.run
        cut = self.cut
        if run.depth == 0:
            cut._busy.add(run.phase)
        for t in tensors:
            k = run.key_of.get(id(t))
            if k is not None:
                cut._last_use[k] = max(cut._last_use.get(k, -1), run.phase)
                if run.depth > 0 and id(t) not in run.block_args:
                    cut._closed = False  # a block reads an outside tensor, not via its args
                continue
            inner = self._inner_block(t)
            if inner is not None and (run.depth == 0 or inner != run.block):
                raise CaptureError(
                    cut.source,
                    "layers",
                    f"{name} uses a tensor that block {cut.block_names[inner]} computed but "
                    "did not return (a side output of a block cannot cross a stage); name "
                    "other cut points with layers=[...]",
                )
        rebuild = all(self.rebuildable(t) for t in tensors)
        out = func(*args, **kwargs)
        if (
            run.depth == 0
            and not rebuild
            and not leaves(out)
            and not _mutates(func)  # x[i] = v writes, it does not read
            and run.phase < cut.num_layers - 1
        ):
            # Python reads values that a stage starting later has only as shapes
            raise CaptureError(
                cut.source,
                "layers",
                f"cannot cut after layer {run.phase} ({cut.layer_names[run.phase]}): the "
                f"forward reads tensor values there ({name}) computed from weights, which a "
                "later stage does not compute; name other cut points with layers=[...]",
            )
        if run.depth == 0:
            self.key_outputs(func, args, kwargs, out, real=True, rebuild=rebuild)
        else:
            # an op that returns one of its inputs itself (dropout with p = 0, an identity)
            # made nothing: its result keeps the input's provenance
            given = {id(a) for a in tensors}
            for t in leaves(out):
                if run.key_of.get(id(t)) is None and id(t) not in given:
                    run.inner[id(t)] = (weakref.ref(t), run.block)
        return out


@dataclass
class _BlockRecord:
    """What a block returned in the recording pass (a skipped block returns look-alikes)."""

    spec: Any
    flat: list[Any]  # non-tensor leaves as returned; None where a tensor was
    tensors: list[tuple[tuple[int, ...], torch.dtype, int | None]]  # shape, dtype, same-shape arg
    batch: int | None  # dim 0 of the block's first tensor argument


_MODES: dict[int, _Track] = {}
_META = torch.device("meta")


def _top_function_mode() -> Any:
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n else None


def _stage_device(a: Any, device: torch.device) -> Any:
    return device if isinstance(a, torch.device) and a.type == "meta" else a


def _device_of(inputs: Any) -> torch.device:
    return next(iter(leaves(inputs)), torch.empty(0)).device
