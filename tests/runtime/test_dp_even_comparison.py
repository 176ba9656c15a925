"""The end summary's comparison with even data parallelism (issue 19): never above what the
run's measured speeds allow."""

from __future__ import annotations

import pytest

from hetrain.report.run_report import compare_with_dp_even, speedup_bound


def _events(times_s: list[float], slow_from: int) -> list[dict]:
    return [
        {"event": "step", "step": t, "iteration_time_s": x,
         "slowdown": {"w1": 3.0} if t >= slow_from else {}}
        for t, x in enumerate(times_s)
    ]  # fmt: skip


def test_one_three_times_slower_rank_of_four_is_capped_at_two_and_a_half():
    assert speedup_bound({"w0": 3.0, "w1": 1.0, "w2": 3.0, "w3": 3.0}) == pytest.approx(2.5)
    assert speedup_bound({}) is None
    # the controller's predictions on drifting estimates said even data parallelism takes
    # 3.67x as long (the end line); its last speeds are one 3x-slow rank of four
    events = _events([0.02] * 10 + [0.03] * 20, slow_from=10)
    speeds = {"w0": 3e9, "w1": 1e9, "w2": 3e9, "w3": 3e9}
    rows = [
        {"step": t, "predicted_time_s": 0.03, "dp_even_time_s": 0.11, "speed_flops": speeds}
        for t in range(30)
    ]
    cmp = compare_with_dp_even(events, rows)
    assert cmp["speedup_bound"] == pytest.approx(2.5)
    assert cmp["speedup_over_dp_even"] == pytest.approx(2.5)
    assert cmp["dp_even_time_s"] == pytest.approx(2.5 * 0.03)
    # a figure under the bound is kept as predicted
    rows = [dict(r, dp_even_time_s=0.06) for r in rows]
    cmp = compare_with_dp_even(events, rows)
    assert cmp["speedup_over_dp_even"] == pytest.approx(2.0)
    assert cmp["dp_even_time_s"] == pytest.approx(0.06)


def test_the_figure_is_capped_at_the_models_lower_bound_on_the_same_estimates():
    # speeds allow 2.5x, but on the same estimates no plan is predicted below 0.05 s while
    # dp-even is 0.11 s: at most 2.2x
    events = _events([0.02] * 10 + [0.03] * 20, slow_from=10)
    speeds = {"w0": 3e9, "w1": 1e9, "w2": 3e9, "w3": 3e9}
    rows = [
        {"step": t, "predicted_time_s": 0.03, "dp_even_time_s": 0.11, "speed_flops": speeds,
         "lower_bound_s": 0.05}
        for t in range(30)
    ]  # fmt: skip
    cmp = compare_with_dp_even(events, rows)
    assert cmp["speedup_bound"] == pytest.approx(2.2)
    assert cmp["speedup_over_dp_even"] == pytest.approx(2.2)
