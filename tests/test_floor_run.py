"""The declared Airflow range is tested by every `make test`: besides the suite on the lock (the
range's newest), this runs `make test-floor` (the floor: Airflow 3.3.1 with MWAA 3.3.1's
providers, the package installed from the wheel; see tests/test_floor.py) in a virtualenv of its
own, beside the other tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from tests.conftest import REPO

FLOOR_RUN_TIMEOUT = 1500  # s: the floor's run took 190 s of pytest beside a whole suite


@pytest.mark.floor
@pytest.mark.timeout(FLOOR_RUN_TIMEOUT + 60)
def test_the_declared_floor_passes():
    if os.environ.get("MAXTEXT_SFT_FLOOR") == "1":
        pytest.skip("already the floor's run")
    # Nothing of this session's settings (its Airflow home and database, connections to its local
    # cloud, xdist's worker id): the floor's run makes its own.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "PYTEST_", "VIRTUAL_ENV", "PYTHON", "HF_", "MAXTEXT_SFT_"))}
    process = subprocess.Popen(["make", "--no-print-directory", "test-floor"], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=FLOOR_RUN_TIMEOUT)
    finally:
        if process.poll() is None:
            # As Ctrl-C would: pytest tears its fixtures down (local cloud, VMs, servers)...
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # ...or the group goes at once
                process.wait()
    assert process.returncode == 0, output[-8000:]
    [summary] = re.findall(r"^=+ (.*) in [0-9.]+s.*=+$", output, re.M)[-1:]
    counts = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (\w+)", summary))
    # Every floor test ran (the floor's own checks skip outside the floor), but for those the
    # Makefile's FLOOR_DESELECT leaves to the suite.
    assert counts.get("passed", 0) >= 40 and set(counts) <= {"passed", "deselected", "warnings"}, summary
