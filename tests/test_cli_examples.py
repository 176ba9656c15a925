"""``hetrain profile --example X`` describes exactly the model ``hetrain train --example X``
trains: same layers, same parameter count, for every example ``train`` offers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetrain.cli import main
from hetrain.commands.profile import HF_EXAMPLES
from hetrain.models.registry import EXAMPLES as PROFILE_EXAMPLES
from hetrain.runtime.data import task_chain
from hetrain.runtime.examples import EXAMPLES as TRAIN_EXAMPLES
from hetrain.runtime.examples import example_task


def test_every_train_example_can_be_profiled() -> None:
    assert set(TRAIN_EXAMPLES) <= set(PROFILE_EXAMPLES) | set(HF_EXAMPLES)


@pytest.mark.parametrize("name", sorted(TRAIN_EXAMPLES))
def test_profile_describes_the_trained_model(name: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / f"{name}.json"
    assert main(["profile", "--example", name, "--out", str(out), "--batch", "2"]) == 0
    capsys.readouterr()
    profile = json.loads(out.read_text())
    task = example_task(name)  # the default size of `train`, also `profile`'s default
    model = task.build_model()
    chain = task_chain(task, model)  # the layers hetrain trains (cut at the blocks)
    assert len(profile["layers"]) == chain.num_layers
    profiled_params = sum(
        ly["param_bytes"] + ly.get("frozen_param_bytes", 0) for ly in profile["layers"]
    ) + sum(s["bytes"] for s in profile.get("shared", []))
    trained_params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert profiled_params == trained_params, (name, profiled_params / 4, trained_params / 4)
    # per layer too: layer l of the profile holds the parameters of layer l of the trained
    # chain, shared (tied) tensors listed once apart
    shared = {id(chain.tensors[name]) for name in chain.shared}
    for index, ly in enumerate(profile["layers"]):
        own = {
            id(p): p
            for m in chain.layer_modules(index)
            for p in m.parameters()
            if id(p) not in shared
        }
        assert ly["param_bytes"] + ly.get("frozen_param_bytes", 0) == sum(
            p.numel() * p.element_size() for p in own.values()
        ), ly["name"]


def test_charlm_description_states_the_trained_width() -> None:
    from hetrain.models.charlm import CHARLM

    model = example_task("charlm").build_model()
    assert model[0].tok.embedding_dim == CHARLM.n_embd
    assert f"{CHARLM.n_embd} wide" in PROFILE_EXAMPLES["charlm"].description
