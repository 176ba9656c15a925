"""FLOPs and bytes of each layer of a chain (docs/model.md §2 model profile) measured on a real
module.

For each child ``l`` of an ``nn.Sequential`` (a pipeline layer), run on an example batch of
``N`` samples:

* ``fwd_flops`` / ``bwd_flops``: :class:`torch.utils.flop_counter.FlopCounterMode` around the
  child's forward, and around the backward of its output given an upstream gradient of ones
  (weight gradients plus the gradient of the input, except for layer 0 whose input is data);
* ``activation_bytes``: bytes of the output tensor(s) (what crosses a stage boundary);
* ``activation_memory_bytes``: bytes of the tensors autograd saves for backward, captured with
  :func:`torch.autograd.graph.saved_tensors_hooks`, each storage counted once and parameters
  left out (they are ``param_bytes``);
* ``param_bytes``: bytes of the child's parameters (a parameter shared by several layers is
  counted in the first);
* ``overhead_weight``: the number of ATen operators the child's forward and backward dispatch
  (:class:`OpCounter`), divided by the mean over the layers: each operator costs about the
  same fixed time (dispatch, kernel launch) whatever its size, so a layer's share of the
  per-layer fixed cost λ follows its operator count (docs/model.md §3 "Per-layer overhead
  weights"; on this machine, a character-level transformer's embedding, block and head
  dispatch 14, 104 and 24 operators and take 8.2, 8.0 and 7.4 µs per operator at one
  sample).

All but ``param_bytes`` are divided by ``N`` (per sample, docs/model.md §7). FLOPs and bytes depend
on shapes only, so the module may live on the ``meta`` device (no memory, no compute): a chain
with meta inputs, or any module with real inputs under :class:`MetaModelMode`
(:func:`profile_on_meta`), which keeps the values that Python code of the model reads (masks,
position ids) real.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from hetrain.profile import LayerProfile, ModelProfile


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a pytree (tuple, dict, ``ModelOutput``), in pytree order."""
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _detach_for_next(obj: Any, requires_grad: bool) -> Any:
    from torch.utils._pytree import tree_map_only

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.detach()
        if requires_grad and out.is_floating_point():
            out.requires_grad_(True)
        return out

    return tree_map_only(torch.Tensor, one, obj)


def _sdpa_fwd(query_shape, key_shape, value_shape, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_bwd(grad_out_shape, query_shape, key_shape, value_shape, *args: Any, **kw: Any) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _custom_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas for fused attention kernels that ``FlopCounterMode`` does not register
    (the CPU flash-attention kernel in torch 2.13): the same counts as its registered
    ``_scaled_dot_product_flash_attention`` formulas (2 bmm forward, 5 bmm backward)."""
    aten = torch.ops.aten
    out: dict[Any, Any] = {}
    for op, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_fwd),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_bwd),
    ):
        if hasattr(aten, op):
            out[getattr(aten, op)] = formula
    return out


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched while active (``count``), passing each through
    unchanged (``torch.utils._python_dispatch.TorchDispatchMode``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += 1
        return func(*args, **(kwargs or {}))


def overhead_weights(op_counts: Sequence[int]) -> list[float]:
    """ν_l = ``op_counts[l] / mean(op_counts)`` (docs/model.md §3), rounded to 4 digits; all
    ones when no layer dispatched an operator. Shape ``(L,)``, mean 1."""
    total = float(sum(op_counts))
    if total <= 0:
        return [1.0] * len(op_counts)
    mean = total / len(op_counts)
    return [round(c / mean, 4) for c in op_counts]


def profile_chain(model: Any, example_input: Any, *, name: str = "model") -> ModelProfile:
    """Measure the docs/model.md §7 profile of ``model`` on ``example_input``.

    Args:
        model: an ``nn.Sequential`` (one layer per child), or a
            :class:`~hetrain.runtime.cutting.Chain` of any module (layer ``l`` runs with
            ``stage_forward(l, l + 1, ...)``, docs/model.md §5 cut). Put it in the mode it trains
            in.
        example_input: the model's input, a tensor (or pytree of tensors) whose first dimension
            is the batch ``N >= 1``; on the same device as ``model``.
        name: the profile's ``name``.

    Returns:
        A validated :class:`~hetrain.profile.ModelProfile`: FLOPs and bytes per sample;
        ``activation_bytes`` counts every tensor crossing the boundary after the layer (hidden
        states, rotary tables, an encoder's output; before a block, also that block's other
        tensor arguments, e.g. position ids, which a next stage of blocks only receives instead
        of running the model's forward: docs/runtime.md "Any model"); ``param_bytes`` the
        layer's own trainable parameters, ``frozen_param_bytes`` its own parameters without
        gradient; ``overhead_weight`` its ATen operator count over the mean
        (:func:`overhead_weights`); a tensor used by two or more layers (tied weights) is
        listed once in ``shared`` (docs/model.md §2) and in no layer.

    Raises:
        ValueError: ``model`` has no layers, the batch dimension is missing, or a layer's
            output holds no floating-point tensor (nothing to back-propagate).
    """
    from hetrain.profile import SharedTensorProfile
    from hetrain.runtime.cutting import Chain, cut_module

    if isinstance(model, nn.Sequential) and len(model) == 0:
        raise ValueError("profile_chain: the model has no layers (children)")
    chain = model if isinstance(model, Chain) else cut_module(model, example_input)
    first = _tensors(example_input)
    if not first or first[0].dim() == 0:
        raise ValueError("profile_chain: example_input needs a leading batch dimension")
    batch = int(first[0].shape[0])
    custom = _custom_flop_formulas()
    shared = chain.shared
    layers: list[LayerProfile] = []
    op_counts: list[int] = []
    x: Any = None
    for idx in range(chain.num_layers):
        names = chain.layer_tensors[idx]
        params = [chain.tensors[n] for n in names if chain.is_param[n]]
        param_keys = {_storage_key(p) for p in params}
        param_ids = {id(p) for p in params}
        own = [n for n in names if chain.is_param[n] and n not in shared]
        trainable = sum(_nbytes(chain.tensors[n]) for n in own if not chain.frozen(n))
        frozen = sum(_nbytes(chain.tensors[n]) for n in own if chain.frozen(n))
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved=saved, keys=param_keys, ids=param_ids) -> Any:
            if id(t) in ids:
                return t
            key = _storage_key(t)  # meta tensors have (empty) storages shared by views too
            if key not in keys:
                saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
            return t

        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            FlopCounterMode(display=False, custom_mapping=custom) as fwd_counter,
            OpCounter() as fwd_ops,
        ):
            y = chain.stage_forward(idx, idx + 1, x, example_input)
        outs = [t for t in _tensors(y) if t.is_floating_point()]
        if not outs:
            raise ValueError(
                f"profile_chain: layer {idx} ({chain.layer_names[idx]}) has no floating-point "
                "output"
            )
        grads = [t for t in outs if t.requires_grad]
        with (
            FlopCounterMode(display=False, custom_mapping=custom) as bwd_counter,
            OpCounter() as bwd_ops,
        ):
            if grads:
                torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
        for p in params:
            p.grad = None
        op_counts.append(fwd_ops.count + bwd_ops.count)
        layers.append(
            LayerProfile(
                name=chain.layer_names[idx]
                if not isinstance(chain.module, nn.Sequential)
                else f"{idx}:{type(chain.module[idx]).__name__}",
                fwd_flops=fwd_counter.get_total_flops() / batch,
                bwd_flops=bwd_counter.get_total_flops() / batch,
                activation_bytes=sum(_nbytes(t) for t in _tensors(y)) / batch,
                activation_memory_bytes=sum(saved.values()) / batch,
                param_bytes=float(trainable),
                frozen_param_bytes=float(frozen),
            )
        )
        x = _detach_for_next(y, requires_grad=True)
        del y, outs, grads, saved
    shared_list = [
        SharedTensorProfile(
            name=n,
            bytes=float(_nbytes(chain.tensors[n])),
            layers=list(ls),
            frozen=chain.frozen(n),
        )
        for n, ls in shared.items()
        if chain.is_param[n]
    ]
    for layer, weight in zip(layers, overhead_weights(op_counts), strict=True):
        layer.overhead_weight = weight
    return ModelProfile(name=name, layers=layers, shared=shared_list)


class MetaModelMode(TorchDispatchMode):
    """Run a model whose parameters and buffers live on the ``meta`` device on *real* inputs
    (a shape-only forward and backward that Python code of the model can still branch on).

    Every op with a meta tensor among its arguments runs on meta copies of all of them (shapes
    only, no memory, no compute); an op on real tensors only runs for real (the masks, position
    ids and their checks that Hugging Face models compute from the inputs: on meta, their
    ``.item()``/``all()`` checks would fail); a factory (``arange``, ``ones``...) asked for the
    ``meta`` device, as ``device=hidden.device`` does, is made on ``device`` (real). Modes
    entered inside this one (a ``FlopCounterMode``) see every op, with the same shapes as on
    the real device, so FLOPs and bytes equal a real run's (``tests/profiler/test_chain.py``).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        device = kwargs.get("device")
        if not tensors and isinstance(device, torch.device) and device.type == "meta":
            return func(*args, **{**kwargs, "device": self.device})
        if any(t.device.type == "meta" for t in tensors):
            flat = [
                a.to("meta") if isinstance(a, torch.Tensor) and a.device.type != "meta" else a
                for a in flat
            ]
            args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **kwargs)


def profile_on_meta(
    build: Callable[[], nn.Module],
    example_input: Any,
    *,
    name: str = "model",
    layers: Sequence[str] | None = None,
    source: str = "model",
) -> ModelProfile:
    """:func:`profile_chain` of the module ``build()`` returns, built on the ``meta`` device (no
    weights allocated, no compute: the published GPT-2 small / BERT-base / ResNet-50 shapes in
    seconds; a module that ``build`` makes elsewhere, a copy, is moved there), cut as in
    training (:func:`hetrain.runtime.cutting.cut_module`, cut points
    ``layers`` or the default blocks) and run under :class:`MetaModelMode` on the real
    ``example_input`` (CPU tensors whose first dimension is the batch).

    Returns:
        The same profile as :func:`profile_chain` of the module built on the CPU (FLOPs,
        parameter, activation and saved-activation bytes, shared and frozen tensors).

    Raises:
        InputError: as :func:`~hetrain.runtime.cutting.cut_module` (a cut point naming no
            module, a model that cannot be captured).
        ValueError: as :func:`profile_chain`.
    """
    from hetrain.runtime.cutting import cut_module

    with torch.device("meta"):
        module = build()
    if any(t.device.type != "meta" for t in [*module.parameters(), *module.buffers()]):
        module = _to_meta_keeping_ties(module)  # built elsewhere (a copy of a module)
    module.train()
    with MetaModelMode(next(iter(_tensors(example_input)), torch.empty(0)).device):
        # the cut records the forward on the first sample, as for a real module
        first = _first_sample(example_input)
        chain = cut_module(module, first, layers, source=source)
        return profile_chain(chain, example_input, name=name)


def _to_meta_keeping_ties(module: nn.Module) -> nn.Module:
    """``module`` moved to the meta device with every tied parameter still one object
    (``Module.to("meta")`` makes a new parameter per use)."""
    uses: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        uses.setdefault(id(p), []).append(name)
    module = module.to("meta")
    for names in uses.values():
        first = module.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, first)
    return module


def _first_sample(obj: Any) -> Any:
    """``obj`` with every tensor cut to its first sample (``t[:1]``)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t[:1], obj)
