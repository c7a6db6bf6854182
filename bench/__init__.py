"""Benchmarks of the package (performance goals are measured here, not in timed tests): `make bench`
(bench/run.py) prints one table; bench/dag_parse.py measures the DAG processor's parse cost.
Not product code and not a test."""
