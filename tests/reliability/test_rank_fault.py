"""A rank that fails while another rank is still busy (not waiting in a collective that the
failure would break): the launcher stops the busy rank and prints one line naming the failed
rank, its layer and the error; nothing else on stderr (torch's process context logs a
``Terminating process ... via signal SIGTERM`` warning per rank it stops), exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

FACTORY = """
import time

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        if self.training and torch.distributed.is_initialized():
            self.calls += 1
            if self.calls > 6:
                if torch.distributed.get_rank() == 0:
                    raise RuntimeError("user model fault on rank 0")
                time.sleep(120)  # rank 1 is busy, not in a collective, when rank 0 fails
        return torch.relu(self.lin(x))


def make():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = torch.randint(0, 16, (256,), generator=g)
    model = nn.Sequential(Block(), Block(), Block())
    return {"model": model, "dataset": (x, y), "loss_fn": nn.functional.cross_entropy}
"""


def test_a_failed_rank_with_a_busy_peer_is_one_line(tmp_path):
    (tmp_path / "faulty_factory.py").write_text(textwrap.dedent(FACTORY))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    run = tmp_path / "run"
    command = [sys.executable, "-m", "hetrain", "train", "--model", "faulty_factory:make",
               "--workers", "2", "--steps", "30", "--batch", "32", "--no-progress",
               "--no-report", "--no-demo-slowdown", "--run-dir", str(run)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert lines == [
        "hetrain: error: rank 0 (w0), layer 0 (Block): RuntimeError: user model fault on "
        f"rank 0 (tracebacks of all ranks: {run / 'rank_errors.jsonl'})"
    ], done.stderr
    assert "Traceback" not in done.stdout
