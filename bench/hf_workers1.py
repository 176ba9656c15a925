"""``hetrain train --workers 1`` on Hugging Face GPT-2 tiny vs a plain PyTorch loop on the same
model and data, iterations per second side by side in one run (target: hetrain >= 0.95x).

Both train ``GPT2LMHeadModel`` (tiny config, tied head, dropout 0.1) from the same seed on the
same global batches of the ``gpt2`` example (bytes of ``pydoc_data.topics``, context 64, the
deterministic sampler), AdamW with the example's learning rate, clipping at 1.0, one torch
thread, in this process:

- ``plain``: ``model(x)``, cross-entropy, ``backward``, ``clip_grad_norm_``, ``step``;
- ``hetrain``: :func:`hetrain.runtime.worker_main.run_worker` (the per-rank loop of ``hetrain
  train --workers 1``, a one-rank gloo group): the engine's cut model (one stage spanning every
  layer), plan-invariant dropout, metrics.

Iterations per second over the steps after ``--warmup``; the two alternate ``--repeats`` times
and the medians are compared. The last line is JSON ``{"plain_it_s", "hetrain_it_s", "ratio",
"pass"}``.

Usage: ``.venv/bin/python bench/hf_workers1.py [--steps 40] [--warmup 5] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from hetrain.runtime.api import build_job
from hetrain.runtime.data import GlobalBatchSampler, example_task, lm_loss
from hetrain.runtime.worker_main import lr_multiplier, run_worker

TARGET = 0.95


def plain(task, job, steps: int, warmup: int) -> float:
    """Iterations per second of a plain PyTorch loop (no hetrain code in the loop)."""
    torch.manual_seed(job.seed)
    model = task.build_model()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=job.weight_decay)
    factor = lr_multiplier(job)
    sampler = GlobalBatchSampler(len(task.train), job.batch, job.seed)
    t0 = 0.0
    for step in range(steps):
        if step == warmup:
            t0 = time.perf_counter()
        x, y = task.train.batch(sampler.indices(step))
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = job.lr * factor(step)
        opt.step()
    return (steps - warmup) / (time.perf_counter() - t0)


def hetrain_run(task, steps: int, warmup: int, folder: str) -> float:
    """Iterations per second of ``hetrain train --workers 1`` (its per-rank loop)."""
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
    times = []
    with open(job.metrics_out) as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("event") == "step" and row["step"] >= warmup:
                times.append(row["iteration_time_s"])
    return len(times) / sum(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    task = example_task("gpt2", "tiny")
    job = build_job(task, workers=1, steps=args.steps)
    plain_runs, hetrain_runs = [], []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            hetrain_runs.append(hetrain_run(task, args.steps, args.warmup, folder))
        plain_runs.append(plain(task, job, args.steps, args.warmup))
        print(f"repeat {r}: plain {plain_runs[-1]:.3f} it/s, hetrain {hetrain_runs[-1]:.3f} it/s")
    p, h = statistics.median(plain_runs), statistics.median(hetrain_runs)
    ratio = h / p
    verdict = "PASS" if ratio >= TARGET else "FAIL"
    print(f"GPT-2 tiny, batch {job.batch}: plain {p:.3f} it/s, hetrain --workers 1 {h:.3f} it/s")
    print(f"ratio {ratio:.3f} (target >= {TARGET}): {verdict}; load {os.getloadavg()[0]:.1f}")
    print(json.dumps({"plain_it_s": p, "hetrain_it_s": h, "ratio": ratio, "pass": ratio >= 0.95}))


if __name__ == "__main__":
    main()
