"""The estimator's median (``hetrain.control.estimates._median``) is numpy's, float for float:
the speed estimates (and so every decision) do not depend on which one computes it."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.control.estimates import _median

_finite = st.one_of(
    st.floats(min_value=-1e12, max_value=1e12, allow_nan=False),
    st.sampled_from([0.0, -0.0, 1.0, math.inf, -math.inf, 5e-324, 1.7e308]),
)


@settings(max_examples=400, deadline=None)
@given(
    values=st.lists(_finite, min_size=1, max_size=60),
    ties=st.integers(0, 3),
    as_array=st.booleans(),
)
def test_median_is_numpys_float_for_float(values, ties, as_array):
    values = values + values[:ties]  # repeated values, even and odd lengths
    x = np.asarray(values, dtype=float) if as_array else values
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, 1.7e308 + 1.7e308
        expected = float(np.median(np.asarray(values, dtype=float)))
    got = _median(x)
    if math.isnan(expected):
        assert math.isnan(got)
    else:
        assert got == expected and math.copysign(1.0, got) == math.copysign(1.0, expected)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 64))
def test_median_of_log_ratios_is_numpys(seed, n):
    """The estimator's inputs: ratios near 1 and their logs, whose two middle values' sum
    rounds."""
    rng = np.random.default_rng(seed)
    ratios = rng.uniform(0.3, 5.0, n) * rng.choice([1.0, 1.0 + 1e-15, 3.0], n)
    for x in (ratios, np.log(ratios), ratios.tolist()):
        assert _median(x) == float(np.median(np.asarray(x, dtype=float)))


def test_median_with_a_nan_is_nan():
    assert math.isnan(_median([1.0, float("nan"), 2.0]))
