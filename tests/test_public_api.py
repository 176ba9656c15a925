"""The public functions of ``hetrain`` show their real signature and docstring in ``help()``
(not a ``(*args, **kwargs)`` wrapper), and ``import hetrain`` stays light (no torch)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import hetrain


def _public_functions() -> dict[str, object]:
    return {
        name: getattr(hetrain, name)
        for name in hetrain.__all__
        if callable(getattr(hetrain, name)) and not inspect.isclass(getattr(hetrain, name))
    }


def test_all_names_resolve() -> None:
    for name in hetrain.__all__:
        assert getattr(hetrain, name) is not None
    assert "train" in _public_functions()


def test_public_functions_show_their_real_signature_and_docstring() -> None:
    for name, fn in _public_functions().items():
        params = inspect.signature(fn).parameters.values()
        kinds = [p.kind for p in params]
        # not a bare (*args, **kwargs) pass-through: named parameters come first
        assert kinds and kinds[0] is not inspect.Parameter.VAR_POSITIONAL, name
        doc = inspect.getdoc(fn) or ""
        assert "Returns" in doc and "Raises" in doc, f"{name}: docstring lacks Returns/Raises"


def test_train_signature_names_its_arguments() -> None:
    from hetrain.runtime.api import train

    assert hetrain.train is train
    params = inspect.signature(hetrain.train).parameters
    for name in ("model", "dataset", "loss_fn", "cluster", "steps", "batch", "run_dir"):
        assert name in params, name
    assert params["run_dir"].default is None
    assert "report" in params and params["report"].default is True
    assert "tensorboard" in params and params["tensorboard"].default is False


def test_help_text_of_train() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import hetrain; help(hetrain.train)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "train(*args, **kwargs)" not in out
    assert "run_dir" in out and "report" in out


def test_import_hetrain_does_not_import_torch() -> None:
    code = "import sys, hetrain; hetrain.__version__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_attribute_is_an_attribute_error() -> None:
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hetrain.nope  # noqa: B018
    assert "train" in dir(hetrain)
