"""Stage boundaries exchange data, never pickles: a pytree's structure travels as JSON
(torch's treespec serialisation) and round-trips for any tree of tensors, plain values and
registered containers; a crafted pickle or any other malformed structure is rejected with one
line and runs nothing."""

from __future__ import annotations

import contextlib
import os
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten

from hetrain.runtime.stages import P2P, Timers
from hetrain.runtime.stagewire import (
    TAG_PAYLOAD,
    StageMessageError,
    decode_structure,
    encode_structure,
)
from hetrain.runtime.testing import RankFailure, run_ranks

plain = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
leaf = st.one_of(plain, st.just("TENSOR"))
trees = st.recursive(
    leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.tuples(kids, kids),
        st.dictionaries(st.text(max_size=6), kids, max_size=4),
    ),
    max_leaves=20,
)


def _tensors(obj):
    if obj == "TENSOR":
        return torch.arange(3.0)
    if isinstance(obj, list):
        return [_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_tensors(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    return obj


@settings(max_examples=200, deadline=None)
@given(trees)
def test_structure_round_trips(tree):
    flat, spec = tree_flatten(_tensors(tree))
    mask = [isinstance(a, torch.Tensor) for a in flat]
    got_spec, leaves, got_mask = decode_structure(encode_structure(spec, flat, mask), "test")
    assert got_spec == spec and got_mask == mask
    assert leaves == [None if m else a for a, m in zip(flat, mask, strict=True)]


def test_hugging_face_model_output_round_trips():
    from transformers.modeling_outputs import BaseModelOutputWithPast

    out = BaseModelOutputWithPast(last_hidden_state=torch.zeros(2, 3), hidden_states=None)
    flat, spec = tree_flatten(out)
    mask = [isinstance(a, torch.Tensor) for a in flat]
    got_spec, _, _ = decode_structure(encode_structure(spec, flat, mask), "test")
    assert got_spec == spec


class _Payload:
    """A pickle that would create a file when unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_crafted_pickle_is_rejected_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Payload(str(marker)))
    with pytest.raises(StageMessageError, match="stage message from rank 1: malformed"):
        decode_structure(blob, "stage message from rank 1")
    assert not marker.exists()


@pytest.mark.parametrize(
    "blob",
    [
        b'{"format": 1, "spec": "[1, {\\"type\\": \\"os.system\\", \\"context\\": \\"null\\", '
        b'\\"children_spec\\": []}]", "leaves": [], "mask": []}',
        b'{"format": 2, "spec": "", "leaves": [], "mask": []}',
        b'{"format": 1, "spec": "x", "leaves": [1], "mask": []}',
        b'{"format": 1, "spec": "x", "leaves": [[1]], "mask": [false]}',
        b"[" * 100000,
    ],
)
def test_malformed_structures_are_one_line_errors(blob):
    with pytest.raises(StageMessageError) as info:
        decode_structure(blob, "stage message from rank 0")
    assert "\n" not in str(info.value)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_rejected(blob):
    with contextlib.suppress(StageMessageError):  # anything else escaping fails the test
        decode_structure(blob, "fuzz")


def _hostile_peer(rank, world, marker):
    device = torch.device("cpu")
    if rank == 0:  # speaks the tree protocol with a pickle as the structure
        # a description of a non-tensor tree of 0 tensors whose structure is the pickle
        blob = pickle.dumps(_Payload(marker))
        torch.distributed.send(torch.tensor([0, len(blob), 0]), 1, tag=TAG_PAYLOAD)
        torch.distributed.send(
            torch.frombuffer(bytearray(blob), dtype=torch.uint8), 1, tag=TAG_PAYLOAD
        )
        return None
    p2p = P2P(device, ("w0", "w1"), rank, Timers(), None)
    p2p.recv_tree(0)
    return "accepted"


def test_hostile_peer_is_rejected_over_the_wire(tmp_path):
    marker = str(tmp_path / "pwned")
    with pytest.raises(RankFailure) as info:
        run_ranks(_hostile_peer, 2, tmp_path / "ranks", args=(marker,), timeout_s=60)
    assert set(info.value.failures) == {1}
    kind, message, _ = info.value.failures[1]
    assert kind == "StageMessageError"
    assert message.startswith("stage message from rank 0: malformed structure")
    assert not os.path.exists(marker)


def _bad_description_peer(rank, world, description, header):
    if rank == 0:
        torch.distributed.send(torch.tensor(description), 1, tag=TAG_PAYLOAD)
        if header is not None:
            torch.distributed.send(torch.tensor(header), 1, tag=TAG_PAYLOAD)
        return None
    P2P(torch.device("cpu"), ("w0", "w1"), rank, Timers(), None).recv_tree(0)
    return "accepted"


@pytest.mark.parametrize(
    ("description", "header", "what"),
    [
        ([2, 0, 1], None, "malformed description"),  # neither plain nor a tree
        ([1, 0, 1 << 20], None, "malformed description"),  # too many tensors
        ([0, -5, 1], None, "malformed description"),  # negative structure length
        ([1, 0, 1], [99, 1, 0, 4] + [0] * 8, "malformed tensor header"),  # unknown dtype
        ([1, 0, 1], [0, 2, 0, 4, -3] + [0] * 7, "malformed tensor header"),  # negative dim
        ([1, 0, 1], [0, 1, 0, 1 << 50] + [0] * 8, "malformed tensor header"),  # 4 PiB
    ],
)
def test_malformed_descriptions_are_rejected(tmp_path, description, header, what):
    """A peer's tensor description is validated before anything is allocated or received."""
    with pytest.raises(RankFailure) as info:
        run_ranks(
            _bad_description_peer, 2, tmp_path / "r", args=(description, header), timeout_s=60
        )
    kind, message, _ = info.value.failures[1]
    assert (kind, message) == ("StageMessageError", f"stage message from rank 0: {what}")


def _message(k: int):
    """Message ``k`` of a seeded population: a tensor, a tuple or a dict of 1-3 tensors of any
    wire dtype (bfloat16, bool and complex included), 0-4 dims (0-dim and empty included),
    some non-contiguous, some requiring grad; every third message repeats the previous
    description (the cached path), the others change it (the changed-description path)."""
    from hetrain.runtime.stagewire import _DTYPES

    rng = torch.Generator().manual_seed(1000 + k - (k % 3 == 2))  # repeat: the same draws

    def one():
        dtype = _DTYPES[int(torch.randint(len(_DTYPES), (), generator=rng))]
        shape = [int(v) for v in torch.randint(0, 5, (int(torch.randint(5, (), generator=rng)),),
                                               generator=rng)]  # fmt: skip
        t = torch.randn([*shape, 2], generator=rng, dtype=torch.float64) * 50
        t = t[..., 0] if int(torch.randint(2, (), generator=rng)) else t[..., 1].contiguous()
        t = t.to(dtype) if not dtype.is_complex else torch.complex(t, -t).to(dtype)
        if (t.is_floating_point() or t.is_complex()) and int(torch.randint(2, (), generator=rng)):
            t = t.requires_grad_(True) * 1
        return t

    kind = int(torch.randint(3, (), generator=rng))
    if kind == 0:
        return one()
    parts = [one() for _ in range(int(torch.randint(1, 4, (), generator=rng)))]
    return tuple(parts) if kind == 1 else {f"t{i}": p for i, p in enumerate(parts)}


def _wire_bytes(tree):
    """(dtype, shape, requires grad, bytes) of every tensor of a tree, in tree order."""
    out = []
    for t in tree_flatten(tree)[0]:
        flat = t.detach().resolve_conj().reshape(-1).clone(memory_format=torch.contiguous_format)
        raw = bytes(flat.view(torch.uint8)) if t.numel() else b""
        out.append((str(t.dtype), tuple(t.shape), t.requires_grad, raw))
    return out


def _sequence_peer(rank, world, count):
    p2p = P2P(torch.device("cpu"), ("w0", "w1"), rank, Timers(), None)
    if rank == 0:
        for k in range(count):
            p2p.send_tree(_message(k), 1)
        p2p.wait_sends()
        return None
    got = []
    for k in range(count):
        tree, flags = p2p.recv_tree(0)
        if k + 1 < count:
            p2p.post_recv(0)  # the next message's receive, posted ahead as run_stage does
        for t, flag in zip(tree_flatten(tree)[0], flags, strict=True):
            if flag:
                t.requires_grad_(True)
        got.append(_wire_bytes(tree))
    return got


def test_message_sequences_arrive_bit_exact_through_posted_receives(tmp_path):
    """60 messages of every wire dtype, shape and tree kind, their descriptions changing or
    repeating, arrive bit-exact (dtypes, shapes, requires-grad flags, bytes) while the
    receiver posts each next receive ahead (``P2P.post_recv``) of the size it knows."""
    count = 60
    out = run_ranks(_sequence_peer, 2, tmp_path, args=(count,), timeout_s=120)
    expected = [_wire_bytes(_message(k)) for k in range(count)]
    assert out[1] == expected


def _pooled_peer(rank, world):
    pool: dict = {}
    cache: dict = {}
    got, reused = [], []
    for step in range(3):
        p2p = P2P(torch.device("cpu"), ("w0", "w1"), rank, Timers(), None, None, cache, pool)
        if rank == 0:
            before = {id(b) for free in pool.values() for b in free}
            for k in range(4):
                p2p.send_tree(torch.full((5, 3), float(10 * step + k)), 1)
            taken = before - {id(b) for free in pool.values() for b in free}
            p2p.wait_sends()
            reused.append((len(before), len(taken)))
        else:
            got.append([p2p.recv_tree(0)[0].tolist() for _ in range(4)])
    return reused if rank == 0 else got


def test_send_buffers_are_reused_across_steps_once_sent(tmp_path):
    """A step's packed messages go out of host buffers put back by the previous step's
    ``wait_sends`` (none allocated in a steady step), and every message still arrives with
    its own values."""
    sender, receiver = run_ranks(_pooled_peer, 2, tmp_path, timeout_s=120)
    assert sender == [(0, 0), (4, 4), (4, 4)]
    assert receiver == [
        [torch.full((5, 3), float(10 * step + k)).tolist() for k in range(4)] for step in range(3)
    ]
