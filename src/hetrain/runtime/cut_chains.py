"""The chain interface of a cut model and the cut points (docs/model.md §2 chain, §5 cut
points; docs/runtime.md "Any model").

:class:`Chain` is what the engine, the profiler and the planner see of any model: layers, the
tensors each layer uses, and ``stage_forward`` (one stage of one micro-batch).
:class:`SequentialChain` cuts an ``nn.Sequential`` at its children; :func:`default_blocks`
finds the default cut points of any other module (cut by
:class:`hetrain.runtime.module_cut.ModuleCut`). Importing this module imports torch.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

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
    #: draw sites without a sample dimension (:func:`hetrain.runtime.randomness.
    #: batch_free_draw_sites`), found on the example inputs of the cut
    batch_free_draws: frozenset[tuple[str, int]] = frozenset()

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


def call_inputs(module: nn.Module, inputs: Any) -> Any:
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
