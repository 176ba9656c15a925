"""The multi-node path: two ``torchrun`` agents as two nodes (``--nnodes 2``, c10d rendezvous on
127.0.0.1) run one pipeline plan across both; the result equals single-process training
(float64)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hetrain
from hetrain.models import digits_cnn
from hetrain.runtime.data import GlobalBatchSampler
from hetrain.runtime.examples import digits_loss, digits_task

STEPS = 3
PLAN = {
    "groups": [
        {"devices": ["w0", "w1"], "stages": [[0, 3], [3, 6]], "microbatch_size": 8, "batch": 24},
    ]
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on one process: the whole global batch, SGD with momentum."""
    task = digits_task()
    torch.manual_seed(0)
    model = digits_cnn().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    sampler = GlobalBatchSampler(len(task.train), 24, 0)
    losses = []
    for t in range(STEPS):
        x, y = task.train.batch(sampler.indices(t))
        loss = digits_loss(model(x.double()), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("launcher", ["torchrun", "hetrain"])
def test_two_nodes_match_single_process(tmp_path, launcher):
    """Two agents as two nodes: ``torchrun ... -m hetrain train`` or ``hetrain train --nnodes 2``
    (torch's elastic launch API inside hetrain)."""
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    port = _free_port()
    # the processes import the hetrain under test (this checkout), whatever the cwd
    src = str(Path(hetrain.__file__).resolve().parents[1])
    pythonpath = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    train_args = [
        "-m",
        "hetrain",
        "train",
        "--example",
        "digits",
        "--plan",
        "plan.json",
        "--dtype",
        "float64",
        "--steps",
        str(STEPS),
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--momentum",
        "0.9",
        "--lr-schedule",
        "constant",
        "--warmup-steps",
        "0",
        "--out",
        "model.pt",
        "--metrics-out",
        "metrics.jsonl",
        "--no-report",
        "--no-progress",
    ]
    rdzv = ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hetrain-test"]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        command += ["--nproc-per-node", "1", "--rdzv-backend", "c10d", *rdzv, *train_args]
    else:
        command = [sys.executable, *train_args, "--nnodes", "2", "--workers", "1", *rdzv]
    procs = [
        subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _node in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)[-3000:]

    ref_losses, ref_state = _reference()
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == STEPS
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        rtol=1e-9,
        atol=1e-12,
    )
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-12)
    # the exported state_dict loads into the original module without hetrain
    digits_cnn().double().load_state_dict(state)
