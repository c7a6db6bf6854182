"""Waits for capacity under Airflow's real scheduler, on one Airflow deployed as on Cloud Composer
3: capacity without a reservation (docs/capacity.md), a queued flex-start request and a Spot run's
preemptions, a recovery while the reservation is full, and the capacity gate's create started on
the triggerer. A file of its own, so that its minutes
run beside the scheduler file's on another worker (tests/conftest.py deals out files)."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from tests.conftest import REPO
from tests.dags import fault_tally
from tests.dags.conftest import module_airflow, wait_for_run_end, wait_until
from tests.plugins.test_capacity_gate import DAG_ID as GATE_DAG_ID
from tests.plugins.test_capacity_gate import (  # noqa: F401 - compute and names are fixtures
    BUNDLE_CONFIG_LIST, add_reservation, compute, create, inserts_of, is_read_of, names, run_conf,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def airflow(tmp_path_factory, pipeline_connections, postgres_server, migrated_database, wheel_site):
    """One Airflow for this file's runs, deployed as on Cloud Composer 3: every component has the
    installed wheel and the DAG files, and nothing from plugins/ (an empty plugins folder, plugins/
    not on the path), so create_vm's start, the training's wait and the capacity waits run on a
    triggerer that has the package only as an installed distribution; the declared jobs' folder is
    named by MAXTEXT_SFT_JOBS_DIR (Composer's mounted data/ folder, say). The capacity is read
    every 2 s (the triggers' first events after the tests' 10 s, not 60): each recovery's and the
    queue's waits are the cloud's, not the polls'. Beside the DAGs folder, a bundle of its own
    holds the capacity gate's one-task DAG (tests/plugins/capacity_gate_dags)."""
    settings = {
        "AIRFLOW__MAXTEXT_SFT__CAPACITY_POLL_SECONDS": "2",
        "MAXTEXT_SFT_JOBS_DIR": str(REPO / "include" / "jobs"),
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": BUNDLE_CONFIG_LIST,
        # The janitor DAG deletes the VMs these tests make straight through the API (their DAG runs
        # do not exist) whenever its 10-minute tick falls inside a test: once the other run's VM in
        # the gate test (2026-12-08), which freed the reservation early. Here it is not scheduled.
        "AIRFLOW__MAXTEXT_SFT__JANITOR_INTERVAL_MINUTES": "0",
    }
    with module_airflow(tmp_path_factory, pipeline_connections, postgres_server, migrated_database, settings,
                        installed_package=wheel_site) as instance:
        yield instance


def test_the_package_is_loaded_from_the_installed_wheel_only(airflow):
    assert airflow.get("/api/v2/importErrors")["total_entries"] == 0
    sources = {p["name"]: p["source"] for p in airflow.get("/api/v2/plugins")["plugins"]}
    assert {"maxtext_sft", "maxtext_sft_run_notes"} <= set(sources), sources
    assert all("maxtext-sft-airflow" in sources[name] for name in ("maxtext_sft", "maxtext_sft_run_notes")), sources


def test_flex_start_and_spot_runs_wait_deferred_resume_after_preemptions_and_leave_nothing(airflow, local_cloud):
    """Without a reservation (issue 31), three runs at once: a flex-start request queued 20 s, its
    create_vm deferred while the instance is PENDING, then trained; a Spot run preempted twice
    mid-training (the cloud's preempted operation, a soft off, the VM deleted), which resumes each
    time from its last checkpoint, counted as preemptions, not as lost VMs; and a flex-start
    request that expires in the queue, which fails naming the expiry. Then a Spot run whose insert
    meets the zone's stockout twice waits deferred and runs."""
    from localcloud.connections import LOCAL_RUN_CONF
    from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
    from maxtext_sft.run.spec import RunSpec
    from tests.dags.test_fault_matrix import training_logged

    for _ in ("Spot preemptions", "the flex-start expiry", "the Spot stockouts"):
        fault_tally.fault_injected()
    bucket = "scheduler-capacity"
    local_cloud.create_bucket(bucket, exist_ok=True)
    compute = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    no_reservation = {**LOCAL_RUN_CONF, "reservation": None, "poke_interval_seconds": 2}
    # Holds a training after step 4 until the faults are lifted; the flex-start run's 4 steps end first.
    local_cloud.set_vm_file("maxtext-faults.json", json.dumps({"train_sft": {"stall_at_step": 5}}))
    # The expiring request's VM has a name of its own, so that its rule is its own. It expires 20 s
    # after its insert, not sooner: a trigger event that comes before the executor's report of the
    # deferral (apache/airflow#72716) has the scheduler fail the try that was already resuming, and
    # the retry makes a new request. A loaded suite saw the report 8 s after the deferral, behind an
    # expiry at 6 s (2026-12-07), before the trigger's first read waited capacity_first_read_seconds
    # (10 s in the tests' Airflow). A real request lasts 90 s at least.
    expiring_prefix = "flex-expiring"
    local_cloud.set_faults({"flex_start_wait": [
        {"seconds": 20, "name_regex": "^maxtext-sft-"},
        {"seconds": 20, "expires": True, "name_regex": f"^{expiring_prefix}-"},
    ]})
    try:
        spot_run = airflow.trigger({
            **no_reservation, "capacity": "spot", "steps": 8, "checkpoint_period": 3, "max_vm_recoveries": 0,
            "output_location": f"gs://{bucket}/{time.time_ns()}",
        })
        flex_run = airflow.trigger({**no_reservation, "capacity": "flex-start", "flex_start_valid_minutes": 2, "steps": 4})
        expiring_run = airflow.trigger({**no_reservation, "capacity": "flex-start", "flex_start_valid_minutes": 2,
                                        "steps": 4, "vm_name_prefix": expiring_prefix})
        flex = RunSpec.from_dict(wait_until(lambda: airflow.xcom(flex_run, "plan_run", "spec"), 120, "the flex-start spec"))
        # (create_vm starts on the triggerer, which hands a run without a reservation straight back.)
        flex_status = lambda: compute.instance_status(flex.vm_name, zone=flex.zone, project_id=flex.project_id)  # noqa: E731
        wait_until(lambda: flex_status() == "PENDING", 120, "the flex-start request to be queued")
        wait_until(lambda: airflow.task_states(flex_run)["create_vm"] == "deferred", 30, "create_vm to wait deferred")
        assert flex_status() == "PENDING"  # still queued: the wait holds no worker slot

        spot = RunSpec.from_dict(wait_until(lambda: airflow.xcom(spot_run, "plan_run", "spec"), 120, "the Spot spec"))
        for preemption in (1, 2):
            wait_until(
                lambda: any(vm["name"] == spot.vm_name and not vm.get("preempted")
                            and training_logged(local_cloud, vm, "completed step: 4,") for vm in local_cloud.vms()),
                300, f"step 4 on the Spot VM before preemption {preemption}",
            )
            local_cloud.preempt_vm(spot.vm_name, soft_off_seconds=1)
            wait_until(lambda: all(vm["name"] != spot.vm_name or vm.get("preempted") for vm in local_cloud.vms())
                       and compute.instance_status(spot.vm_name, zone=spot.zone, project_id=spot.project_id) is None,
                       60, f"preemption {preemption} to delete the VM")
        local_cloud.set_vm_file("maxtext-faults.json", "{}")  # the third VM trains to the end
        finals = {run: wait_for_run_end(airflow, run, timeout=420) for run in (flex_run, spot_run)}
        expired = wait_for_run_end(airflow, expiring_run, timeout=300)

        # The zone is out of Spot machines for the next two inserts (on their operations).
        local_cloud.set_faults({"insert_fails_after_accept": {"preset": "zone_resource_pool_exhausted", "count": 2}})
        stockout_run = airflow.trigger({**no_reservation, "capacity": "spot", "steps": 4,
                                        "output_location": f"gs://{bucket}/{time.time_ns()}"})
        stocked_out = wait_for_run_end(airflow, stockout_run, timeout=420)
    finally:
        local_cloud.set_vm_file("maxtext-faults.json", "{}")
        local_cloud.set_faults({})
    for run, final in finals.items():
        assert final["state"] == "success", airflow.task_states(run)
    # The expired request: create_vm failed naming the expiry, and its instance is gone.
    assert expired["state"] == "failed", airflow.task_states(expiring_run)
    assert airflow.task_states(expiring_run)["create_vm"] == "failed"
    expiry_log = json.dumps(airflow.task_log(expiring_run, "create_vm"))
    fault_tally.failed_run(expiry_log, "expired after")
    assert "expired after" in expiry_log, expiry_log[-3000:]
    expiring = RunSpec.from_dict(airflow.xcom(expiring_run, "plan_run", "spec"))
    assert compute.instance_status(expiring.vm_name, zone=expiring.zone, project_id=expiring.project_id) is None
    # The stockouts were waited out deferred, within create_vm's first try.
    assert stocked_out["state"] == "success", airflow.task_states(stockout_run)
    create_log = json.dumps(airflow.task_log(stockout_run, "create_vm"))
    assert "Asking for the VM again after the zone's stockout" in create_log, create_log[-3000:]
    assert airflow.get(f"/api/v2/dags/maxtext_sft/dagRuns/{stockout_run}/taskInstances/create_vm")["try_number"] == 1
    stockout = RunSpec.from_dict(airflow.xcom(stockout_run, "plan_run", "spec"))
    leaked = [vm for vm in local_cloud.vms() if vm["name"] in (flex.vm_name, spot.vm_name, expiring.vm_name, stockout.vm_name)]
    fault_tally.vms_left(leaked)
    assert leaked == []
    flex_summary = airflow.xcom(flex_run, "summarize_run")
    assert flex_summary["vm"]["capacity"] == "flex-start" and flex_summary["vm"]["waited_for_capacity_seconds"] >= 15
    spot_summary = airflow.xcom(spot_run, "summarize_run")
    assert spot_summary["preemptions"] == 2 and airflow.xcom(spot_run, "wait_for_final_checkpoint")["vm_recoveries"] == 2
    # Each VM was held after step 4 and resumed from the checkpoint of step 3: less than a period lost.
    assert all(row["preempted"] and row["resumes_after_step"] == 3 and row["steps_lost"] in (None, 0, 1)
               for row in spot_summary["recoveries"]), spot_summary["recoveries"]


def test_a_recovery_while_the_reservation_is_full_waits_deferred_holding_no_worker_slot(airflow, local_cloud):
    """The VM is deleted mid-training (durable checkpoints) and another run takes the freed
    machine. The training sensor finds the VM gone and the reservation full: it defers to the
    capacity trigger (the scheduler's task state says deferred) until the machine comes back, then
    recreates the VM and resumes. bench/recovery_slots.py measures, from Airflow's event log and
    the run's ledger, the worker-slot-seconds held while it waited: none. On this file's Airflow
    (as on Composer 3), the capacity wait runs on a triggerer that has the package only as an
    installed wheel."""
    from bench.recovery_slots import AirflowApi, measure, report
    from localcloud.connections import LOCAL_PROJECT, LOCAL_RESERVATION_COUNT, LOCAL_RUN_CONF, LOCAL_ZONE
    from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
    from maxtext_sft.run.spec import RunSpec
    from tests.dags.test_fault_matrix import training_logged

    fault_tally.fault_injected()
    reservation = LOCAL_RUN_CONF["reservation"]
    bucket = "scheduler-recovery"
    local_cloud.create_bucket(bucket, exist_ok=True)
    compute = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    blocker = None
    local_cloud.add_reservation(reservation, 1, zone=LOCAL_ZONE, project=LOCAL_PROJECT)
    local_cloud.set_vm_file("maxtext-faults.json", json.dumps({"train_sft": {"stall_at_step": 5}}))
    try:
        run_id = airflow.trigger({
            **LOCAL_RUN_CONF, "steps": 8, "checkpoint_period": 2, "poke_interval_seconds": 2,
            "output_location": f"gs://{bucket}/{time.time_ns()}",
        })
        spec = RunSpec.from_dict(wait_until(lambda: airflow.xcom(run_id, "plan_run", "spec"), 120, "the run's spec"))
        wait_until(lambda: any(training_logged(local_cloud, vm, "completed step: 4,") for vm in local_cloud.vms()),
                   300, "step 4 of the training")
        local_cloud.set_vm_file("maxtext-faults.json", "{}")  # the resumed training runs to its end
        local_cloud.terminate_vm(spec.vm_name, "DELETE")
        blocker = f"{spec.vm_name}-other"  # another run takes the machine
        compute.insert_instance(body={**spec.instance_body(), "name": blocker}, zone=spec.zone, project_id=spec.project_id)

        wait_until(lambda: airflow.task_states(run_id)["wait_for_final_checkpoint"] == "deferred", 120,
                   "the training sensor to defer")
        reads = lambda: sum(1 for r in local_cloud.requests() if r["method"] == "GET" and f"/reservations/{reservation}" in r["path"])  # noqa: E731
        seen = reads()
        wait_until(lambda: reads() >= seen + 3, 60, "the triggerer to read the full reservation three times")
        assert airflow.task_states(run_id)["wait_for_final_checkpoint"] == "deferred"
        compute.delete_instance(resource_id=blocker, zone=spec.zone, project_id=spec.project_id, request_id=None)
        wait_until(lambda: all(vm["name"] != blocker for vm in local_cloud.vms()), 60, "the other run's VM to go")
        blocker = None

        final = wait_for_run_end(airflow, run_id, timeout=420)
    finally:
        local_cloud.set_vm_file("maxtext-faults.json", "{}")
        if blocker:
            compute.delete_instance(resource_id=blocker, zone=spec.zone, project_id=spec.project_id, request_id=None)
        local_cloud.add_reservation(
            reservation, LOCAL_RESERVATION_COUNT, zone=LOCAL_ZONE, project=LOCAL_PROJECT
        )
    states = airflow.task_states(run_id)
    assert final["state"] == "success", states
    leaked = [vm for vm in local_cloud.vms() if vm["name"].startswith(spec.vm_name)]
    fault_tally.vms_left(leaked)
    assert leaked == []
    assert airflow.xcom(run_id, "wait_for_final_checkpoint")["vm_recoveries"] == 1
    # The run-note listener ran in the scheduler, from the installed wheel's entry point.
    note = wait_until(lambda: airflow.run(run_id)["note"], 60, "the run's note")
    assert note.startswith("Succeeded: "), note
    # The training trigger's log lines (it watched steps on the triggerer) are in the task's log.
    sensor_log = json.dumps(airflow.task_log(run_id, "wait_for_final_checkpoint"))
    assert "TrainingStatusTrigger" in sensor_log and "training progress: step 8, loss" in sensor_log, sensor_log[-3000:]

    rows = measure(AirflowApi(airflow.url, airflow.token), "maxtext_sft", run_id, "google_cloud_default")
    print(report(rows))
    [row] = rows
    assert row["capacity_wait_seconds"] > 5  # three reads of the full reservation, at least
    assert row["capacity_stretches_inside"] == 0 and row["capacity_slot_seconds_inside"] == 0, row


def test_under_the_scheduler_a_waiting_create_is_deferred_until_a_machine_is_free(
    airflow, names, local_cloud, compute
):
    """The scheduler starts create_vm on the triggerer (start_from_trigger): the trigger reads the
    full reservation, then, once a machine is given back, inserts the VM; the worker only adopts
    it. No worker ran create_vm before the insert."""
    wait_until(lambda: airflow.get(f"/api/v2/dags/{GATE_DAG_ID}", missing_ok=True), 300, "the gate's DAG to be parsed")
    reservation, spec_for = names
    add_reservation(local_cloud, reservation)
    other_run, ours = spec_for(reservation), spec_for(reservation)
    create(compute, other_run)

    run_id = airflow.trigger(run_conf(ours, max_wait=10), dag_id=GATE_DAG_ID)
    wait_until(lambda: airflow.task_states(run_id, GATE_DAG_ID).get("create_vm") == "deferred", 180, "create_vm to defer")
    # The triggerer keeps reading; the task stays deferred and asks for no VM.
    wait_until(lambda: sum(is_read_of(r, reservation) for r in local_cloud.requests()) >= 3, 60, "the trigger's reads")
    assert airflow.task_states(run_id, GATE_DAG_ID)["create_vm"] == "deferred"
    assert inserts_of(local_cloud.requests(), ours.vm_name) == []

    compute.delete_instance(
        resource_id=other_run.vm_name, project_id=other_run.project_id, zone=other_run.zone, request_id=None
    )
    run = wait_for_run_end(airflow, run_id, timeout=180, dag_id=GATE_DAG_ID)

    assert run["state"] == "success", airflow.task_states(run_id, GATE_DAG_ID)
    inserts = inserts_of(local_cloud.requests(), ours.vm_name)
    # A loaded suite once showed two (2026-12-07, cause not seen): each one's id, time and answer.
    assert len(inserts) == 1, [(r["query"].get("requestId"), r.get("time"), r["status"]) for r in inserts]
    [insert] = inserts
    assert insert["status"] == 200
    # Not the worker's insert (its request id is the try's): the trigger's, with an id of its own.
    assert insert["query"]["requestId"] != str(uuid.uuid5(uuid.NAMESPACE_URL, f"{ours.request_id}/1"))
    [create_vm] = [ti for ti in airflow.task_instances(run_id, GATE_DAG_ID) if ti["task_id"] == "create_vm"]
    assert create_vm["try_number"] == 1  # resumed, not retried
    log = json.dumps(airflow.task_log(run_id, "create_vm", dag_id=GATE_DAG_ID))
    assert "1 of 1 machines in use; waiting (deferred, no worker slot)" in log, log
    assert f"machines free: creating {ours.vm_name}" in log, log
    assert f"Instance {ours.vm_name} already exists (RUNNING): adopting it" in log, log
    assert compute.get_instance(resource_id=ours.vm_name, project_id=ours.project_id, zone=ours.zone).status == "RUNNING"
