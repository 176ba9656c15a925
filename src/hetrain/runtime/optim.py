"""Optimizers where the parameters live: one optimizer per layer, so that a layer moves to a
new owner together with its optimizer state (docs/model.md §5)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer of a training run (validated here, built per layer by the engine).

    Attributes:
        name: ``"sgd"`` (with optional momentum) or ``"adamw"``.
        lr: base learning rate.
        momentum: SGD momentum (``dampening`` is 0, as in ``torch.optim.SGD``'s default).
        weight_decay: SGD L2 penalty or AdamW decoupled weight decay.
        betas, eps: AdamW parameters.
        lr_schedule: optional hook ``step -> multiplier`` of ``lr`` (step counts from 0); the
            learning rate of step ``t`` is ``lr * lr_schedule(t)``.

    Raises:
        ValueError: unknown name, non-finite or negative numbers, betas outside ``[0, 1)``.
    """

    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_schedule: Callable[[int], float] | None = None

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adamw"):
            raise ValueError(f"optimizer.name: expected 'sgd' or 'adamw', got {self.name!r}")
        for key in ("lr", "momentum", "weight_decay", "eps"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"optimizer.{key}: expected a finite number >= 0, got {v!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas: expected two numbers in [0, 1), got {self.betas!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step``: ``lr * lr_schedule(step)`` (or ``lr``)."""
        if self.lr_schedule is None:
            return float(self.lr)
        factor = float(self.lr_schedule(step))
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(
                f"optimizer.lr_schedule({step}): expected a finite number >= 0, got {factor!r}"
            )
        return float(self.lr) * factor

    @property
    def state_factor(self) -> float:
        """docs/model.md §2 ``o``: optimizer state bytes per parameter byte (2 AdamW, 1
        SGD+momentum,
        0 plain SGD)."""
        if self.name == "adamw":
            return 2.0
        return 1.0 if self.momentum > 0 else 0.0

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """A ``torch.optim`` optimizer over ``params`` (the single-process reference uses the
        same call over the whole model). ``foreach=False`` keeps per-parameter arithmetic the
        same whatever the grouping of parameters."""
        params = list(params)
        if self.name == "sgd":
            return torch.optim.SGD(
                params,
                lr=self.lr,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
                foreach=False,
            )
        return torch.optim.AdamW(
            params,
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            foreach=False,
        )


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
