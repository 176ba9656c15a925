"""Trace-driven simulation of online policies (docs/model.md §4, §7): dynamics generators,
converters from
real traces, and the simulator loop. Never imports torch."""
