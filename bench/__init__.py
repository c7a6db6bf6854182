"""Benchmarks of the package (performance goals are measured here, not in timed tests)."""
