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
  cross that boundary (then that block's other tensor arguments and a tag, for a next stage of
  blocks only).

A stage of blocks only (no prefix, no suffix) does not run the model's forward: it calls its
blocks directly with the arguments recorded for them (:mod:`hetrain.runtime.cut_direct`), and
falls back to the forward where the recording shows code between its blocks or the first
block's call differs from the recorded one. The last stage records its suffix (the calls after
the last block) on its first micro-batch of each signature and then calls its blocks directly
and replays those calls (:mod:`hetrain.runtime.cut_suffix`), with the same kind of fallback.

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

The code: :mod:`hetrain.runtime.cut_chains` (the chain interface, the default cut points),
:mod:`hetrain.runtime.module_cut` (:class:`ModuleCut`), :mod:`hetrain.runtime.cut_record` (the
first pass), :mod:`hetrain.runtime.cut_track` (the tracking mode),
:mod:`hetrain.runtime.cut_direct` (stages of blocks only), :mod:`hetrain.runtime.cut_suffix`
(the last stage). Importing this module imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from hetrain.errors import InputError
from hetrain.runtime.cut_chains import (
    CaptureError,
    Chain,
    SequentialChain,
    default_blocks,
    leaves,
)
from hetrain.runtime.module_cut import ModuleCut

__all__ = [
    "CaptureError",
    "Chain",
    "ModuleCut",
    "SequentialChain",
    "cut_module",
    "default_blocks",
    "leaves",
]


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
