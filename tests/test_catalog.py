"""Catalog, converters and shipped example data checked against their public sources.

The sources are the extract the repository ships in ``tests/data/shared/`` (values unchanged,
attribution and licenses there; ``tests/data/make_shared_extract.py`` makes it from the full
data sets), so these tests run on a fresh clone. Where the full data sets are present
(``$HETRAIN_SHARED_DATA``, default ``/work/shared/data``), one more test checks that the
extract gives the same figures as the full data."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from hetrain.catalog import (
    DEFAULT_DATA_DIR,
    DEVICE_KINDS,
    GAVEL_RATIO_TO_V100,
    derive_gavel_ratios,
    derive_sailor_speeds,
    make_cluster,
    make_mixed_cluster,
)
from hetrain.cluster import load_cluster
from hetrain.converters import (
    load_json,
    pipedream_chain,
    sailor_model_profile,
    total_train_flops,
)
from hetrain.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DATA = ROOT / "tests" / "data" / "shared"  # shipped extract
FULL_DATA = DEFAULT_DATA_DIR


def test_sailor_speeds_and_kappa_match_the_catalog():
    derived = derive_sailor_speeds(DATA)
    sailor_kinds = {"A100-40", "A100-80", "GH-96", "V100-16", "RTX-2080", "RTX-3090", "Titan-RTX"}
    assert set(derived) == sailor_kinds
    for kind, (tflops, kappa_ms, rms) in derived.items():
        assert DEVICE_KINDS[kind].tflops == pytest.approx(tflops, rel=1e-3), kind
        assert DEVICE_KINDS[kind].microbatch_overhead_ms == pytest.approx(kappa_ms, abs=0.01)
        assert rms < 0.05, kind  # docs/model.md §3's linear model fits sailor's times within 5 %
    # the ordering the hardware generations imply
    t = {k: v[0] for k, v in derived.items()}
    assert t["GH-96"] > t["A100-80"] > t["A100-40"] > t["RTX-3090"] > t["V100-16"]


def test_gavel_ratios_and_old_gpu_speeds():
    ratios = derive_gavel_ratios(DATA)
    for kind in ("k80", "p100"):
        assert GAVEL_RATIO_TO_V100[kind] == pytest.approx(ratios[kind], rel=1e-3)
    v100 = DEVICE_KINDS["V100-16"].tflops
    assert DEVICE_KINDS["K80"].tflops == pytest.approx(v100 * ratios["k80"], rel=1e-3)
    assert DEVICE_KINDS["P100"].tflops == pytest.approx(v100 * ratios["p100"], rel=1e-3)
    assert DEVICE_KINDS["K80"].tflops < DEVICE_KINDS["P100"].tflops < v100


def test_memory_network_and_prices_come_from_the_files():
    cfg = load_json(DATA / "sailor" / "basic_cluster_config.json")
    het = load_json(DATA / "sailor" / "multizone_bandwidths_het.json")["us-central1-a"]
    for kind in ("A100-40", "V100-16", "GH-96", "RTX-2080", "Titan-RTX", "RTX-3090"):
        assert DEVICE_KINDS[kind].memory_gib * 2**30 == pytest.approx(cfg[kind]["mem_per_gpu"])
        assert DEVICE_KINDS[kind].devices_per_node == cfg[kind]["gpus_per_node"]
        max_bw = het[kind]["1"]["us-central1-a"][kind]["1"][1]
        assert DEVICE_KINDS[kind].nic_gbps == pytest.approx(max_bw * 8 / 1e9, rel=1e-6)
    for kind, inst in (("K80", "p2.xlarge"), ("V100-16", "p3.2xlarge")):
        hist = load_json(DATA / "spot-prices-aws" / "us-east-1" / f"{inst}.json")
        median = statistics.median(float(r["SpotPrice"]) for r in hist["SpotPriceHistory"])
        assert DEVICE_KINDS[kind].spot_price_per_hour == pytest.approx(median)
    for kind in DEVICE_KINDS.values():
        assert {"tflops", "memory_gib", "nic_gbps", "power_w", "price_per_hour"} <= set(
            kind.sources
        )


def test_sailor_opt350_profile_values():
    llm = load_json(DATA / "sailor" / "llm_info.json")
    prof = sailor_model_profile(llm, "OPT-350")
    assert prof.num_layers == 26
    s, h = 2048, 1024
    block = prof.layers[5]
    p = llm["OPT-350"]["1"]["5"]
    assert block.param_bytes == p["params_bytes"] == 4 * p["params_floats"]
    assert block.fwd_flops == 2 * p["params_floats"] * s + 4 * s * s * h
    assert block.bwd_flops == 2 * block.fwd_flops
    assert block.activation_bytes == s * h * 4
    assert block.activation_memory_bytes == p["act_mem_bytes"]
    # Kaplan et al. 2020: training ≈ 6 N s FLOP per sequence (+ attention)
    n_params = sum(ly.param_bytes for ly in prof.layers[1:]) / 4
    approx = 6 * n_params * s + 24 * 12 * s * s * h
    assert total_train_flops(prof) == pytest.approx(approx, rel=0.05)
    shipped = load_profile(EXAMPLES / "profiles" / "opt-350m.json")
    assert [ly.fwd_flops for ly in shipped.layers] == [ly.fwd_flops for ly in prof.layers]
    assert load_profile(EXAMPLES / "profiles" / "gpt-neo-2.7b.json").num_layers == 34


def test_pipedream_vgg16_and_resnet50_match_published_sizes():
    vgg = pipedream_chain(DATA / "pipedream-profiles" / "vgg16_graph.txt")
    assert vgg.batch_size == 128
    # VGG16: 138,357,544 parameters, 15.47 GMACs per 224x224 image (torchvision model card)
    assert sum(ly.param_bytes for ly in vgg.profile.layers) == 138_357_544 * 4
    convfc = sum(ly.fwd_flops for ly in vgg.profile.layers if "Conv" in ly.name or "Lin" in ly.name)
    assert convfc / 2 == pytest.approx(15.47e9, rel=0.01)
    assert vgg.profile.num_layers >= 24
    rn = pipedream_chain(DATA / "pipedream-profiles" / "resnet50_graph.txt")
    # ResNet-50: 25,557,032 parameters (BatchNorm running stats are buffers), 4.09 GMACs
    assert sum(ly.param_bytes for ly in rn.profile.layers) == 25_557_032 * 4
    assert sum(ly.fwd_flops for ly in rn.profile.layers) / 2 == pytest.approx(4.1e9, rel=0.03)
    # each bottleneck block is one layer (16 of them), cuts only where one tensor crosses
    assert sum(1 for n in rn.ops_per_layer if n >= 8) == 16
    lines = (DATA / "pipedream-profiles" / "resnet50_graph.txt").read_text().splitlines()
    published_fwd_ms = sum(
        float(x.split("forward_compute_time=")[1].split(",")[0])
        for x in lines
        if "forward_compute_time" in x and " Input " not in x
    )
    assert rn.fwd_ms.sum() == pytest.approx(published_fwd_ms, rel=1e-9)
    shipped = json.loads((EXAMPLES / "profiles" / "resnet50-pipedream.json").read_text())
    assert len(shipped["layers"]) == rn.profile.num_layers


def test_make_cluster_nodes_links_and_sizes():
    spec = make_cluster({"V100-16": 6, "K80": 3}, devices_per_node=4, nic_gbps=0.79)
    st = spec.state()
    assert st.num_devices == 9
    assert [d.node for d in spec.devices] == ["n0"] * 4 + ["n1"] * 2 + ["n2"] * 3
    assert st.link_bandwidth(0, 1) == pytest.approx(80e9 / 8)  # min intra-node of the kinds
    assert st.link_bandwidth(0, 5) == pytest.approx(0.79e9 / 8)
    assert st.speed_flops[0] == pytest.approx(DEVICE_KINDS["V100-16"].tflops * 1e12)
    priced = make_cluster({"K80": 1, "A100-40": 1}, spot=True)
    assert [d.price_per_hour for d in priced.devices] == [0.3785, 4.0966]
    jit = make_cluster({"A100-40": 50}, speed_jitter=0.1, seed=3)
    speeds = [d.tflops for d in jit.devices]
    assert min(speeds) >= 29.53 * 0.9 and max(speeds) <= 29.53 * 1.1 and len(set(speeds)) > 40
    again = make_cluster({"A100-40": 50}, speed_jitter=0.1, seed=3)
    assert speeds == [d.tflops for d in again.devices]
    big = make_mixed_cluster(1024)
    assert len(big.devices) == 1024 and len({d.id for d in big.devices}) == 1024
    with pytest.raises(ValueError, match="unknown device kind"):
        make_cluster({"H100": 1})


def test_shipped_clusters_load_and_match_the_builder():
    c4 = load_cluster(EXAMPLES / "clusters" / "mixed4.yaml")
    assert len({d.tflops for d in c4.devices}) == 4
    slow = load_cluster(EXAMPLES / "clusters" / "two_nodes_slow.yaml")
    assert len({d.node for d in slow.devices}) == 2
    assert {d.nic_gbps for d in slow.devices} == {0.79}
    priced = load_cluster(EXAMPLES / "clusters" / "priced8.yaml")
    assert all(d.power_w > 0 and d.price_per_hour > 0 for d in priced.devices)
    assert priced == make_cluster({"A100-40": 2, "V100-16": 2, "K80": 4}, spot=True)


def test_pipedream_chain_on_a_small_residual_graph(tmp_path):
    """No shared data needed: Input -> conv -> relu -> {conv -> add, skip -> add} -> linear."""
    b = 2  # minibatch: the input is 2 x 3x4x4 fp32 = 384 bytes
    node = (
        "node{} -- {} -- forward_compute_time={}, backward_compute_time={}, "
        "activation_size={}, parameter_size={}"
    )
    lines = [
        node.format(1, "Input", 5.0, 0.0, 384.0, 0.0),
        node.format(
            2,
            "Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))",
            1.0,
            2.0,
            b * 8 * 16 * 4.0,
            8 * 3 * 9 * 4 + 32.0,
        ),
        node.format(3, "ReLU(inplace)", 0.5, 0.5, b * 8 * 16 * 4.0, 0.0),
        node.format(
            4,
            "Conv2d(8, 8, kernel_size=(1, 1), stride=(1, 1), bias=False)",
            1.0,
            2.0,
            b * 8 * 16 * 4.0,
            8 * 8 * 4.0,
        ),
        node.format(5, "Add(inplace)", 0.1, 0.1, b * 8 * 16 * 4.0, 0.0),
        node.format(6, "View(-1)", 0.0, 0.0, b * 128 * 4.0, 0.0),
        node.format(
            7,
            "Linear(in_features=128, out_features=10, bias=True)",
            0.2,
            0.3,
            b * 10 * 4.0,
            (1280 + 10) * 4.0,
        ),
    ]
    edges = ["1 -- 2", "2 -- 3", "3 -- 4", "3 -- 5", "4 -- 5", "5 -- 6", "6 -- 7"]
    text = "\n".join(
        lines + [f"\tnode{e.split(' -- ')[0]} -- node{e.split(' -- ')[1]}" for e in edges]
    )
    path = tmp_path / "toy_graph.txt"
    path.write_text(text + "\n")
    chain = pipedream_chain(path, input_bytes_per_sample=3 * 4 * 4 * 4)
    assert chain.batch_size == b
    # no cut between the ReLU and the Add (the skip tensor crosses): conv4 + add are one layer
    assert chain.ops_per_layer == (1, 1, 2, 1, 1)
    conv1, relu, block, view, fc = chain.profile.layers
    assert conv1.fwd_flops == 2 * 8 * 16 * 3 * 9 and conv1.bwd_flops == 2 * conv1.fwd_flops
    assert block.fwd_flops == 2 * 8 * 16 * 8 + 8 * 16  # 1x1 conv + the add
    assert block.activation_memory_bytes == 2 * 8 * 16 * 4  # both ops' outputs, per sample
    assert fc.fwd_flops == 2 * 128 * 10 and fc.param_bytes == (1280 + 10) * 4
    assert view.fwd_flops == 0 and relu.activation_bytes == 8 * 16 * 4
    assert list(chain.fwd_ms) == [1.0, 0.5, 1.1, 0.0, 0.2]


def test_the_extract_is_shipped_with_its_attribution():
    for folder in ("sailor", "gavel", "spot-prices-aws", "pipedream-profiles"):
        names = {p.name for p in (DATA / folder).iterdir()}
        assert "PROVENANCE.md" in names and any(n.startswith("LICENSE") for n in names), folder
    assert "MIT" in (DATA / "sailor" / "LICENSE").read_text()


@pytest.mark.skipif(
    not (FULL_DATA / "sailor").is_dir(), reason=f"full data sets not at {FULL_DATA}"
)
def test_the_extract_gives_the_figures_of_the_full_data():
    assert derive_sailor_speeds(DATA) == derive_sailor_speeds(FULL_DATA)
    full_ratios = derive_gavel_ratios(FULL_DATA)  # same terms, summed in another order
    assert derive_gavel_ratios(DATA) == pytest.approx(full_ratios, rel=1e-12)
    for name in ("OPT-350",):
        full = sailor_model_profile(load_json(FULL_DATA / "sailor" / "llm_info.json"), name)
        part = sailor_model_profile(load_json(DATA / "sailor" / "llm_info.json"), name)
        assert full == part
    for inst in ("p2.xlarge", "p3.2xlarge"):
        prices = [
            [r["SpotPrice"] for r in load_json(d / "spot-prices-aws" / "us-east-1" / f"{inst}.json")
             ["SpotPriceHistory"]]
            for d in (DATA, FULL_DATA)
        ]  # fmt: skip
        assert prices[0] == prices[1]


def test_the_extract_names_its_sources():
    text = (DATA / "README.md").read_text(encoding="utf-8")
    for folder in ("sailor", "gavel", "spot-prices-aws", "pipedream-profiles"):
        assert f"`{folder}/`" in text and (DATA / folder).is_dir()
