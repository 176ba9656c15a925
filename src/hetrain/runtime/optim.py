"""Optimizers where the parameters live: one optimizer per layer, so that a layer moves to a
new owner together with its optimizer state (docs/model.md §5).

The optimizer is hetrain's own (``sgd``, ``adamw``) or the user's: any callable ``param groups
-> torch.optim.Optimizer`` (a ``torch.optim`` class, a ``functools.partial`` of one, a lambda),
called once per layer over the parameters of that layer, with parameter groups given by
parameter name (:func:`resolve_param_groups`). Every ``torch.optim`` optimizer but LBFGS updates
each parameter from its own gradient and state only, so per-layer optimizers step exactly as
one optimizer over the whole model."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hetrain.errors import InputError

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
"""``param groups -> torch.optim.Optimizer``: a list of ``{"params": [...], **options}``."""

GROUP_OPTION_SKIP = ("params", "initial_lr", "param_names")


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer of a training run (validated here, built per layer by the engine).

    Attributes:
        name: ``"sgd"`` (with optional momentum), ``"adamw"``, or ``"user"`` (``factory``).
        lr: base learning rate (``"user"``: the first group's, for the metrics).
        momentum: SGD momentum (``dampening`` is 0, as in ``torch.optim.SGD``'s default).
        weight_decay: SGD L2 penalty or AdamW decoupled weight decay.
        betas, eps: AdamW parameters.
        lr_schedule: optional hook ``step -> multiplier`` of ``lr`` (step counts from 0); the
            learning rate of step ``t`` is ``lr * lr_schedule(t)``, and every parameter
            group's is its own initial learning rate times ``lr_schedule(t)``.
        factory: the user's ``param groups -> torch.optim.Optimizer`` (``name="user"``).
        param_groups: per group, the parameter names (``named_parameters()`` names of the
            model) and the group's options (e.g. ``{"weight_decay": 0.0}``); every trainable
            parameter in exactly one group (:func:`resolve_param_groups`). Empty: one group.
        measured_state_factor: ``"user"``: optimizer state bytes per parameter byte, measured
            by :func:`check_factory`.

    Raises:
        ValueError: unknown name, non-finite or negative numbers, betas outside ``[0, 1)``,
            ``"user"`` without a factory.
    """

    name: Literal["sgd", "adamw", "user"] = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_schedule: Callable[[int], float] | None = None
    factory: OptimizerFactory | None = None
    param_groups: tuple[tuple[tuple[str, ...], Mapping[str, Any]], ...] = ()
    measured_state_factor: float | None = None

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adamw", "user"):
            raise ValueError(f"optimizer.name: expected 'sgd' or 'adamw', got {self.name!r}")
        if (self.name == "user") != (self.factory is not None):
            raise ValueError("optimizer.factory: expected one exactly with name 'user'")
        for key in ("lr", "momentum", "weight_decay", "eps"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"optimizer.{key}: expected a finite number >= 0, got {v!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas: expected two numbers in [0, 1), got {self.betas!r}")

    def lr_factor(self, step: int) -> float:
        """``lr_schedule(step)`` (1.0 without a schedule).

        Raises:
            ValueError: a negative or non-finite multiplier.
        """
        if self.lr_schedule is None:
            return 1.0
        factor = float(self.lr_schedule(step))
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(
                f"optimizer.lr_schedule({step}): expected a finite number >= 0, got {factor!r}"
            )
        return factor

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step``: ``lr * lr_schedule(step)`` (or ``lr``)."""
        if self.lr_schedule is None:
            return float(self.lr)
        return float(self.lr) * self.lr_factor(step)

    @property
    def state_factor(self) -> float:
        """docs/model.md §2 ``o``: optimizer state bytes per parameter byte (2 AdamW, 1
        SGD+momentum, 0 plain SGD; the user's optimizer: measured)."""
        if self.name == "user":
            return float(self.measured_state_factor or 0.0)
        if self.name == "adamw":
            return 2.0
        return 1.0 if self.momentum > 0 else 0.0

    def _factory(self) -> OptimizerFactory:
        if self.factory is not None:
            return self.factory
        # foreach=False keeps per-parameter arithmetic the same whatever the grouping
        if self.name == "sgd":
            return functools.partial(
                torch.optim.SGD,
                lr=self.lr,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
                foreach=False,
            )
        return functools.partial(
            torch.optim.AdamW,
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            foreach=False,
        )

    def build(
        self, params: Iterable[torch.nn.Parameter], groups: Sequence[int] | None = None
    ) -> torch.optim.Optimizer:
        """A ``torch.optim`` optimizer over ``params`` (the single-process reference uses the
        same call over the whole model). ``groups[i]``: the :attr:`param_groups` index of
        ``params[i]``; the optimizer then has one group per index present (in index order,
        with that group's options). Every group records ``initial_lr`` (the base of
        :func:`set_lr_factor`)."""
        params = list(params)
        if groups is None or not self.param_groups:
            dicts: list[dict[str, Any]] = [{"params": params}]
        else:
            dicts = [
                {
                    "params": [p for p, g in zip(params, groups, strict=True) if g == index],
                    **dict(self.param_groups[index][1]),
                }
                for index in sorted(set(groups))
            ]
        opt = self._factory()(dicts)
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
        return opt


def set_lr_factor(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Every parameter group's learning rate to its ``initial_lr`` times ``factor`` (the
    learning-rate schedule's multiplier of the step)."""
    for group in optimizer.param_groups:
        group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor


def resolve_param_groups(
    model: torch.nn.Module, groups: Any, source: str = "param_groups"
) -> tuple[tuple[tuple[str, ...], dict[str, Any]], ...]:
    """Parameter groups by name, as :attr:`OptimizerSpec.param_groups`, from what a user
    gives: a list of dicts ``{"params": [...], **options}`` (as ``torch.optim`` takes) whose
    ``params`` are parameter names of ``model`` (``named_parameters()``, tied aliases
    included) or the model's parameter objects themselves.

    Raises:
        InputError: not a list of such dicts, an unknown name or a tensor that is not a
            parameter of ``model``, a parameter in two groups, or a trainable parameter in no
            group (torch.optim would not train it: put it in a group or set
            ``requires_grad=False``).
    """
    if isinstance(groups, Mapping | str) or not isinstance(groups, Sequence) or not groups:
        raise InputError(source, "", 'expected a list of {"params": [names], **options} dicts')
    named = dict(model.named_parameters(remove_duplicate=False))
    canonical = {id(p): n for n, p in model.named_parameters()}
    name_of = {id(p): n for n, p in reversed(list(named.items()))}
    seen: dict[str, int] = {}
    out = []
    for index, group in enumerate(groups):
        where = f"{source}[{index}]"
        if not isinstance(group, Mapping) or "params" not in group:
            raise InputError(source, f"[{index}]", 'expected a dict with a "params" list')
        entries = group["params"]
        if isinstance(entries, str | torch.Tensor) or not isinstance(entries, Iterable):
            raise InputError(where, "params", "expected a list of parameter names or parameters")
        names = []
        for entry in entries:
            if isinstance(entry, str):
                if entry not in named:
                    raise InputError(where, "params", f"no parameter named {entry!r} in the model")
                name = entry
            elif isinstance(entry, torch.Tensor) and id(entry) in name_of:
                name = name_of[id(entry)]
            else:
                raise InputError(
                    where, "params", "expected names or parameters of the model being trained"
                )
            key = canonical[id(named[name])]
            if key in seen and seen[key] != index:
                raise InputError(
                    where, "params", f"parameter {name!r} is also in group {seen[key]}"
                )
            if key not in seen:
                seen[key] = index
                names.append(name)
        options = {k: v for k, v in group.items() if k != "params"}
        out.append((tuple(names), options))
    for name, p in model.named_parameters():
        if p.requires_grad and name not in seen:
            raise InputError(
                source,
                "",
                f"parameter {name!r} is in no group (torch.optim would not train it): add it "
                "to a group or set requires_grad=False",
            )
    return tuple(out)


def check_factory(
    factory: Any, param_groups: Sequence[tuple[Sequence[str], Mapping[str, Any]]] = ()
) -> tuple[float, float]:
    """Check a user's optimizer on stand-in parameters (one per group, 8 float32 values, a
    gradient of ones, two steps) and measure it.

    Returns:
        ``(lr, state_factor)``: the first group's learning rate and the optimizer state bytes
        per parameter byte (state tensors shaped like their parameter).

    Raises:
        InputError: not callable, not returning a ``torch.optim.Optimizer``, a group option
            the optimizer does not know (it would be kept and silently unused), a learning
            rate that is not a finite number >= 0, or a step that fails or needs a closure
            (LBFGS): one line naming it.
    """
    if not callable(factory):
        raise InputError("optimizer", "", f"expected a callable, got {type(factory).__name__}")
    count = max(len(param_groups), 1)
    params = [torch.nn.Parameter(torch.zeros(8)) for _ in range(count)]
    dicts = (
        [{"params": [p], **dict(opts)} for p, (_, opts) in zip(params, param_groups, strict=True)]
        if param_groups
        else [{"params": params}]
    )
    what = getattr(factory, "__name__", None) or type(factory).__name__
    try:
        opt = factory(dicts)
    except Exception as exc:  # the user's code or options: one line
        raise InputError(
            "optimizer", what, f"building it failed: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(opt, torch.optim.Optimizer):
        raise InputError(
            "optimizer", what, f"expected a torch.optim.Optimizer, got {type(opt).__name__}"
        )
    known = set(opt.defaults) | set(GROUP_OPTION_SKIP)
    for index, (_, opts) in enumerate(param_groups):
        unknown = sorted(set(opts) - known)
        if unknown:
            raise InputError(
                f"param_groups[{index}]",
                unknown[0],
                f"not an option of {type(opt).__name__} (options: "
                f"{', '.join(sorted(opt.defaults))})",
            )
    if isinstance(opt, torch.optim.LBFGS):
        raise InputError(
            "optimizer", "LBFGS", "its step needs a closure re-evaluating the whole model"
        )
    lrs = [g.get("lr") for g in opt.param_groups]
    if not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in lrs):
        raise InputError("optimizer", what, f"expected learning rates >= 0, got {lrs}")
    try:
        for _ in range(2):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
    except Exception as exc:
        raise InputError(
            "optimizer", what, f"its step failed: {type(exc).__name__}: {exc}"
        ) from None
    state = sum(
        v.numel() * v.element_size()
        for p in params
        for v in opt.state.get(p, {}).values()
        if isinstance(v, torch.Tensor) and v.shape == p.shape
    )
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return float(lrs[0]), state / nbytes


def load_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)`` keeping every state tensor's dtype as saved:
    ``torch.optim`` casts floating state to its parameter's dtype on load, which turns state
    kept in float32 (NAdam's ``mu_product``) into float64 beside float64 parameters, and a
    moved layer would then step with other arithmetic than where it was."""
    optimizer.load_state_dict(state_dict)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, saved in state_dict["state"].items():
        state = optimizer.state.get(params[index], {})
        for key, value in saved.items():
            mine = state.get(key)
            tensors = isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor)
            if tensors and mine.dtype != value.dtype:
                state[key] = mine.to(value.dtype)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """Factor applied to every gradient by clipping to ``max_norm`` (global L2 norm), the same
    formula as ``torch.nn.utils.clip_grad_norm_``: ``min(1, max_norm / (total_norm + 1e-6))``;
    1.0 when ``max_norm`` is None."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
