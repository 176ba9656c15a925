"""Stages of blocks only, run without the model's forward (docs/runtime.md "Any model",
"Stages of blocks only"). Importing this module imports torch.

A stage ``[s, e)`` of a :class:`hetrain.runtime.module_cut.ModuleCut` whose layers are all
blocks (``1 <= s < e <= number of blocks + 1``: no prefix, no suffix) calls its blocks directly,
one after the other, with the arguments the model's forward gives them: the forward's own code
(HF's mask and position-id building, the embedding, the tracking of every torch call) is not
run at all. What it needs comes across the boundary:

* the previous stage sends, after the boundary's tensors (:meth:`ModuleCut.boundary_keys`), the
  *extras* of the first block's call (the tensors among its arguments that do not cross the
  boundary anyway: position ids, padding masks, whatever the model passes its blocks that is
  made from the micro-batch's inputs) and a tag (a 0-dim int64 tensor holding the boundary),
  but only when that call's arguments have the structure recorded when the model was cut
  (the same pytree, the same non-tensor values, tensors where the recording had tensors);
  otherwise it sends the boundary's tensors alone and the next stage runs the model's forward;
* each later block of the stage is called with the arguments recorded for it, each tensor
  found by the key it had in the recording: an output of an earlier block of the stage, a
  tensor received at the stage's start (boundary tensor or extra), or the module's own weight.

It applies when, in the recording, (1) no block reads a tensor made outside the blocks other
than through its arguments, (2) no torch call and no module call ran between two blocks of the
stage (the forward only passes values from one block to the next), (3) every tensor argument of
the stage's blocks and every tensor the stage sends on resolves as above, and (4) the first
block's non-tensor arguments are plain values (None, bool, int, float, str). Otherwise the
stage runs the model's forward as before (:mod:`hetrain.runtime.cut_track`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from hetrain.runtime.cut_chains import CaptureError
from hetrain.runtime.cut_track import Key

if TYPE_CHECKING:
    from hetrain.runtime.module_cut import ModuleCut

_PLAIN = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class CallTemplate:
    """A block's call arguments as recorded: the pytree ``spec`` of ``(args, kwargs)`` and per
    leaf ``("t", key)`` (a tensor and its key, None when untracked), ``("p", tensor)`` (one of
    the module's parameters or buffers) or ``("c", value)`` (any other value)."""

    spec: TreeSpec
    leaves: list[tuple[str, Any]]


def record_template(cut: ModuleCut, key_of: dict[int, Key], args: Any, kwargs: Any) -> CallTemplate:
    """The :class:`CallTemplate` of one block call of the recording pass."""
    flat, spec = tree_flatten((args, kwargs))
    leaves: list[tuple[str, Any]] = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            if id(a) in cut._name_of:
                leaves.append(("p", a))
            else:
                leaves.append(("t", key_of.get(id(a))))
        else:
            leaves.append(("c", a))
    return CallTemplate(spec, leaves)


@dataclass(frozen=True)
class DirectPlan:
    """How stage ``[start, end)`` runs its blocks directly: per block, the module, its call
    structure, one source per leaf and how many tensors it returns; then the sources of the
    tensors it sends (the boundary's, then the next block's extras, or None: boundary only).
    A source is ``("recv", i)`` (received boundary tensor ``i``), ``("x", n)`` (received extra
    ``n``), ``("out", key)`` (a block output of the stage), ``("p", tensor)`` or ``("c", value)``.
    """

    start: int
    end: int
    steps: list[tuple[int, nn.Module, TreeSpec, list[tuple[str, Any]], int]]
    send: list[tuple[str, Any]]
    extras_out: list[tuple[str, Any]] | None


def boundary_extras(cut: ModuleCut, boundary: int) -> list[int] | None:
    """Leaf positions (in the recorded call of block ``boundary - 1``) of the extras sent at
    ``boundary``: its tensor arguments that are not boundary tensors. None when no stage can
    start there with its blocks called directly (not a block boundary, or the call has a
    non-plain value)."""
    nb = len(cut.blocks)
    if not (1 <= boundary <= nb) or not cut._closed:
        return None
    tmpl = cut._templates[boundary - 1]
    if tmpl is None:
        return None
    live = set(cut._live[boundary])
    out = []
    for pos, (kind, v) in enumerate(tmpl.leaves):
        if kind == "c" and not isinstance(v, _PLAIN):
            return None
        if kind == "t" and v not in live:
            out.append(pos)
    return out


def direct_plan(cut: ModuleCut, start: int, end: int) -> DirectPlan | None:
    """The :class:`DirectPlan` of stage ``[start, end)``, or None when it must run the model's
    forward (the conditions: module docstring)."""
    nb = len(cut.blocks)
    extras = cut._extras_at[start] if 1 <= start <= nb else None
    if extras is None or end > nb + 1 or end <= start:
        return None
    if any(p in cut._busy for p in range(start, end)):
        return None  # the forward computes something between two blocks of the stage
    live_in = cut._live[start]
    recv = {k: i for i, k in enumerate(live_in)}
    first = cut._templates[start - 1]
    x_key = {first.leaves[pos][1]: n for n, pos in enumerate(extras)}
    x_key.pop(None, None)
    produced: set[Key] = set()

    def source(key: Key | None) -> tuple[str, Any] | None:
        if key is None:
            return None
        if key in produced:
            return ("out", key)
        if key in recv:
            return ("recv", recv[key])
        if key in x_key:
            return ("x", x_key[key])
        return None

    steps = []
    for i in range(start - 1, end - 1):
        tmpl = cut._templates[i]
        rec = cut._block_records[i]
        if tmpl is None or rec is None:
            return None
        fills: list[tuple[str, Any]] = []
        n_extra = 0
        for kind, v in tmpl.leaves:
            if kind != "t":
                fills.append((kind, v))
            elif i == start - 1 and v not in recv:
                fills.append(("x", n_extra))  # the first block's extras, by position
                n_extra += 1
            else:
                src = source(v)
                if src is None:
                    return None
                fills.append(src)
        steps.append((i, cut.blocks[i], tmpl.spec, fills, len(rec.tensors)))
        produced.update((i + 1, "", -1, -1, j) for j in range(len(rec.tensors)))
    send = [source(k) for k in cut._live[end]]
    if any(s is None for s in send):
        return None
    extras_out = None
    positions = cut._extras_at[end] if end <= nb else None
    if positions is not None:
        nxt = cut._templates[end - 1]
        extras_out = [source(nxt.leaves[pos][1]) for pos in positions]
        if any(s is None for s in extras_out):
            extras_out = None  # the next stage runs the model's forward
    return DirectPlan(start, end, steps, send, extras_out)  # type: ignore[arg-type]


def _resolve(src: tuple[str, Any], live: list, extras: list, outs: dict) -> Any:
    kind, v = src
    if kind == "recv":
        return live[v]
    if kind == "x":
        return extras[v]
    if kind == "out":
        return outs[v]
    return v  # "p", "c"


def run_direct(
    cut: ModuleCut, plan: DirectPlan, live: list[torch.Tensor], extras: list[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Stage ``[plan.start, plan.end)`` on the received boundary tensors and extras: its blocks
    called one after the other; returns what it sends (boundary tensors, then the next block's
    extras and the tag when :attr:`DirectPlan.extras_out` is set).

    Raises:
        CaptureError: a block returned another number of tensors than when it was recorded.
    """
    outs = run_blocks(cut, plan, live, extras)
    sent = [_resolve(f, live, extras, outs) for f in plan.send]
    if plan.extras_out is None:
        return tuple(sent)
    sent += [_resolve(f, live, extras, outs) for f in plan.extras_out]
    return (*sent, boundary_tag(plan.end, sent[0].device if sent else None))


def run_blocks(
    cut: ModuleCut, plan: DirectPlan, live: list[torch.Tensor], extras: list[torch.Tensor]
) -> dict[Key, torch.Tensor]:
    """The blocks of ``plan`` called one after the other on the received boundary tensors and
    extras; returns every block's output tensors by key ``(i + 1, "", -1, -1, j)``.

    Raises:
        CaptureError: a block returned another number of tensors than when it was recorded.
    """
    outs: dict[Key, torch.Tensor] = {}
    for i, block, spec, fills, count in plan.steps:
        flat = [_resolve(f, live, extras, outs) for f in fills]
        ts = call_recorded(cut, block, flat, spec, count, f"block {cut.block_names[i]}")
        for j, t in enumerate(ts):
            outs[(i + 1, "", -1, -1, j)] = t
    return outs


def call_recorded(
    cut: ModuleCut, fn: Any, flat: list[Any], spec: Any, count: int, what: str
) -> list[torch.Tensor]:
    """``fn`` called on the arguments ``tree_unflatten(flat, spec)`` (``(args, kwargs)``) of
    a recorded call; returns the tensors of its output in ``tree_flatten`` order.

    Raises:
        CaptureError: the output holds another number of tensors (``count``) than when the
            call was recorded (``what`` names the call).
    """
    args, kwargs = tree_unflatten(flat, spec)
    y = fn(*args, **kwargs)
    ts = [t for t in tree_flatten(y)[0] if isinstance(t, torch.Tensor)]
    if len(ts) != count:
        raise CaptureError(
            cut.source,
            "layers",
            f"{what} returned {len(ts)} tensors, {count} when it was recorded: the forward "
            "took another path; name other cut points with layers=[...]",
        )
    return ts


_TAGS: dict[tuple[int, Any], torch.Tensor] = {}


def boundary_tag(boundary: int, device: torch.device | None) -> torch.Tensor:
    """The 0-dim int64 tensor (holding ``boundary``) ending a message that carries a block
    call's extras; made once per boundary and device (no operator per micro-batch, so profiles
    and operator counts do not see it)."""
    key = (boundary, device)
    tag = _TAGS.get(key)
    if tag is None:
        with torch._C.DisableTorchFunction(), torch.utils._python_dispatch._disable_current_modes():
            tag = _TAGS[key] = torch.tensor(boundary, dtype=torch.int64, device=device)
    return tag


def extras_now(
    cut: ModuleCut, boundary: int, args: Any, kwargs: Any, key_of: dict[int, Key]
) -> list[torch.Tensor] | None:
    """The extras of block ``boundary - 1``'s call ``(args, kwargs)`` in a stage running the
    model's forward, or None when the call does not have the recorded structure (the next
    stage then runs the model's forward too)."""
    positions = cut._extras_at[boundary] if 1 <= boundary <= len(cut.blocks) else None
    if positions is None:
        return None
    tmpl = cut._templates[boundary - 1]
    flat, spec = tree_flatten((args, kwargs))
    if len(flat) != len(tmpl.leaves) or spec != tmpl.spec:
        return None
    extra = set(positions)
    out = []
    for pos, (a, (kind, v)) in enumerate(zip(flat, tmpl.leaves, strict=True)):
        if kind == "c":
            if isinstance(a, torch.Tensor) or type(a) is not type(v) or a != v:
                return None
        elif kind == "p":
            if a is not v:
                return None
        elif not isinstance(a, torch.Tensor):
            return None
        elif pos in extra:
            if (
                a.requires_grad
                or id(a) in cut._name_of
                or (a.device.type == "meta" and not cut._meta_model)
            ):
                return None
            out.append(a)
        elif key_of.get(id(a)) != v:
            return None
    return out
