"""The deterministic global-batch sampler and the example data."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.runtime.data import GlobalBatchSampler
from hetrain.runtime.examples import charlm_vocab, encode_chars


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 50), batch=st.integers(1, 40), seed=st.integers(0, 3), step=st.integers(0, 30)
)
def test_sampler_is_a_stream_of_epoch_permutations(n, batch, seed, step):
    s = GlobalBatchSampler(n, batch, seed)
    idx = s.indices(step)
    assert idx.shape == (batch,) and idx.min() >= 0 and idx.max() < n
    # the same positions from a sampler with another batch size give the same samples
    stream = np.concatenate(
        [GlobalBatchSampler(n, 1, seed).indices(p) for p in range(step * batch, (step + 1) * batch)]
    )
    np.testing.assert_array_equal(idx, stream)
    # every epoch is a permutation
    epoch0 = np.concatenate([GlobalBatchSampler(n, 1, seed).indices(p) for p in range(n)])
    assert sorted(epoch0.tolist()) == list(range(n))


def test_sampler_depends_on_seed_and_step_only():
    a = GlobalBatchSampler(1000, 32, 7)
    assert np.array_equal(a.indices(5), GlobalBatchSampler(1000, 32, 7).indices(5))
    assert not np.array_equal(a.indices(5), a.indices(6))
    assert not np.array_equal(a.indices(5), GlobalBatchSampler(1000, 32, 8).indices(5))
    assert a.position(5) == 160


def test_encode_chars_maps_typography_to_ascii():
    ids = encode_chars("a’b\n…")
    vocab = charlm_vocab()
    assert "".join(vocab[i] for i in ids.tolist()) == "a'b\n."
    assert len(vocab) == 96


def test_quality_line_says_when_nothing_was_measured():
    """A ``--model`` factory without ``val_dataset`` or ``evaluate``: the console's quality line
    says so (it was ``quality: `` with nothing after it); with metrics, the metric and target."""
    from torch import nn

    from hetrain.runtime.data import Task

    bare = Task("model", nn.Identity, None, None, None)
    assert bare.quality_line({}) == "not measured (no val_dataset or evaluate given)"
    stated = Task("m", nn.Identity, None, None, None, quality_metric="val_loss",
                  quality_target=2.3)  # fmt: skip
    assert stated.quality_line({"val_loss": 2.1}) == "val_loss 2.1000 (target <= 2.3: reached)"
    assert bare.quality_line({"val_loss": 2.1, "acc": 0.5}) == "val_loss 2.1, acc 0.5"
