"""Reliability tests: prints the number of fuzzed inputs tried at the end of the session (issue 6
asks for the count). The fuzz tests add to ``config._hetrain_fuzz_counts`` (kind -> count)."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = getattr(config, "_hetrain_fuzz_counts", None)
    if counts:
        parts = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        terminalreporter.write_sep("-", "hetrain fuzzing")
        terminalreporter.write_line(f"fuzzed inputs tried: {sum(counts.values())} ({parts})")
