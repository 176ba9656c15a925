"""FLOPs and bytes of each layer of a chain (SPEC §2 model profile) measured on a real module.

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
  counted in the first).

All but ``param_bytes`` are divided by ``N`` (per sample, SPEC §7). FLOPs and bytes depend on
shapes only, so the module may live on the ``meta`` device (no memory, no compute).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from hetrain.profile import LayerProfile, ModelProfile


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Sequence) and not isinstance(obj, str):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _detach_for_next(obj: Any, requires_grad: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        out = obj.detach()
        if requires_grad and out.is_floating_point():
            out.requires_grad_(True)
        return out
    if isinstance(obj, tuple):
        return tuple(_detach_for_next(o, requires_grad) for o in obj)
    if isinstance(obj, list):
        return [_detach_for_next(o, requires_grad) for o in obj]
    return obj


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


def profile_chain(model: nn.Sequential, example_input: Any, *, name: str = "model") -> ModelProfile:
    """Measure the SPEC §7 profile of ``model`` (one layer per child) on ``example_input``.

    Args:
        model: the chain; child ``l`` receives child ``l-1``'s output. Put it in the mode it
            trains in (the function does not change it).
        example_input: the first child's input, a tensor (or tuple of tensors) whose first
            dimension is the batch ``N >= 1``; on the same device as ``model``.
        name: the profile's ``name``.

    Returns:
        A validated :class:`~hetrain.profile.ModelProfile` with ``len(model)`` layers named
        ``"{l}:{ClassName}"``; FLOPs and bytes per sample, ``param_bytes`` per layer.

    Raises:
        ValueError: ``model`` has no children, the batch dimension is missing, or a layer's
            output holds no floating-point tensor (nothing to back-propagate).
    """
    children = list(model)  # not .children(): it skips a module used twice
    if not children:
        raise ValueError("profile_chain: the model has no layers (children)")
    first = _tensors(example_input)
    if not first or first[0].dim() == 0:
        raise ValueError("profile_chain: example_input needs a leading batch dimension")
    batch = int(first[0].shape[0])
    custom = _custom_flop_formulas()
    seen_params: set[int] = set()
    layers: list[LayerProfile] = []
    x = _detach_for_next(example_input, requires_grad=False)
    for idx, child in enumerate(children):
        params = list(child.parameters())
        param_keys = {_storage_key(p) for p in params}
        param_bytes = 0
        for p in params:
            key = _storage_key(p)
            if key not in seen_params:
                seen_params.add(key)
                param_bytes += _nbytes(p)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved=saved, param_keys=param_keys) -> torch.Tensor:
            key = _storage_key(t)
            if key not in param_keys:
                saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
            return t

        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            FlopCounterMode(display=False, custom_mapping=custom) as fwd_counter,
        ):
            y = child(x)
        outs = [t for t in _tensors(y) if t.is_floating_point()]
        if not outs:
            raise ValueError(
                f"profile_chain: layer {idx} ({type(child).__name__}) has no floating-point output"
            )
        grads = [t for t in outs if t.requires_grad]
        with FlopCounterMode(display=False, custom_mapping=custom) as bwd_counter:
            if grads:
                torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
        for p in params:
            p.grad = None
        layers.append(
            LayerProfile(
                name=f"{idx}:{type(child).__name__}",
                fwd_flops=fwd_counter.get_total_flops() / batch,
                bwd_flops=bwd_counter.get_total_flops() / batch,
                activation_bytes=sum(_nbytes(t) for t in _tensors(y)) / batch,
                activation_memory_bytes=sum(saved.values()) / batch,
                param_bytes=float(param_bytes),
            )
        )
        x = _detach_for_next(y, requires_grad=True)
        del y, outs, grads, saved
    return ModelProfile(name=name, layers=layers)
