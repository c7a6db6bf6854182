"""The rehearsal DAG against a real Google Cloud project: the project's opt-in system test, as
Airflow's providers have theirs (`-m gcp`). It runs `maxtext_sft_rehearsal` exactly as users run
it, from dags/, with `dag.test()` (no scheduler needed), and costs a few cents: a CPU VM for some
minutes. Skipped unless the environment gives it a project:

    MAXTEXT_SFT_GCP_RUN_CONF   the run conf, JSON: at least project_id and reservation (and
                               output_location, hub_repo_id of a private repo, to check those)
    AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT, AIRFLOW_CONN_MAXTEXT_SFT_VM_SSH, AIRFLOW_CONN_HUGGINGFACE_DEFAULT
                               the three connections (docs/google-cloud.md, Connections)

    make test PYTEST_WORKERS=0 PYTEST_ARGS='-m gcp tests/system'

It cannot run on the machines this project is built on (no Google Cloud there): it is collected
and skipped in every `make test`.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO
from tests.dags.conftest import collect

pytestmark = pytest.mark.gcp
CONF_ENV = "MAXTEXT_SFT_GCP_RUN_CONF"
CONNECTIONS = ("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", "AIRFLOW_CONN_MAXTEXT_SFT_VM_SSH", "AIRFLOW_CONN_HUGGINGFACE_DEFAULT")


@pytest.fixture
def google_cloud_run_conf() -> dict:
    missing = [name for name in (CONF_ENV, *CONNECTIONS) if not os.environ.get(name)]
    if missing:
        pytest.skip(f"no Google Cloud project given ({', '.join(missing)} unset): see this file's docstring")
    conf = json.loads(os.environ[CONF_ENV])
    assert conf.get("project_id") and conf.get("reservation"), f"{CONF_ENV} needs project_id and reservation"
    return conf


def test_the_rehearsal_passes_every_check_on_google_cloud(google_cloud_run_conf, airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(str(REPO / "dags"))
    assert bag.import_errors == {}
    run = collect(bag.dags["maxtext_sft_rehearsal"].test(run_conf=google_cloud_run_conf))
    summary = run.xcoms.get("summarize_run.return_value") or {}
    checks = {row["check"]: row for row in summary.get("rehearsal_checks", [])}
    failed = {name: row["detail"] for name, row in checks.items() if row["result"] not in ("passed", "skipped")}
    assert run.state == "success" and not failed, (run.state, failed)
    assert checks["delete"]["result"] == "passed"  # the summary read the instance back: gone
    print(f"Rehearsal cost: {summary['vm']['vm_hours']:.3f} VM-hours, ${summary['vm']['estimated_cost_usd']}")
