"""Stages of blocks only call their blocks directly (runtime/cut_direct.py, docs/runtime.md "Any
model"): a middle stage of Llama runs none of the model's code before its blocks, what its
first block needs crosses the boundary (and the profile counts it), a call whose arguments do
not have the recorded structure (a padded micro-batch after an unpadded recording) falls back
to the model's forward, and every split stays exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetrain.models.hf import llama_model
from hetrain.runtime.cutting import cut_module

pytest.importorskip("transformers")

SEQ = 12
HIDDEN = 64  # llama tiny: 64 wide, 4 heads of 16
HEAD = 16


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return llama_model("tiny", dropout=0.0, context=SEQ).double()


def _middle_stage_outside_calls(model, chain, inputs) -> list:
    """The modules outside block 1 that run in stage ``[2, 3)`` of ``chain`` (no gradient),
    fed what stage ``[0, 2)`` sends for ``inputs``."""
    with torch.no_grad():
        sent = chain.stage_forward(0, 2, None, inputs)
    seen, handles = _calls_outside(model, chain.blocks[1])
    try:
        with torch.no_grad():
            chain.stage_forward(2, 3, sent, inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _calls_outside(model: nn.Module, block: nn.Module) -> tuple[list[str], list]:
    """Record the names of the modules called outside ``block`` (forward pre-hooks)."""
    inside = {id(m) for m in block.modules()}
    seen: list[str] = []
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen.append(name))
        for name, m in model.named_modules()
        if id(m) not in inside
    ]
    return seen, handles


def _run(chain, cuts, inputs):
    """Stages ``[cuts[k], cuts[k+1])`` one after the other with detached boundaries, then the
    backward of the logits' sum; returns the logits and what each stage sent."""
    outs, y, sent = [], None, []
    for s, e in zip(cuts[:-1], cuts[1:], strict=True):
        x = None
        if y is not None:
            x = tuple(t.detach().requires_grad_(t.requires_grad) for t in y)
            sent.append(y)
        y = chain.stage_forward(s, e, x, inputs)
        outs.append((x, y))
    logits = y.logits
    grads = None
    for k in reversed(range(len(outs))):
        x, out = outs[k]
        if k == len(outs) - 1:
            out.logits.sum().backward()
        else:
            pairs = [(t, g) for t, g in zip(out, grads, strict=True) if g is not None]
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        grads = None if x is None else [t.grad for t in x]
    return logits, sent


def test_a_middle_stage_of_llama_runs_only_its_block_and_stays_exact():
    model = _llama()
    x = torch.randint(1, 256, (3, SEQ))
    chain = cut_module(model, x[:2])
    ref = model(x).logits
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # the embedding, the rotary table, the mask code and the head do not run in stage [2, 3)
    assert _middle_stage_outside_calls(model, chain, x) == []
    for cuts in ([0, 2, 3, 4, chain.num_layers], list(range(chain.num_layers + 1))):
        model.zero_grad(set_to_none=True)
        logits, _ = _run(chain, cuts, x)
        torch.testing.assert_close(logits, ref, rtol=1e-12, atol=1e-14)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-12, atol=1e-14, msg=n)


def test_the_next_blocks_arguments_cross_the_boundary_and_are_counted():
    from hetrain.profiler.chain import profile_chain

    model = _llama()
    x = torch.randint(1, 256, (4, SEQ))
    chain = cut_module(model, x[:2])
    with torch.no_grad():
        sent = chain.stage_forward(0, 2, None, x)
    # hidden states and the rotary cos/sin, then the block's position ids and the tag
    assert len(chain.boundary_keys(2)) == 3 and len(sent) == 5
    assert torch.equal(sent[3], torch.arange(SEQ)[None])
    assert sent[4].dtype == torch.int64 and sent[4].dim() == 0
    prof = profile_chain(chain, x)
    per_batch = 4 * SEQ * HIDDEN * 8 + 2 * SEQ * HEAD * 8 + SEQ * 8 + 8
    assert prof.layers[2].activation_bytes == per_batch / 4
    # after the last block: the hidden states only (the head runs the model's forward)
    assert prof.layers[4].activation_bytes == SEQ * HIDDEN * 8


def test_a_padded_micro_batch_after_an_unpadded_recording_runs_the_models_forward():
    model = _llama()
    ids = torch.randint(1, 256, (3, SEQ))
    chain = cut_module(model, {"input_ids": ids[:2], "attention_mask": torch.ones(2, SEQ)})
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[0, :4] = 0  # left padding: the blocks get a mask the recording did not have
    for m, direct in ((mask, False), (torch.ones_like(mask), True)):
        inputs = {"input_ids": ids, "attention_mask": m}
        model.zero_grad(set_to_none=True)
        ref = model(**inputs).logits
        ref.sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        cuts = [0, 2, 3, chain.num_layers]
        logits, sent = _run(chain, cuts, inputs)
        assert [len(s) for s in sent] == ([5, 5] if direct else [3, 3])
        torch.testing.assert_close(logits, ref, rtol=1e-12, atol=1e-14)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-12, atol=1e-14, msg=n)
        assert (_middle_stage_outside_calls(model, chain, inputs) == []) == direct


class _Between(nn.Module):
    """A forward that computes between its blocks (a scale per block): a stage of several
    blocks must run it, so it runs the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            h = b(h) * (i + 1)
        return h.sum(-1)


def test_code_between_blocks_keeps_the_models_forward():
    from hetrain.runtime.cut_direct import direct_plan

    torch.manual_seed(0)
    model = _Between().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    chain = cut_module(model, x[:2])
    # [1, 2): block 0 alone, but the scale after it belongs to its layer
    assert direct_plan(chain, 1, 2) is None and direct_plan(chain, 1, 3) is None
    ref = model(x)
    for cuts in ([0, 1, 2, 3, chain.num_layers], [0, 2, chain.num_layers]):
        y = None
        for s, e in zip(cuts[:-1], cuts[1:], strict=True):
            y = chain.stage_forward(s, e, y, x)
        torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_the_first_stage_runs_without_the_tracking_mode():
    # every tensor it sends (embedding output, rotary tables, a block's output) is a module's
    # output: the module hooks name them, no torch call is followed
    model = _llama()
    x = torch.randint(1, 256, (3, SEQ))
    chain = cut_module(model, x[:2])
    modes: list[int] = []
    hook = model.model.embed_tokens.register_forward_pre_hook(
        lambda mod, args: modes.append(torch._C._len_torch_function_stack())
    )
    try:
        with torch.no_grad():
            sent = chain.stage_forward(0, 2, None, x)
            y = chain.stage_forward(2, chain.num_layers, sent, x)
    finally:
        hook.remove()
    assert modes[0] == 0
    torch.testing.assert_close(y.logits, model(x).logits, rtol=0, atol=0)


def _last_stage_calls(model, chain, start, inputs) -> list[str]:
    """The modules called in stage ``[start, num_layers)`` of ``chain`` for ``inputs`` (no
    gradient; the stage runs twice: the first run records its suffix), outside its blocks."""
    with torch.no_grad():
        sent = chain.stage_forward(0, start, None, inputs)
        chain.stage_forward(start, chain.num_layers, sent, inputs)
    inside = {id(m) for b in chain.blocks[start - 1 :] for m in b.modules()}
    names = {id(m): n for n, m in model.named_modules()}
    seen: list[str] = []
    # a global hook: a hook on a module around the suffix would keep the model's forward
    hook = nn.modules.module.register_module_forward_pre_hook(
        lambda mod, args: None if id(mod) in inside else seen.append(names[id(mod)])
    )
    try:
        with torch.no_grad():
            chain.stage_forward(start, chain.num_layers, sent, inputs)
    finally:
        hook.remove()
    return seen


def _exact_against_whole(model, chain, cuts, inputs, logits_of=lambda out: out.logits):
    """Run ``cuts`` twice (record, then replay the suffix): logits and every gradient equal
    the whole model's."""
    model.zero_grad(set_to_none=True)
    ref = logits_of(model(**inputs) if isinstance(inputs, dict) else model(inputs))
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        logits, _ = _run(chain, cuts, inputs)
        torch.testing.assert_close(logits, ref, rtol=1e-12, atol=1e-14)
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == ref_grads.keys()
        for n, g in got.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-12, atol=1e-14, msg=n)


def test_the_last_stage_of_llama_runs_only_its_block_and_the_head():
    # the second micro-batch of a signature replays the recorded suffix (final norm, the
    # slice, lm_head): no embedding, no rotary table, no mask code, no model forward
    model = _llama()
    x = torch.randint(1, 256, (3, SEQ))
    chain = cut_module(model, x[:2])
    assert _last_stage_calls(model, chain, 4, x) == ["model.norm", "lm_head"]
    assert _last_stage_calls(model, chain, 3, x) == ["model.norm", "lm_head"]
    # a hook on a module around the suffix (added after the recording) keeps the forward
    hook = model.register_forward_hook(lambda mod, args, out: None)
    try:
        assert "model.embed_tokens" in _last_stage_calls(model, chain, 4, x)
    finally:
        hook.remove()
    _exact_against_whole(model, chain, [0, 2, 3, 4, chain.num_layers], x)
    _exact_against_whole(model, chain, [0, 1, 3, chain.num_layers], x)
    _exact_against_whole(model, chain, list(range(chain.num_layers + 1)), x)
    # another micro-batch size: its own recording, exact as well
    _exact_against_whole(model, chain, [0, 2, 3, 4, chain.num_layers], x[:1])


class _TiedHead(nn.Module):
    """Embedding, a padding mask from the inputs, blocks taking ``(h, mask)``, then a final
    norm, a head tied to the embedding, a masked mean loss over the tokens and, when
    ``read_value``, a Python branch on a tensor value in the suffix."""

    def __init__(self, read_value: bool, dropout: float = 0.0, functional: str = "") -> None:
        super().__init__()
        self.read_value = read_value
        self.functional = functional
        self.drop = nn.Dropout(dropout)
        self.emb = nn.Embedding(20, 8)
        self.blocks = nn.ModuleList([_MaskedBlock() for _ in range(3)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, mask):
        h = self.emb(ids)
        if self.functional == "shared":  # the suffix's dropout module also runs in the prefix
            h = self.drop(h)
        m = mask[..., None].to(h.dtype)
        for b in self.blocks:
            h = b(h, m)
        h = self.norm(h)
        if self.functional == "functional":  # a random draw outside any module
            h = nn.functional.dropout(h, self.drop.p, self.training)
        logits = self.head(self.drop(h))
        per_token = logits.logsumexp(-1) * mask
        loss = per_token.sum() / mask.sum()
        if self.read_value and loss.item() > 1e9:
            loss = loss * 0
        return logits, loss


class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h, m):
        return h + torch.tanh(self.lin(h)) * m


@pytest.mark.parametrize("read_value", [False, True])
def test_a_suffix_with_a_tied_head_and_a_masked_loss_is_exact_replayed_or_not(read_value):
    torch.manual_seed(0)
    model = _TiedHead(read_value).double()
    ids = torch.randint(0, 20, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 3:] = 0  # padding: the loss and every block see the mask
    inputs = (ids, mask)
    chain = cut_module(model, (ids[:2], mask[:2]))
    calls: list[int] = []
    hook = nn.modules.module.register_module_forward_pre_hook(
        lambda mod, args: calls.append(1) if mod is model else None
    )
    try:
        for run in range(2):
            model.zero_grad(set_to_none=True)
            ref = model(*inputs)
            (ref[0].sum() + ref[1]).backward()
            ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            calls.clear()
            y = None
            outs = []
            for s, e in zip([0, 2, 3], [2, 3, chain.num_layers], strict=True):
                x = (
                    None
                    if y is None
                    else tuple(t.detach().requires_grad_(t.requires_grad) for t in y)
                )
                y = chain.stage_forward(s, e, x, inputs)
                outs.append((x, y))
            # the first stage calls the model; the last one when it records its suffix, or
            # on every micro-batch when a value read (loss.item()) keeps the model's forward
            assert len(calls) == (2 if run == 0 else 1 + read_value)
            (trace,) = chain._suffix_traces.values()
            assert (trace is None) == read_value
            torch.testing.assert_close(y[0], ref[0], rtol=0, atol=0)
            torch.testing.assert_close(y[1], ref[1], rtol=0, atol=0)
            grads = None
            for k in reversed(range(len(outs))):
                x, out = outs[k]
                if k == len(outs) - 1:
                    (out[0].sum() + out[1]).backward()
                else:
                    pairs = [(t, g) for t, g in zip(out, grads, strict=True) if g is not None]
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                grads = None if x is None else [t.grad for t in x]
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-12, atol=1e-14, msg=n)
    finally:
        hook.remove()


@pytest.mark.parametrize("functional", ["", "functional", "shared"])
def test_dropout_in_the_suffix_draws_as_in_the_whole_model(functional):
    # plan-invariant randomness keys a draw by its innermost module and its call number: a
    # dropout module of the suffix is replayed as a module call (the same draws); F.dropout
    # called in the forward itself, or a dropout module also called before the blocks, keeps
    # the model's forward
    from hetrain.runtime.randomness import InvariantRandomness

    torch.manual_seed(0)
    model = _TiedHead(False, dropout=0.5, functional=functional).double().train()
    ids = torch.randint(0, 20, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.long)
    inputs = (ids, mask)
    chain = cut_module(model, (ids[:2], mask[:2]))
    rng = InvariantRandomness(model, seed=3)
    rows = torch.arange(3)
    with rng.forward(step=1, sample_index=rows):
        ref = model(*inputs)[0]
    for _ in range(2):
        y = None
        for s, e in zip([0, 2], [2, chain.num_layers], strict=True):
            with rng.forward(step=1, sample_index=rows):
                y = chain.stage_forward(s, e, y, inputs)
        torch.testing.assert_close(y[0], ref, rtol=0, atol=0)
    (trace,) = chain._suffix_traces.values()
    assert (trace is None) == bool(functional)
    with torch.no_grad():
        assert not torch.equal(model.eval()(*inputs)[0], ref)  # dropout did draw
