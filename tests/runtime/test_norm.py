"""BatchNorm with a norm block (hetrain.runtime.norm): ghost batch norm over aligned blocks of G
samples of the global batch, running statistics updated once per step from the pooled block
statistics; equal to a direct single-process computation and to workers=1 under every plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetrain.errors import InputError
from hetrain.plan import plan_from_dict
from hetrain.runtime import OptimizerSpec, Worker
from hetrain.runtime.norm import NormBlocks, check_plan_norm_block
from hetrain.runtime.testing import run_ranks


def _reference_ghost(x, weight, bias, eps, g):
    """Blocks of G consecutive samples, each normalised with torch's own F.batch_norm."""
    out = [
        F.batch_norm(x[s : s + g], None, None, weight, bias, training=True, eps=eps)
        for s in range(0, x.shape[0], g)
    ]
    c = x.shape[1]
    xb = x.reshape(x.shape[0] // g, g, c, -1).transpose(1, 2).reshape(-1, c, g * x[0, 0].numel())
    mean = x.transpose(0, 1).reshape(c, -1).mean(1)
    within = (xb - xb.mean(-1, keepdim=True)).pow(2).sum(-1).reshape(-1, c).sum(0)
    count = x.numel() // c
    var = within / (count - x.shape[0] // g)  # pooled within-block, unbiased
    return torch.cat(out), mean, var


@pytest.mark.parametrize("dims", [1, 2])
def test_ghost_batchnorm_equals_blocks_of_the_global_batch_for_any_micro_batching(dims):
    g = torch.Generator().manual_seed(0)
    shape = (24, 3) if dims == 1 else (24, 3, 4, 5)
    x = torch.randn(*shape, dtype=torch.float64, generator=g) * 2 + 1
    bn_cls = nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d
    torch.manual_seed(0)
    proto = bn_cls(3, momentum=0.2).double()
    with torch.no_grad():
        proto.weight.uniform_(0.5, 1.5)
        proto.bias.uniform_(-0.5, 0.5)
        proto.running_mean.fill_(0.3)
    ref_y, mean, var = _reference_ghost(x, proto.weight, proto.bias, proto.eps, 4)
    ref_rm = 0.8 * 0.3 + 0.2 * mean
    ref_rv = 0.8 * 1.0 + 0.2 * var
    for splits in [[(0, 24)], [(0, 8), (8, 20), (20, 24)], [(i, i + 4) for i in range(0, 24, 4)]]:
        bn = bn_cls(3, momentum=0.2).double()
        bn.load_state_dict(proto.state_dict())
        norm = NormBlocks(bn, 4)
        parts = []
        for s, e in splits:
            with norm.forward():
                parts.append(bn(x[s:e]))
        # before the step end the running statistics are untouched
        torch.testing.assert_close(bn.running_mean, proto.running_mean, rtol=0, atol=0)
        norm.apply_step([bn], norm.step_tensor([bn], active=True))
        torch.testing.assert_close(torch.cat(parts), ref_y, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(bn.running_mean, ref_rm, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(bn.running_var, ref_rv, rtol=1e-9, atol=1e-12)
        assert int(bn.num_batches_tracked) == 1  # once per step, not per micro-batch
        assert "forward" not in vars(bn)  # the ghost forward is removed after the context
    # the step statistics of two halves (two groups), summed, give the same update
    bns = [bn_cls(3, momentum=0.2).double() for _ in range(2)]
    norms = [NormBlocks(b, 4) for b in bns]
    for b, n, (s, e) in zip(bns, norms, [(0, 12), (12, 24)], strict=True):
        b.load_state_dict(proto.state_dict())
        with n.forward():
            b(x[s:e])
    total = sum(n.step_tensor([b], active=True) for b, n in zip(bns, norms, strict=True))
    for b, n in zip(bns, norms, strict=True):
        n.apply_step([b], total)
        torch.testing.assert_close(b.running_var, ref_rv, rtol=1e-9, atol=1e-12)
    # G = B is torch's BatchNorm on the whole batch, running statistics included
    bn, plain = bn_cls(3).double(), bn_cls(3).double()
    norm = NormBlocks(bn, 24)
    with norm.forward():
        y = bn(x)
    norm.apply_step([bn], norm.step_tensor([bn], active=True))
    torch.testing.assert_close(y, plain(x), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(bn.running_var, plain.running_var, rtol=1e-9, atol=1e-12)
    # eval mode uses the running statistics as usual
    bn.eval()
    with norm.forward():
        torch.testing.assert_close(bn(x), plain.eval()(x), rtol=1e-12, atol=1e-12)


def test_gradients_flow_through_the_block_statistics():
    x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    bn = nn.BatchNorm1d(3).double()
    norm = NormBlocks(bn, 4)

    def f(inp):
        with norm.forward():
            return bn(inp)

    assert torch.autograd.gradcheck(f, (x.clone().requires_grad_(),))
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    (f(xs) * torch.arange(24.0).reshape(8, 3)).sum().backward()
    ref = torch.cat([F.batch_norm(xr[i : i + 4], None, None, training=True) for i in (0, 4)])
    (ref * torch.arange(24.0).reshape(8, 3)).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-9, atol=1e-12)


def test_norm_block_checks():
    check_plan_norm_block([(0, 8, 4), (1, 0, 3), (2, 12, 6)], 2)  # idle groups are free
    with pytest.raises(InputError, match=r"plan: groups\[1\]: share 6 and micro-batch size 3"):
        check_plan_norm_block([(0, 8, 4), (1, 6, 3)], 2)
    with pytest.raises(InputError, match="--norm-block"):
        NormBlocks(nn.BatchNorm1d(2), 0)
    bn = nn.BatchNorm1d(2)
    with (
        pytest.raises(InputError, match="micro-batch of 6 rows is not a multiple"),
        NormBlocks(bn, 4).forward(),
    ):
        bn(torch.randn(6, 2))
    assert "depend on the plan" in NormBlocks(nn.Sequential(bn), None).startup_message()
    assert NormBlocks(nn.Sequential(bn), 2).startup_message() is None
    assert NormBlocks(nn.Linear(2, 2), None).startup_message() is None


# ------------------------------------------------------------------------------ engine level
STEPS = 3
BATCH = 24
SPEC = OptimizerSpec("sgd", lr=0.05, momentum=0.9)


def _bn_chain() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 16),
        nn.Sequential(nn.BatchNorm1d(16, momentum=None), nn.ReLU()),
        nn.Linear(16, 5),
    )


def _data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(STEPS * BATCH, 2, 4, 4, generator=g)
    return x, torch.randint(0, 5, (STEPS * BATCH,), generator=g)


def _g(devices, stages, mb, batch):
    return {"devices": devices, "stages": stages, "microbatch_size": mb, "batch": batch}


PLANS = {  # G = 2: every share and micro-batch size is even
    "one": [_g(["w0"], [[0, 7]], 8, BATCH)],
    "dp-uneven": [
        _g(["w0"], [[0, 7]], 4, 10),
        _g(["w1"], [[0, 7]], 2, 6),
        _g(["w2"], [[0, 7]], 6, 6),
        _g(["w3"], [[0, 7]], 2, 2),
    ],
    "pipeline": [_g(["w0", "w1", "w2", "w3"], [[0, 2], [2, 4], [4, 6], [6, 7]], 4, BATCH)],
    "hybrid": [
        _g(["w3", "w1"], [[0, 4], [4, 7]], 2, 14),
        _g(["w0"], [[0, 7]], 10, 10),
        _g(["w2"], [[0, 7]], 4, 0),
    ],
}


def _train(rank, world, plan, change, norm_block):
    torch.manual_seed(0)
    worker = Worker(
        _bn_chain(),
        plan_from_dict({"groups": PLANS[plan]}),
        f"w{rank}",
        F.cross_entropy,
        SPEC,
        dtype=torch.float64,
        grad_clip_norm=0.5,
        norm_block=norm_block,
    )
    x, y = _data()
    losses = []
    for t in range(STEPS):
        if change and t == 1:
            worker.apply_plan(plan_from_dict({"groups": PLANS[change]}))
        rows = slice(t * BATCH, (t + 1) * BATCH)
        losses.append(worker.step(x[rows].double(), y[rows], t).loss)
    return losses, worker.full_state_dict()


@pytest.mark.multiprocess
def test_batchnorm_chain_with_norm_block_trains_like_one_process(tmp_path):
    ref_losses, ref_state = run_ranks(_train, 1, tmp_path / "one", args=("one", None, 2))[0]
    assert int(ref_state["1.num_batches_tracked"]) == STEPS
    assert ref_state["1.running_mean"].abs().max() > 1e-3  # the running stats moved
    for plan, change in [("dp-uneven", None), ("pipeline", None), ("hybrid", "dp-uneven")]:
        out = run_ranks(_train, 4, tmp_path / plan, args=(plan, change, 2))
        for losses, _ in out:
            torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=1e-12)
        state = out[0][1]
        assert state.keys() == ref_state.keys()
        for key in ref_state:  # weights and BatchNorm running statistics
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-9, atol=1e-12)


def _per_microbatch(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    plan = {"groups": [_g(["w0"], [[0, 2]], 4, 8), _g(["w1"], [[0, 2]], 4, 4)]}
    worker = Worker(model, plan_from_dict(plan), f"w{rank}", F.mse_loss, SPEC, dtype=torch.float64)
    x = torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    worker.step(x, torch.zeros(12, 3, dtype=torch.float64), 0)
    return {k: v for k, v in worker.layers[1].state_dict().items()}


@pytest.mark.multiprocess
def test_without_norm_block_running_stats_are_averaged_over_replicas(tmp_path, capfd):
    out = run_ranks(_per_microbatch, 2, tmp_path)
    assert capfd.readouterr().err.count("no --norm-block: batch statistics are per micro") == 1
    # reference: w0 ran micro-batches [0, 4) and [4, 8) (two updates), w1 ran [8, 12)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).double()
    x = torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    replicas = []
    for parts in [[(0, 4), (4, 8)], [(8, 12)]]:
        bn = nn.BatchNorm1d(3).double()
        for s, e in parts:
            bn(model[0](x[s:e]))
        replicas.append(bn)
    for state in out:
        for key in ("running_mean", "running_var"):
            expected = (getattr(replicas[0], key) + getattr(replicas[1], key)) / 2
            torch.testing.assert_close(state[key], expected, rtol=1e-9, atol=1e-12)
        assert int(state["num_batches_tracked"]) == 2  # round((2 + 1) / 2)


def test_hf_resnet_ghost_batchnorm_is_plan_invariant():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3
    )
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(cfg).double().train()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    runs = []
    for splits in [[(0, 8)], [(0, 2), (2, 8)], [(0, 4), (4, 6), (6, 8)]]:
        model.load_state_dict(start)
        norm = NormBlocks(model, 2)
        parts = []
        for s, e in splits:
            with norm.forward():
                parts.append(model(x[s:e]).logits)
        norm.apply_step([model], norm.step_tensor([model], active=True))
        runs.append((torch.cat(parts), {k: v.clone() for k, v in model.state_dict().items()}))
    for out, state in runs[1:]:
        torch.testing.assert_close(out, runs[0][0], rtol=1e-9, atol=1e-12)
        for key, value in state.items():
            torch.testing.assert_close(value, runs[0][1][key], rtol=1e-9, atol=1e-12)
    moved = [k for k in start if "running_var" in k and not torch.equal(start[k], runs[0][1][k])]
    assert len(moved) == len(NormBlocks(model, 2).modules) == 6  # stem, 2 basic blocks, shortcut
