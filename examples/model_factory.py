"""A model factory for the command line: ``hetrain train --model examples.model_factory:make``.

The factory returns ``{"model", "dataset", "loss_fn"}`` (optionally ``"val_dataset"`` and
``"evaluate"``); every rank starts from the weights of the model it returns.

    PYTHONPATH=src python -m hetrain train --model examples.model_factory:make \\
        --workers 3 --steps 100 --batch 96 --lr 3e-3 --slowdown w2=3
"""

from __future__ import annotations

from torch.nn import functional as F

from examples.train_own_model import accuracy, make_data, make_model


def make() -> dict:
    x, y = make_data()
    x_val, y_val = make_data(1000, seed=1)

    def evaluate(model, dtype):
        return {"val_accuracy": accuracy(model, x_val.to(dtype), y_val)}

    return {
        "model": make_model(),
        "dataset": (x, y),
        "val_dataset": (x_val, y_val),
        "loss_fn": F.cross_entropy,
        "evaluate": evaluate,
    }
