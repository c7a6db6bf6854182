"""A user acting on a running fine-tune through the REST API, under Airflow's real scheduler: a run
marked failed or success, the training sensor skipped, a task cleared after the run. The tests
leave Airflow's components alone: they share one Airflow with the slice's (SHARED_AIRFLOW_GROUP);
a file apart from the scheduler file's, so that they run beside its tests on another worker
(tests/conftest.py deals out files)."""

from __future__ import annotations

import json

import pytest

from tests.dags import fault_tally
from tests.dags.conftest import SHARED_AIRFLOW_GROUP, wait_for_run_end, wait_for_training_watched, wait_until

pytestmark = [pytest.mark.e2e, SHARED_AIRFLOW_GROUP]

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


def test_a_run_marked_failed_mid_training_still_deletes_its_vm(shared_airflow, local_cloud):
    airflow = shared_airflow
    from localcloud.connections import LOCAL_RUN_CONF

    fault_tally.fault_injected()
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
    leaked = local_cloud.vms()
    fault_tally.vms_left(leaked)
    assert leaked == []
    # Airflow brings the run back to running for its teardown; it must still end failed.
    final = wait_for_run_end(airflow, run_id, timeout=120)
    states = airflow.task_states(run_id)
    assert final["state"] == "failed", states
    assert states["check_run_outcome"] == "failed"
    error = outcome_error(airflow, run_id)
    fault_tally.failed_run(error, "wait_for_final_checkpoint=failed")
    assert "wait_for_final_checkpoint=failed" in error
    deletes = [r for r in local_cloud.requests() if r["method"] == "DELETE"]
    assert len(deletes) == 1 and deletes[0]["status"] == 200


def test_a_run_marked_success_mid_training_still_deletes_its_vm(shared_airflow, local_cloud):
    airflow = shared_airflow
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


def test_a_sensor_marked_skipped_mid_training_deletes_the_vm_and_fails_naming_it(shared_airflow, local_cloud):
    airflow = shared_airflow
    """A user skips the running sensor: its downstream tasks are skipped by their trigger rule, the
    teardown still deletes the VM, and the run fails naming the skipped sensor."""

    def skip_sensor(run_id):
        path = f"/api/v2/dags/maxtext_sft/dagRuns/{run_id}/taskInstances/wait_for_final_checkpoint"
        airflow.request("PATCH", path, {"new_state": "skipped"})

    run_id, final = run_acted_on_mid_training(airflow, local_cloud, skip_sensor)
    states = assert_failed_with_vm_deleted(airflow, local_cloud, run_id, final, "wait_for_final_checkpoint=skipped")
    skipped = ("wait_for_final_checkpoint", "export_to_hf", "collect_outputs", "publish_to_hub")
    assert {states[t] for t in skipped} == {"skipped"}


def _instances_made(local_cloud, vm_name: str) -> int:
    return sum(
        1 for r in local_cloud.requests()
        if r["method"] == "POST" and r["path"].endswith("/instances") and r["status"] == 200
        and vm_name in json.dumps(r.get("body") or "")
    )


@pytest.mark.parametrize("downstream", [False, True], ids=["alone", "with the tasks after it"])
def test_clearing_convert_checkpoint_after_the_run_makes_a_new_vm_and_succeeds(shared_airflow, local_cloud, downstream):
    """The run finished and deleted its VM; a user clears convert_checkpoint (after fixing a
    conversion flag, say). Airflow clears its setup and teardown with it (vm_lease, delete_vm),
    not create_vm: the cleared task makes the VM again, installs MaxText on it and converts; with
    the tasks after it cleared too, the training and export run again on that VM. The run ends
    success again, and the VM is deleted again."""
    from localcloud.connections import LOCAL_RUN_CONF

    airflow = shared_airflow
    run_id = airflow.trigger({**LOCAL_RUN_CONF, "steps": 4})
    assert wait_for_run_end(airflow, run_id, timeout=300)["state"] == "success", airflow.task_states(run_id)
    assert local_cloud.vms() == []
    vm_name = airflow.xcom(run_id, "plan_run", "spec")["vm_name"]
    local_cloud.clear_requests()

    airflow.request("POST", "/api/v2/dags/maxtext_sft/clearTaskInstances", {
        "dry_run": False, "dag_run_id": run_id, "task_ids": ["convert_checkpoint"], "only_failed": False,
        "reset_dag_runs": True, "include_downstream": downstream,
    })
    final = wait_for_run_end(airflow, run_id, timeout=300)

    states = airflow.task_states(run_id)
    assert final["state"] == "success", states
    leaked = local_cloud.vms()
    assert leaked == []
    assert _instances_made(local_cloud, vm_name) == 1  # by convert_checkpoint: create_vm was not cleared
    deletes = [r for r in local_cloud.requests() if r["method"] == "DELETE" and r["status"] == 200]
    assert len(deletes) == 1  # delete_vm ran again
    log = json.dumps(airflow.task_log(run_id, "convert_checkpoint", try_number=2))
    assert "Made VM" in log and "On the new VM: install took" in log
    if downstream:
        assert "Started training" in json.dumps(airflow.task_log(run_id, "start_training", try_number=2))
