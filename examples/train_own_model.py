"""Train your own chain model on your own data with ``hetrain.train``.

A small MLP on a synthetic 3-class problem, on 3 local ranks of which ``w1`` is emulated 3x
slower: hetrain measures the ranks, plans (data and pipeline parallel), re-plans online, and
writes the trained weights back into ``model``.

    PYTHONPATH=src python examples/train_own_model.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import hetrain


def make_data(n: int = 4000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Points in 16-D (drawn with ``seed``); the class is the argmax of three fixed random
    projections (the same for every seed)."""
    w = torch.randn(16, 3, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, (x @ w).argmax(dim=1)


def make_model() -> nn.Sequential:
    """The pipeline layers are the children of the ``nn.Sequential``."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(16, 256), nn.GELU()),
        nn.Sequential(nn.Linear(256, 256), nn.GELU()),
        nn.Sequential(nn.Linear(256, 256), nn.GELU()),
        nn.Linear(256, 3),
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    x, y = make_data()
    x_val, y_val = make_data(1000, seed=1)
    model = make_model()
    result = hetrain.train(
        model=model,
        dataset=(x, y),
        val_dataset=(x_val, y_val),
        loss_fn=F.cross_entropy,
        workers=3,
        steps=150,
        batch=96,
        optimizer="adamw",
        lr=3e-3,
        slowdown={"w1": 3.0},
        run_dir="runs/own-model",
    )
    print(f"plan changes: {result['replans']}, final plan: {result['final_plan']['groups']}")
    print(f"validation loss {result['metrics']['val_loss']:.4f}")
    # the trained weights are in `model` (a plain state_dict is at result["model_path"])
    print(f"validation accuracy of the trained module: {accuracy(model, x_val, y_val):.3f}")


if __name__ == "__main__":
    main()
