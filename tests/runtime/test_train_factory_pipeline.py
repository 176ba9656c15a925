"""``hetrain train --model MODULE:FACTORY`` with a user's own factory returning Hugging Face's
``GPT2LMHeadModel`` (``wte`` tied to ``lm_head``, dropout on), cut by the default cutter
(docs/model.md §5) into a 2-stage pipeline from a ``--plan`` file: the first stage holds the
embedding, the last the tied head. Trained for a few steps in float64, the loss of every step
and the exported weights equal the same run with ``--workers 1`` (docs/runtime.md "Any
model"), and the tied tensor is exported once, equal to the head."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from hetrain.cli import main

FACTORY = """
import torch
from torch import nn
from hetrain.models.hf import gpt2_model

def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (48, 9), generator=g)
    return x[:, :-1], x[:, 1:]

def loss(out, y):
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())

def make():
    return {"model": gpt2_model("tiny", dropout=0.1), "dataset": _data(), "loss_fn": loss}
"""

# prefix (embeddings), 4 GPT-2 blocks, suffix (final norm + tied head): 6 layers
PIPELINE = {
    "groups": [
        {"devices": ["w0", "w1"], "stages": [[0, 3], [3, 6]], "microbatch_size": 2, "batch": 8}
    ]
}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "usergpt2.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _train(tmp_path, capsys, name: str, *extra: str) -> tuple[dict, dict]:
    out = tmp_path / f"{name}.pt"
    code = main(
        [
            "train",
            "--model",
            "usergpt2:make",
            "--steps",
            "3",
            "--batch",
            "8",
            "--dtype",
            "float64",
            "--lr",
            "0.01",
            "--seed",
            "3",
            "--run-dir",
            str(tmp_path / name),
            "--out",
            str(out),
            "--no-progress",
            "--no-report",
            "--json",
            *extra,
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    summary = json.loads(captured.out.strip().splitlines()[-1])
    metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in metrics]
    losses = [r["loss"] for r in rows if r.get("event") == "step"]
    summary["losses"] = losses
    return summary, torch.load(out, weights_only=True)


def test_user_gpt2_factory_trains_on_a_two_stage_pipeline_like_one_process(user_module, capsys):
    plan = user_module / "pipeline.json"
    plan.write_text(json.dumps(PIPELINE))
    one, one_state = _train(user_module, capsys, "one", "--workers", "1")
    two, two_state = _train(user_module, capsys, "two", "--workers", "2", "--plan", str(plan))
    assert len(one["losses"]) == len(two["losses"]) == 3
    torch.testing.assert_close(two["losses"], one["losses"], rtol=1e-9, atol=1e-12)
    assert one_state.keys() == two_state.keys()
    for key in one_state:
        torch.testing.assert_close(two_state[key], one_state[key], rtol=1e-9, atol=1e-12, msg=key)
    # the tied tensor trained (it moved from the seeded initial weights) and the exported
    # Hugging Face model loads with its head tied to it
    from transformers import GPT2LMHeadModel

    from hetrain.models.hf import gpt2_model

    torch.manual_seed(3)  # --seed: the factory's model is built after seeding with it
    initial = gpt2_model("tiny", dropout=0.1).transformer.wte.weight.detach().double()
    wte = two_state["transformer.wte.weight"]
    assert not torch.allclose(wte, initial)
    loaded = GPT2LMHeadModel.from_pretrained(user_module / "two" / "model")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert torch.equal(loaded.transformer.wte.weight, wte.float())
    assert one["final_loss"] == pytest.approx(two["final_loss"], rel=1e-9)
