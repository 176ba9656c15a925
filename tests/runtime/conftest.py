"""Shared fixtures for runtime tests; the fork-and-run helper is
:func:`hetrain.runtime.testing.run_ranks`."""
