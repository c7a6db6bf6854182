"""The environment the harness gives Airflow's components (localcloud.airflow_harness)."""

from __future__ import annotations

import os
import subprocess
import sys

from localcloud.airflow_harness import Airflow
from tests.conftest import GC_THRESHOLDS, REPO
from tests.dags.conftest import AIRFLOW_SITE, AIRFLOW_TEST_SETTINGS

PRINT_THRESHOLDS = "import gc; print(gc.get_threshold())"


def test_site_folders_come_first_on_the_path_and_the_tests_one_sets_the_gc_thresholds(tmp_path):
    env = Airflow(tmp_path / "home", AIRFLOW_TEST_SETTINGS, site_dirs=(AIRFLOW_SITE,))._component_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(AIRFLOW_SITE), str(REPO / "plugins")]
    # Each component is `python -m airflow` in this environment: its interpreter starts with them.
    started = subprocess.run([sys.executable, "-c", PRINT_THRESHOLDS], env=env, capture_output=True, text=True,
                             timeout=60, check=True)
    assert started.stdout.strip() == str(GC_THRESHOLDS)
    assert GC_THRESHOLDS != gc_defaults()

    wheel = tmp_path / "site-packages"
    plain = Airflow(tmp_path / "home", AIRFLOW_TEST_SETTINGS, installed_package=wheel)._component_env()
    assert plain["PYTHONPATH"] == str(wheel)  # no site folder: nothing but the package
    started = subprocess.run([sys.executable, "-c", PRINT_THRESHOLDS], env=plain, capture_output=True, text=True,
                             timeout=60, check=True)
    assert started.stdout.strip() == str(gc_defaults())


def gc_defaults() -> tuple[int, int, int]:
    """A fresh interpreter's thresholds (this session's own are the tests')."""
    probe = subprocess.run([sys.executable, "-I", "-c", PRINT_THRESHOLDS], capture_output=True, text=True,
                           timeout=60, check=True)
    return tuple(int(n) for n in probe.stdout.strip("()\n").split(","))
