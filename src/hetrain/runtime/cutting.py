"""Cutting any ``torch.nn.Module`` into a chain of pipeline layers (docs/model.md §5,
docs/runtime.md).

Two kinds of chains, both running the **original** modules (weights, tied tensors, ``eval()``
and every micro-batch size keep working):

* :class:`SequentialChain`: an ``nn.Sequential`` (or a list of blocks); layer ``l`` is child
  ``l`` and the value passed between layers may be any pytree of tensors (tuple, dict, ...).
* :class:`ModuleCut`: any other module, cut at module boundaries. The cut points are the
  *blocks*: by default every block of every ``ModuleList``/``Sequential`` of two or more blocks
  of one class, flattened in execution order (GPT-2's ``transformer.h``, BERT's
  ``encoder.layer``, every bottleneck of every ResNet stage), or the modules the user names
  (``layers=[...]``). Layer 0 is the *prefix* (everything the forward runs before the first
  block), layer ``i + 1`` is block ``i`` plus the code that runs until the next block, and the
  last layer is the *suffix* (what runs after the last block).

How a stage ``[s, e)`` of a :class:`ModuleCut` runs: the model's own ``forward`` is called on
the micro-batch's inputs and computes, with real tensors, only the stage's layers:

* the blocks before the stage are skipped: their ``forward`` is swapped, for the call, for a
  stand-in that returns the tensors received from the previous stage for the outputs the stage
  uses, and meta look-alikes (shapes only) for the others;
* the code outside the blocks is followed call by call by a ``TorchFunctionMode`` (:class:`_Track`):
  before the stage, a call on the micro-batch's inputs alone (or on tensors made from them, or
  on received tensors) runs for real (masks, position ids, Python checks of their values), a
  call that reads a weight, a buffer or an earlier layer's result runs on meta copies; from the
  stage's first layer on, everything runs for real, each received tensor in place of its
  stand-in;
* the stage stops at the call of the block that starts layer ``e`` and returns the tensors that
  cross that boundary.

Which tensors cross each boundary is recorded once, on the example inputs: every tensor made
outside the blocks (named by the module call that made it: robust to how a module computes
it, e.g. plan-invariant dropout) or returned by a block, made before the boundary and used at
or after it, except those computed from the inputs alone (every stage rebuilds them). A forward
that reads values computed from weights outside the blocks before a later cut (``if h.sum() >
0``), or uses a block's side output (a tensor it does not return) elsewhere, "cannot be cut"
there: :class:`CaptureError` names it (name other cut points with ``layers=``). This is a
home-made but small alternative to ``torch.export`` (which copies no weights but bakes
``train()``/``eval()`` and the randomness into the graph); it is not
``torch.distributed.pipelining.pipeline()``, which copies tied weights into separate stages and
fixes the micro-batch size.

Importing this module imports torch.
"""

from __future__ import annotations

import difflib
import hashlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import SUPPORTED_NODES as _PYTREE_NODES
from torch.utils._pytree import tree_flatten, tree_unflatten

from hetrain.errors import InputError


class CaptureError(InputError):
    """A module that cannot be cut where asked (one line: the op and what to do)."""


def leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors of a pytree (tuple, list, dict, ``ModelOutput``...), in pytree order."""
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


# ------------------------------------------------------------------------------------------
# chains
# ------------------------------------------------------------------------------------------


class Chain:
    """A model cut into ``num_layers`` layers (docs/model.md §2 chain).

    Attributes:
        module: the original module (trained in place; export and evaluation use it).
        layer_names: one name per layer (profiles name layers after them).
        tensors: canonical name -> the module's parameter or buffer object (a tied tensor once,
            under ``named_parameters()``'s first name).
        layer_tensors: per layer, the canonical names of the tensors it uses (a shared tensor is
            listed in every layer that uses it).
    """

    module: nn.Module
    layer_names: list[str]
    tensors: dict[str, torch.Tensor]
    layer_tensors: list[list[str]]

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def __len__(self) -> int:
        return self.num_layers

    def _index_tensors(self) -> None:
        self.tensors = {}
        self.is_param: dict[str, bool] = {}
        for name, p in self.module.named_parameters():
            self.tensors[name] = p
            self.is_param[name] = True
        for name, b in self.module.named_buffers():
            self.tensors.setdefault(name, b)
            self.is_param.setdefault(name, False)
        self._name_of = {id(t): n for n, t in self.tensors.items()}

    @property
    def shared(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> layers using it, for tensors used by two or more layers (docs/model.md
        §2
        shared tensors)."""
        use: dict[str, list[int]] = {}
        for layer, names in enumerate(self.layer_tensors):
            for n in names:
                use.setdefault(n, []).append(layer)
        return {n: tuple(ls) for n, ls in use.items() if len(ls) > 1}

    def owner_layers(self, name: str) -> tuple[int, ...]:
        return tuple(i for i, names in enumerate(self.layer_tensors) if name in names)

    def frozen(self, name: str) -> bool:
        """True for a parameter that takes no gradient, and for every buffer."""
        t = self.tensors[name]
        return not (self.is_param[name] and t.requires_grad)

    def structure_digest(self) -> str:
        """Hash of the layers, tensor names, shapes and dtypes (ranks must agree on it)."""
        items = [
            (i, n, tuple(self.tensors[n].shape), str(self.tensors[n].dtype))
            for i, names in enumerate(self.layer_tensors)
            for n in names
        ]
        return hashlib.sha256(repr((self.layer_names, items)).encode()).hexdigest()[:16]

    def layer_modules(self, layer: int) -> list[nn.Module]:
        """The modules that run in ``layer`` (its child, its block, or the leaf modules of
        the prefix/suffix)."""
        raise NotImplementedError

    def __getitem__(self, layer: int) -> nn.Module:
        """Layer ``layer`` as one module (the child or block itself; a ``ModuleList`` of the
        prefix's/suffix's leaf modules)."""
        mods = self.layer_modules(layer)
        return mods[0] if len(mods) == 1 else nn.ModuleList(mods)

    def stage_forward(self, start: int, end: int, x: Any, inputs: Any) -> Any:
        """Run layers ``[start, end)`` on one micro-batch: ``x`` is what the previous stage
        sent (ignored when ``start == 0``), ``inputs`` the micro-batch's model inputs."""
        raise NotImplementedError


class SequentialChain(Chain):
    """An ``nn.Sequential``: layer ``l`` is child ``l``; values between layers are any pytree."""

    def __init__(self, module: nn.Sequential) -> None:
        self.module = module
        self.children = list(module)  # not .children(): it skips a module used twice
        self.layer_names = [f"{i}:{type(c).__name__}" for i, c in enumerate(self.children)]
        self._index_tensors()
        self.layer_tensors = []
        for child in self.children:
            names = []
            for t in [*child.parameters(), *child.buffers()]:
                n = self._name_of[id(t)]
                if n not in names:
                    names.append(n)
            self.layer_tensors.append(names)

    def layer_modules(self, layer: int) -> list[nn.Module]:
        return [self.children[layer]]

    def stage_forward(self, start: int, end: int, x: Any, inputs: Any) -> Any:
        if start == 0:
            x = inputs
        for layer in self.children[start:end]:
            x = layer(x)
        return x


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


def _scan(obj: Any, tensors: list[torch.Tensor]) -> bool:
    """Append the tensors of the pytree ``obj`` to ``tensors`` (the leaves ``tree_flatten``
    gives, without building its spec: this runs on every call outside the blocks); True when a
    leaf is the meta ``torch.device``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return False
    kind = type(obj)
    if kind is tuple or kind is list:
        meta = False
        for a in obj:
            meta |= _scan(a, tensors)
        return meta
    if kind is dict:
        meta = False
        for a in obj.values():
            meta |= _scan(a, tensors)
        return meta
    if kind is torch.device:
        return obj.type == "meta"
    if kind in _PYTREE_NODES or isinstance(obj, tuple) and hasattr(obj, "_fields"):
        flat = tree_flatten(obj)[0]
        tensors += [a for a in flat if isinstance(a, torch.Tensor)]
        return any(isinstance(a, torch.device) and a.type == "meta" for a in flat)
    return False


def _out_leaves(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else leaves(out)


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
        if hit is None:
            with _disable_current_modes():
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
        if not any(id(a) in run.key_of for a in tensors):
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
        name, call = run.frames[-1][:2] if run.frames else ("", 0)
        frame = (run.phase, name, call)
        outs = _out_leaves(out)
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
        counter = (*frame, rebuild)
        o = run.ords.get(counter, 0)
        run.ords[counter] = o + 1
        ordinal: Any = ("r", o) if rebuild else o
        for j, t in enumerate(outs):
            self.assign(t, (*frame, ordinal, j), real, rebuild)
        if written is not None:
            self.assign(written, (*frame, ordinal, "w"), real, rebuild)

    # ------------------------------------------------------------------------- events
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        run = self.run
        name = _func_name(func)
        if run.quiet or name in _METADATA_READS:
            return func(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        meta_device = _scan(args, tensors) | _scan(kwargs, tensors)
        if run.record:
            return self._record_event(func, name, args, kwargs, tensors)
        before = run.phase < run.start and run.depth == 0
        if before and not all(id(t) not in self.cut._name_of and self.is_real(t) for t in tensors):
            # before the stage, on weights or results of earlier layers: shapes only
            flat, spec = tree_flatten((args, kwargs))
            flat = [
                self.to_meta(a)
                if isinstance(a, torch.Tensor)
                else _META
                if isinstance(a, torch.device)
                else a
                for a in flat
            ]
            margs, mkwargs = tree_unflatten(flat, spec)
            try:
                with torch.no_grad(), _disable_current_modes():
                    out = func(*margs, **mkwargs)
            except Exception as exc:
                raise CaptureError(
                    self.cut.source,
                    "layers",
                    f"cannot run {name} before stage {run.start}-{run.end - 1} without tensor "
                    f"values ({str(exc).splitlines()[0][:120]}); name other cut points with "
                    "layers=[...]",
                ) from None
            if run.depth == 0:
                self.key_outputs(func, args, kwargs, out, real=False, rebuild=False)
            return out
        key_of = run.key_of
        swap = not before and any(
            id(a) in key_of and self._received_or_valid(a, name) is not a for a in tensors
        )
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
            rebuild = all(self.rebuildable(t) for t in tensors)
            self.key_outputs(func, args, kwargs, out, real=True, rebuild=rebuild)
        return out

    def _record_event(self, func, name, args, kwargs, tensors):  # noqa: ANN001, ANN202
        run = self.run
        cut = self.cut
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
            for t in leaves(out):
                if run.key_of.get(id(t)) is None:
                    run.inner[id(t)] = (weakref.ref(t), run.block)
        return out


@dataclass
class _BlockRecord:
    """What a block returned in the recording pass (a skipped block returns look-alikes)."""

    spec: Any
    flat: list[Any]  # non-tensor leaves as returned; None where a tensor was
    tensors: list[tuple[tuple[int, ...], torch.dtype, int | None]]  # shape, dtype, same-shape arg
    batch: int | None  # dim 0 of the block's first tensor argument


def _call_inputs(module: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, list | tuple):
        return module(*inputs)
    return module(inputs)


def _qualifies(m: nn.Module) -> bool:
    kids = list(m.children())
    return (
        isinstance(m, nn.ModuleList | nn.Sequential)
        and len(kids) >= 2
        and len({type(k) for k in kids}) == 1
    )


def _containers(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """The top-most qualifying containers strictly inside ``module``, in module order."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        full = f"{path}.{name}" if path else name
        out += [(full, child)] if _qualifies(child) else _containers(child, full)
    return out


def _blocks_of(container: nn.Module, path: str) -> list[str]:
    """Blocks of a qualifying container: its children, or, when every child is only a wrapper
    of lists of blocks (all its parameters inside them, as a ResNet stage), theirs."""
    kids = [(f"{path}.{n}", c) for n, c in container.named_children()]
    inner = []
    for full, child in kids:
        conts = _containers(child, full)
        covered = {id(p) for _, c in conts for p in c.parameters()}
        if not conts or any(id(p) not in covered for p in child.parameters()):
            return [full for full, _ in kids]
        inner.append([b for cpath, c in conts for b in _blocks_of(c, cpath)])
    return [b for blocks in inner for b in blocks]


def default_blocks(module: nn.Module) -> list[str]:
    """docs/model.md §5 default cut points of ``module``: every block of every ``ModuleList``/
    ``Sequential`` of two or more blocks of one class, in module order (:class:`ModuleCut`
    re-orders them by execution). Lists inside blocks stay inside (a ResNet bottleneck's
    convolutions), except when every block of a list only wraps lists (ResNet stages): then
    their blocks are flattened (all bottlenecks of all stages)."""
    return [b for path, c in _containers(module, "") for b in _blocks_of(c, path)]


class ModuleCut(Chain):
    """Any module cut at its blocks (see the module docstring).

    Args:
        module: the model; ``module(inputs)`` (a tensor), ``module(*inputs)`` (tuple) or
            ``module(**inputs)`` (dict) is its forward.
        example_inputs: a small batch of model inputs (2+ samples) used to record which
            tensors each layer uses, the order of the blocks and which tensors cross each
            boundary.
        blocks: module names of the cut points (default :func:`default_blocks`).
        source: where the model came from (error messages).

    Raises:
        InputError: a cut point that names no module (near names listed), no blocks found,
            or blocks not called exactly once each per forward.
        CaptureError: the forward cannot be recorded, or a block's side output (a tensor it
            computes but does not return) is used outside it.
    """

    def __init__(
        self,
        module: nn.Module,
        example_inputs: Any,
        blocks: Sequence[str] | None = None,
        *,
        source: str = "model",
    ) -> None:
        self.module = module
        self.source = source
        mods = dict(module.named_modules())
        default = blocks is None
        if blocks is None:
            blocks = default_blocks(module)
            if not blocks:
                raise InputError(
                    source,
                    "layers",
                    f"{type(module).__name__} has no ModuleList/Sequential of two or more blocks "
                    "of one class; name the cut points with layers=[module names]",
                )
        for b in blocks:
            if b not in mods or b == "":
                near = difflib.get_close_matches(str(b), [m for m in mods if m], n=4, cutoff=0.5)
                hint = f"; near names: {', '.join(near)}" if near else ""
                raise InputError(source, "layers", f"no module named {b!r}{hint}")
        self._index_tensors()
        self._meta_model = any(t.device.type == "meta" for t in self.tensors.values())
        self.blocks = [mods[b] for b in blocks]
        try:
            self._record(list(blocks), example_inputs, default=default)
        except _Uncalled as called:
            blocks = called.names
            self.blocks = [mods[b] for b in blocks]
            self._record(list(blocks), example_inputs)
        self._mod_names = {id(m): n for n, m in mods.items()}
        self._mods_by_name = mods
        # buffers and tensors kept as plain module attributes: a forward that re-assigns one
        # (CTRL moves its position table, on meta copies before a stage) is undone after each
        # stage, so the model keeps the tensors the chain indexes
        self._plain_attrs = [
            (m, n) for m in mods.values() for n, v in vars(m).items() if isinstance(v, torch.Tensor)
        ] + [(m, n) for m in mods.values() for n in m._buffers]
        self._block_ids = {id(b) for b in self.blocks}
        self._run: _Run | None = None
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)
            block.register_forward_hook(self._post_hook(i))
        self._outside: dict[int, nn.Module] = {}  # modules the forward calls outside blocks
        self._record_boundaries(example_inputs)
        for mod in self._outside.values():
            mod.register_forward_pre_hook(self._module_pre)
            mod.register_forward_hook(self._module_post)

    # ---------------------------------------------------------------------------- recording
    def _record(self, names: list[str], example_inputs: Any, default: bool = False) -> None:
        """Order of the blocks, and the tensors (parameters, buffers) each layer uses."""
        order: list[int] = []
        by_id = {id(b): i for i, b in enumerate(self.blocks)}
        phase = [0]
        used: dict[int, set[str]] = {}
        depth = [0]

        def pre(mod, args):  # noqa: ANN001
            i = by_id.get(id(mod))
            if i is not None and depth[0] == 0:
                order.append(i)
                phase[0] = len(order)
            if i is not None:
                depth[0] += 1

        def post(mod, args, out):  # noqa: ANN001
            if id(mod) in by_id:
                depth[0] -= 1
                if depth[0] == 0 and len(order) == len(self.blocks):
                    phase[0] = len(self.blocks) + 1  # the suffix

        cut = self

        class _Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                for a in tree_flatten((args, kwargs or {}))[0]:
                    if isinstance(a, torch.Tensor):
                        n = cut._name_of.get(id(a))
                        if n is not None:
                            used.setdefault(phase[0], set()).add(n)
                return func(*args, **(kwargs or {}))

        module_hooks: list[Any] = []
        mod_phase: dict[int, set[int]] = {}

        def any_pre(mod, args):  # noqa: ANN001
            # a block's own call belongs to its layer (the global hook runs before ``pre``)
            i = by_id.get(id(mod))
            p = len(order) + 1 if i is not None and depth[0] == 0 else phase[0]
            mod_phase.setdefault(id(mod), set()).add(p)

        for b in self.blocks:
            module_hooks.append(b.register_forward_pre_hook(pre))
            module_hooks.append(b.register_forward_hook(post))
        module_hooks.append(nn.modules.module.register_module_forward_pre_hook(any_pre))
        try:
            with torch.no_grad(), _Record():
                out = _call_inputs(self.module, example_inputs)
        except InputError:
            raise
        except Exception as exc:
            raise CaptureError(
                self.source, "forward", f"the model's forward failed: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            for h in module_hooks:
                h.remove()
        n = len(self.blocks)
        if sorted(order) != list(range(n)):
            twice = sorted({names[i] for i in order if order.count(i) > 1})
            missing = [names[i] for i in range(n) if i not in order]
            if default and order and not twice:
                # default cut points the forward never calls (a vision tower of a model fed
                # text only) are not cut points
                raise _Uncalled([names[i] for i in sorted(set(order))])
            raise InputError(
                self.source,
                "layers",
                "expected every cut point to run exactly once per forward"
                + (f"; called twice: {', '.join(twice)}" if twice else "")
                + (f"; never called: {', '.join(missing)}" if missing else ""),
            )
        if not leaves(out):
            raise InputError(self.source, "forward", "expected the model to return tensors")
        # re-order the blocks by execution
        self.blocks = [self.blocks[i] for i in order]
        self.block_names = [names[i] for i in order]
        num_layers = n + 2
        self.layer_names = (
            ["prefix"]
            + [
                f"{b}:{type(m).__name__}"
                for b, m in zip(self.block_names, self.blocks, strict=True)
            ]
            + ["suffix"]
        )
        layer_sets: list[set[str]] = [set() for _ in range(num_layers)]
        for p, names_used in used.items():
            layer_sets[p] |= names_used
        seen = set().union(*layer_sets)
        # tensors no op reads (buffers read without an op, unused parameters): the layers
        # that call their module
        for mod in self.module.modules():
            for p in mod_phase.get(id(mod), ()):
                for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
                    name = self._name_of.get(id(t))
                    if name is not None and name not in seen:
                        layer_sets[p].add(name)
        # never-used tensors: the layer of their block (or the prefix)
        seen = set().union(*layer_sets)
        for name in self.tensors:
            if name not in seen:
                layer = 0
                for i, b in enumerate(self.block_names):
                    if name.startswith(b + "."):
                        layer = i + 1
                layer_sets[layer].add(name)
        order_of = {n: i for i, n in enumerate(self.tensors)}
        self.layer_tensors = [sorted(s, key=order_of.__getitem__) for s in layer_sets]
        self._layer_module_names: list[list[str]] = [[] for _ in range(num_layers)]
        for mname, mod in self.module.named_modules():
            for p in mod_phase.get(id(mod), ()):
                self._layer_module_names[p].append(mname)

    def _record_boundaries(self, example_inputs: Any) -> None:
        """Which tensors each boundary carries: every tensor made outside the blocks (or
        returned by a block) before the boundary and used at or after it, except those
        computed from the micro-batch's inputs alone (every stage rebuilds them)."""
        self._rebuild: dict[Key, bool] = {}
        self._produced: dict[Key, int] = {}
        self._last_use: dict[Key, int] = {}
        self._closed = True
        self._module_calls: dict[str, int] = {}
        self._module_outs: dict[tuple[int, str, int], _BlockRecord] = {}
        self._block_records: list[_BlockRecord | None] = [None] * len(self.blocks)
        self._skippable: dict[int, list[tuple[nn.Module, dict]]] = {}
        run = _Run(
            start=0,
            end=self.num_layers,
            record=True,
            received={},
            device=_device_of(example_inputs),
        )
        try:
            with torch.no_grad():
                out = self._forward(run, example_inputs)
        except InputError:
            raise
        except Exception as exc:
            raise CaptureError(
                self.source, "forward", f"the model's forward failed: {type(exc).__name__}: {exc}"
            ) from None
        for t in leaves(out):  # the model's outputs are used at its end
            k = run.key_of.get(id(t))
            if k is not None:
                self._last_use[k] = self.num_layers
        self._live: list[list[Key]] = [
            [
                k
                for k, p in self._produced.items()
                if not self._rebuild[k] and p < b <= self._last_use.get(k, -1)
            ]
            for b in range(self.num_layers + 1)
        ]

    def boundary_keys(self, boundary: int) -> list[Key]:
        """The tensors that cross the boundary before layer ``boundary`` (``1 <= boundary <
        num_layers``), in the order a stage sends them."""
        return list(self._live[boundary])

    def layer_modules(self, layer: int) -> list[nn.Module]:
        mods = dict(self.module.named_modules())
        if 1 <= layer <= len(self.blocks):
            return [self.blocks[layer - 1]]
        return [mods[m] for m in self._layer_module_names[layer] if not list(mods[m].children())]

    # ---------------------------------------------------------------------------- running
    def _pre_hook(self, i: int) -> Callable:
        def hook(mod, args, kwargs):  # noqa: ANN001
            run = self._run
            if run is None or run.depth > 0:
                return None
            phase = i + 1
            if not run.record and phase == run.end:
                raise _Stop(self._boundary(run, phase))
            run.phase, run.depth, run.block = phase, 1, i
            if run.record:
                run.block_args = {id(t) for t in leaves((args, kwargs))}
                return None
            if phase < run.start:
                return None  # skipped: its stand-in answers
            mode = _MODES.get(id(run))
            args, kwargs = mode.substitute((args, kwargs), None)
            if self._closed and _top_function_mode() is mode:
                run.suspended = torch._C._pop_torch_function_stack()
            return args, kwargs

        return hook

    def _post_hook(self, i: int) -> Callable:
        last = i == len(self.blocks) - 1

        def hook(mod, args, output):  # noqa: ANN001
            run = self._run
            if run is None or run.depth != 1 or run.block != i:
                return None
            if run.suspended is not None:
                torch._C._push_on_torch_function_stack(run.suspended)
                run.suspended = None
            run.depth, run.block = 0, -1
            mode = _MODES[id(run)]
            real = run.record or i + 1 >= run.start
            flat, spec = tree_flatten(output)
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            for j, t in enumerate(tensors):
                key = (i + 1, "", -1, -1, j)
                mode.assign(t, key, real or key in run.received, rebuild=False)
            if run.record:
                arg_leaves = leaves((args,))
                shapes = [tuple(a.shape) for a in arg_leaves]
                self._block_records[i] = _BlockRecord(
                    spec=spec,
                    flat=[None if isinstance(a, torch.Tensor) else a for a in flat],
                    tensors=[
                        (
                            tuple(t.shape),
                            t.dtype,
                            shapes.index(tuple(t.shape)) if tuple(t.shape) in shapes else None,
                        )
                        for t in tensors
                    ],
                    batch=shapes[0][0] if shapes and shapes[0] else None,
                )
            if not last:
                return None
            suffix = len(self.blocks) + 1
            run.phase = suffix
            if run.record:
                return None
            if run.end == suffix:
                raise _Stop(self._boundary(run, suffix))
            return None

        return hook

    def _stand_in(self, i: int, run: _Run) -> Callable:
        """The forward of skipped block ``i``: the received tensors for the outputs the
        stage uses, meta look-alikes (shapes only) for the others; no compute."""
        rec = self._block_records[i]

        def forward(*args: Any, **kwargs: Any) -> Any:
            run.quiet = True
            try:
                cur = leaves((args,)) or leaves(kwargs)
                floats = [c.dtype for c in cur if c.is_floating_point()]
                flat = list(rec.flat)
                slots = [k for k, a in enumerate(flat) if a is None]
                for j, (shape, dtype, match) in enumerate(rec.tensors):
                    got = run.received.get((i + 1, "", -1, -1, j))
                    if got is None:
                        if match is not None and match < len(cur):
                            shape = tuple(cur[match].shape)
                        elif shape and rec.batch is not None and shape[0] == rec.batch and cur:
                            shape = (cur[0].shape[0], *shape[1:])
                        if dtype.is_floating_point and floats:
                            dtype = floats[0]
                        got = torch.empty(shape, dtype=dtype, device="meta")
                    flat[slots[j]] = got
                return tree_unflatten(flat, rec.spec)
            finally:
                run.quiet = False

        return forward

    def _boundary(self, run: _Run, boundary: int) -> tuple[torch.Tensor, ...]:
        out = []
        for key in self._live[boundary]:
            t = run.received.get(key)
            if t is None:
                t = run.obj_of.get(key)
                if t is None or key not in run.valid:
                    raise CaptureError(
                        self.source,
                        "layers",
                        f"stage {run.start}-{run.end - 1} cannot send a tensor of "
                        f"{key[1] or 'the model'} that the next stage needs: the forward took "
                        "another path than when it was recorded; name other cut points with "
                        "layers=[...]",
                    )
            out.append(t)
        return tuple(out)

    def _forward(self, run: _Run, inputs: Any) -> Any:
        """The model's forward under ``run`` (stand-ins for the skipped blocks, the tracking
        mode, the module hooks that name each tensor's producer)."""
        mode = _Track(self, run)
        _MODES[id(run)] = mode
        skipped = [] if run.record else self.blocks[: max(run.start - 1, 0)]
        saved = [b.__dict__.get("forward") for b in skipped]
        for i, b in enumerate(skipped):
            b.forward = self._stand_in(i, run)
        skipped_mods = [] if run.record else self._skippable_modules(run.start)
        saved_mods = [m.__dict__.get("forward") for m, _ in skipped_mods]
        for m, answers in skipped_mods:
            m.forward = self._module_stand_in(run, m.forward, answers)
        skipped += [m for m, _ in skipped_mods]
        saved += saved_mods
        # recording names every module the forward calls outside the blocks (global hooks);
        # a stage runs the hooks of those modules only, so the modules inside its blocks keep
        # torch's fast call path
        hooks = (
            [
                nn.modules.module.register_module_forward_pre_hook(self._module_pre),
                nn.modules.module.register_module_forward_hook(self._module_post),
            ]
            if run.record
            else []
        )
        self._run = run
        attrs = [(m, n, getattr(m, n)) for m, n in self._plain_attrs]
        try:
            with mode:
                try:
                    return _call_inputs(self.module, inputs)
                finally:
                    if run.suspended is not None:
                        torch._C._push_on_torch_function_stack(run.suspended)
                        run.suspended = None
        finally:
            for m, n, v in attrs:
                if getattr(m, n, None) is not v:
                    setattr(m, n, v)
            self._run = None
            _MODES.pop(id(run), None)
            for h in hooks:
                h.remove()
            for b, f in zip(skipped, saved, strict=True):
                if f is None:
                    del b.forward
                else:
                    b.forward = f

    def _skippable_modules(self, start: int) -> list[tuple[nn.Module, dict]]:
        """Modules outside the blocks, called once per forward before stage ``start``, without
        dropout, whose every output the stage receives (rotary tables): they are not run at
        all. The same for every micro-batch of the stage (computed once)."""
        hit = self._skippable.get(start)
        if hit is None:
            hit = self._skippable[start] = self._find_skippable(start)
        return hit

    def _find_skippable(self, start: int) -> list[tuple[nn.Module, dict]]:
        received = set(self._live[start]) if start > 0 else set()
        mods = self._mods_by_name
        out: dict[str, dict] = {}
        for (phase, name, c), rec in self._module_outs.items():
            if phase >= start or self._module_calls.get(name) != 1 or name not in mods:
                continue
            keys = [(phase, name, c, -1, j) for j in range(len(rec.tensors))]
            if not all(k in received for k in keys):
                continue
            if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in mods[name].modules()):
                continue
            out.setdefault(name, {})[(phase, name, c)] = (rec, keys)
        return [(mods[name], answers) for name, answers in out.items()]

    @staticmethod
    def _module_stand_in(run: _Run, forward: Callable, answers: dict) -> Callable:
        def stand_in(*args: Any, **kwargs: Any) -> Any:
            if run.depth == 0 and run.frames:
                name, c = run.frames[-1][:2]
                hit = answers.get((run.phase, name, c))
                if hit is not None:
                    rec, keys = hit
                    flat = list(rec.flat)
                    slots = [k for k, a in enumerate(flat) if a is None]
                    for slot, key in zip(slots, keys, strict=True):
                        flat[slot] = run.received[key]
                    return tree_unflatten(flat, rec.spec)
            return forward(*args, **kwargs)

        return stand_in

    def _module_pre(self, mod: nn.Module, args: Any) -> None:
        run = self._run
        if run is None or run.depth > 0 or id(mod) in self._block_ids:
            return
        if run.record:
            self._outside[id(mod)] = mod
        name = self._mod_names.get(id(mod), type(mod).__name__)
        c = run.calls.get((run.phase, name), 0)
        run.calls[(run.phase, name)] = c + 1
        run.frames.append((name, c, run.phase, run.serial))

    def _module_post(self, mod: nn.Module, args: Any, out: Any) -> None:
        run = self._run
        if run is None or run.depth > 0 or id(mod) in self._block_ids or not run.frames:
            return
        mode = _MODES[id(run)]
        name, c, phase, serial = run.frames.pop()
        if phase != run.phase:
            return  # a module around cut points (its outputs keep their names)
        # what a module makes within one layer is named after the module (robust to how
        # it computes it: plan-invariant dropout, ghost BatchNorm); what it passes through
        # keeps its name
        flat, spec = tree_flatten(out)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if run.record:
            self._module_calls[name] = self._module_calls.get(name, 0) + 1
            if tensors and all(
                run.serial_of.get(id(t), 0) > serial or id(t) not in run.key_of for t in tensors
            ):
                self._module_outs[(phase, name, c)] = _BlockRecord(
                    spec=spec,
                    flat=[None if isinstance(a, torch.Tensor) else a for a in flat],
                    tensors=[(tuple(t.shape), t.dtype, None) for t in tensors],
                    batch=None,
                )
        for j, t in enumerate(tensors):
            if run.serial_of.get(id(t), 0) <= serial and id(t) in run.key_of:
                continue
            k = run.key_of.get(id(t))
            real = mode.is_real(t)
            rebuild = self._rebuild.get(k, False) if k is not None else mode.rebuildable(t)
            mode.assign(t, (run.phase, name, c, -1, j), real, rebuild)

    def verify(self, example_inputs: Any) -> None:
        """Run every layer as its own stage on ``example_inputs`` and on their first sample
        alone (no gradients; another micro-batch size than the recording's) so that a cut that
        cannot be run fails here, before any process starts.

        Raises:
            CaptureError: naming the stage and what failed.
        """
        from torch.utils._pytree import tree_map_only

        first = tree_map_only(torch.Tensor, lambda t: t[:1], example_inputs)
        for inputs in (example_inputs, first):
            self._verify(inputs)

    def _verify(self, example_inputs: Any) -> None:
        with torch.no_grad():
            x = None
            for layer in range(self.num_layers):
                try:
                    x = self.stage_forward(layer, layer + 1, x, example_inputs)
                except InputError:
                    raise
                except Exception as exc:
                    raise CaptureError(
                        self.source,
                        "layers",
                        f"layer {layer} ({self.layer_names[layer]}) cannot run as its own "
                        f"stage: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}; name "
                        "other cut points with layers=[...]",
                    ) from None

    def stage_forward(self, start: int, end: int, x: Any, inputs: Any) -> Any:
        if start == 0 and end == self.num_layers:
            return _call_inputs(self.module, inputs)
        received: dict[Key, torch.Tensor] = {}
        if start > 0:
            got = list(x) if isinstance(x, list | tuple) else [x]
            keys = self._live[start]
            if len(got) != len(keys):
                raise CaptureError(
                    self.source,
                    "layers",
                    f"stage starting at layer {start} received {len(got)} tensors but the "
                    f"boundary carries {len(keys)}; the forward differs between stages",
                )
            received = dict(zip(keys, got, strict=True))
        run = _Run(
            start=start,
            end=end,
            record=False,
            received=received,
            device=_device_of(inputs),
        )
        try:
            out = self._forward(run, inputs)
        except _Stop as stop:
            return stop.value
        if start == 0:
            return out
        mode = _Track(self, run)
        return mode.substitute(out, None)


_MODES: dict[int, _Track] = {}
_META = torch.device("meta")


def _top_function_mode() -> Any:
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n else None


def _stage_device(a: Any, device: torch.device) -> Any:
    return device if isinstance(a, torch.device) and a.type == "meta" else a


def _device_of(inputs: Any) -> torch.device:
    return next(iter(leaves(inputs)), torch.empty(0)).device


def cut_module(
    model: nn.Module | Sequence[nn.Module],
    example_inputs: Any = None,
    layers: Sequence[str] | None = None,
    *,
    source: str = "model",
) -> Chain:
    """The chain of ``model``: an ``nn.Sequential`` (or a list of modules) without ``layers``
    is cut at its children (as before); any other module at its blocks (:class:`ModuleCut`).

    Raises:
        InputError: not a module, an empty chain, a bad cut point or a model that cannot be
            captured (:class:`CaptureError`); ``example_inputs`` missing for a non-chain.
    """
    if isinstance(model, Chain):
        return model
    if isinstance(model, list | tuple) and model and all(isinstance(m, nn.Module) for m in model):
        model = nn.Sequential(*model)
    if not isinstance(model, nn.Module):
        raise InputError(source, "model", f"expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Sequential) and layers is None:
        if len(model) == 0:
            raise InputError(source, "model", "expected at least one layer")
        return SequentialChain(model)
    if example_inputs is None:
        raise InputError(source, "model", "expected example inputs to record the forward")
    return ModuleCut(model, example_inputs, layers, source=source)
