"""The environment the harness gives Airflow's components (localcloud.airflow_harness)."""

from __future__ import annotations

import os
import subprocess
import sys

from localcloud.airflow_harness import Airflow
from tests.conftest import GC_THRESHOLDS, REPO
from tests.dags.conftest import AIRFLOW_SITE, AIRFLOW_TEST_SETTINGS


def test_site_folders_come_first_on_the_path_and_the_tests_one_sets_the_gc_thresholds(tmp_path):
    python_defaults = started_thresholds(None)  # isolated: this session's own are the tests'
    assert GC_THRESHOLDS != python_defaults

    env = Airflow(tmp_path / "home", AIRFLOW_TEST_SETTINGS, site_dirs=(AIRFLOW_SITE,))._component_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(AIRFLOW_SITE), str(REPO / "plugins")]
    # Each component is `python -m airflow` in this environment: its interpreter starts with them.
    assert started_thresholds(env) == GC_THRESHOLDS

    wheel = tmp_path / "site-packages"
    plain = Airflow(tmp_path / "home", AIRFLOW_TEST_SETTINGS, installed_package=wheel)._component_env()
    assert plain["PYTHONPATH"] == str(wheel)  # no site folder: nothing but the package
    assert started_thresholds(plain) == python_defaults


def started_thresholds(env: dict[str, str] | None) -> tuple[int, ...]:
    """The GC thresholds of an interpreter started in `env` (None: isolated from this one's)."""
    isolated = ["-I"] if env is None else []
    probe = subprocess.run([sys.executable, *isolated, "-c", "import gc; print(*gc.get_threshold())"],
                           env=env, capture_output=True, text=True, timeout=60, check=True)
    return tuple(int(n) for n in probe.stdout.split())
