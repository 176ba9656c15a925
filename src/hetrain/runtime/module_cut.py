"""Any module cut at its blocks: :class:`ModuleCut` (docs/runtime.md "Any model"; the design
is described in :mod:`hetrain.runtime.cutting`). Importing this module imports torch.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from hetrain.errors import InputError
from hetrain.runtime.cut_chains import (
    CaptureError,
    Chain,
    call_inputs,
    default_blocks,
    leaves,
)
from hetrain.runtime.cut_direct import (
    boundary_extras,
    boundary_tag,
    direct_plan,
    extras_now,
    record_template,
    run_direct,
)
from hetrain.runtime.cut_record import record_layers
from hetrain.runtime.cut_suffix import TraceRecorder, replay, signature
from hetrain.runtime.cut_track import (
    _MODES,
    Key,
    _BlockRecord,
    _device_of,
    _Run,
    _Stop,
    _top_function_mode,
    _Track,
    _Uncalled,
)
from hetrain.runtime.randomness import batch_free_draw_sites


class ModuleCut(Chain):
    """Any module cut at its blocks (the design: :mod:`hetrain.runtime.cutting`).

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
        if not self._meta_model:
            self.batch_free_draws = batch_free_draw_sites(module, example_inputs, call_inputs)
        self.blocks = [mods[b] for b in blocks]
        try:
            record_layers(self, list(blocks), example_inputs, default=default)
        except _Uncalled as called:
            blocks = called.names
            self.blocks = [mods[b] for b in blocks]
            record_layers(self, list(blocks), example_inputs)
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
        self._suffix_traces: dict[tuple, Any] = {}  # last stage's signature -> trace or None
        for mod in self._outside.values():
            mod.register_forward_pre_hook(self._module_pre, with_kwargs=True)
            mod.register_forward_hook(self._module_post)

    # ---------------------------------------------------------------------------- recording
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
        self._meta_cache: dict[tuple, tuple] = {}  # meta results per call signature
        self._templates: list = [None] * len(self.blocks)  # each block's recorded call
        self._busy: set[int] = set()  # phases with torch or module calls outside the blocks
        self._direct: dict[tuple[int, int], Any] = {}  # stage -> DirectPlan or None
        self._named_by_hooks: dict[int, bool] = {}
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
        # boundaries where a stage of blocks only can start without the model's forward
        self._extras_at = [boundary_extras(self, b) for b in range(self.num_layers + 1)]

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
                sent = self._boundary(run, phase)
                extras = extras_now(self, phase, args, kwargs, run.key_of)
                if extras is not None:
                    sent = (*sent, *extras, boundary_tag(phase, run.device))
                raise _Stop(sent)
            if run.trace is not None and phase == run.start:
                # the stage's first block: its extras stand for what the replay receives
                extras = extras_now(self, phase, args, kwargs, run.key_of)
                if extras is None:
                    run.trace.fail("the first block's call differs from the recorded one")
                else:
                    for n, t in enumerate(extras):
                        run.trace.name(t, ("x", n))
            run.phase, run.depth, run.block = phase, 1, i
            if run.record:
                run.block_args = {id(t) for t in leaves((args, kwargs))}
                self._templates[i] = record_template(self, run.key_of, args, kwargs)
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
                if run.trace is not None and i + 1 >= run.start:
                    run.trace.name(t, ("out", key))
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
            if run.trace is not None:
                run.trace.enter_suffix([self._mods_by_name.get(f[0]) for f in run.frames])
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
        # the first stage computes everything for real: when every tensor it sends is a
        # module's or a block's output (named by the module hooks alone), no torch call needs
        # following
        light = run.light = not run.record and run.start == 0 and self._hooks_name_boundary(run.end)
        try:
            with contextlib.nullcontext() if light else mode:
                try:
                    return call_inputs(self.module, inputs)
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

    def _hooks_name_boundary(self, boundary: int) -> bool:
        """True when every tensor crossing ``boundary`` is the output of a module called
        outside the blocks or of a block (the hooks name it), on a model with real tensors."""
        hit = self._named_by_hooks.get(boundary)
        if hit is None:
            hit = self._named_by_hooks[boundary] = not self._meta_model and all(
                k[3] == -1 for k in self._live[boundary]
            )
        return hit

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

    def _module_pre(self, mod: nn.Module, args: Any, kwargs: Any = None) -> None:
        run = self._run
        if run is None or run.depth > 0 or id(mod) in self._block_ids:
            return
        if run.record:
            self._outside[id(mod)] = mod
            self._busy.add(run.phase)
        name = self._mod_names.get(id(mod), type(mod).__name__)
        c = run.calls.get((run.phase, name), 0)
        run.calls[(run.phase, name)] = c + 1
        run.frames.append((name, c, run.phase, run.serial))
        trace = run.trace
        if (
            trace is not None
            and run.phase == trace.suffix
            and sum(1 for f in run.frames if f[2] == trace.suffix) == 1  # outermost there
        ):
            trace.module_pre(mod, args, kwargs or {}, run)

    def _module_post(self, mod: nn.Module, args: Any, out: Any) -> None:
        run = self._run
        if run is None or run.depth > 0 or id(mod) in self._block_ids or not run.frames:
            return
        mode = _MODES[id(run)]
        name, c, phase, serial = run.frames.pop()
        if phase != run.phase:
            return  # a module around cut points (its outputs keep their names)
        trace = run.trace
        if (
            trace is not None
            and trace.open is not None
            and trace.open[0] is mod
            and not any(f[2] == trace.suffix for f in run.frames)
        ):
            trace.module_post(mod, out)
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
                if run.light:  # an op that returns its input (dropout with p = 0) was not
                    # followed: the object also stands for the module's output
                    run.obj_of[(run.phase, name, c, -1, j)] = t
                    run.valid.add((run.phase, name, c, -1, j))
                continue
            k = run.key_of.get(id(t))
            real = mode.is_real(t)
            rebuild = self._rebuild.get(k, False) if k is not None else mode.rebuildable(t)
            mode.assign(t, (run.phase, name, c, -1, j), real, rebuild)

    def _replayable_module(self, mod: nn.Module) -> bool:
        """True when ``mod`` (a module called at the top level of the suffix) can be called
        alone: called once per forward, holding no block and no module called more than once
        outside the blocks."""
        calls = self._module_calls
        if calls.get(self._mod_names.get(id(mod), ""), 0) != 1:
            return False
        for m in mod.modules():
            if id(m) in self._block_ids:
                return False
            if m is not mod and calls.get(self._mod_names.get(id(m), ""), 0) > 1:
                return False
        return True

    def _last_stage(self, start: int, got: list, inputs: Any) -> tuple[Any, tuple | None]:
        """``(output, None)``: stage ``[start, num_layers)`` from the recorded suffix
        (:mod:`hetrain.runtime.cut_suffix`); or ``(None, recording)``: it runs the model's
        forward, recording the suffix when ``recording`` (``(signature, TraceRecorder)``) is
        not None (a new signature)."""
        nb = len(self.blocks)
        if self._meta_model or start > nb + 1:
            return None, None
        keys = self._live[start]
        plan = None
        extras: list = []
        if start <= nb:
            positions = self._extras_at[start]
            if positions is None or len(got) != len(keys) + len(positions) + 1:
                return None, None
            key = (start, nb + 1)
            plan = self._direct.get(key, False)
            if plan is False:
                plan = self._direct[key] = direct_plan(self, start, nb + 1)
            if plan is None:
                return None, None
            extras = got[len(keys) : -1]
        elif len(got) != len(keys):
            return None, None
        sig = signature(start, got, inputs, self.module)
        if sig is None:
            return None, None
        trace = self._suffix_traces.get(sig, False)
        if trace is False:
            flat, spec = tree_flatten(inputs)
            rec = TraceRecorder(self, nb + 1, torch.is_grad_enabled(), spec)
            for i, a in enumerate(flat):
                if isinstance(a, torch.Tensor):
                    rec.name(a, ("in", i))
            for i, t in enumerate(got[: len(keys)]):
                rec.name(t, ("recv", i))
            return None, (sig, rec)
        if trace is None:
            return None, None
        return replay(self, plan, trace, got[: len(keys)], extras, inputs), None

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
            return call_inputs(self.module, inputs)
        received: dict[Key, torch.Tensor] = {}
        recording = None
        if start > 0:
            got = list(x) if isinstance(x, list | tuple) else [x]
            if end == self.num_layers:
                out, recording = self._last_stage(start, got, inputs)
                if out is not None:
                    return out
            keys = self._live[start]
            extras = self._extras_at[start]
            if extras is not None and len(got) == len(keys) + len(extras) + 1:
                # the first block's call came with its extras: the blocks may run directly
                key = (start, end)
                plan = self._direct.get(key, False)
                if plan is False:
                    plan = self._direct[key] = direct_plan(self, start, end)
                if plan is not None:
                    return run_direct(self, plan, got[: len(keys)], got[len(keys) : -1])
                got = got[: len(keys)]
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
            trace=recording[1] if recording else None,
        )
        try:
            out = self._forward(run, inputs)
        except _Stop as stop:
            return stop.value
        if start == 0:
            return out
        mode = _Track(self, run)
        out = mode.substitute(out, None)
        if recording:
            if len(self._suffix_traces) >= 64:
                self._suffix_traces.clear()
            self._suffix_traces[recording[0]] = run.trace.finish(out, run)
        return out
