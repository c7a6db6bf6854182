"""Run by `make test-floor` only (MAXTEXT_SFT_FLOOR=1): the slice DAG under dag.test() with the
stand-in, on the declared floor (Airflow 3.3.1, MWAA 3.3.1's providers) with the package from the
wheel. The suite runs the slice under the real scheduler (test_pipeline_slice.py)."""

from __future__ import annotations

import os

import pytest

from tests.dags.test_pipeline_slice import DAG_ID, HOSTS, NAME_KEYS, RESERVATION, _conf, _leftovers

if os.environ.get("MAXTEXT_SFT_FLOOR") != "1":
    pytest.skip("the floor's own checks: make test-floor", allow_module_level=True)

pytestmark = pytest.mark.e2e


def test_a_v6e_16_run_trains_on_every_host_and_leaves_nothing(run_pipeline, local_cloud):
    from localcloud.connections import LOCAL_BUCKET, LOCAL_PROJECT, LOCAL_ZONE

    local_cloud.add_reservation(RESERVATION, HOSTS, "ct6e-standard-4t", zone=LOCAL_ZONE, project=LOCAL_PROJECT)
    run = run_pipeline(_conf(LOCAL_BUCKET, steps=4), dag_id=DAG_ID)
    assert run.state == "success", run.report()
    hosts = run.xcoms["create_slice.return_value"]
    assert len(hosts) == HOSTS
    assert run.xcoms["wait_for_final_checkpoint.return_value"]["final_step"] == 4
    names = {key: run.xcoms[f"plan_run.{key}"] for key in NAME_KEYS}
    assert _leftovers(names) == []
    assert [vm for vm in local_cloud.vms() if vm["name"].startswith(names["group_name"])] == []
