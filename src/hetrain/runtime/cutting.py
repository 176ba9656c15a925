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
the micro-batch's inputs; what belongs to layers before ``s`` runs on the ``meta`` device (a
``TorchDispatchMode`` turns every tensor into a shape-only meta tensor, so no weights and no
compute are needed, and Python control flow still sees the real shapes); at the call of block
``s - 1`` the tensors of its arguments are replaced by the ones received from the previous stage
and the forward continues for real; at the call of the block that starts layer ``e`` the tensors
of its arguments are captured (they are what crosses the stage boundary: hidden states,
attention masks, position ids, ...) and the forward is stopped. A tensor computed before the
stage that is not an argument of the boundary block cannot be rebuilt; such a model "cannot be
captured" at that cut and :class:`CaptureError` names the op (name other cut points with
``layers=``). This is a home-made but small alternative to ``torch.export`` (which copies no
weights but bakes ``train()``/``eval()`` and the randomness into the graph); it is not
``torch.distributed.pipelining.pipeline()``, which copies tied weights into separate stages and
fixes the micro-batch size.

Importing this module imports torch.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
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


class _Stop(BaseException):  # noqa: N818 - control flow, not an error
    def __init__(self, value: Any) -> None:
        self.value = value


@dataclass
class _Run:
    start: int
    end: int
    x: Any
    meta: bool
    real_of: dict[int, tuple[torch.Tensor, torch.Tensor]]
    meta_of: dict[int, tuple[torch.Tensor, torch.Tensor]]
    grad_enabled: bool
    device: torch.device = torch.device("cpu")
    # the model lives on the meta device (a shape-only profile): the outputs of the replay
    # before the stage, by id (the only meta tensors a stage may not use)
    replayed: dict[int, torch.Tensor] | None = None


class _MetaMode(TorchDispatchMode):
    """While ``run.meta``: every op runs on meta copies of its tensors (shapes only). Else: ops
    run for real; a meta argument is replaced by the real tensor received for it, if any."""

    def __init__(self, cut: ModuleCut, run: _Run) -> None:
        super().__init__()
        self.cut = cut
        self.run = run

    def _to_meta(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            return t
        hit = self.run.meta_of.get(id(t))
        if hit is None:
            with _disable_current_modes():  # a meta copy, whatever an outer mode does
                m = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
            hit = self.run.meta_of[id(t)] = (t, m)
        return hit[1]

    def _to_real(self, func: Any, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            return t
        hit = self.run.real_of.get(id(t))
        if hit is None and self.run.replayed is not None and id(t) not in self.run.replayed:
            return t  # a meta model's tensor, or computed from one within the stage
        if hit is None or t.requires_grad:
            raise CaptureError(
                self.cut.source,
                "layers",
                f"cannot capture {func} in stage {self.run.start}-{self.run.end - 1}: it uses a "
                "tensor computed before the stage that is not an argument of the first block of "
                "the stage; name other cut points with layers=[...]",
            )
        return hit[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        if (
            self.run.meta
            and isinstance(kwargs.get("device"), torch.device)
            and kwargs["device"].type == "meta"
            and not any(isinstance(a, torch.Tensor) for a in flat)
        ):
            # a factory (arange, ones) placed on the device of a meta tensor: make it real
            kwargs = {**kwargs, "device": self.run.device}
            return func(*args, **kwargs)
        if self.run.meta and any(
            isinstance(a, torch.Tensor) and (a.device.type == "meta" or id(a) in self.cut._name_of)
            for a in flat
        ):
            # an op on weights or on what came from them: shapes only. Ops on the inputs alone
            # (masks, position ids) run for real, so Python checks of their values still work.
            flat = [self._to_meta(a) if isinstance(a, torch.Tensor) else a for a in flat]
            args, kwargs = tree_unflatten(flat, spec)
            try:
                # outer modes (a FLOP counter) must not see this shape-only replay
                with _disable_current_modes():
                    out = func(*args, **kwargs)
                if self.run.replayed is not None:
                    self.run.replayed.update((id(t), t) for t in leaves(out))
                return out
            except CaptureError:
                raise
            except Exception as exc:
                raise CaptureError(
                    self.cut.source,
                    "layers",
                    f"cannot capture {func} before stage {self.run.start}-{self.run.end - 1} "
                    f"(it needs tensor values: {str(exc).splitlines()[0][:120]}); name other cut "
                    "points with layers=[...]",
                ) from None
        if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in flat):
            flat = [self._to_real(func, a) if isinstance(a, torch.Tensor) else a for a in flat]
            args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **kwargs)


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
            tensors each layer uses and the order of the blocks.
        blocks: module names of the cut points (default :func:`default_blocks`).
        source: where the model came from (error messages).

    Raises:
        InputError: a cut point that names no module (near names listed), no blocks found,
            or blocks not called exactly once each per forward.
        CaptureError: the forward cannot be recorded.
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
        self._record(list(blocks), example_inputs)
        self._run: _Run | None = None
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)
            block.register_forward_hook(self._post_hook(i))

    # ---------------------------------------------------------------------------- recording
    def _record(self, names: list[str], example_inputs: Any) -> None:
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
            mod_phase.setdefault(id(mod), set()).add(phase[0])

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
        # tensors of modules called in a phase (buffers read without an op, unused params)
        for mod in self.module.modules():
            for p in mod_phase.get(id(mod), ()):
                for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
                    if id(t) in self._name_of:
                        layer_sets[p].add(self._name_of[id(t)])
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

    def layer_modules(self, layer: int) -> list[nn.Module]:
        mods = dict(self.module.named_modules())
        if 1 <= layer <= len(self.blocks):
            return [self.blocks[layer - 1]]
        return [mods[m] for m in self._layer_module_names[layer] if not list(mods[m].children())]

    # ---------------------------------------------------------------------------- running
    def _pre_hook(self, i: int) -> Callable:
        def hook(mod, args, kwargs):  # noqa: ANN001
            run = self._run
            if run is None:
                return None
            phase = i + 1
            if phase == run.end:
                raise _Stop(leaves((args, kwargs)))
            if phase == run.start:
                args, kwargs = self._inject((args, kwargs), run.x, run)
                run.meta = False
                torch.set_grad_enabled(run.grad_enabled)
                return args, kwargs
            if not run.meta:
                flat, spec = tree_flatten((args, kwargs))
                if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in flat):
                    flat = [
                        run.real_of[id(a)][1]
                        if isinstance(a, torch.Tensor) and id(a) in run.real_of
                        else a
                        for a in flat
                    ]
                    return tree_unflatten(flat, spec)
            return None

        return hook

    def _post_hook(self, i: int) -> Callable:
        last = i == len(self.blocks) - 1

        def hook(mod, args, output):  # noqa: ANN001
            run = self._run
            if run is None or not last:
                return None
            suffix = len(self.blocks) + 1
            if run.end == suffix:
                raise _Stop(leaves(output))
            if run.start == suffix:
                output = self._inject(output, run.x, run)
                run.meta = False
                torch.set_grad_enabled(run.grad_enabled)
                return output
            return None

        return hook

    def _inject(self, local: Any, received: Any, run: _Run) -> Any:
        flat, spec = tree_flatten(local)
        got = list(received) if isinstance(received, list | tuple) else [received]
        slots = [k for k, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        if len(slots) != len(got):
            raise CaptureError(
                self.source,
                "layers",
                f"stage starting at layer {run.start} received {len(got)} tensors but the cut "
                f"point takes {len(slots)}; the forward differs between stages",
            )
        for k, t in zip(slots, got, strict=True):
            run.real_of[id(flat[k])] = (flat[k], t)
            flat[k] = t
        return tree_unflatten(flat, spec)

    def verify(self, example_inputs: Any) -> None:
        """Run every layer as its own stage on ``example_inputs`` (no gradients) so that a cut
        that cannot be captured fails here, before any process starts.

        Raises:
            CaptureError: naming the op and the stage.
        """
        with torch.no_grad():
            x = None
            for layer in range(self.num_layers):
                x = self.stage_forward(layer, layer + 1, x, example_inputs)

    def stage_forward(self, start: int, end: int, x: Any, inputs: Any) -> Any:
        run = _Run(
            start=start,
            end=end,
            x=x,
            meta=start > 0,
            real_of={},
            meta_of={},
            grad_enabled=torch.is_grad_enabled(),
            device=next(iter(leaves(inputs)), torch.empty(0)).device,
            replayed={} if self._meta_model else None,
        )
        self._run = run
        try:
            if start == 0:
                return _call_inputs(self.module, inputs)
            with torch.no_grad(), _MetaMode(self, run):
                try:
                    out = _call_inputs(self.module, inputs)
                finally:
                    torch.set_grad_enabled(run.grad_enabled)
            return out
        except _Stop as stop:
            return tuple(stop.value)
        finally:
            torch.set_grad_enabled(run.grad_enabled)
            self._run = None


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
