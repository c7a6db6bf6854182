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
from tests.dags import fault_tally

pytestmark = pytest.mark.e2e


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(1)  # polling interval; the condition is re-read each time
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_for_training_watched(airflow, run_id: str) -> None:
    wait_until(
        lambda: airflow.task_states(run_id).get("wait_for_final_checkpoint") in ("running", "up_for_reschedule"),
        240,
        "training to be watched",
    )


def wait_for_run_end(airflow, run_id: str, timeout: float = 240) -> dict:
    def ended():
        run = airflow.run(run_id)
        return run if run["state"] in ("success", "failed") else None

    return wait_until(ended, timeout, "the run to end")


@pytest.fixture
def airflow(request, tmp_path, pipeline_connections, postgres_server):
    """Airflow on a fresh database; a test's `airflow_config` marker adds settings to its environment."""
    marker = request.node.get_closest_marker("airflow_config")
    settings = marker.args[0] if marker else {}
    database = f"scheduler_{uuid.uuid4().hex[:8]}"
    url = postgres_server.create_database(database)
    env = {**os.environ, **pipeline_connections, **settings}
    instance = Airflow(tmp_path / "airflow-home", env, database_url=url)
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
        wait_for_training_watched(airflow, run_id)
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
        wait_for_training_watched(airflow, run_id)
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


# ----- user actions and a killed worker mid-training (issue 5's rows that need a scheduler) -------

STALLED_TRAINING = {"train_sft": {"stall_at_step": 3}}  # holds the sensor watching until the run ends


def outcome_error(airflow, run_id: str) -> str:
    """check_run_outcome's error (the run's), from its task log."""
    for entry in airflow.task_log(run_id, "check_run_outcome"):
        for detail in (entry.get("error_detail") or []) if isinstance(entry, dict) else []:
            if "The fine-tune did not complete" in str(detail.get("exc_value")):
                return detail["exc_value"]
    raise AssertionError(f"no run error in check_run_outcome's log: {airflow.task_log(run_id, 'check_run_outcome')}")


def run_acted_on_mid_training(airflow, local_cloud, act) -> tuple[str, dict]:
    """Trigger a run whose training stalls; once the sensor watches it, `act(run_id)` as a user
    would. Returns the run id and the ended run."""
    from localcloud.connections import LOCAL_RUN_CONF

    fault_tally.fault_injected()
    local_cloud.clear_requests()
    local_cloud.set_vm_file("maxtext-faults.json", json.dumps(STALLED_TRAINING))
    try:
        run_id = airflow.trigger({**LOCAL_RUN_CONF, "steps": 50})
        wait_for_training_watched(airflow, run_id)
        assert len(local_cloud.vms()) == 1
        act(run_id)
        return run_id, wait_for_run_end(airflow, run_id)
    finally:
        local_cloud.set_vm_file("maxtext-faults.json", "{}")


def assert_failed_with_vm_deleted(airflow, local_cloud, run_id: str, final: dict, cause: str) -> dict:
    """No VM left, one successful delete, and the run failed by check_run_outcome naming `cause`."""
    leaked = local_cloud.vms()
    fault_tally.vms_left(leaked)
    assert leaked == []
    states = airflow.task_states(run_id)
    assert final["state"] == "failed", states
    assert states["delete_vm"] == "success" and states["check_run_outcome"] == "failed"
    error = outcome_error(airflow, run_id)
    fault_tally.failed_run(error, cause)
    assert cause in error and "the VM was deleted" in error
    deletes = [r for r in local_cloud.requests() if r["method"] == "DELETE"]
    assert len(deletes) == 1 and deletes[0]["status"] == 200
    return states


def test_a_run_marked_success_mid_training_still_deletes_its_vm(airflow, local_cloud):
    """Marking a run success sets its running tasks success and skips the pending ones, but leaves
    teardowns alone and the run running while one is pending (airflow/api/common/mark_tasks.py,
    _set_dag_run_terminal_state): delete_vm runs, and check_run_outcome fails the run, since the
    training never finished."""

    def mark_run_success(run_id):
        marked = airflow.request("PATCH", f"/api/v2/dags/maxtext_sft/dagRuns/{run_id}", {"state": "success"})
        assert marked["state"] == "running"  # not "success": its teardowns are still to run

    run_id, final = run_acted_on_mid_training(airflow, local_cloud, mark_run_success)
    states = assert_failed_with_vm_deleted(airflow, local_cloud, run_id, final, "export_to_hf=skipped")
    assert states["wait_for_final_checkpoint"] == "success"  # as marked, not as finished
    assert {states[t] for t in ("export_to_hf", "collect_outputs", "publish_to_hub")} == {"skipped"}


def test_a_sensor_marked_skipped_mid_training_deletes_the_vm_and_fails_naming_it(airflow, local_cloud):
    """A user skips the running sensor: its downstream tasks are skipped by their trigger rule, the
    teardown still deletes the VM, and the run fails naming the skipped sensor."""

    def skip_sensor(run_id):
        path = f"/api/v2/dags/maxtext_sft/dagRuns/{run_id}/taskInstances/wait_for_final_checkpoint"
        airflow.request("PATCH", path, {"new_state": "skipped"})

    run_id, final = run_acted_on_mid_training(airflow, local_cloud, skip_sensor)
    states = assert_failed_with_vm_deleted(airflow, local_cloud, run_id, final, "wait_for_final_checkpoint=skipped")
    skipped = ("wait_for_final_checkpoint", "export_to_hf", "collect_outputs", "publish_to_hub")
    assert {states[t] for t in skipped} == {"skipped"}
