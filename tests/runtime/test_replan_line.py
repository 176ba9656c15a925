"""The re-plan console line's shares: a pipeline's devices joined by ``+`` with their group's
share once (the per-device form listed a 2-stage pipeline's share twice: ``w0:32 w1:32 w2:0``
for a batch of 32)."""

from __future__ import annotations

from hetrain.plan import GroupPlan, Plan
from hetrain.runtime.ctldecision import Decision, device_shares, shares_text


def _plan(groups, plan_id=0) -> Plan:
    return Plan(schedule="1f1b", plan_id=plan_id, groups=tuple(
        GroupPlan(devices=tuple(d), stages=tuple(s), microbatch_size=m, batch=b)
        for d, s, m, b in groups))  # fmt: skip


PIPE = _plan([(("w0", "w1"), ((0, 4), (4, 8)), 8, 32)])
SPLIT = _plan([(("w0",), ((0, 8),), 8, 8), (("w1",), ((0, 8),), 8, 8),
               (("w2",), ((0, 8),), 16, 16)], plan_id=1)  # fmt: skip


def test_shares_text_groups_a_pipeline_and_sums_to_the_batch() -> None:
    devices = ["w0", "w1", "w2"]
    before, after = device_shares(PIPE, devices), device_shares(SPLIT, devices)
    assert shares_text(before, PIPE) == "w0+w1:32 w2:0"
    assert shares_text(after, SPLIT) == "w0:8 w1:8 w2:16"
    assert shares_text(before, None) == "w0:32 w1:32 w2:0"  # no plan: per device
    decision = Decision(SPLIT, "re-plan", 9, 0.2, 0.1, 0.0, 10.0, True,
                        shares_before=before, shares_after=after)  # fmt: skip
    line = decision.console_line(11, PIPE)
    assert "shares w0+w1:32 w2:0 -> w0:8 w1:8 w2:16;" in line
    for text in ("w0+w1:32 w2:0", "w0:8 w1:8 w2:16"):  # each side sums to the global batch
        assert sum(int(x.split(":")[1]) for x in text.split()) == 32
