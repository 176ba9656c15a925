"""Your own model and data as a :class:`~hetrain.runtime.data.Task`: objects given to
``hetrain.train`` (:func:`task_from_objects`) or a ``--model pkg.module:factory`` of
``hetrain train`` (:func:`task_from_factory`); bad input raises a one-line
:class:`~hetrain.errors.InputError`.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hetrain.errors import InputError
from hetrain.runtime.data import DEFAULT_TARGET_KEY, Task, as_chain, as_source
from hetrain.runtime.optim import resolve_param_groups


def load_model_factory(spec: str) -> Callable[[], Any]:
    """Import ``"pkg.module:factory"``.

    Raises:
        InputError: malformed spec, module not importable, or no such callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError("--model", spec, "expected pkg.module:factory")
    import os
    import sys

    if os.getcwd() not in sys.path:  # like `python -m`: modules of the current folder
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError("--model", spec, f"cannot import {module_name!r} ({exc})") from None
    except Exception as exc:  # the module's own code failed (a SyntaxError, 1/0 at import)
        where = ""
        if isinstance(exc, SyntaxError) and exc.filename:
            where = f" at {exc.filename}:{exc.lineno}"
        raise InputError(
            "--model",
            spec,
            f"importing {module_name!r} failed{where}: {type(exc).__name__}: {exc}",
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InputError("--model", spec, f"expected a callable {attr!r} in {module_name}")
    return factory


def task_from_objects(
    model: nn.Module | Sequence[nn.Module],
    dataset: Any,
    loss_fn: Callable | None,
    *,
    val_dataset: Any = None,
    evaluate: Callable | None = None,
    name: str = "model",
    layers: Sequence[str] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    target_key: str = DEFAULT_TARGET_KEY,
    optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
) -> Task:
    """A :class:`Task` for a user's chain and data. Every rank deep-copies ``model`` (ranks are
    forked, so all start from its current weights). Without ``evaluate``, the validation
    quality is the mean ``loss_fn`` over ``val_dataset``. ``collate_fn`` and ``target_key``:
    how map-style data sets are collated and which key of a dict sample holds the targets
    (:func:`hetrain.runtime.data.as_source`), for both data sets. ``optimizer``: the user's
    ``param groups -> torch.optim.Optimizer``; ``param_groups``: ``[{"params": [names or
    parameters of model], **options}, ...]`` (resolved to names here, against ``model``).

    Raises:
        InputError: not a chain, bad data set, no loss function, an optimizer that is not
            callable, bad parameter groups.
    """
    chain = as_chain(model, name)
    if optimizer is not None and not callable(optimizer):
        raise InputError(
            "optimizer",
            "",
            f"expected a callable (param groups -> torch.optim.Optimizer), got "
            f"{type(optimizer).__name__}",
        )
    groups = resolve_param_groups(chain, param_groups) if param_groups is not None else None
    train = as_source(dataset, "dataset", collate_fn=collate_fn, target_key=target_key)
    val = (
        as_source(val_dataset, "val_dataset", collate_fn=collate_fn, target_key=target_key)
        if val_dataset is not None
        else None
    )
    if not callable(loss_fn):
        raise InputError("loss_fn", "", "expected a callable (outputs, targets) -> mean loss")

    def build() -> nn.Module:
        return copy.deepcopy(chain)

    def default_eval(m: nn.Module, dtype: torch.dtype) -> dict[str, float]:
        from hetrain.runtime.data import _mean_loss

        return {"val_loss": _mean_loss(m, loss_fn, val, 256, len(val), dtype)}

    return Task(
        name=name,
        build_model=build,
        train=train,
        val=val,
        loss_fn=loss_fn,
        evaluate=evaluate or (default_eval if val is not None else None),
        quality_metric="val_loss" if evaluate is None and val is not None else None,
        layers=list(layers) if layers is not None else None,
        optimizer=optimizer,
        param_groups=groups,
    )


FACTORY_KEYS = (
    "model",
    "dataset",
    "loss_fn",
    "val_dataset",
    "evaluate",
    "layers",
    "collate_fn",
    "target_key",
    "optimizer",
    "param_groups",
)
"""Keys a ``--model`` factory's mapping may hold (docs/training.md); any other is refused."""


def task_from_factory(spec: str, seed: int | None = None) -> Task:
    """The task of ``--model pkg.module:factory``: the factory returns a :class:`Task`, or a
    mapping with ``model`` (chain or list of blocks), ``dataset`` and ``loss_fn`` (optional
    ``val_dataset``, ``evaluate``). With ``seed``, torch's global generator is seeded with it
    just before the factory is called, so a model the factory builds has the same random
    weights in every run with that ``--seed`` (and on every node of a torchrun job).

    Raises:
        InputError: the factory fails or returns something else.
    """
    factory = load_model_factory(spec)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        made = factory()
    except Exception as exc:  # the user's code: report it in one line
        raise InputError("--model", spec, f"factory raised {type(exc).__name__}: {exc}") from None
    if isinstance(made, Task):
        return made
    if isinstance(made, Mapping) and {"model", "dataset", "loss_fn"} <= set(made):
        unknown = sorted(str(k) for k in set(made) - set(FACTORY_KEYS))
        if unknown:  # a key hetrain would not use is an error, never silently ignored
            raise InputError(
                "--model",
                spec,
                f"the factory returned unknown keys {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(FACTORY_KEYS)})",
            )
        return task_from_objects(
            made["model"],
            made["dataset"],
            made["loss_fn"],
            val_dataset=made.get("val_dataset"),
            evaluate=made.get("evaluate"),
            name=spec,
            layers=made.get("layers"),
            collate_fn=made.get("collate_fn"),
            target_key=made.get("target_key", DEFAULT_TARGET_KEY),
            optimizer=made.get("optimizer"),
            param_groups=made.get("param_groups"),
        )
    raise InputError(
        "--model",
        spec,
        f"expected the factory to return a Task or {{'model', 'dataset', 'loss_fn'}}, got "
        f"{type(made).__name__}",
    )
