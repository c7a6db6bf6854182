"""Capacity without a reservation (docs/capacity.md) under Airflow's real scheduler: a queued
flex-start request and a Spot run's preemptions. A file of its own, so that its minutes run beside
the scheduler file's on another worker (tests/conftest.py deals out files)."""

from __future__ import annotations

import json
import time

import pytest

from tests.dags import fault_tally
from tests.dags.conftest import wait_for_run_end, wait_until

pytestmark = pytest.mark.e2e


# The triggers' first event after 5 s, not 60, and the queue read every 2 s: each recovery's and the
# queue's waits are the cloud's, not the polls'.
@pytest.mark.airflow_config(
    {"AIRFLOW__MAXTEXT_SFT__CAPACITY_FIRST_READ_SECONDS": "5", "AIRFLOW__MAXTEXT_SFT__CAPACITY_POLL_SECONDS": "2"}
)
def test_a_queued_flex_start_run_and_a_twice_preempted_spot_run_both_succeed_leaving_nothing(airflow, local_cloud):
    """Without a reservation, two runs at once (issue 31): a flex-start request queued 20 s, its
    create_vm deferred while the instance is PENDING, then trained; and a Spot run preempted twice
    mid-training (the cloud's preempted operation, a soft off, the VM deleted), which resumes each
    time from its last checkpoint, counted as preemptions, not as lost VMs."""
    from localcloud.connections import LOCAL_RUN_CONF
    from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
    from maxtext_sft.run.spec import RunSpec
    from tests.dags.test_fault_matrix import training_logged

    fault_tally.fault_injected()
    bucket = "scheduler-capacity"
    local_cloud.create_bucket(bucket, exist_ok=True)
    compute = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    no_reservation = {**LOCAL_RUN_CONF, "reservation": None, "poke_interval_seconds": 2}
    # Holds a training after step 4 until the faults are lifted; the flex-start run's 4 steps end first.
    local_cloud.set_vm_file("maxtext-faults.json", json.dumps({"train_sft": {"stall_at_step": 5}}))
    local_cloud.set_faults({"flex_start_wait": {"seconds": 20}})
    try:
        spot_run = airflow.trigger({
            **no_reservation, "capacity": "spot", "steps": 8, "checkpoint_period": 3, "max_vm_recoveries": 0,
            "output_location": f"gs://{bucket}/{time.time_ns()}",
        })
        flex_run = airflow.trigger({**no_reservation, "capacity": "flex-start", "flex_start_valid_minutes": 2, "steps": 4})
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
    finally:
        local_cloud.set_vm_file("maxtext-faults.json", "{}")
        local_cloud.set_faults({})
    for run, final in finals.items():
        assert final["state"] == "success", airflow.task_states(run)
    leaked = [vm for vm in local_cloud.vms() if vm["name"] in (flex.vm_name, spot.vm_name)]
    fault_tally.vms_left(leaked)
    assert leaked == []
    flex_summary = airflow.xcom(flex_run, "summarize_run")
    assert flex_summary["vm"]["capacity"] == "flex-start" and flex_summary["vm"]["waited_for_capacity_seconds"] >= 15
    spot_summary = airflow.xcom(spot_run, "summarize_run")
    assert spot_summary["preemptions"] == 2 and airflow.xcom(spot_run, "wait_for_final_checkpoint")["vm_recoveries"] == 2
    # Each VM was held after step 4 and resumed from the checkpoint of step 3: less than a period lost.
    assert all(row["preempted"] and row["resumes_after_step"] == 3 and row["steps_lost"] in (None, 0, 1)
               for row in spot_summary["recoveries"]), spot_summary["recoveries"]
