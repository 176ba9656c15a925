"""The first pass of cutting a module at its blocks: the order in which the forward calls the
blocks, and the tensors (parameters, buffers) each layer uses (docs/model.md §2 layer tensors).
Importing this module imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hetrain.errors import InputError
from hetrain.runtime.cut_chains import CaptureError, call_inputs, leaves
from hetrain.runtime.cut_track import _Uncalled

if TYPE_CHECKING:
    from hetrain.runtime.module_cut import ModuleCut


def record_layers(
    cut: ModuleCut, names: list[str], example_inputs: Any, default: bool = False
) -> None:
    """Order of the blocks, and the tensors (parameters, buffers) each layer uses."""
    order: list[int] = []
    by_id = {id(b): i for i, b in enumerate(cut.blocks)}
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
            if depth[0] == 0 and len(order) == len(cut.blocks):
                phase[0] = len(cut.blocks) + 1  # the suffix

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

    for b in cut.blocks:
        module_hooks.append(b.register_forward_pre_hook(pre))
        module_hooks.append(b.register_forward_hook(post))
    module_hooks.append(nn.modules.module.register_module_forward_pre_hook(any_pre))
    try:
        with torch.no_grad(), _Record():
            out = call_inputs(cut.module, example_inputs)
    except InputError:
        raise
    except Exception as exc:
        raise CaptureError(
            cut.source, "forward", f"the model's forward failed: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        for h in module_hooks:
            h.remove()
    n = len(cut.blocks)
    if sorted(order) != list(range(n)):
        twice = sorted({names[i] for i in order if order.count(i) > 1})
        missing = [names[i] for i in range(n) if i not in order]
        if default and order and not twice:
            # default cut points the forward never calls (a vision tower of a model fed
            # text only) are not cut points
            raise _Uncalled([names[i] for i in sorted(set(order))])
        raise InputError(
            cut.source,
            "layers",
            "expected every cut point to run exactly once per forward"
            + (f"; called twice: {', '.join(twice)}" if twice else "")
            + (f"; never called: {', '.join(missing)}" if missing else ""),
        )
    if not leaves(out):
        raise InputError(cut.source, "forward", "expected the model to return tensors")
    # re-order the blocks by execution
    cut.blocks = [cut.blocks[i] for i in order]
    cut.block_names = [names[i] for i in order]
    num_layers = n + 2
    cut.layer_names = (
        ["prefix"]
        + [f"{b}:{type(m).__name__}" for b, m in zip(cut.block_names, cut.blocks, strict=True)]
        + ["suffix"]
    )
    layer_sets: list[set[str]] = [set() for _ in range(num_layers)]
    for p, names_used in used.items():
        layer_sets[p] |= names_used
    seen = set().union(*layer_sets)
    # tensors no op reads (buffers read without an op, unused parameters): the layers
    # that call their module
    for mod in cut.module.modules():
        for p in mod_phase.get(id(mod), ()):
            for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
                name = cut._name_of.get(id(t))
                if name is not None and name not in seen:
                    layer_sets[p].add(name)
    # never-used tensors: the layer of their block (or the prefix)
    seen = set().union(*layer_sets)
    for name in cut.tensors:
        if name not in seen:
            layer = 0
            for i, b in enumerate(cut.block_names):
                if name.startswith(b + "."):
                    layer = i + 1
            layer_sets[layer].add(name)
    order_of = {n: i for i, n in enumerate(cut.tensors)}
    cut.layer_tensors = [sorted(s, key=order_of.__getitem__) for s in layer_sets]
    cut._layer_module_names: list[list[str]] = [[] for _ in range(num_layers)]
    for mname, mod in cut.module.named_modules():
        for p in mod_phase.get(id(mod), ()):
            cut._layer_module_names[p].append(mname)
