"""``hetrain train --workers 1`` on Hugging Face GPT-2 tiny and Llama tiny vs a plain PyTorch loop
on the same model and data, iterations per second side by side in one run (target: hetrain >=
0.95x); and the cost of cutting: Llama tiny on a 4-stage pipeline, the sum over its stages of
the compute time of one step's micro-batches vs the same micro-batches through the whole model
(target <= 1.10x).

Both loops train ``GPT2LMHeadModel`` (tiny config, tied head) or ``LlamaForCausalLM`` (tiny:
4 layers, 64 wide, 4 query and 2 key/value heads, rotary embeddings; ``models/hf.py``), dropout
0.1 or ``--dropout``, from the same seed on the same global batches of the ``gpt2`` example
(bytes of ``pydoc_data.topics``, context 64, the deterministic sampler), AdamW with the
example's learning rate, clipping at 1.0, one torch thread, in this process:

- ``plain``: fetch the batch, ``model(x)``, cross-entropy, ``backward``, ``clip_grad_norm_``,
  ``step``;
- ``hetrain``: :func:`hetrain.runtime.worker_main.run_worker` (the per-rank loop of ``hetrain
  train --workers 1``, a one-rank gloo group): the engine's cut model (one stage spanning every
  layer), plan-invariant dropout, metrics.

The two run in lockstep, so that both see the same machine load (this machine is shared): when
hetrain's loop fetches the batch of step ``k`` from the task's training source, the source first
runs step ``k`` of the plain loop and times it. hetrain's step ``k`` is then the time from the
end of that plain step to the next fetch: its whole loop (data, engine step, metrics line).
Iterations per second over steps ``warmup .. steps - 2`` (hetrain's last step, which also
gathers the run's timeline, is left out), wall clock (the target) and this thread's CPU time
(``time.thread_time``, printed too); ``--repeats`` fresh runs: the ratio is the median of the
repeats' ratios (hetrain / plain within a repeat), the rates the medians. One JSON line per
model: ``{"model", "plain_it_s", "hetrain_it_s", "ratio", "cpu_ratio", "dropout", "load",
"pass"}``.

The cost of cutting (``--part cutting``), in this process, no ranks: the cut Llama tiny
(``cut_module``, default blocks: prefix, 4 decoder layers, suffix), stages ``[0, 2), [2, 3),
[3, 4), [4, 6)`` (first: embedding and layer 0; last: layer 3 and the head); per repeat, one
global batch of 32 in micro-batches of 8, alternately (a) each micro-batch through the whole
model (forward, loss, backward: what ``--workers 1`` computes) and (b) each micro-batch stage by
stage (which of the two runs first alternates from one micro-batch to the next): each stage's
``stage_forward`` on what the previous one sent (detached, as received; the two middle stages,
blocks only, call their blocks directly, and the last stage calls its block and then replays
its recorded suffix, docs/runtime.md "Any model"; the warm-up repeat records it), then the backward
stage by stage with the gradients the next stage returned; the compute time of
(b) is the sum of every stage's forward and backward time (what the stages' engine timers
measure), without messages. The ratio (b)/(a) of wall-clock times (the target) is the median
of the repeats' ratios; the same ratio of this thread's CPU time is printed too. JSON line:
``{"model": "llama-cutting", "whole_s", "stages_s", "ratio", "cpu_ratio", "load", "pass"}``.

Usage: ``.venv/bin/python bench/hf_workers1.py [--part all|workers1|cutting] [--model
all|gpt2|llama] [--steps 40] [--warmup 5] [--repeats 3] [--dropout 0.1]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from hetrain.models.hf import gpt2_model, llama_model
from hetrain.runtime.api import RunConfig, build_job
from hetrain.runtime.data import HF_CONTEXT, GlobalBatchSampler, example_task, lm_loss
from hetrain.runtime.worker_main import lr_multiplier, run_worker

TARGET = 0.95
CUTTING_TARGET = 1.10


def _clocks() -> np.ndarray:
    return np.array([time.perf_counter(), time.thread_time()])


class _Lockstep:
    """hetrain's training source: before the batch of the loop's step ``k`` (the sampler's
    indices of step ``k``; the start-up's smaller fetches pass through) it runs ``plain_step(k)``;
    keeps ``(wall_s, cpu_s)`` per step of both loops."""

    def __init__(self, source, sampler, steps: int, plain_step: Callable[[int], None]) -> None:
        self.source = source
        self.sampler = sampler
        self.steps = steps
        self.plain_step = plain_step
        self.plain: list[np.ndarray] = []
        self.hetrain: list[np.ndarray] = []
        self._mark: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.source)

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def batch(self, indices):
        k = len(self.plain)
        if k < self.steps and np.array_equal(np.asarray(indices), self.sampler.indices(k)):
            start = _clocks()
            if self._mark is not None:
                self.hetrain.append(start - self._mark)
            self.plain_step(k)
            self._mark = _clocks()
            self.plain.append(self._mark - start)
        return self.source.batch(indices)


def plain_loop(task, job) -> Callable[[int], None]:
    """Step ``k`` of a plain PyTorch loop (no hetrain code in it), as a function."""
    torch.manual_seed(job.seed)
    model = task.build_model()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=job.weight_decay)
    factor = lr_multiplier(job)
    sampler = GlobalBatchSampler(len(task.train), job.batch, job.seed)

    def step(k: int) -> None:
        x, y = task.train.batch(sampler.indices(k))
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = job.lr * factor(k)
        opt.step()

    return step


def side_by_side(task, steps: int, warmup: int, folder: str) -> tuple[np.ndarray, np.ndarray]:
    """``(plain, hetrain)`` iterations per ``[wall, CPU]`` second, run in lockstep."""
    config = RunConfig(workers=1, steps=steps, metrics_out=os.path.join(folder, "m.jsonl"),
                       run_dir=folder)  # fmt: skip
    job = dataclasses.replace(build_job(task, config), adaptive=False)
    sampler = GlobalBatchSampler(len(task.train), job.batch, job.seed)
    source = _Lockstep(task.train, sampler, steps, plain_loop(task, job))
    job = dataclasses.replace(job, task=dataclasses.replace(job.task, train=source))
    store = dist.FileStore(os.path.join(folder, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        run_worker(job, num_threads=1)
    finally:
        dist.destroy_process_group()
    if len(source.hetrain) != steps - 1:
        raise RuntimeError(f"timed {len(source.hetrain)} hetrain steps, expected {steps - 1}")
    window = slice(warmup, steps - 1)
    n = steps - 1 - warmup
    return n / np.sum(source.plain[window], axis=0), n / np.sum(source.hetrain[window], axis=0)


def cutting_cost(repeats: int, dropout: float) -> tuple[float, float, float, float]:
    """Median over ``repeats`` of ``(whole_s, stages_s, stages_s / whole_s, the same ratio
    of this thread's CPU time)``: the compute time of one global batch of Llama tiny through
    the whole model and through its 4 stages (module docstring)."""
    from torch.utils._pytree import tree_flatten

    from hetrain.runtime.cutting import cut_module

    task = example_task("gpt2", "tiny")
    torch.manual_seed(0)
    model = llama_model("tiny", dropout, HF_CONTEXT)
    sampler = GlobalBatchSampler(len(task.train), 32, 0)
    chain = cut_module(model, task.train.batch(sampler.indices(0))[0][:2])
    cuts = [0, 2, 3, 4, chain.num_layers]
    params = [p for p in model.parameters() if p.requires_grad]

    def whole(x, y) -> np.ndarray:
        t0 = _clocks()
        lm_loss(chain.stage_forward(0, chain.num_layers, None, x), y).backward()
        return _clocks() - t0

    def staged(x, y) -> np.ndarray:
        spent = np.zeros(2)
        saved = []
        sent = None
        for s, e in zip(cuts[:-1], cuts[1:], strict=True):
            got = None
            if sent is not None:
                got = tuple(t.detach().requires_grad_(t.requires_grad) for t in sent)
            t0 = _clocks()
            out = chain.stage_forward(s, e, got, x)
            if e == chain.num_layers:
                out = lm_loss(out, y)
            spent += _clocks() - t0
            saved.append((got, out))
            sent = out
        grads = None
        for got, out in reversed(saved):
            t0 = _clocks()
            if grads is None:
                out.backward()
            else:
                pairs = [(t, g) for t, g in zip(tree_flatten(out)[0], grads, strict=True)]
                pairs = [(t, g) for t, g in pairs if t.requires_grad and g is not None]
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            spent += _clocks() - t0
            grads = None if got is None else [t.grad for t in got]
        return spent

    rows = []
    for r in range(repeats + 1):  # the first repeat warms up
        x, y = task.train.batch(sampler.indices(r))
        times = np.zeros((2, 2))  # [whole, stages] x [wall, CPU]
        for k in range(4):
            mb = slice(8 * k, 8 * (k + 1))
            # alternate which of the two runs first, so neither always finds the caches warm
            for which in (0, 1) if k % 2 == 0 else (1, 0):
                for p in params:
                    p.grad = None
                times[which] += (whole if which == 0 else staged)(x[mb], y[mb])
        if r:
            ratio = times[1] / times[0]
            rows.append((times[0, 0], times[1, 0], ratio[0], ratio[1]))
    whole_s, stages_s, _, _ = np.median(rows, axis=0)
    ratio, cpu_ratio = np.median([row[2:] for row in rows], axis=0)
    return float(whole_s), float(stages_s), float(ratio), float(cpu_ratio)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("all", "workers1", "cutting"), default="all")
    ap.add_argument("--model", choices=("all", "gpt2", "llama"), default="all")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.1, help="the models' dropout")
    args = ap.parse_args()
    if not 0 <= args.warmup < args.steps - 1:
        ap.error("--warmup: expected 0 <= warmup < steps - 1")
    torch.set_num_threads(1)
    builders = {"gpt2": gpt2_model, "llama": llama_model}
    names = list(builders) if args.model == "all" else [args.model]
    for name in names if args.part in ("all", "workers1") else []:
        rate, builder = args.dropout, builders[name]
        task = dataclasses.replace(
            example_task("gpt2", "tiny"),
            build_model=lambda builder=builder, rate=rate: builder("tiny", rate, HF_CONTEXT),
        )
        runs = []
        for r in range(args.repeats):
            with tempfile.TemporaryDirectory() as folder:
                runs.append(side_by_side(task, args.steps, args.warmup, folder))
            (pw, pc), (hw, hc) = runs[-1]
            print(
                f"{name} repeat {r}: plain {pw:.3f} it/s ({pc:.3f} per CPU s), "
                f"hetrain {hw:.3f} it/s ({hc:.3f} per CPU s)"
            )
        p, pc = np.median([run[0] for run in runs], axis=0)
        h, hc = np.median([run[1] for run in runs], axis=0)
        # each repeat runs the two in lockstep: compare within a repeat, then the median
        ratio, cpu_ratio = (float(x) for x in np.median([run[1] / run[0] for run in runs], axis=0))
        load = os.getloadavg()[0]
        verdict = "PASS" if ratio >= TARGET else "FAIL"
        print(
            f"{name} tiny (dropout {args.dropout}), batch {task.defaults['batch']}: plain "
            f"{p:.3f} it/s, hetrain --workers 1 {h:.3f} it/s"
        )
        print(
            f"ratio {ratio:.3f} (target >= {TARGET}): {verdict}; CPU-time ratio "
            f"{cpu_ratio:.3f}; load {load:.1f}"
        )
        print(
            json.dumps(
                {
                    "model": name,
                    "plain_it_s": float(p),
                    "hetrain_it_s": float(h),
                    "ratio": ratio,
                    "cpu_ratio": cpu_ratio,
                    "dropout": args.dropout,
                    "load": load,
                    "pass": ratio >= TARGET,
                }
            )
        )
    if args.part in ("all", "cutting"):
        whole_s, stages_s, ratio, cpu_ratio = cutting_cost(args.repeats, args.dropout)
        verdict = "PASS" if ratio <= CUTTING_TARGET else "FAIL"
        load = os.getloadavg()[0]
        print(
            f"llama tiny, 4-stage pipeline, batch 32 in micro-batches of 8: whole model "
            f"{1e3 * whole_s:.1f} ms, sum over the 4 stages {1e3 * stages_s:.1f} ms; ratio "
            f"{ratio:.3f} (target <= {CUTTING_TARGET}): {verdict}; CPU-time ratio "
            f"{cpu_ratio:.3f}; load {load:.1f}"
        )
        print(
            json.dumps(
                {
                    "model": "llama-cutting",
                    "whole_s": whole_s,
                    "stages_s": stages_s,
                    "ratio": ratio,
                    "cpu_ratio": cpu_ratio,
                    "load": load,
                    "pass": ratio <= CUTTING_TARGET,
                }
            )
        )


if __name__ == "__main__":
    main()
