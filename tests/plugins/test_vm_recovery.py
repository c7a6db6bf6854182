"""VmRecovery through the training sensor, against the local cloud: what a retried sensor try
finds when the try before it was cut short in the middle of a recovery, and what a training seen
dead means while its VM is going away."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone

import pytest
from google.api_core.exceptions import NotFound

from airflow.providers.ssh.hooks.ssh import SSHHook
from airflow.sdk import PokeReturnValue
from airflow.sdk.exceptions import AirflowFailException
from localcloud.connections import LOCAL_RUN_CONF
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.storage import StorageEndpointHook
from maxtext_sft.tasks.vm_sensors import TrainingCheckpointSensor
from maxtext_sft.run.spec import build_run_spec

pytestmark = pytest.mark.e2e
BUCKET = "recovery-tests"
CONNECTIONS = {"gcp_conn_id": "google_cloud_default", "ssh_conn_id": "maxtext_sft_vm_ssh", "hf_conn_id": "huggingface_default"}


@pytest.fixture
def spec(local_cloud, pipeline_connections):
    local_cloud.create_bucket(BUCKET, exist_ok=True)
    key = SSHHook(ssh_conn_id=CONNECTIONS["ssh_conn_id"], remote_host="not-connected")
    run_id = f"recovery-test-{uuid.uuid4().hex[:8]}"
    return build_run_spec(
        {**LOCAL_RUN_CONF, "output_location": f"gs://{BUCKET}/{run_id}", "steps": 6, "checkpoint_period": 2},
        dag_id="maxtext_sft",
        run_id=run_id,
        generation=0,
        started=datetime.now(timezone.utc),
        default_project_id=None,
        ssh_user=key.username,
        ssh_public_key=f"{key.pkey.get_name()} {key.pkey.get_base64()}",
    )


@pytest.fixture
def compute(spec):
    hook = ComputeEngineEndpointHook(gcp_conn_id=CONNECTIONS["gcp_conn_id"])
    yield hook
    where = {"resource_id": spec.vm_name, "project_id": spec.project_id, "zone": spec.zone}
    hook.delete_instance(request_id=None, **where)


def poke_until_done(sensor, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = sensor.poke({})
        if isinstance(result, PokeReturnValue) and result.is_done:
            return result.xcom_value
        time.sleep(1)  # the sensor's poke interval
    raise AssertionError(f"training did not finish within {timeout} s")


def test_a_retry_finishes_a_recovery_that_was_cut_short(spec, compute, local_cloud):
    """Ledger entry 1 written and the VM recreated, then the try died: no training runs on the new
    VM. The next poke installs, converts and starts the training there, and counts no new recovery."""
    local_cloud.clear_requests()
    storage = StorageEndpointHook(gcp_conn_id=CONNECTIONS["gcp_conn_id"])
    assert storage.create_once(f"{spec.vm_recoveries_uri}/1.json", '{"recovery": 1}')
    compute.insert_instance(body=spec.instance_body(), zone=spec.zone, project_id=spec.project_id)
    sensor = TrainingCheckpointSensor(task_id="wait_for_final_checkpoint", spec=spec.to_dict(), **CONNECTIONS)

    result = poke_until_done(sensor)

    assert result["final_step"] == 6
    assert result["vm_recoveries"] == 1
    assert storage.names_under(spec.vm_recoveries_uri) == ["1-resumed.json", "1.json"]  # no new recovery
    assert storage.committed_steps(spec.checkpoints_dir)[-1] == 6
    inserts = [r for r in local_cloud.requests() if r["method"] == "POST" and r["path"].endswith("/instances")]
    assert len(inserts) == 1  # the test's own: the sensor recreated nothing


def test_without_a_ledger_a_vm_with_no_training_fails_the_sensor(spec, compute):
    """No recovery was under way, so a VM without a training is an error, not something to resume."""
    compute.insert_instance(body=spec.instance_body(), zone=spec.zone, project_id=spec.project_id)
    sensor = TrainingCheckpointSensor(task_id="wait_for_final_checkpoint", spec=spec.to_dict(), **CONNECTIONS)
    deadline = time.monotonic() + 120
    with pytest.raises(AirflowFailException, match="No training was ever started on VM"):
        while time.monotonic() < deadline:
            sensor.poke({})  # False while the VM's sshd is not up yet
            time.sleep(1)  # the sensor's poke interval


def test_a_training_seen_dead_on_a_vm_going_away_is_a_lost_vm_not_a_failed_training(spec, local_cloud):
    """Before the sensor fails a run for a dead training it asks the Compute API about the VM: a
    RUNNING VM means the training failed; a STOPPING one (a preemption's guest shutdown kills the
    workload, maybe before sshd) means the VM is being lost, so the poke waits; a gone one is
    recovered, within the run's bound."""
    compute = ComputeEngineEndpointHook(gcp_conn_id=CONNECTIONS["gcp_conn_id"])
    where = {"resource_id": spec.vm_name, "zone": spec.zone, "project_id": spec.project_id}
    compute.insert_instance(body=spec.instance_body(), zone=spec.zone, project_id=spec.project_id)
    sensor = TrainingCheckpointSensor(task_id="wait_for_final_checkpoint", spec=spec.to_dict(), **CONNECTIONS)
    try:
        assert sensor._lost_with_its_vm({}, spec) is False

        # A delete whose operation hangs holds the instance STOPPING with its VM up.
        local_cloud.set_faults({"operation_hangs": {"operation": "delete"}})
        compute.get_conn().instances().delete(
            project=spec.project_id, zone=spec.zone, instance=spec.vm_name
        ).execute()
        assert compute.get_instance(**where).status == "STOPPING"
        assert sensor._lost_with_its_vm({}, spec) is True
    finally:
        local_cloud.set_faults({})  # the delete goes on

    deadline = time.monotonic() + 60
    while instance_exists(compute, where):  # the API's word: the VM's processes end before its record
        assert time.monotonic() < deadline, "the delete did not finish"
        time.sleep(0.2)  # polling interval; the instance is asked for again each time
    storage = StorageEndpointHook(gcp_conn_id=CONNECTIONS["gcp_conn_id"])
    for number in range(1, spec.max_vm_recoveries + 1):  # the run's recoveries used up
        assert storage.create_once(f"{spec.vm_recoveries_uri}/{number}.json", "{}")
    with pytest.raises(AirflowFailException, match=r"no longer exists.*has already recreated its VM 2 time"):
        sensor._lost_with_its_vm({}, spec)


def instance_exists(compute: ComputeEngineEndpointHook, where: dict) -> bool:
    try:
        compute.get_instance(**where)
    except NotFound:
        return False
    return True
