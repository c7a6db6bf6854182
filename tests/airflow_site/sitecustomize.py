"""Imported at the start of every Python process of the tests' Airflow (tests/dags/conftest.py puts
this folder first on the components' PYTHONPATH): the cyclic garbage collector's thresholds from
$TESTS_GC_THRESHOLDS, the ones the test session's own processes use (tests/conftest.py)."""

import gc
import os

if os.environ.get("TESTS_GC_THRESHOLDS"):
    gc.set_threshold(*(int(value) for value in os.environ["TESTS_GC_THRESHOLDS"].split(",")))
