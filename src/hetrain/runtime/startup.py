"""Start-up never changes the model (docs/runtime.md "Start-up").

Before training, hetrain runs the model for its own purposes: the cut records it on two samples,
the profiler counts it, the calibration times forwards and backwards in training mode on
micro-batches of several sizes, and the update time is measured with an optimizer step. In
training mode a forward updates BatchNorm statistics and any buffer the model's ``forward``
changes (a counter, an exponential moving average), and draws from torch's random generator.
:func:`unchanged` puts every parameter and buffer (value, dtype, device, the object in its
module), the modules' training flags and the random generators' states back as they were, so
training starts from the model the user built whatever the start-up ran.

:func:`forward_changed_buffers` finds the buffers a training forward changes: their values
depend on how the global batch is split (plan-dependent), except BatchNorm statistics under a
norm block (:mod:`hetrain.runtime.norm`), so the start-up warns about them and ``--exact``
refuses them (:func:`check_forward_buffers`).
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from hetrain.errors import InputError


@contextlib.contextmanager
def unchanged(model: nn.Module) -> Iterator[None]:
    """Run the body, then restore ``model`` exactly: every parameter and buffer object back
    in its module (a ``forward`` that reassigned a buffer attribute included) with its value,
    dtype and device as on entry and no gradient; every module's training flag; the random
    states of torch (CPU and initialised CUDA devices), numpy's global generator and Python's
    ``random``. Costs one copy of the parameters and buffers (host or device memory where they
    are)."""
    saved: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    values: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is None:
                    continue
                saved.append((module, kind, name, t))
                if id(t) not in values:
                    values[id(t)] = t.detach().clone()
    modes = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    np_rng = np.random.get_state()
    py_rng = random.getstate()
    try:
        yield
    finally:
        with torch.no_grad():
            for module, kind, name, t in saved:
                getattr(module, kind)[name] = t
                value = values[id(t)]
                if (t.dtype, t.device, t.shape) == (value.dtype, value.device, value.shape):
                    t.copy_(value)  # in place: views of the storage stay views
                else:
                    t.data = value
                t.grad = None
        for m, mode in modes:
            m.training = mode
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        np.random.set_state(np_rng)
        random.setstate(py_rng)


def _batchnorm_buffers(model: nn.Module) -> set[str]:
    from torch.nn.modules.batchnorm import _BatchNorm

    return {
        f"{path}.{name}" if path else name
        for path, m in model.named_modules()
        if isinstance(m, _BatchNorm)
        for name, _ in m.named_buffers(recurse=False)
    }


def forward_changed_buffers(model: nn.Module, inputs: Any) -> tuple[list[str], list[str]]:
    """Buffers one training-mode forward of ``model`` on ``inputs`` changes (value, object or
    a new buffer), as ``(others, batchnorm)``: BatchNorm statistics apart. The model is left
    as it was (:func:`unchanged`).

    Raises:
        Exception: whatever the model's forward raises.
    """
    from hetrain.runtime.data import call_model

    with unchanged(model):
        before = {n: (b, b.detach().clone()) for n, b in model.named_buffers()}
        model.train()
        with torch.no_grad():
            call_model(model, inputs)
        changed = [
            n
            for n, b in model.named_buffers()
            if n not in before
            or b is not before[n][0]
            or b.shape != before[n][1].shape
            or not torch.equal(b, before[n][1])
        ]
    norm = _batchnorm_buffers(model)
    return [n for n in changed if n not in norm], [n for n in changed if n in norm]


def check_forward_buffers(
    model: nn.Module, inputs: Any, *, norm_block: int | None, exact: bool, source: str
) -> str | None:
    """The start-up check of buffers that ``forward`` changes (:func:`forward_changed_buffers`
    on ``inputs``, a couple of training samples): their values after training depend on the
    plan (how many forwards ran, on which rows), except BatchNorm statistics under a norm
    block. Returns the one-line warning (or None); a forward that fails here is reported in
    the line instead (the buffers could not be checked).

    Raises:
        InputError: with ``exact``, such a buffer (BatchNorm statistics without a norm block
            included), naming it.
    """
    try:
        others, batchnorm = forward_changed_buffers(model, inputs)
    except Exception as exc:  # the model's own forward: say so, training will report it
        return f"buffers not checked (a forward on 2 samples failed: {type(exc).__name__})"
    named = others + (batchnorm if norm_block is None else [])
    if exact and named:
        shown = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
        raise InputError(
            source,
            "buffer",
            f"forward changes buffer(s) {shown}: their values depend on the plan (--exact)",
        )
    if not others:
        return None
    shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return (
        f"forward changes buffer(s) {shown}: their values after training depend on the plan "
        "(--exact refuses them)"
    )


def warn(line: str | None) -> None:
    """Print ``hetrain: warning: LINE`` on stderr (nothing for None)."""
    if line:
        print(f"hetrain: warning: {line}", file=sys.stderr, flush=True)
