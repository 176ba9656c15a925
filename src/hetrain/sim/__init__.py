"""Trace-driven simulation of online policies (SPEC §4, §7): dynamics generators, converters from
real traces, and the simulator loop. Never imports torch."""
