"""profile_chain against hand-computed FLOPs and bytes; published-config models; CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from hetrain.calibration import fit_speed_kappa
from hetrain.cli import main
from hetrain.cluster import load_cluster
from hetrain.models.registry import EXAMPLES
from hetrain.profile import load_profile
from hetrain.profiler import LayerTimes, fit_device, profile_chain, time_layers


def test_mlp_flops_and_bytes_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    prof = profile_chain(model, torch.randn(4, 10), name="mlp")
    l0, l1, l2 = prof.layers
    assert (l0.fwd_flops, l0.bwd_flops) == (400, 400)  # 2·10·20; data needs no input grad
    assert (l2.fwd_flops, l2.bwd_flops) == (200, 400)  # 2·20·5; input + weight gradients
    assert (l1.fwd_flops, l1.bwd_flops) == (0, 0)  # element-wise ops are not counted
    assert [ly.activation_bytes for ly in prof.layers] == [80, 80, 20]  # fp32 outputs
    assert [ly.param_bytes for ly in prof.layers] == [(200 + 20) * 4, 0, (100 + 5) * 4]
    # saved for backward: Linear keeps its input, ReLU its output (weights excluded)
    assert [ly.activation_memory_bytes for ly in prof.layers] == [40, 80, 80]
    assert [ly.name for ly in prof.layers] == ["0:Linear", "1:ReLU", "2:Linear"]
    assert all(p.grad is None for p in model.parameters())


def test_shared_parameter_listed_once_and_frozen_bytes_apart():
    lin = nn.Linear(8, 8, bias=False)
    frozen = nn.Linear(8, 8)
    frozen.requires_grad_(False)
    model = nn.Sequential(lin, nn.Tanh(), frozen, lin)
    prof = profile_chain(model, torch.randn(2, 8))
    assert [ly.param_bytes for ly in prof.layers] == [0, 0, 0, 0]  # the tied tensor: shared
    assert [ly.frozen_param_bytes for ly in prof.layers] == [0, 0, (64 + 8) * 4, 0]
    assert [(s.name, s.bytes, s.layers, s.frozen) for s in prof.shared] == [
        ("0.weight", 256, [0, 3], False)
    ]


def test_charlm_block_matches_the_transformer_formula():
    ex = EXAMPLES["charlm"]
    torch.manual_seed(0)
    prof = profile_chain(ex.build(), ex.make_input(2))
    from hetrain.models.charlm import CHARLM  # the trained example's sizes (64 wide)

    t, c, v = CHARLM.block_size, CHARLM.n_embd, CHARLM.vocab_size
    block = prof.layers[1]
    # 2·T·(3C² + C² + 8C²) for the linears + 4·T²·C for QKᵀ and AV (sdpa, counted non-causal)
    assert block.fwd_flops == 2 * t * 12 * c * c + 4 * t * t * c
    assert block.bwd_flops > 2 * block.fwd_flops  # flash backward recomputes the scores
    assert block.activation_bytes == t * c * 4
    assert block.param_bytes == (12 * c * c + 13 * c) * 4
    assert prof.layers[-1].fwd_flops == 2 * t * c * v
    assert prof.layers[0].param_bytes == (v * c + t * c) * 4


def test_overhead_weights_follow_each_layers_operator_count():
    """ν_l (docs/model.md §3): a transformer block dispatches many more ATen operators than the
    embedding or the head, so it carries more of the per-layer fixed cost; the mean is 1."""
    ex = EXAMPLES["charlm"]
    prof = profile_chain(ex.build(), ex.make_input(2))
    nu = [ly.overhead_weight for ly in prof.layers]
    assert sum(nu) == pytest.approx(len(nu), abs=1e-3)
    assert nu[1:5] == [nu[1]] * 4  # four identical blocks, one weight
    assert nu[1] > 1.2 and nu[0] < 0.3 and nu[5] < 0.5
    arrays = prof.arrays()
    assert arrays.layer_units(0, 6) == pytest.approx(6.0, abs=1e-3)
    assert arrays.layer_units(1, 3) == pytest.approx(2 * nu[1])
    # a linear layer and a ReLU: the same weight whatever the width (counts, not FLOPs)
    small = profile_chain(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4))
    wide = profile_chain(nn.Sequential(nn.Linear(64, 64), nn.ReLU()), torch.randn(2, 64))
    assert [ly.overhead_weight for ly in small.layers] == [ly.overhead_weight for ly in wide.layers]
    assert small.layers[0].overhead_weight > small.layers[1].overhead_weight


@pytest.mark.parametrize(
    ("name", "params", "fwd_gflop", "layers"),
    [
        ("resnet50", 25_557_032, 8.18, 18),  # He et al. 2016: 4.1 GMAC
        # bert-base-uncased has 109,482,240 parameters with its pooler (768² + 768, not here);
        # the MLM head adds dense + LayerNorm + an untied decoder
        ("bert-base", 109_482_240 - 590_592 + 590_592 + 1536 + 768 * 30522 + 30522, None, 14),
        # gpt2 has 124,439,808 parameters; the untied head adds 768·50257 + 50257
        ("gpt2-small", 124_439_808 + 768 * 50257 + 50257, None, 14),
    ],
)
def test_published_config_models_on_meta(name, params, fwd_gflop, layers):
    ex = EXAMPLES[name]
    with torch.device("meta"):
        model = ex.build()
    prof = profile_chain(model, ex.make_input(2, device="meta"))
    assert prof.num_layers == layers
    assert sum(ly.param_bytes for ly in prof.layers) == params * 4
    total = sum(ly.fwd_flops for ly in prof.layers)
    if fwd_gflop is not None:
        assert total / 1e9 == pytest.approx(fwd_gflop, rel=0.01)
    else:  # Kaplan et al. 2020: forward ≈ 2 N T + attention, N = non-embedding weights
        t = 1024 if name == "gpt2-small" else 512
        c = 768
        approx = 2 * (12 * 12 * c * c) * t + 12 * 4 * t * t * c
        blocks = sum(ly.fwd_flops for ly in prof.layers[1:-1])
        assert blocks == pytest.approx(approx, rel=0.01)


def test_fit_device_on_constructed_times():
    ex = EXAMPLES["digits"]
    prof = profile_chain(ex.build(), ex.make_input(4))
    flops = prof.arrays().train_flops
    speed, kappa = 5e10, 2e-4
    mus = (2, 8, 32)
    per = np.array([[m * f / speed + kappa / len(flops) for f in flops] for m in mus])
    times = LayerTimes(mus, per / 3, 2 * per / 3, threads=1)
    fit = fit_device(prof, times)
    assert fit.chain.speed_flops == pytest.approx(speed, rel=1e-9)
    assert fit.chain.kappa_s == pytest.approx(kappa, rel=1e-6)
    ref = fit_speed_kappa(mus, flops.sum(), per.sum(axis=1))
    assert fit.chain.speed_flops == pytest.approx(ref.speed_flops)


def test_time_layers_shapes_and_restores_threads():
    ex = EXAMPLES["digits"]
    model = ex.build()
    before = torch.get_num_threads()
    times = time_layers(model, lambda n: ex.make_input(n), (1, 4), warmup=0, repeats=1, threads=1)
    assert times.fwd_s.shape == times.bwd_s.shape == (2, 6)
    assert np.all(times.fwd_s > 0) and np.all(times.bwd_s[:, 1:] > 0)
    assert torch.get_num_threads() == before
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError):
        time_layers(model, lambda n: ex.make_input(n), ())


def _run(*args):
    """The CLI in-process (``hetrain.cli.main``): exit status."""
    return main(["profile", *args])


def test_cli_profile_and_measure(tmp_path, capsys):
    out = tmp_path / "d.json"
    code = _run(
        "--example",
        "digits",
        "--out",
        str(out),
        "--measure",
        "--microbatch-sizes",
        "4,1024",
        "--repeats",
        "3",
        "--warmup",
        "1",
        "--workers",
        "3",
        "--no-link",
    )
    assert code == 0, capsys.readouterr().err
    prof = load_profile(out)
    assert prof.num_layers == 6 and prof.layers[1].fwd_flops == 2 * 64 * 16 * 9 * 32
    cluster = load_cluster(tmp_path / "d.cluster.yaml")
    details = json.loads((tmp_path / "d.measure.json").read_text())
    assert [d.id for d in cluster.devices] == ["w0", "w1", "w2"]
    # docs/model.md (v3): speed, κ and λ of the fit over stages of 1, 2, 3 and 6 layers
    stage_fit = details["stage_fit"]
    assert cluster.devices[0].tflops == pytest.approx(stage_fit["speed_flops"] / 1e12, rel=1e-4)
    assert cluster.devices[0].layer_overhead_ms == pytest.approx(
        stage_fit["layer_overhead_s"] * 1e3, abs=1e-4
    )
    assert sorted({b - a for a, b in details["stages"]}) == [2, 3, 6]
    assert np.array(details["fwd_s"]).shape == (2, 6)


def test_cli_bad_input_exits_2(tmp_path, capsys):
    assert _run("--example", "nope") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hetrain: error: --example: expected one of bert, bert-base, charlm, digits, gpt2, "
        "gpt2-small, resnet, resnet50, got 'nope'"
    ]
    out = str(tmp_path / "x.json")
    assert _run("--example", "digits", "--measure", "--out", out, "--microbatch-sizes", "4") == 2
    assert "--microbatch-sizes" in capsys.readouterr().err
    assert _run("--example", "digits", "--batch", "0") == 2
    assert "--batch: expected an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["gpt2", "bert", "resnet"])
def test_meta_profile_of_hf_models_equals_the_cpu_profile(name):
    """profile_on_meta (weights on ``meta``, real inputs) gives exactly the CPU profile: FLOPs,
    parameter, boundary (masks included) and saved-activation bytes, tied tensors."""
    from hetrain.commands.profile import hf_build, hf_inputs
    from hetrain.profiler import profile_on_meta
    from hetrain.runtime.cutting import cut_module

    inputs = hf_inputs(name, "tiny", 2)
    torch.manual_seed(0)
    cpu = profile_chain(cut_module(hf_build(name, "tiny"), inputs[:1]), inputs).to_json_dict()
    built = []
    meta = profile_on_meta(lambda: built.append(hf_build(name, "tiny")) or built[-1], inputs)
    assert all(t.is_meta for t in [*built[0].parameters(), *built[0].buffers()])
    assert meta.to_json_dict() == cpu
    assert len(meta.layers) == 6  # prefix, 4 blocks, suffix
    if name != "resnet":  # the tied embedding / head, once, used by the prefix and the suffix
        (tied,) = meta.shared
        assert tied.layers == [0, 5]
        assert tied.bytes == built[0].get_input_embeddings().weight.nbytes
    if name == "gpt2":  # a block's boundary: 64 tokens x 64 wide, then the next block's
        # position ids (1 x 64 int64) and the 0-dim int64 tag (per sample of the batch of 2)
        assert meta.layers[1].activation_bytes == 64 * 64 * 4 + (64 * 8 + 8) / 2


def test_cli_profile_of_an_hf_example_on_meta_and_cpu_agree(tmp_path, capsys):
    paths = {d: tmp_path / f"{d}.json" for d in ("meta", "cpu")}
    for device, path in paths.items():
        args = ["--example", "gpt2", "--batch", "2", "--device", device, "--out", str(path)]
        assert _run(*args) == 0
    assert "s on meta" in capsys.readouterr().out
    meta, cpu = (json.loads(p.read_text()) for p in paths.values())
    assert meta["name"].endswith("; meta)") and cpu["name"].endswith("; cpu)")
    assert meta["layers"] == cpu["layers"] and meta["shared"] == cpu["shared"]


def test_cli_measure_of_an_hf_example_times_its_blocks_with_a_progress_bar(tmp_path, capsys):
    out = tmp_path / "g.json"
    args = ["--example", "gpt2", "--out", str(out), "--measure", "--microbatch-sizes", "1,256"]
    args += ["--repeats", "1", "--warmup", "0", "--no-link", "--seq-len", "16"]
    code = _run(*args, "--stage-lengths", "3,6", "--workers", "2")
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "remaining" in captured.err and "timing gpt2-tiny on inputs of shape 16" in captured.err
    details = json.loads((tmp_path / "g.measure.json").read_text())
    # timed on windows of 16 tokens; the written profile keeps the model's 64
    assert details["timed_input_shape"] == [16]
    assert np.array(details["fwd_s"]).shape == (2, 6)  # prefix, 4 blocks, suffix
    assert details["stages"] == [[0, 3], [3, 6], [0, 6]]
    prof = load_profile(out)
    # hidden states; the first block's position ids (1 x 64 int64) and the 0-dim tag, per
    # sample of the profile's batch
    assert prof.layers[0].activation_bytes == 64 * 64 * 4 + (64 * 8 + 8) / 8
    cluster = load_cluster(tmp_path / "g.cluster.yaml")
    assert [d.id for d in cluster.devices] == ["w0", "w1"]
    assert cluster.devices[0].tflops == pytest.approx(
        details["stage_fit"]["speed_flops"] / 1e12, rel=1e-4
    )


def test_meta_profile_of_a_module_built_on_the_cpu_keeps_its_tied_weights():
    """``--model`` factories hand over a module already built (a copy): moved to meta with
    ``wte`` and ``lm_head`` still one tensor, the profile still equals the CPU one."""
    import copy

    from hetrain.commands.profile import hf_build, hf_inputs
    from hetrain.profiler import profile_on_meta
    from hetrain.runtime.cutting import cut_module

    inputs = hf_inputs("gpt2", "tiny", 2)
    model = hf_build("gpt2", "tiny")
    cpu = profile_chain(cut_module(model, inputs[:1]), inputs)
    meta = profile_on_meta(lambda: copy.deepcopy(model), inputs)
    assert meta.to_json_dict() == cpu.to_json_dict()
    assert [t.name for t in meta.shared] == ["transformer.wte.weight"]
