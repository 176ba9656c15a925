"""Plan-invariant randomness (hetrain.runtime.randomness): a sample's dropout masks depend only on
(seed, step, sample, module path, call number), never on the micro-batch or the plan."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hetrain.errors import InputError
from hetrain.plan import plan_from_dict
from hetrain.runtime import OptimizerSpec, Worker, randomness
from hetrain.runtime.randomness import (
    InvariantRandomness,
    draw_key,
    draws_per_sample,
    keep_per_sample,
    keep_threshold,
    splitmix64,
    splitmix64_int,
    uniform_per_sample,
    words_per_sample,
)
from hetrain.runtime.testing import run_ranks


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def test_tensor_splitmix64_equals_the_integer_reference():
    values = [0, 1, 2**63 - 1, 2**63 + 5, 2**64 - 1, 0x123456789ABCDEF0]
    got = splitmix64(torch.tensor([_signed(v) for v in values], dtype=torch.int64)).tolist()
    assert got == [_signed(splitmix64_int(v)) for v in values]
    # published first outputs of splitmix64 seeded with 0 (state += golden gamma, then mix)
    assert splitmix64_int(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_uniform_draws_are_per_sample_and_uniform():
    key = draw_key(7, 3, "layers.1.dropout", 0)
    rows = torch.tensor([5, 9, 2])
    u = uniform_per_sample(key, rows, (3, 4, 5))
    # the same sample alone, or in another order, gets the same numbers
    assert torch.equal(uniform_per_sample(key, torch.tensor([9]), (1, 4, 5))[0], u[1])
    perm = uniform_per_sample(key, torch.tensor([2, 5]), (2, 4, 5))
    assert torch.equal(perm[0], u[2]) and torch.equal(perm[1], u[0])
    # flattened sample-major (B*T, H): sample s owns rows [s*T, (s+1)*T)
    flat = uniform_per_sample(key, rows, (12, 5))
    assert torch.equal(flat.reshape(3, 4, 5), u)
    big = uniform_per_sample(key, torch.arange(200), (200, 1000))
    assert big.min() >= 0 and big.max() < 1
    assert abs(big.mean().item() - 0.5) < 0.003  # 2e5 draws: sd of the mean 6.5e-4
    assert abs(big.var().item() - 1 / 12) < 0.002
    with pytest.raises(InputError, match="no sample dimension"):
        uniform_per_sample(key, rows, (4, 5))


def test_draws_follow_the_documented_formula():
    # Z(s, i) = splitmix64(splitmix64(key + s*phi) + (i+1)*phi'); of m draws per sample,
    # h = ceil(m/2): draw j < h is the high half of Z(s, j), draw j >= h the low half of
    # Z(s, j - h); u = V * 2^-32
    phi, phi2, m64 = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03, (1 << 64) - 1
    key = draw_key(3, 11, "transformer.h.0.attn", 2)
    rows = torch.tensor([0, 7, 2**40 + 3])
    for shape in [(3, 2, 3), (3, 7)]:  # m = 6 (h = 3) and m = 7 (h = 4, one half unused)
        m = shape[1] * (shape[2] if len(shape) > 2 else 1)
        h = (m + 1) // 2
        v = draws_per_sample(key, rows, shape).reshape(3, m)
        u = uniform_per_sample(key, rows, shape).reshape(3, m)
        for a, s in enumerate(rows.tolist()):
            k_s = splitmix64_int(key + s * phi)
            words = [splitmix64_int((k_s + (i + 1) * phi2) & m64) for i in range(h)]
            want = [words[j] >> 32 if j < h else words[j - h] & 0xFFFFFFFF for j in range(m)]
            assert v[a].tolist() == want
            assert u[a].tolist() == [w * 2.0**-32 for w in want]
            assert words_per_sample(key, rows, h)[a].tolist() == [_signed(w) for w in words]


def test_keep_mask_is_u_at_least_p_on_the_integers():
    key = draw_key(1, 2, "drop", 0)
    rows = torch.arange(4, 9)
    for shape in [(5, 7, 11), (5, 2, 4)]:  # odd and even draws per sample
        u = uniform_per_sample(key, rows, shape)
        grid = sorted(u.reshape(-1).tolist())
        # p on a drawn value (the boundary: u == p is kept), just above it, usual rates, 0
        for p in [grid[10], math.nextafter(grid[10], 1.0), grid[-1], 0.1, 0.5, 1 / 3, 0.9, 0.0]:
            keep = keep_per_sample(key, rows, shape, p)
            assert keep.dtype == torch.bool and keep.shape == shape
            assert torch.equal(keep, u >= p), p
        assert not keep_per_sample(key, rows, shape, 1.0).any()
    assert keep_threshold(1.0) == 1 << 32 and keep_threshold(0.0) == 0
    assert keep_threshold(0.5) == 1 << 31 and keep_threshold(2**-33) == 1
    # flattened (B*T, H) rows and another micro-batch composition give the sample's same mask
    u = uniform_per_sample(key, rows, (5, 7, 11))
    flat = keep_per_sample(key, rows, (35, 11), 0.3)
    assert torch.equal(flat.reshape(5, 7, 11), u >= 0.3)
    part = keep_per_sample(key, torch.tensor([8, 5]), (2, 7, 11), 0.3)
    assert torch.equal(part[0], flat.reshape(5, 7, 11)[4])
    assert torch.equal(part[1], flat.reshape(5, 7, 11)[1])
    big = keep_per_sample(key, torch.arange(100), (100, 1001), 0.1)
    assert abs(big.float().mean().item() - 0.9) < 0.004  # 1e5 draws: sd 9.5e-4


class _Net(nn.Module):
    """Dropout module, functional dropout called twice, feature dropout, SDPA with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.3)
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, T, 6)
        h = self.drop(self.inp(x))
        h = F.dropout(h, 0.2, self.training) + F.dropout(h, 0.1, self.training)
        h = F.dropout1d(h, 0.25, self.training)
        n, t = x.shape[:2]
        q, k, v = self.qkv(h).reshape(n, t, 2, 12).transpose(1, 2).chunk(3, -1)  # (N, 2, T, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4 if self.training else 0.0)
        return self.out(a.transpose(1, 2).reshape(n, t, 8))


def _run(net, rng, x, step, rows):
    with rng.forward(step=step, sample_index=rows):
        return net(x[rows])


def test_same_sample_same_masks_whatever_the_micro_batch():
    torch.manual_seed(0)
    net = _Net().double()
    rng = InvariantRandomness(net, seed=11)
    assert rng.is_active()
    x = torch.randn(7, 5, 6, dtype=torch.float64)
    full = _run(net, rng, x, 4, torch.arange(7))
    split = [_run(net, rng, x, 4, torch.arange(s, e)) for s, e in [(0, 3), (3, 4), (4, 7)]]
    torch.testing.assert_close(torch.cat(split), full, rtol=1e-12, atol=1e-14)
    # another composition and order: samples 6, 1 together
    odd = _run(net, rng, x, 4, torch.tensor([6, 1]))
    torch.testing.assert_close(odd, full[[6, 1]], rtol=1e-12, atol=1e-14)
    # the masks change with the step and the seed, and dropout is really on
    assert (_run(net, rng, x, 5, torch.arange(7)) - full).abs().max() > 1e-3
    other = InvariantRandomness(net, seed=12)
    assert (_run(net, other, x, 4, torch.arange(7)) - full).abs().max() > 1e-3
    net.eval()
    with torch.no_grad():
        assert (net(x) - full).abs().max() > 1e-3
    assert rng.problems == []


def test_masks_differ_across_samples_modules_and_calls_and_rate_is_right():
    rng = InvariantRandomness(nn.Identity(), seed=0, active=True)
    ones = torch.ones(2, 20000, dtype=torch.float64)
    with rng.forward(step=0, sample_index=torch.tensor([0, 1])):
        a = F.dropout(ones, 0.3)  # call 0 at the root
        b = F.dropout(ones, 0.3)  # call 1
    keep_a, keep_b = a > 0, b > 0
    assert not torch.equal(keep_a[0], keep_a[1])  # samples differ
    assert not torch.equal(keep_a, keep_b)  # call numbers differ
    rate = 1 - keep_a.double().mean().item()
    assert abs(rate - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 40000)
    torch.testing.assert_close(a[keep_a], torch.full_like(a[keep_a], 1 / 0.7))
    # two Dropout modules with the same p draw different masks (module paths differ)
    seq = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5))
    rng2 = InvariantRandomness(seq, seed=0)
    with rng2.forward(step=0, sample_index=torch.tensor([0, 1])):
        m0 = seq[0](ones) > 0
        m1 = seq[1](ones) > 0
    assert not torch.equal(m0, m1)
    # alpha dropout keeps mean 0 and variance 1 (SELU self-normalisation)
    z = torch.randn(4, 50000, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with rng.forward(step=1, sample_index=torch.arange(4)):
        y = F.alpha_dropout(z, 0.2, training=True)
    assert abs(y.mean().item()) < 0.02 and abs(y.var().item() - 1) < 0.03


def test_sdpa_with_dropout_is_invariant_and_has_the_right_gradient():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 5, 3, dtype=torch.float64, generator=g) for _ in range(3))
    mask = torch.rand(5, 5, generator=g) > 0.3
    mask.fill_diagonal_(True)
    rng = InvariantRandomness(nn.Identity(), seed=5, active=True)

    def attn(rows, qq, kk, vv):
        with rng.forward(step=2, sample_index=rows):
            return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, dropout_p=0.3)

    full = attn(torch.arange(4), q, k, v)
    part = attn(torch.tensor([2, 3]), q[2:], k[2:], v[2:])
    torch.testing.assert_close(part, full[2:], rtol=1e-12, atol=1e-14)
    # explicit reference with the same keep mask: softmax(qk^T/sqrt(d) + mask) * keep / 0.7 @ v
    key = draw_key(5, 2, "", 0)
    keep = uniform_per_sample(key, torch.arange(4), (4, 2, 5, 5)) >= 0.3
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(3)
    ref_w = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) * keep / 0.7
    torch.testing.assert_close(full, ref_w @ v, rtol=1e-12, atol=1e-14)
    # gradients: autograd through the same mask
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    attn(torch.arange(4), qs, ks, vs).pow(2).sum().backward()
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    sr = (qr @ kr.transpose(-1, -2)) / math.sqrt(3)
    w = torch.softmax(sr.masked_fill(~mask, float("-inf")), -1) * keep / 0.7
    (w @ vr).pow(2).sum().backward()
    for a, b in [(qs, qr), (ks, kr), (vs, vr)]:
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda qq: attn(torch.arange(2), qq, k[:2], v[:2]), (q[:2].clone().requires_grad_(),)
    )


def test_hf_gpt2_attention_dropout_is_invariant():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=32, n_positions=16, use_cache=False
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double().train()
    rng = InvariantRandomness(model, seed=1)
    x = torch.randint(0, 32, (5, 8), generator=torch.Generator().manual_seed(1))
    full = _run(model, rng, x, 0, torch.arange(5)).logits
    parts = [_run(model, rng, x, 0, torch.arange(s, e)).logits for s, e in [(0, 2), (2, 5)]]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-10, atol=1e-12)
    model.eval()
    with torch.no_grad():
        assert (model(x).logits - full).abs().max() > 1e-3
    assert rng.problems == []


class _Uncovered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + 0.01 * torch.rand_like(x)


def test_uncovered_random_ops_are_named():
    net = nn.Sequential(nn.Linear(4, 4), _Uncovered(), nn.Dropout(0.1))
    rng = InvariantRandomness(net, seed=0)
    x = torch.randn(3, 4)
    with rng.forward(step=0, sample_index=torch.arange(3)):
        net(x)
    assert rng.problems == ["1: rand_like draws random numbers hetrain cannot make plan-invariant"]
    # without any dropout the mode is off; the generator-state check still notices the draw
    quiet = nn.Sequential(nn.Linear(4, 4), _Uncovered())
    rng = InvariantRandomness(quiet, seed=0)
    assert not rng.is_active()
    with rng.forward(step=0, sample_index=torch.arange(3)):
        quiet(x)
    assert rng.problems and "does not intercept" in rng.problems[0]
    mha = nn.Sequential(nn.MultiheadAttention(4, 2, dropout=0.1))
    assert "nn.MultiheadAttention" in InvariantRandomness(mha).static_problems()[0]


def test_watch_checks_the_generator_as_an_inactive_forward_does():
    """``watch`` (the engine's micro-batch context while the mode is off) notices a draw
    from torch's global generator, records nothing for a forward that draws none, and
    nothing for a forward that raises (as ``forward``)."""
    x = torch.randn(3, 4)
    quiet = nn.Sequential(nn.Linear(4, 4), _Uncovered())
    rng = InvariantRandomness(quiet, seed=0)
    with rng.watch():
        quiet[0](x)
    assert rng.problems == []
    with pytest.raises(ZeroDivisionError), rng.watch():
        quiet(x)
        raise ZeroDivisionError
    assert rng.problems == []
    with rng.watch():
        quiet(x)
    assert len(rng.problems) == 1 and "does not intercept" in rng.problems[0]


# ------------------------------------------------------------------------------ engine level
STEPS = 3
BATCH = 24


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (N, T, 8)
        q, k, v = self.qkv(h).chunk(3, -1)
        return h + F.scaled_dot_product_attention(q, k, v, dropout_p=0.25 if self.training else 0)


def _dropout_chain() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.Dropout(0.3),
        _Attention(),
        nn.Sequential(nn.GELU(), nn.Dropout(0.2), nn.Linear(8, 8)),
        nn.Flatten(),
        nn.Linear(32, 5),
    )


def _data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(STEPS * BATCH, 4, 6, generator=g), torch.randint(
        0, 5, (STEPS * BATCH,), generator=g
    )


def _g(devices, stages, mb, batch):
    return {"devices": devices, "stages": stages, "microbatch_size": mb, "batch": batch}


SPEC = OptimizerSpec("sgd", lr=0.1, momentum=0.9)
PLANS = {
    "one": [_g(["w0"], [[0, 6]], 8, BATCH)],
    "dp-uneven": [
        _g(["w0"], [[0, 6]], 4, 10),
        _g(["w1"], [[0, 6]], 3, 7),
        _g(["w2"], [[0, 6]], 2, 4),
        _g(["w3"], [[0, 6]], 5, 3),
    ],
    "pipeline": [_g(["w0", "w1", "w2", "w3"], [[0, 1], [1, 3], [3, 4], [4, 6]], 5, BATCH)],
    "hybrid": [
        _g(["w2", "w0"], [[0, 3], [3, 6]], 3, 15),
        _g(["w1"], [[0, 6]], 9, 9),
        _g(["w3"], [[0, 6]], 4, 0),
    ],
}


def _train(rank, world, plan, change):
    torch.manual_seed(0)
    worker = Worker(
        _dropout_chain(),
        plan_from_dict({"groups": PLANS[plan]}),
        f"w{rank}",
        F.cross_entropy,
        SPEC,
        dtype=torch.float64,
        grad_clip_norm=0.5,
        seed=3,
    )
    x, y = _data()
    losses = []
    for t in range(STEPS):
        if change and t == 1:
            worker.apply_plan(plan_from_dict({"groups": PLANS[change]}))
        rows = slice(t * BATCH, (t + 1) * BATCH)
        losses.append(worker.step(x[rows].double(), y[rows], t).loss)
    return losses, worker.full_state_dict(), worker.randomness.problems


@pytest.mark.multiprocess
def test_dropout_chain_trains_like_one_process_under_every_plan(tmp_path):
    ref_losses, ref_state, problems = run_ranks(_train, 1, tmp_path / "one", args=("one", None))[0]
    assert problems == []
    # dropout is really on: the first loss differs from the same model without dropout
    torch.manual_seed(0)
    x, y = _data()
    plain = F.cross_entropy(_dropout_chain().double().eval()(x[:BATCH].double()), y[:BATCH])
    assert abs(plain.item() - ref_losses[0]) > 1e-4
    for plan, change in [("dp-uneven", None), ("pipeline", None), ("hybrid", "dp-uneven")]:
        out = run_ranks(_train, 4, tmp_path / plan, args=(plan, change))
        for losses, _, _ in out:
            torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=1e-12)
        state = out[0][1]
        assert state.keys() == ref_state.keys()
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-9, atol=1e-12)


def _uncovered(rank, world, exact):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Uncovered(), nn.Linear(4, 2))
    plan = {"groups": [_g(["w0"], [[0, 3]], 2, 4), _g(["w1"], [[0, 3]], 2, 4)]}
    worker = Worker(model, plan_from_dict(plan), f"w{rank}", F.cross_entropy, SPEC, exact=exact)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    try:
        worker.step(x, y, 0)
    except InputError as exc:
        return str(exc)
    return worker.step(x, y, 1).loss


@pytest.mark.multiprocess
def test_uncovered_random_op_warns_or_is_refused_with_exact(tmp_path, capfd):
    refused = run_ranks(_uncovered, 2, tmp_path / "exact", args=(True,), pg_timeout_s=20)
    for message in refused:  # every rank refuses (no hang), naming the op and module
        assert message.startswith("model: random op: 1: rand_like draws random numbers")
        assert message.endswith("(--exact)")
    warned = run_ranks(_uncovered, 2, tmp_path / "warn", args=(False,), pg_timeout_s=20)
    assert all(math.isfinite(loss) for loss in warned)
    err = capfd.readouterr().err
    # no dropout in the model, so the mode is off: the generator-state check finds the draw
    assert err.count("hetrain: warning: a random op hetrain does not intercept") == 2  # per rank


def test_worker_refuses_multihead_attention_dropout_with_exact(tmp_path):
    def fn(rank, world):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[1] = nn.Sequential(nn.Linear(4, 4))
        model.add_module("2", nn.TransformerEncoderLayer(4, 2, 8, dropout=0.1))
        plan = {"groups": [_g(["w0"], [[0, 3]], 2, 4)]}
        try:
            Worker(model, plan_from_dict(plan), "w0", F.mse_loss, SPEC, exact=True)
        except InputError as exc:
            return str(exc)
        return None

    message = run_ranks(fn, 1, tmp_path)[0]
    assert message is not None and "2.self_attn: nn.MultiheadAttention(dropout=0.1)" in message


def test_sdpa_causal_and_grouped_query_attention_with_dropout():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 6, 2, dtype=torch.float64, generator=g)
    k, v = (torch.randn(3, 2, 6, 2, dtype=torch.float64, generator=g) for _ in range(2))
    rng = InvariantRandomness(nn.Identity(), seed=9, active=True)
    with rng.forward(step=0, sample_index=torch.arange(3)):
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.5, is_causal=True, enable_gqa=True
        )
    keep = uniform_per_sample(draw_key(9, 0, "", 0), torch.arange(3), (3, 4, 6, 6)) >= 0.5
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    s = (q @ kk.transpose(-1, -2) / math.sqrt(2)).masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(
        out, (torch.softmax(s, -1) * keep / 0.5) @ vv, rtol=1e-12, atol=1e-14
    )


def _keep_reference(key: int, rows: list[int], shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The documented definition, one sample and one element at a time on Python ints:
    ``V(s, j)`` = high half of ``Z(j)`` for ``j < h``, low half of ``Z(j - h)`` otherwise, with
    ``Z(i) = splitmix64(k_s + (i + 1) φ')``, ``k_s = splitmix64(key + s φ)``; kept when
    ``V >= ceil(p 2^32)``."""
    n = len(rows)
    m = math.prod(shape) // n
    h = (m + 1) // 2
    threshold = keep_threshold(p)
    out = []
    for s in rows:
        ks = splitmix64_int(key + s * 0x9E3779B97F4A7C15)
        words = [splitmix64_int(ks + (i + 1) * 0xD1B54A32D192ED03) for i in range(h)]
        draws = [w >> 32 for w in words] + [w & 0xFFFFFFFF for w in words[: m - h]]
        out.append([d >= threshold for d in draws])
    return torch.tensor(out, dtype=torch.bool).reshape(shape)


@settings(max_examples=80, deadline=None)
@given(
    key=st.integers(0, 2**64 - 1),
    rows=st.lists(st.integers(0, 10**6), min_size=1, max_size=5, unique=True),
    per_row=st.sampled_from([1, 2, 3]),
    inner=st.integers(1, 13),
    p=st.sampled_from([0.0, 0.1, 1 / 3, 0.5, 0.9, 2**-33, 1 - 2**-30]),
    block=st.sampled_from([1, 2, 5, 16, 1 << 16]),
)
def test_blocked_keep_masks_equal_the_per_sample_definition(key, rows, per_row, inner, p, block):
    # keep_per_sample draws every sample of the micro-batch at once, in blocks of words
    # (whole samples, or pieces of one sample when a sample has more words than a block)
    shape = (len(rows) * per_row, inner)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(randomness, "KEEP_BLOCK_WORDS", block)
        got = keep_per_sample(key, torch.tensor(rows), shape, p)
    assert torch.equal(got, _keep_reference(key, rows, shape, p))
    assert torch.equal(got, uniform_per_sample(key, torch.tensor(rows), shape) >= p)


def _sdpa_reference(q, k, v, mask, p, causal, scale, keep, gqa):
    """ATen's math kernel with the same explicit keep mask (the reference the fused kernels
    are tested against; it takes a bool mask as SDPA's front end converts it)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=q.dtype).masked_fill(mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, mask, p, causal, keep, scale=scale, enable_gqa=gqa
    )[0]


@pytest.mark.parametrize(
    "lead, heads, kv_heads, length, source, mask_kind, causal, scale, p",
    [
        ((3,), 4, 2, 5, 5, None, True, None, 0.3),  # Llama: grouped-query, causal
        ((3,), 4, 4, 5, 5, None, False, 0.7, 0.1),
        ((2,), 2, 1, 4, 6, "bool", False, None, 0.5),  # a row masked entirely: weights 0
        ((2,), 3, 3, 6, 4, "float", False, None, 0.25),  # learned bias (gets a gradient)
        ((2,), 2, 2, 6, 3, None, True, None, 0.4),  # causal with L > S
        ((2, 3), 2, 2, 4, 4, "bool", False, None, 0.2),  # two leading dims
        ((4,), None, None, 3, 5, "float", False, None, 0.6),  # (N, L, E): no head dim
    ],
)
def test_sdpa_dropout_equals_the_math_kernel_with_the_same_keep_mask(
    lead, heads, kv_heads, length, source, mask_kind, causal, scale, p
):
    g = torch.Generator().manual_seed(len(lead) + length + source)
    qh = () if heads is None else (heads,)
    kh = () if kv_heads is None else (kv_heads,)
    q = torch.randn(*lead, *qh, length, 3, dtype=torch.float64, generator=g)
    k = torch.randn(*lead, *kh, source, 3, dtype=torch.float64, generator=g)
    v = torch.randn(*lead, *kh, source, 2, dtype=torch.float64, generator=g)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(length, source, generator=g) > 0.4
        mask[0] = False
    elif mask_kind == "float":
        mask = torch.randn(length, source, dtype=torch.float64, generator=g)
        mask[1, 0] = float("-inf")
    gqa = heads != kv_heads
    n = lead[0]
    rng = InvariantRandomness(nn.Identity(), seed=4, active=True)
    keep = keep_per_sample(draw_key(4, 1, "", 0), torch.arange(n), (*q.shape[:-1], source), p)

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        m = mask.clone().requires_grad_(True) if mask_kind == "float" else mask
        out = fn(*leaves, m)
        out.pow(2).sum().backward()
        return [out] + [t.grad for t in leaves] + ([m.grad] if mask_kind == "float" else [])

    def ours(qq, kk, vv, m):
        with rng.forward(step=1, sample_index=torch.arange(n)):
            return F.scaled_dot_product_attention(
                qq, kk, vv, m, p, causal, scale=scale, enable_gqa=gqa
            )

    got = grads(ours)
    want = grads(lambda qq, kk, vv, m: _sdpa_reference(qq, kk, vv, m, p, causal, scale, keep, gqa))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    if mask_kind == "bool":
        assert torch.all(got[0][..., 0, :] == 0)  # the query row that sees no key


def test_sdpa_dropout_one_gives_zeros_as_torch():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 3, 2, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 3, 2, dtype=torch.float64, generator=g) for _ in range(2))
    rng = InvariantRandomness(nn.Identity(), seed=0, active=True)
    # torch's SDPA gives zeros for dropout_p = 1 (ATen's dropout returns input * 0), not NaN
    with rng.forward(step=0, sample_index=torch.arange(2)):
        zero = F.scaled_dot_product_attention(q, q, q, None, 1.0)
        grouped = F.scaled_dot_product_attention(q, k, v, None, 1.0, enable_gqa=True)
    assert torch.equal(zero, torch.zeros_like(q))
    assert torch.equal(grouped, torch.zeros_like(q))
    assert torch.equal(zero, F.scaled_dot_product_attention(q, q, q, None, 1.0))  # torch's own
