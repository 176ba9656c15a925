"""The shipped profiles of the paper's three workloads built from the ``transformers`` classes
(``hetrain profile --example gpt2|bert|resnet --size base``): their cut, tied tensors, published
sizes, and plans on the example clusters (docs/model.md §2 shared tensors in the cost model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetrain.cli import main
from hetrain.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "examples" / "profiles"

# name -> (layers, parameters with the tie counted once, tied tensor or None)
EXPECTED = {
    # GPT-2 small: 124,439,808 parameters (tied head)
    "hf-gpt2-base": (14, 124_439_808, "transformer.wte.weight"),
    # BertForMaskedLM: bert-base-uncased without its pooler (109,482,240 - 590,592) plus the MLM
    # head's dense + LayerNorm + decoder bias (the decoder weight is tied)
    "hf-bert-base": (14, 109_482_240 - 590_592 + 590_592 + 1536 + 30522, "word_embeddings"),
    # ResNet-50: 25,557,032 parameters, 16 bottleneck blocks + prefix + suffix
    "hf-resnet-base": (18, 25_557_032, None),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_hf_profiles_have_the_published_shapes(name):
    path = PROFILES / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path.name} not shipped")
    prof = load_profile(path)
    layers, params, tied = EXPECTED[name]
    assert prof.num_layers == layers
    total = sum(ly.param_bytes for ly in prof.layers) + sum(t.bytes for t in prof.shared)
    assert total == params * 4  # float32
    if tied is None:
        assert prof.shared == []
    else:
        (shared,) = prof.shared
        assert tied in shared.name and shared.layers == [0, layers - 1]  # embedding and head
        assert not shared.frozen
    assert all(ly.frozen_param_bytes == 0 for ly in prof.layers)
    if name == "hf-resnet-base":  # He et al. 2016: 4.1 GMAC per 224x224 image
        assert sum(ly.fwd_flops for ly in prof.layers) / 1e9 == pytest.approx(8.18, rel=0.01)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("cluster", ["mixed4.yaml", "priced8.yaml"])
def test_shipped_hf_profiles_plan_on_the_example_clusters(name, cluster, capsys):
    path = PROFILES / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path.name} not shipped")
    code = main(
        [
            "plan",
            "--cluster",
            str(ROOT / "examples" / "clusters" / cluster),
            "--model",
            str(path),
            "--batch",
            "32",
            "--json",
        ]
    )
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert sum(g["batch"] for g in plan["groups"]) == 32
    assert plan["iteration_time_s"] >= plan["lower_bound_s"] > 0
