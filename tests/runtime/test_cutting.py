"""Cutting any module into layers (runtime/cutting.py, docs/model.md §5): default cut points of the
standard models, stages that equal the whole forward and its gradients, and bad cuts as one
line with exit 2."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

from hetrain.cli import main
from hetrain.errors import InputError
from hetrain.models.hf import bert_model, gpt2_model, resnet_model
from hetrain.runtime.cutting import CaptureError, ModuleCut, cut_module, default_blocks


def test_default_cut_points_of_the_standard_models():
    assert default_blocks(gpt2_model("tiny")) == [f"transformer.h.{i}" for i in range(4)]
    assert default_blocks(bert_model("tiny")) == [f"bert.encoder.layer.{i}" for i in range(4)]
    blocks = default_blocks(resnet_model("base"))  # ResNet-50: every bottleneck of every stage
    assert len(blocks) == 16 and blocks[0] == "resnet.encoder.stages.0.layers.0"
    assert blocks[-1] == "resnet.encoder.stages.3.layers.2"


def _run_stages(chain, cuts, inputs):
    """Stages ``[cuts[k], cuts[k+1])`` one after the other, like pipeline ranks (detached
    boundaries), then the backward of the logits' sum through all of them."""
    outs, y = [], None
    for s, e in zip(cuts[:-1], cuts[1:], strict=True):
        if y is not None:
            y = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in y)
        x = y
        y = chain.stage_forward(s, e, x, inputs)
        outs.append((x, y))
    logits = y.logits
    grads = None
    for k in reversed(range(len(outs))):
        x, out = outs[k]
        if k == len(outs) - 1:
            out.logits.sum().backward()
        else:
            pairs = [
                (t, g) for t, g in zip(out, grads, strict=True) if t.requires_grad and g is not None
            ]
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        grads = None if x is None else [t.grad for t in x]
    return logits


@pytest.mark.parametrize("name", ["gpt2", "bert", "resnet"])
def test_stages_equal_the_whole_forward_and_backward(name):
    torch.manual_seed(0)
    if name == "resnet":
        model, x = resnet_model("tiny").double().eval(), torch.randn(3, 1, 16, 16).double()
    else:
        build = gpt2_model if name == "gpt2" else bert_model
        model, x = build("tiny", dropout=0.0, context=16).double(), torch.randint(1, 256, (3, 16))
    chain = cut_module(model, x[:2])
    assert chain.num_layers == len(default_blocks(model)) + 2
    if name != "resnet":  # tied embedding / head: one tensor in the prefix and the suffix
        (tied, users), *_ = chain.shared.items()
        assert users == (0, chain.num_layers - 1) and "embeddings" in tied or "wte" in tied
    ref = model(x).logits
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    last = chain.num_layers
    for cuts in ([0, last], [0, 1, 3, last], list(range(last + 1))):
        model.zero_grad(set_to_none=True)
        logits = _run_stages(chain, cuts, x)
        assert torch.equal(logits, ref)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-12, atol=1e-14, msg=n)


def test_a_cut_point_naming_no_module_lists_near_names():
    with pytest.raises(InputError, match=r"no module named 'transformer\.h\.9'.*transformer\.h\."):
        cut_module(gpt2_model("tiny"), torch.zeros(2, 8, dtype=torch.long), ["transformer.h.9"])


class _Peeks(nn.Module):
    """A forward that reads a value computed from the weights before its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        h = self.inp(x)
        if h.sum() > 0:  # data-dependent: needs the prefix's real values on every stage
            h = -h
        for b in self.blocks:
            h = b(h)
        return h


def test_a_module_that_cannot_be_captured_names_the_op_and_suggests_layers():
    with pytest.raises(CaptureError, match=r"after layer 0 .*reads tensor values.*layers=\["):
        ModuleCut(_Peeks(), torch.randn(2, 4))


def test_a_norm_block_not_dividing_the_batch_exits_2(capsys):
    code = main(["train", "--example", "resnet", "--batch", "30", "--norm-block", "4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--norm-block: 4 does not divide the global batch 30" in err


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "userfactories.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn
            from hetrain.models.hf import gpt2_model

            def _data():
                x = torch.randint(0, 256, (64, 9))
                return x[:, :-1], x[:, 1:]

            def loss(out, y):
                return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())

            def bad_cut():
                return {"model": gpt2_model("tiny"), "dataset": _data(), "loss_fn": loss,
                        "layers": ["transformer.h.0", "transformer.hh.1"]}

            def no_model():
                return {"model": None, "dataset": _data(), "loss_fn": loss}

            def nothing():
                return None

            def good():
                return {"model": gpt2_model("tiny"), "dataset": _data(), "loss_fn": loss}
            """
        )
    )
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        ("bad_cut", ["no module named 'transformer.hh.1'", "transformer.h.1"]),
        ("no_model", ["expected a torch.nn.Module", "NoneType"]),
        ("nothing", ["expected the factory to return", "NoneType"]),
    ],
)
def test_bad_models_exit_2_with_one_line(factories, capsys, factory, words):
    code = main(["train", "--model", f"userfactories:{factory}", "--steps", "1", "--workers", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err


def test_profile_of_a_factory_module_lists_the_tied_tensor(factories, tmp_path, capsys):
    from hetrain.profile import load_profile

    out = tmp_path / "prof.json"
    code = main(["profile", "--model", "userfactories:good", "--batch", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    prof = load_profile(out)
    assert prof.num_layers == 6  # prefix, 4 GPT-2 blocks, suffix
    (tied,) = prof.shared
    assert tied.name == "transformer.wte.weight" and tied.layers == [0, 5]
    assert tied.bytes == 256 * 64 * 4
    # a block's boundary carries the hidden states (8 tokens x 64 floats), and for a next
    # stage of blocks only the next block's other tensor arguments (the position ids, 1 x 8
    # int64) and the 0-dim int64 tag; per sample of the batch of 2
    assert prof.layers[1].activation_bytes == 8 * 64 * 4 + (8 * 8 + 8) / 2


class _ScaledBlock(nn.Module):
    """A block with a parameter of its own (not in a child module), as ConvNeXt's layer
    scale."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gamma = nn.Parameter(torch.full((4,), 0.5))

    def forward(self, h):
        return h + self.gamma * self.lin(h)


class _OwnParams(nn.Module):
    """A parent with parameters of its own used before and after its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.scale_in = nn.Parameter(torch.ones(4))
        self.blocks = nn.ModuleList([_ScaledBlock() for _ in range(3)])
        self.scale_out = nn.Parameter(torch.ones(4))
        self.register_buffer("unused_buf", torch.zeros(2))

    def forward(self, x):
        h = x * self.scale_in
        for b in self.blocks:
            h = b(h)
        return h * self.scale_out


def test_each_tensor_is_listed_under_the_layers_that_use_it_only():
    chain = cut_module(_OwnParams(), torch.randn(2, 4))
    assert chain.layer_names[1:4] == [f"blocks.{i}:_ScaledBlock" for i in range(3)]
    assert chain.shared == {}
    assert chain.layer_tensors[0] == ["scale_in", "unused_buf"]
    for i in range(3):
        assert chain.layer_tensors[i + 1] == [
            f"blocks.{i}.gamma",
            f"blocks.{i}.lin.weight",
            f"blocks.{i}.lin.bias",
        ]
    assert chain.layer_tensors[4] == ["scale_out"]
    x = torch.randn(3, 4)
    ref = chain.module(x)
    y = None
    for layer in range(chain.num_layers):
        y = chain.stage_forward(layer, layer + 1, y, x)
    assert torch.equal(y, ref)


def _tiny_hf(name: str):
    """Tiny float64 models (dropout 0) of the families the old meta replay refused or broke,
    with a two-sample recording batch and a 3-sample batch."""
    import transformers as tf

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (3, 8), generator=g)
    dec = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "use_cache": False,
    }
    if name == "llama-padded":  # rotary tables cross every boundary; a padding mask
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**dec))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
    elif name == "mixtral":  # top-2 routing needs values inside every block
        cfg = tf.MixtralConfig(
            **dec, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"
        )
        model, inputs = tf.MixtralForCausalLM(cfg), ids
    elif name == "roberta":  # position ids from the token ids (padding index 1)
        cfg = tf.RobertaConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=3,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=12,
            pad_token_id=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model, inputs = tf.RobertaForMaskedLM(cfg), ids
    elif name == "deberta-v2":  # relative-position table made once, through a p = 0 dropout
        cfg = tf.DebertaV2Config(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=3,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
            relative_attention=True,
            position_buckets=8,
            pos_att_type=["p2c", "c2p"],
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model, inputs = tf.DebertaV2ForMaskedLM(cfg), ids
    else:  # t5: the encoder output feeds every decoder block, block 0's position bias too
        cfg = tf.T5Config(
            vocab_size=64,
            d_model=16,
            d_kv=4,
            d_ff=32,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            use_cache=False,
            decoder_start_token_id=0,
        )
        model = tf.T5ForConditionalGeneration(cfg)
        inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    return model.double(), inputs


@pytest.mark.parametrize("name", ["llama-padded", "mixtral", "roberta", "deberta-v2", "t5"])
def test_stages_of_rotary_moe_and_encoder_decoder_models_equal_the_whole_model(name):
    torch.manual_seed(0)
    model, inputs = _tiny_hf(name)
    first_two = {k: v[:2] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[:2]
    chain = cut_module(model, first_two)
    chain.verify(inputs)
    call = (lambda m: m(**inputs)) if isinstance(inputs, dict) else (lambda m: m(inputs))
    ref = call(model).logits
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    last = chain.num_layers
    for cuts in ([0, 2, last], list(range(last + 1))):
        model.zero_grad(set_to_none=True)
        logits = _run_stages(chain, cuts, inputs)
        torch.testing.assert_close(logits, ref, rtol=1e-12, atol=1e-13)
        for n, g in ref_grads.items():
            p = model.get_parameter(n)
            torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-13, msg=n)


def test_a_block_side_output_used_outside_it_is_refused_in_one_line():
    """Mixtral's router logits, collected by hooks inside the blocks for the load-balancing
    loss (``output_router_logits=True``), cannot cross a stage that skips those blocks."""
    import transformers as tf

    cfg = tf.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation="eager",
        output_router_logits=True,
        use_cache=False,
    )
    with pytest.raises(CaptureError, match=r"block model\.layers\.0 computed but did not return"):
        cut_module(tf.MixtralForCausalLM(cfg), torch.randint(0, 64, (2, 8)))


class _SeesHooks(nn.Module):
    """A module inside a block that records how many module hooks torch would run around it
    (global ones and its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[int] = []

    def forward(self, h):
        from torch.nn.modules import module as torch_module

        self.seen.append(
            len(torch_module._global_forward_pre_hooks)
            + len(torch_module._global_forward_hooks)
            + len(self._forward_pre_hooks)
            + len(self._forward_hooks)
        )
        return self.lin(h)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _SeesHooks()

    def forward(self, h, table):
        return self.inner(h) * table


class _HookedBlocks(nn.Module):
    """An embedding-like module, a rotary-like table made from a buffer (it crosses every
    boundary), blocks holding a :class:`_SeesHooks`, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 4))
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        table = torch.cos(x.shape[0] * self.freq)
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, table)
        return self.out(h)


def test_a_stage_runs_no_hooks_around_the_modules_inside_its_blocks():
    # the cost of cutting (issue 18): torch's fast call path for every module inside a block,
    # the code outside the blocks followed by hooks on its own modules only
    torch.manual_seed(0)
    model = _HookedBlocks().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    chain = cut_module(model, x[:2])
    assert [len(chain.boundary_keys(b)) for b in (1, 2, 3, 4)] == [2, 2, 2, 1]  # h, table
    ref = model(x)
    inner = [b.inner for b in model.blocks]
    for m in inner:
        m.seen.clear()
    for cuts in ([0, 2, chain.num_layers], list(range(chain.num_layers + 1))):
        y = None
        for s, e in zip(cuts[:-1], cuts[1:], strict=True):
            y = chain.stage_forward(s, e, y, x)
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
    seen = [n for m in inner for n in m.seen]
    assert len(seen) == 6 and set(seen) == {0}


_FAKE_CALLS = [0]


@torch.library.custom_op("hetrain_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _twice_meta(x):
    _FAKE_CALLS[0] += 1
    return torch.empty_like(x)


class _MetaPrefix(nn.Module):
    """A prefix that computes from a weight with an op whose meta kernel counts its calls,
    returns one of its inputs (``contiguous``, ``to``) and splits; then blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([_ScaledBlock() for _ in range(3)])

    def forward(self, x):
        h = _twice(self.inp(x)).contiguous().to(x.dtype)
        a, b = h.split(2, dim=1)
        h = torch.cat([b, a], dim=1)
        for blk in self.blocks:
            h = blk(h)
        return h


def test_a_stage_runs_each_meta_kernel_once_per_call_signature():
    # the cost of cutting (issue 18): calls before a stage run on meta copies, often through
    # Python decompositions; their results are kept per signature (shapes, strides, dtypes,
    # other arguments), and stay exact for other micro-batch sizes
    torch.manual_seed(0)
    model = _MetaPrefix().double()
    chain = cut_module(model, torch.randn(2, 4, dtype=torch.float64))
    calls = []
    with torch.no_grad():
        for rows in (3, 3, 3, 5, 5, 1):
            x = torch.randn(rows, 4, dtype=torch.float64)
            sent = chain.stage_forward(0, 2, None, x)
            before = _FAKE_CALLS[0]
            y = chain.stage_forward(3, chain.num_layers, chain.stage_forward(2, 3, sent, x), x)
            calls.append(_FAKE_CALLS[0] - before)
            torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    # stages [2, 3) and [3, 5) both run the prefix on meta: once per new micro-batch size
    assert calls == [1, 0, 0, 1, 0, 1]
