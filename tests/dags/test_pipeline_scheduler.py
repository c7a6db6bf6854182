"""The pipeline under Airflow's real scheduler, for what dag.test() cannot do.

Airflow runs as separate components (localcloud.airflow_harness) on the session's PostgreSQL
server, each test with a database of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from localcloud.airflow_harness import Airflow
from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(1)  # polling interval; the condition is re-read each time
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def airflow(tmp_path, pipeline_connections, postgres_server):
    database = f"scheduler_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(database)
    instance = Airflow(tmp_path / "airflow-home", {**os.environ, **pipeline_connections}, database_url=url)
    try:
        instance.start()
        yield instance
    finally:
        instance.stop()
        postgres_server.drop_database(database)


def test_a_run_marked_failed_mid_training_still_deletes_its_vm(airflow, local_cloud):
    from localcloud.connections import LOCAL_RUN_CONF

    local_cloud.clear_requests()
    local_cloud.set_vm_file("maxtext-faults.json", json.dumps({"train_sft": {"stall_at_step": 3}}))
    try:
        run_id = airflow.trigger({**LOCAL_RUN_CONF, "steps": 50})
        wait_until(
            lambda: airflow.task_states(run_id).get("wait_for_final_checkpoint") in ("running", "up_for_reschedule"),
            240,
            "training to be watched",
        )
        assert len(local_cloud.vms()) == 1
        airflow.request("PATCH", f"/api/v2/dags/maxtext_sft/dagRuns/{run_id}", {"state": "failed"})
        wait_until(lambda: airflow.task_states(run_id).get("delete_vm") == "success", 180, "the delete")
    finally:
        local_cloud.set_vm_file("maxtext-faults.json", "{}")
    assert local_cloud.vms() == []
    # Airflow brings the run back to running for its teardown; it must still end failed.
    final = wait_until(lambda: airflow.run(run_id)["state"] in ("success", "failed") and airflow.run(run_id), 120, "the run to end")
    states = airflow.task_states(run_id)
    assert final["state"] == "failed", states
    assert states["check_run_outcome"] == "failed"
    deletes = [r for r in local_cloud.requests() if r["method"] == "DELETE"]
    assert len(deletes) == 1 and deletes[0]["status"] == 200


@pytest.mark.parametrize("backstop", ["cloud lifetime", "janitor command"])
def test_a_scheduler_killed_mid_training_leaves_no_vm(airflow, local_cloud, backstop):
    """SIGKILL the scheduler mid-training and never restart it: the VM must still go, by its
    maxRunDuration, or (lifetime left to Airflow) by the janitor command alone."""
    from localcloud.connections import LOCAL_PROJECT, LOCAL_RUN_CONF

    lifetime = 60
    conf = {
        **LOCAL_RUN_CONF,
        "steps": 50,
        "max_run_duration_minutes": lifetime // 60,
        "cloud_enforced_lifetime": backstop == "cloud lifetime",
    }
    local_cloud.set_vm_file("maxtext-faults.json", json.dumps({"train_sft": {"stall_at_step": 3}}))
    try:
        run_id = airflow.trigger(conf)
        wait_until(
            lambda: airflow.task_states(run_id).get("wait_for_final_checkpoint") in ("running", "up_for_reschedule"),
            240,
            "training to be watched",
        )
        airflow.kill_scheduler()
        [vm] = local_cloud.vms()
        started = time.time()  # at most this long after the VM started: its lifetime ends <= started + lifetime
        expires = int(_instance_label(vm["name"], "expires-at"))
        if backstop == "cloud lifetime":
            # Compute Engine may act up to 30 s late; the local cloud acts within a second or two.
            wait_until(lambda: local_cloud.vms() == [], lifetime + 35, "the VM's lifetime to delete it")
            assert time.time() <= started + lifetime + 35
        else:
            wait_until(lambda: time.time() > expires + 1, lifetime + 10, "the VM's expiry to pass")
            assert len(local_cloud.vms()) == 1  # nothing else removes it: no scheduler, no cloud lifetime
            result = subprocess.run(
                [sys.executable, "-m", "maxtext_sft.janitor", "--project", LOCAL_PROJECT],
                capture_output=True, text=True, timeout=120,
                env={**os.environ, "PYTHONPATH": str(REPO / "plugins")},
            )
            assert result.returncode == 0, result.stderr
            assert "its lifetime ended" in result.stderr
            assert local_cloud.vms() == []
        assert not airflow.running("scheduler")
    finally:
        local_cloud.set_vm_file("maxtext-faults.json", "{}")


def _instance_label(name: str, key: str) -> str:
    from localcloud.connections import LOCAL_PROJECT
    from maxtext_sft.hooks.compute import ComputeEngineEndpointHook

    instance = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default").get_instance(
        resource_id=name, zone="us-east5-b", project_id=LOCAL_PROJECT
    )
    return instance.labels[key]
