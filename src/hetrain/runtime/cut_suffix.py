"""The last stage of a :class:`hetrain.runtime.module_cut.ModuleCut` without the model's forward
(docs/runtime.md "Any model", "The last stage"). Importing this module imports torch.

A last stage ``[s, L)`` (``L`` = number of layers, ``s >= 1``) runs the model's forward once per
*signature* (below) under the tracking mode, as any stage, and meanwhile records its *suffix*
(the code after the last block) as a list of calls: each call of a module outside the blocks
made at the top level of the suffix, and each torch call made there outside such a module
(``norm(h)``, ``h[:, -k:, :]``, ``lm_head(h)``), with, per argument, where its value comes from:
a tensor received from the previous stage, an extra of the stage's first block (its position
ids, its mask: the previous stage sends them), an output of a block of the stage, the output of
an earlier recorded call, a leaf of the micro-batch's inputs, a weight or buffer, or a plain
value. Later micro-batches with the same signature call the stage's blocks directly
(:func:`hetrain.runtime.cut_direct.run_direct`'s block loop) and then the recorded calls, one
after the other, and build the model's output from the recorded structure: none of the code
before the first block (embedding on ``meta``, mask building, position ids) and no tracking.

The signature: the stage, the grad and inference modes, the autocast state, the root module's
training flag, the shape, dtype, device and ``requires_grad`` of every received tensor and of
every input leaf, the inputs' structure and non-tensor values. Python code of the suffix may
branch on nothing else for the recording to hold; so a recording is kept only when, in the
suffix:

* no call reads tensor values into Python (a torch call at the top level that returns no
  tensor and writes none: ``.item()``, ``bool(t)``, ``.tolist()``); calls inside a recorded
  module run again in full, so the module's own code may branch as it likes;
* no top-level torch call draws random numbers (dropout called as a function, outside a
  module: plan-invariant randomness keys its draws by the innermost module, which differs when
  the call is made outside the forward); a dropout *module* is a recorded module call;
* every tensor argument resolves as above (a tensor made before the stage and not received,
  made by an attribute read such as ``w.T``, or made by code the replay does not run, cannot);
* every non-tensor argument and output leaf is a plain value (None, bool, int, float, str,
  slice, Ellipsis, ``torch.dtype``, ``torch.device``, or tuples of those);
* the grad mode of every call is the stage's (no ``torch.no_grad()`` block in the suffix);
* every recorded module is called once per forward, contains no block and no other module
  called outside the blocks, and the modules whose forward spans the suffix (the root, HF's
  inner ``model``) carry no forward or pre-forward hooks other than the cut's own (global
  module hooks see the recorded modules called, not those spanning modules).

It also assumes what the recording assumes everywhere: the forward's Python code depends on
the signature only (no Python state that changes from one call to the next, such as a call
counter on the module). Otherwise the stage runs the model's forward, exact as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from hetrain.runtime.cut_direct import DirectPlan
    from hetrain.runtime.module_cut import ModuleCut

_PLAIN_LEAVES = (
    type(None),
    bool,
    int,
    float,
    str,
    slice,
    type(Ellipsis),
    torch.dtype,
    torch.device,
)
#: torch calls that draw random numbers (not replayed outside the forward), by name without a
#: trailing underscore; and every name holding "dropout"
_RANDOM = frozenset(
    {
        "rrelu",
        "bernoulli",
        "normal",
        "log_normal",
        "multinomial",
        "rand",
        "randn",
        "randint",
        "rand_like",
        "randn_like",
        "randint_like",
        "randperm",
        "uniform",
        "exponential",
        "geometric",
        "cauchy",
        "poisson",
        "scaled_dot_product_attention",
    }
)


def _random(name: str) -> bool:
    return "dropout" in name or name.rstrip("_") in _RANDOM


def _plain(v: Any) -> bool:
    if isinstance(v, tuple):
        return all(_plain(a) for a in v)
    if isinstance(v, slice):
        return all(_plain(a) for a in (v.start, v.stop, v.step))
    return isinstance(v, _PLAIN_LEAVES)


@dataclass
class SuffixTrace:
    """The recorded suffix of a last stage: ``ops`` per call ``(kind, callable, spec, fills,
    tensor count)`` (kind ``"m"``: a module, ``"f"``: a torch function), the output's ``spec``
    and ``fills``; a fill is a source as in :class:`hetrain.runtime.cut_direct.DirectPlan` or
    ``("s", (op, j))`` (tensor ``j`` of recorded call ``op``) or ``("in", i)`` (input leaf
    ``i``). ``spanning``: the modules whose forward spans the suffix, with their hook counts."""

    ops: list[tuple[str, Any, TreeSpec, list[tuple[str, Any]], int]]
    out_spec: TreeSpec
    out_fills: list[tuple[str, Any]]
    spanning: list[tuple[nn.Module, int, int]]
    input_spec: TreeSpec


@dataclass
class TraceRecorder:
    """The recording of a suffix during one tracking run of a last stage (set as
    ``_Run.trace``); :attr:`ok` turns False at the first thing that cannot be replayed."""

    cut: ModuleCut
    suffix: int  # the suffix's phase
    grad: bool
    input_spec: TreeSpec
    src_of: dict[int, tuple[str, Any]] = field(default_factory=dict)
    keep: list[torch.Tensor] = field(default_factory=list)  # named tensors: ids stay unique
    ops: list = field(default_factory=list)
    open: tuple | None = None  # the module call being recorded: (module, spec, fills)
    spanning: list[tuple[nn.Module, int, int]] = field(default_factory=list)
    ok: bool = True
    why: str = ""

    def name(self, t: torch.Tensor, src: tuple[str, Any]) -> None:
        """Name tensor ``t`` (kept alive while recording, so no later tensor reuses its id)."""
        if id(t) not in self.src_of:
            self.src_of[id(t)] = src
            self.keep.append(t)

    def fail(self, why: str) -> None:
        if self.ok:
            self.ok, self.why = False, why

    def source(self, a: Any, run: Any) -> tuple[str, Any] | None:
        if not isinstance(a, torch.Tensor):
            return ("c", a) if _plain(a) else None
        s = self.src_of.get(id(a))
        if s is None:
            k = run.key_of.get(id(a))
            got = run.received.get(k) if k is not None else None
            if got is not None:
                s = self.src_of.get(id(got))
        if s is None and id(a) in self.cut._name_of:
            s = ("p", a)
        return s

    def template(self, args: Any, kwargs: Any, run: Any) -> tuple[TreeSpec, list] | None:
        flat, spec = tree_flatten((args, kwargs))
        fills = []
        for a in flat:
            s = self.source(a, run)
            if s is None:
                self.fail("an argument of the suffix cannot be named")
                return None
            fills.append(s)
        return spec, fills

    def outputs(self, out: Any) -> int:
        """Name the tensors of call ``len(ops)``'s output; returns their count."""
        ts = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        op = len(self.ops)
        for j, t in enumerate(ts):
            self.name(t, ("s", (op, j)))
        return len(ts)

    # ------------------------------------------------------------------- events
    def enter_suffix(self, modules: list[nn.Module | None]) -> None:
        """The last block returned: ``modules`` are those whose call spans the suffix."""
        for m in modules:
            if m is None:
                self.fail("a module around the blocks has no name")
                return
            self.spanning.append((m, len(m._forward_hooks), len(m._forward_pre_hooks)))

    def on_call(self, func: Any, name: str, args: Any, kwargs: Any, out: Any, run: Any) -> None:
        """A torch call at the top level of the suffix (outside any module call)."""
        if not self.ok:
            return
        if torch.is_grad_enabled() != self.grad:
            self.fail(f"{name} runs under another grad mode")
            return
        if _random(name):
            self.fail(f"{name} draws random numbers outside a module")
            return
        n_out = len([t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
        from hetrain.runtime.cut_track import _mutates

        if n_out == 0 and not _mutates(func):
            self.fail(f"{name} reads tensor values")
            return
        tmpl = self.template(args, kwargs, run)
        if tmpl is None:
            return
        self.outputs(out)
        self.ops.append(("f", func, tmpl[0], tmpl[1], n_out))

    def module_pre(self, mod: nn.Module, args: Any, kwargs: Any, run: Any) -> None:
        if not self.ok:
            return
        if self.open is not None:
            self.fail("a module call inside a recorded one")
            return
        if torch.is_grad_enabled() != self.grad:
            self.fail("a module runs under another grad mode")
            return
        if not self.cut._replayable_module(mod):
            self.fail(f"module {self.cut._mod_names.get(id(mod), '?')} cannot be called alone")
            return
        tmpl = self.template(args, kwargs, run)
        if tmpl is not None:
            self.open = (mod, *tmpl)

    def module_post(self, mod: nn.Module, out: Any) -> None:
        if self.open is None or self.open[0] is not mod:
            return
        _, spec, fills = self.open
        self.open = None
        n_out = self.outputs(out)
        self.ops.append(("m", mod, spec, fills, n_out))

    def finish(self, out: Any, run: Any) -> SuffixTrace | None:
        """The trace, given the stage's output, or None."""
        if not self.ok or self.open is not None:
            return None
        flat, spec = tree_flatten(out)
        fills = []
        for a in flat:
            s = self.source(a, run)
            if s is None:
                return None
            fills.append(s)
        return SuffixTrace(self.ops, spec, fills, self.spanning, self.input_spec)


def signature(start: int, got: list[torch.Tensor], inputs: Any, root: nn.Module) -> tuple | None:
    """What a recorded suffix is valid for (module docstring), or None when an input leaf is
    not hashable; the inputs' pytree spec is compared apart (:attr:`SuffixTrace.input_spec`)."""
    flat = tree_flatten(inputs)[0]
    parts: list[Any] = [
        start,
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled(),
        root.training,
        len(flat),
    ]
    for t in got:
        parts.append((t.shape, t.dtype, t.device, t.requires_grad))
    for a in flat:
        if isinstance(a, torch.Tensor):
            parts.append((a.shape, a.dtype, a.device, a.requires_grad))
        elif _plain(a):
            parts.append((type(a), a))
        else:
            return None
    return tuple(parts)


def replay(
    cut: ModuleCut,
    plan: DirectPlan | None,
    trace: SuffixTrace,
    live: list[torch.Tensor],
    extras: list[torch.Tensor],
    inputs: Any,
) -> Any | None:
    """The last stage's output: the blocks of ``plan`` (None: the stage is the suffix alone)
    called directly, then the recorded suffix; None (nothing run) when a module around the
    suffix gained a hook since the recording or the inputs have another structure.

    Raises:
        CaptureError: a call returned another number of tensors than when it was recorded.
    """
    for m, n_post, n_pre in trace.spanning:
        if len(m._forward_hooks) != n_post or len(m._forward_pre_hooks) != n_pre:
            return None
    in_flat, in_spec = tree_flatten(inputs)
    if in_spec != trace.input_spec:
        return None
    from hetrain.runtime.cut_direct import _resolve, call_recorded, run_blocks

    outs = run_blocks(cut, plan, live, extras) if plan is not None else {}
    env: dict[tuple[int, int], torch.Tensor] = {}

    def resolve(src: tuple[str, Any]) -> Any:
        kind, v = src
        if kind == "s":  # a result of an earlier replayed call
            return env[v]
        if kind == "in":
            return in_flat[v]
        return _resolve(src, live, extras, outs)  # "out", "recv", "x", "p", "c"

    for op, (_kind, fn, spec, fills, count) in enumerate(trace.ops):
        flat = [resolve(f) for f in fills]
        for j, t in enumerate(call_recorded(cut, fn, flat, spec, count, f"the suffix's call {op}")):
            env[(op, j)] = t
    return tree_unflatten([resolve(f) for f in trace.out_fills], trace.out_spec)
