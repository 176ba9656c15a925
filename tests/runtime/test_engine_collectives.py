"""The engine's per-step collectives (docs/runtime.md "Per-step collectives"): a pure
data-parallel step runs the bucketed gradient all-reduce and nothing else (the loss, the item
count of a ``(sum, count)`` loss and the callers' report rows ride in it, the clipping norm is
computed locally); a pipeline without clipping reports its sums a step late through the
process group's store (no collective); both train exactly like one process (gloo, forked
ranks, float64)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetrain.plan import plan_from_dict
from hetrain.runtime import OptimizerSpec, Worker
from hetrain.runtime.optim import set_lr
from hetrain.runtime.testing import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 4
BATCH = 12
CLIP = 0.05
SPEC = OptimizerSpec("adamw", lr=1e-2, weight_decay=0.01)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5)
    ).double()


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS * BATCH, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (STEPS * BATCH,), generator=g)
    return x, y


def _masked_sum(out: torch.Tensor, target: torch.Tensor):
    """A ``(sum, count)`` loss: samples with an even target count, odd ones are masked out."""
    keep = target % 2 == 0
    losses = F.cross_entropy(out, target, reduction="none")
    return (losses * keep).sum(), keep.sum()


def _reference(loss_name: str, clip: float | None):
    model = _model()
    opt = SPEC.build(model.parameters())
    x, y = _data()
    losses, norms = [], []
    for t in range(STEPS):
        rows = slice(t * BATCH, (t + 1) * BATCH)
        opt.zero_grad(set_to_none=True)
        out = model(x[rows])
        if loss_name == "sum":
            total, count = _masked_sum(out, y[rows])
            loss = total / count
        else:
            loss = F.cross_entropy(out, y[rows])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))
        set_lr(opt, SPEC.lr_at(t))
        opt.step()
        losses.append(loss.item())
        norms.append(float(norm))
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}


def _rank(rank, world, plan, loss_name, clip):
    calls: list[tuple[str, int]] = []
    originals = {}
    names = (
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "broadcast",
        "barrier",
        "isend",
        "irecv",
        "recv",
    )
    for name in names:
        originals[name] = getattr(dist, name)

        def counted(*args, _name=name, **kwargs):
            group = kwargs.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            calls.append((_name, size))
            return originals[_name](*args, **kwargs)

        setattr(dist, name, counted)
    loss_fn = _masked_sum if loss_name == "sum" else F.cross_entropy
    worker = Worker(
        _model(),
        plan_from_dict(plan),
        f"w{rank}",
        loss_fn,
        SPEC,
        grad_clip_norm=clip,
        dtype=torch.float64,
    )
    x, y = _data()
    results, per_step_calls = [], []
    for t in range(STEPS):
        calls.clear()
        rows = slice(t * BATCH, (t + 1) * BATCH)
        result = worker.step(x[rows], y[rows], t, report=lambda t=t: [rank * 10.0 + t, 1.0])
        per_step_calls.append(list(calls))
        results.append(result)
    late = [r.late for r in results]
    losses = [r.loss for r in results]  # waits for the last late sums
    norms = [r.grad_norm for r in results]
    reports = [r.report for r in results]
    for name, fn in originals.items():
        setattr(dist, name, fn)
    return late, losses, norms, reports, per_step_calls, worker.full_state_dict()


def _dp(world: int) -> dict:
    shares = [5, 4, 3][:world]
    return {
        "groups": [
            {"devices": [f"w{r}"], "stages": [[0, 5]], "microbatch_size": 2, "batch": b}
            for r, b in enumerate(shares)
        ]
    }


PIPE = {
    "schedule": "1f1b",
    "groups": [
        {
            "devices": ["w0", "w1", "w2"],
            "stages": [[0, 2], [2, 4], [4, 5]],
            "microbatch_size": 3,
            "batch": BATCH,
        }
    ],
}


def _ragged(mb: int) -> dict:
    return {**PIPE, "groups": [{**PIPE["groups"][0], "microbatch_size": mb}]}


def _check_training(out, loss_name, clip):
    losses, norms, state = _reference(loss_name, clip)
    for _, got_losses, got_norms, _, _, _ in out:
        assert got_losses == pytest.approx(losses, rel=1e-9, abs=1e-12)
        assert got_norms == pytest.approx(norms, rel=1e-9, abs=1e-12)
    final = out[0][5]
    for key, value in state.items():
        torch.testing.assert_close(final[key], value, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("loss_name", ["mean", "sum"])
def test_data_parallel_step_runs_the_gradient_all_reduce_only(tmp_path, loss_name):
    world = 3
    out = run_ranks(_rank, world, tmp_path, args=(_dp(world), loss_name, CLIP))
    _check_training(out, loss_name, CLIP)
    for rank, (late, _, _, reports, calls, _) in enumerate(out):
        assert late == [False] * STEPS
        # one bucket (the model is far below the 64 MiB cap): one all-reduce among the 3
        # ranks per step, nothing else (the old engine added a world all-reduce of the loss)
        for step_calls in calls:
            assert step_calls == [("all_reduce", world)], (rank, step_calls)
        for t, rows in enumerate(reports):
            assert rows == [[r * 10.0 + t, 1.0] for r in range(world)]


def test_pipeline_without_clipping_reports_a_step_late(tmp_path):
    world = 3
    out = run_ranks(_rank, world, tmp_path, args=(PIPE, "mean", None))
    _check_training(out, "mean", None)
    for late, _, _, reports, calls, _ in out:
        # the first step tells every rank the loss kind (blocking); then the sums travel
        # through the store, read at the end of the next step: no collective at all, the
        # pipeline's messages only
        assert late == [False] + [True] * (STEPS - 1)
        for step_calls in calls[1:]:
            assert [c for c in step_calls if c[0] not in ("isend", "irecv", "recv")] == []
        for t, rows in enumerate(reports):
            assert rows == [[r * 10.0 + t, 1.0] for r in range(world)]


def test_pipeline_with_clipping_combines_the_norm_before_the_step(tmp_path):
    world = 3
    out = run_ranks(_rank, world, tmp_path, args=(PIPE, "sum", CLIP))
    _check_training(out, "sum", CLIP)
    for late, *_ in out:
        assert late == [False] * STEPS


@pytest.mark.parametrize("microbatch", [3, 5])
def test_pipeline_sends_one_message_per_activation_and_gradient(tmp_path, microbatch):
    """Once the link's message description is known (after the first step), a stage sends one
    message per activation and one per gradient (torch's pipelining sends the same); a ragged
    last micro-batch (12 = 5 + 5 + 2) changes the description and back within each step and
    still trains exactly (the old format sent a header and a payload per tensor and a
    structure message per tree: 20 messages a step on the middle stage here). Every message of
    a known size is received through a receive posted ahead (``irecv``, stages.P2P.post_recv:
    gloo sends a payload only once its receive is posted); only a changed description's
    counts, headers and data are received blocking."""
    world = 3
    out = run_ranks(_rank, world, tmp_path, args=(_ragged(microbatch), "mean", None))
    _check_training(out, "mean", None)
    n = -(-BATCH // microbatch)
    per_change = 4  # a flagged message, the description's counts, its headers, the data
    for rank, (_, _, _, _, calls, _) in enumerate(out):
        for step_calls in calls[1:]:
            sends = sum(1 for c in step_calls if c[0] == "isend")
            posted = sum(1 for c in step_calls if c[0] == "irecv")
            blocking = sum(1 for c in step_calls if c[0] == "recv")
            # forward messages to the next stage, gradients to the previous one
            steady = n * ((rank < world - 1) + (rank > 0))
            extra = 0
            if microbatch == 5:  # the smaller last micro-batch and the first of the next step
                changes = 2 * ((rank < world - 1) + (rank > 0))
                extra = changes * (per_change - 1)
            assert (sends, posted, blocking) == (steady + extra, steady, extra), (
                rank,
                sends,
                posted,
                blocking,
            )


def _where_sums_are_read(rank, world):
    """Per step: whether this rank read the previous step's late sums inside its stage's
    schedule (``run_stage``) or after it."""
    import hetrain.runtime.engine as engine
    from hetrain.runtime.step_result import StoreSums

    state = {"in_stage": False, "reads": []}
    run_stage, fetch = engine.run_stage, StoreSums.fetch

    def staged(**kwargs):
        state["in_stage"] = True
        try:
            return run_stage(**kwargs)
        finally:
            state["in_stage"] = False

    def read(self, step, length):
        state["reads"].append(state["in_stage"])
        return fetch(self, step, length)

    engine.run_stage, StoreSums.fetch = staged, read
    worker = Worker(
        _model(), plan_from_dict(PIPE), f"w{rank}", F.cross_entropy, SPEC, dtype=torch.float64
    )
    x, y = _data()
    reads = []
    for t in range(STEPS):
        state["reads"].clear()
        rows = slice(t * BATCH, (t + 1) * BATCH)
        worker.step(x[rows], y[rows], t)
        reads.append(list(state["reads"]))
    engine.run_stage, StoreSums.fetch = run_stage, fetch
    return reads


def test_pipeline_stages_read_late_sums_while_waiting_for_their_first_gradient(tmp_path):
    """The previous step's sums are read once per step: inside the schedule (while the
    stage waits for its first gradient, off the step's tail) on every stage that receives
    gradients, at the step's end on the last stage."""
    world = 3
    out = run_ranks(_where_sums_are_read, world, tmp_path)
    for rank, reads in enumerate(out):
        # step 0 combines its sums blocking (the loss kind is not known yet); step 1's are
        # the first late ones, read during step 2
        assert reads[:2] == [[], []], (rank, reads)
        assert reads[2:] == [[rank < world - 1]] * (STEPS - 2), (rank, reads)
