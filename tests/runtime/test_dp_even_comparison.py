"""The end summary's comparison with even data parallelism (issue 19): never above what the
run's measured speeds allow."""

from __future__ import annotations

import pytest

from hetrain.report.run_report import (
    compare_with_dp_even,
    slowdown_changes,
    slowdown_step,
    speedup_bound,
)


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


def _steps(first: int, last: int, slowdown: dict[str, float]) -> list[dict]:
    return [
        {"event": "step", "step": t, "iteration_time_s": 0.02, "slowdown": dict(slowdown)}
        for t in range(first, last)
    ]


def _restart(step: int, devices: list[str]) -> dict:
    return {"event": "restart", "step": step, "path": f"ckpt/step_{step}", "devices": devices}


def test_the_slow_down_step_is_found_within_a_round_and_never_at_a_resume():
    three = {"w0": 1.0, "w1": 1.0, "w2": 1.0}
    # a real slow-down within one round: w1 3x slower from step 12 on
    one_round = _steps(0, 12, three) + _steps(12, 30, {**three, "w1": 3.0})
    assert slowdown_step(one_round) == 12
    # no emulation at all ({}) is no slow-down; {} then w1 3x slower is one
    assert slowdown_step(_steps(0, 30, {})) is None
    assert slowdown_step(_steps(0, 5, {}) + _steps(5, 10, {"w1": 3.0})) == 5
    # stopped after the checkpoint at step 16 (steps up to 19 logged) and resumed there with
    # w2 gone: the step records after the resume name other devices, no device slowed
    two = {"w0": 1.0, "w1": 1.0}
    resumed = _steps(0, 20, three) + [_restart(16, ["w0", "w1"])] + _steps(16, 30, two)
    assert slowdown_step(resumed) is None
    # w2 joining at the resume, slowed by --slowdown w2=3 from the resume on: no slow-down
    joined = _steps(0, 16, two) + [_restart(16, ["w0", "w1", "w2"])]
    joined += _steps(16, 30, {**two, "w2": 3.0})
    assert slowdown_step(joined) is None
    # a slow-down after the resume is found, in the new round
    later = resumed + _steps(30, 40, {**two, "w0": 2.0})
    assert slowdown_step(later) == 30
    # without the restart record, the step numbers going back start the round
    assert slowdown_step([e for e in resumed if e["event"] == "step"]) is None


def test_no_comparison_for_a_run_resumed_on_fewer_devices():
    three = {"w0": 1.0, "w1": 1.0, "w2": 1.0}
    events = _steps(0, 20, three) + [_restart(16, ["w0", "w1"])]
    events += _steps(16, 30, {"w0": 1.0, "w1": 1.0})
    rows = [
        {"step": t, "predicted_time_s": 0.02, "dp_even_time_s": 0.03, "speed_flops": {}}
        for t in range(30)
    ]
    assert compare_with_dp_even(events, rows) is None


def test_slowdown_changes_are_within_a_round_and_name_the_new_factors() -> None:
    """The run plot's dotted markers: a change within a round is marked with the changed
    devices' new factors; a resume on other devices (or without its restart record) is not."""

    def step(s, slow):
        return {"event": "step", "step": s, "iteration_time_s": 0.1, "slowdown": slow}

    three = {"w0": 1.0, "w1": 1.0, "w2": 1.0}
    events = [step(s, three) for s in range(5)]
    events += [step(s, {**three, "w1": 3.0}) for s in range(5, 8)]  # w1 slowed at 5
    events.append({"event": "restart", "step": 8})
    events += [step(s, {"w0": 1.0, "w2": 2.0}) for s in range(8, 11)]  # resumed, w1 gone
    events += [step(s, {"w0": 1.0, "w2": 1.0}) for s in range(11, 13)]  # w2 back at 11
    events += [step(s, {"w0": 4.0}) for s in range(3, 5)]  # a step going back: new round
    assert slowdown_changes(events) == [(5, {"w1": 3.0}), (11, {"w2": 1.0})]
