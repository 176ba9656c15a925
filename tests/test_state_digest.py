"""hetrain.cluster.state_digest: equal for copies, different when any one value's bits change
(its docstring says what "bit for bit" means: -0.0 is not 0.0, a NaN equals only a NaN of
the same bits)."""

from __future__ import annotations

import struct
from dataclasses import fields, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import ClusterState, state_digest

SCALARS = ("intra_node_bytes_per_s", "latency_s")
NON_FLOAT = ("ids", "kinds", "node", "available")
# every other field of ClusterState is a per-device float array (a field added later is
# covered without editing this list)
FLOAT_ARRAYS = tuple(f.name for f in fields(ClusterState) if f.name not in SCALARS + NON_FLOAT)
QUIET_NAN = float("nan")
OTHER_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0001))[0]  # another payload

# every value whose bits matter: signed zeros, NaNs of two payloads and both signs, infinities
floats = st.one_of(
    st.floats(allow_nan=False, allow_infinity=True, width=64),
    st.sampled_from([0.0, -0.0, QUIET_NAN, -QUIET_NAN, OTHER_NAN, 5e-324]),
)
names = st.text(min_size=0, max_size=4)


@st.composite
def states(draw) -> ClusterState:
    n = draw(st.integers(1, 5))
    ids = tuple(draw(st.lists(names, min_size=n, max_size=n, unique=True)))

    def arr() -> np.ndarray:
        return np.array(draw(st.lists(floats, min_size=n, max_size=n)), dtype=float)

    return ClusterState(
        ids=ids,
        node=np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), dtype=np.int64),
        available=np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool),
        intra_node_bytes_per_s=draw(floats),
        latency_s=draw(floats),
        kinds=tuple(draw(st.lists(names, min_size=n, max_size=n))),
        **{name: arr() for name in FLOAT_ARRAYS},
    )


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _copy(state: ClusterState) -> ClusterState:
    """Fresh objects everywhere: arrays copied (some as strided views of a larger buffer),
    tuples and floats rebuilt."""
    out = {}
    for f in fields(state):
        value = getattr(state, f.name)
        if isinstance(value, np.ndarray):  # a strided view: every other element of a buffer
            wide = np.empty((*value.shape, 2), dtype=value.dtype)
            wide[..., 0] = value
            out[f.name] = wide[..., 0]
        elif isinstance(value, tuple):
            out[f.name] = tuple("".join(list(s)) for s in value)
        else:
            out[f.name] = struct.unpack("<d", _bits(value))[0]
    return ClusterState(**out)


@settings(max_examples=200, deadline=None)
@given(state=states())
def test_a_copy_has_the_same_digest(state):
    twin = _copy(state)
    assert twin is not state and twin.speed_flops is not state.speed_flops
    assert state_digest(twin) == state_digest(state)
    assert len(state_digest(state)) == 20


@settings(max_examples=300, deadline=None)
@given(state=states(), data=st.data())
def test_changing_the_bits_of_one_array_element_changes_the_digest(state, data):
    name = data.draw(st.sampled_from(FLOAT_ARRAYS))
    old = getattr(state, name)
    i = data.draw(st.integers(0, len(old) - 1))
    new_value = data.draw(floats.filter(lambda x: _bits(x) != _bits(float(old[i]))))
    changed = old.copy()
    changed[i] = new_value
    assert state_digest(replace(state, **{name: changed})) != state_digest(state)


@settings(max_examples=200, deadline=None)
@given(state=states(), data=st.data())
def test_changing_one_scalar_flag_node_or_name_changes_the_digest(state, data):
    what = data.draw(st.sampled_from(SCALARS + ("available", "node", "ids", "kinds")))
    i = data.draw(st.integers(0, state.num_devices - 1))
    if what in SCALARS:
        old = getattr(state, what)
        value = data.draw(floats.filter(lambda x: _bits(x) != _bits(old)))
    elif what == "available":
        value = state.available.copy()
        value[i] = not value[i]
    elif what == "node":
        value = state.node.copy()
        value[i] += 1
    else:
        old = getattr(state, what)
        new_name = data.draw(names.filter(lambda s: s != old[i] and s not in old))
        value = old[:i] + (new_name,) + old[i + 1 :]
    assert state_digest(replace(state, **{what: value})) != state_digest(state)


def _state(n: int = 1, **changes) -> ClusterState:
    """``n`` devices with plain values, ``changes`` replacing fields."""
    base = ClusterState(
        ids=tuple(f"d{i}" for i in range(n)),
        node=np.zeros(n, dtype=np.int64),
        speed_flops=np.full(n, 1e12),
        memory_bytes=np.full(n, 16e9),
        nic_bytes_per_s=np.full(n, 1.25e8),
        power_w=np.full(n, 300.0),
        price_per_s=np.zeros(n),
        kappa_s=np.full(n, 1e-3),
        available=np.ones(n, dtype=bool),
        intra_node_bytes_per_s=1e11,
        latency_s=2e-5,
    )
    return replace(base, **changes)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (dict(price_per_s=np.array([0.0])), dict(price_per_s=np.array([-0.0])), False),
        (dict(latency_s=0.0), dict(latency_s=-0.0), False),
        (dict(kappa_s=np.array([QUIET_NAN])), dict(kappa_s=np.array([QUIET_NAN])), True),
        (dict(kappa_s=np.array([QUIET_NAN])), dict(kappa_s=np.array([OTHER_NAN])), False),
        (dict(kappa_s=np.array([QUIET_NAN])), dict(kappa_s=np.array([-QUIET_NAN])), False),
        (dict(latency_s=QUIET_NAN), dict(latency_s=QUIET_NAN), True),
        (dict(latency_s=QUIET_NAN), dict(latency_s=OTHER_NAN), False),
        (dict(latency_s=float("inf")), dict(latency_s=float("inf")), True),
        # the same values in another dtype, or as an int, are other bits
        (dict(speed_flops=np.array([1e12])), dict(speed_flops=np.array([1e12], np.float32)), False),
        (dict(intra_node_bytes_per_s=1e11), dict(intra_node_bytes_per_s=10**11), False),
        # a value moved from one field to the next is not the same state
        (dict(power_w=np.array([5.0]), price_per_s=np.array([6.0])),
         dict(power_w=np.array([6.0]), price_per_s=np.array([5.0])), False),
        # names are length-prefixed: ("ab", "c") is not ("a", "bc")
        (dict(ids=("ab", "c"), kinds=("k", "k")), dict(ids=("a", "bc"), kinds=("k", "k")), False),
        # NULs in names (which separate them otherwise)
        (dict(kinds=("a", "")), dict(kinds=("a\0",)), False),
        (dict(kinds=("a\0", "b")), dict(kinds=("a", "\0b")), False),
        (dict(kinds=("a\0", "b")), dict(kinds=("a\0", "b")), True),
    ],
)  # fmt: skip
def test_what_bit_for_bit_means(a, b, same):
    n = len(a.get("ids", ("d0",)))
    assert (state_digest(_state(n, **a)) == state_digest(_state(n, **b))) is same


def test_a_field_without_a_bit_pattern_is_refused():
    with pytest.raises(TypeError, match="kinds"):
        state_digest(_state(kinds=(1,)))
    with pytest.raises(TypeError, match="power_w"):
        state_digest(_state(power_w=np.array([object()])))
