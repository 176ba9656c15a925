"""``hetrain train --workers 1`` on Hugging Face GPT-2 tiny vs a plain PyTorch loop on the same
model and data, iterations per second side by side in one run (target: hetrain >= 0.95x).

Both train ``GPT2LMHeadModel`` (tiny config, tied head, dropout 0.1 or ``--dropout``) from the
same seed on the same global batches of the ``gpt2`` example (bytes of ``pydoc_data.topics``,
context 64, the deterministic sampler), AdamW with the example's learning rate, clipping at 1.0,
one torch thread, in this process:

- ``plain``: ``model(x)``, cross-entropy, ``backward``, ``clip_grad_norm_``, ``step``;
- ``hetrain``: :func:`hetrain.runtime.worker_main.run_worker` (the per-rank loop of ``hetrain
  train --workers 1``, a one-rank gloo group): the engine's cut model (one stage spanning every
  layer), plan-invariant dropout, metrics.

Iterations per second of the whole loop (data, step, and for hetrain its metrics line) over
steps ``warmup .. steps - 2``: both loops fetch each step's batch from the task's training
source, which notes the wall clock and this thread's CPU clock at every fetch (hetrain's last
step, which also gathers the run's timeline, is left out). The two alternate ``--repeats`` times
and the medians are compared; the wall-clock ratio is the target, the CPU-time ratio (this
thread's ``time.thread_time``) is printed too, being far less sensitive to other processes on a
shared machine. The last line is JSON ``{"plain_it_s", "hetrain_it_s", "ratio", "cpu_ratio",
"dropout", "load", "pass"}``.

Usage: ``.venv/bin/python bench/hf_workers1.py [--steps 40] [--warmup 5] [--repeats 3]
[--dropout 0.1]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from hetrain.models.hf import gpt2_model
from hetrain.runtime.api import build_job
from hetrain.runtime.data import HF_CONTEXT, GlobalBatchSampler, example_task, lm_loss
from hetrain.runtime.worker_main import lr_multiplier, run_worker

TARGET = 0.95


class _Clocked:
    """A training source that notes ``(wall, thread CPU)`` clocks at every ``batch`` call."""

    def __init__(self, source) -> None:
        self.source = source
        self.stamps: list[tuple[float, float]] = []

    def __len__(self) -> int:
        return len(self.source)

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def batch(self, indices):
        self.stamps.append((time.perf_counter(), time.thread_time()))
        return self.source.batch(indices)

    def rates(self, steps: int, first: int, last: int) -> tuple[float, float]:
        """Steps per wall second and per CPU second from the fetch of step ``first`` to that of
        step ``last`` (the loop's fetches are the last ``steps`` ones)."""
        loop = self.stamps[-steps:]
        (w0, c0), (w1, c1) = loop[first], loop[last]
        return (last - first) / (w1 - w0), (last - first) / (c1 - c0)


def plain(task, job, steps: int, warmup: int) -> tuple[float, float]:
    """(wall, CPU) iterations per second of a plain PyTorch loop (no hetrain code in it)."""
    torch.manual_seed(job.seed)
    model = task.build_model()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=job.weight_decay)
    factor = lr_multiplier(job)
    sampler = GlobalBatchSampler(len(task.train), job.batch, job.seed)
    source = _Clocked(task.train)
    for step in range(steps):
        x, y = source.batch(sampler.indices(step))
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = job.lr * factor(step)
        opt.step()
    return source.rates(steps, warmup, steps - 1)


def hetrain_run(task, steps: int, warmup: int, folder: str) -> tuple[float, float]:
    """(wall, CPU) iterations per second of ``hetrain train --workers 1`` (its per-rank loop)."""
    source = _Clocked(task.train)
    task = dataclasses.replace(task, train=source)
    job = build_job(
        task, workers=1, steps=steps, metrics_out=os.path.join(folder, "m.jsonl"), run_dir=folder
    )
    job.adaptive = False
    store = dist.FileStore(os.path.join(folder, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        run_worker(job, num_threads=1)
    finally:
        dist.destroy_process_group()
    return source.rates(steps, warmup, steps - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.1, help="GPT-2's dropout (example: 0.1)")
    args = ap.parse_args()
    if not 1 <= args.warmup < args.steps - 1:
        ap.error("--warmup: expected 1 <= warmup < steps - 1")
    torch.set_num_threads(1)
    task = example_task("gpt2", "tiny")
    if args.dropout != 0.1:
        rate = args.dropout
        task = dataclasses.replace(task, build_model=lambda: gpt2_model("tiny", rate, HF_CONTEXT))
    job = build_job(task, workers=1, steps=args.steps)
    plain_runs, hetrain_runs = [], []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            hetrain_runs.append(hetrain_run(task, args.steps, args.warmup, folder))
        plain_runs.append(plain(task, job, args.steps, args.warmup))
        (pw, pc), (hw, hc) = plain_runs[-1], hetrain_runs[-1]
        print(
            f"repeat {r}: plain {pw:.3f} it/s ({pc:.3f} per CPU s), "
            f"hetrain {hw:.3f} it/s ({hc:.3f} per CPU s)"
        )
    p = statistics.median(w for w, _ in plain_runs)
    h = statistics.median(w for w, _ in hetrain_runs)
    pc = statistics.median(c for _, c in plain_runs)
    hc = statistics.median(c for _, c in hetrain_runs)
    ratio, cpu_ratio = h / p, hc / pc
    load = os.getloadavg()[0]
    verdict = "PASS" if ratio >= TARGET else "FAIL"
    print(
        f"GPT-2 tiny (dropout {args.dropout}), batch {job.batch}: plain {p:.3f} it/s, "
        f"hetrain --workers 1 {h:.3f} it/s"
    )
    print(
        f"ratio {ratio:.3f} (target >= {TARGET}): {verdict}; CPU-time ratio {cpu_ratio:.3f}; "
        f"load {load:.1f}"
    )
    print(
        json.dumps(
            {
                "plain_it_s": p,
                "hetrain_it_s": h,
                "ratio": ratio,
                "cpu_ratio": cpu_ratio,
                "dropout": args.dropout,
                "load": load,
                "pass": ratio >= TARGET,
            }
        )
    )


if __name__ == "__main__":
    main()
