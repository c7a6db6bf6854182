"""What the pipeline reads of Spot and flex-start VMs, against the local cloud: a preempted VM's
operation (what tells a preemption from another loss), and a flex-start request's wait in the
queue as QueuedInsertTrigger sees it, to its machine or to its expiry."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timezone

import pytest
from google.api_core.exceptions import NotFound

from airflow.providers.ssh.hooks.ssh import SSHHook
from localcloud.connections import LOCAL_RUN_CONF
from maxtext_sft.cloud.capacity import QueuedInsertTrigger
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.run.spec import build_run_spec
from maxtext_sft.vm.recovery import VmRecovery

pytestmark = pytest.mark.e2e
CONNECTIONS = {"gcp_conn_id": "google_cloud_default", "ssh_conn_id": "maxtext_sft_vm_ssh", "hf_conn_id": "huggingface_default"}


def spec_of(capacity: str, **more):
    key = SSHHook(ssh_conn_id=CONNECTIONS["ssh_conn_id"], remote_host="not-connected")
    run_id = f"capacity-test-{uuid.uuid4().hex[:8]}"
    conf = {**LOCAL_RUN_CONF, "reservation": None, "capacity": capacity, "output_location": f"gs://capacity-tests/{run_id}"}
    return build_run_spec(
        {**conf, **more}, dag_id="maxtext_sft", run_id=run_id, generation=0, started=datetime.now(timezone.utc),
        default_project_id=None, ssh_user=key.username, ssh_public_key=f"{key.pkey.get_name()} {key.pkey.get_base64()}",
    )


@pytest.fixture
def hook(local_cloud, pipeline_connections):
    local_cloud.create_bucket("capacity-tests", exist_ok=True)
    return ComputeEngineEndpointHook(gcp_conn_id=CONNECTIONS["gcp_conn_id"])


def wait_until_gone(hook, spec, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if hook.instance_status(spec.vm_name, zone=spec.zone, project_id=spec.project_id) is None:
            return
        time.sleep(0.2)  # polling interval: the instance is read again each time
    raise AssertionError(f"{spec.vm_name} is still there after {timeout} s")


def test_a_preemption_is_told_from_another_loss_by_its_operation(hook, local_cloud):
    spec = spec_of("spot")
    where = {"zone": spec.zone, "project_id": spec.project_id}
    recovery = VmRecovery(spec, **CONNECTIONS, log=None)
    hook.insert_instance(body=spec.instance_body(), **where)
    local_cloud.terminate_vm(spec.vm_name, "DELETE")  # lost, but not preempted
    assert hook.preemptions(spec.vm_name, **where) == [] and recovery.preemption() is None

    hook.insert_instance(body=spec.instance_body(), **where)
    local_cloud.preempt_vm(spec.vm_name, soft_off_seconds=0.5)
    wait_until_gone(hook, spec)  # deleted: its termination action
    [operation] = hook.preemptions(spec.vm_name, **where)
    assert operation["operationType"] == "compute.instances.preempted"
    assert operation["targetLink"].endswith(f"/instances/{spec.vm_name}")
    assert recovery.preemption() == operation
    # Another run's preemption is not this run's.
    assert hook.preemptions(spec.vm_name + "-other", **where) == []


def test_a_reservation_run_never_asks_whether_it_was_preempted(hook, local_cloud):
    spec = spec_of("reservation", reservation=LOCAL_RUN_CONF["reservation"])
    local_cloud.clear_requests()
    assert VmRecovery(spec, **CONNECTIONS, log=None).preemption() is None
    assert not [r for r in local_cloud.requests() if "/operations" in r["path"]]


def queued_trigger(spec, operation: str | None, poll_interval: float = 0.5, **options) -> QueuedInsertTrigger:
    return QueuedInsertTrigger(
        project_id=spec.project_id, zone=spec.zone, resource_id=spec.vm_name, deadline=time.time() + 120,
        operation=operation, gcp_conn_id=CONNECTIONS["gcp_conn_id"], poll_interval=poll_interval, **options,
    )


def first_event(trigger: QueuedInsertTrigger) -> dict:
    async def first():
        return (await anext(trigger.run())).payload

    return asyncio.run(first())


def queued_event(spec, operation: str | None) -> dict:
    return first_event(queued_trigger(spec, operation))


def test_a_queued_flex_start_request_is_waited_for_until_its_vm_runs(hook, local_cloud):
    spec = spec_of("flex-start")
    where = {"zone": spec.zone, "project_id": spec.project_id}
    local_cloud.set_faults({"flex_start_wait": {"seconds": 3}})
    try:
        operation = hook.start_insert_instance(body=spec.instance_body(), **where)
        assert hook.instance_status(spec.vm_name, **where) == "PENDING"
        event = queued_event(spec, operation)
        assert event["status"] == "running" and event["queued_seconds"] >= 2.5, event
        assert hook.get_zone_operation(operation, **where)["status"] == "DONE"
    finally:
        local_cloud.set_faults({})
        hook.delete_instance(resource_id=spec.vm_name, request_id=None, **where)


def test_the_first_read_of_a_queued_vm_waits_out_the_deferrals_report(hook, local_cloud):
    """A machine that comes at once must not end the wait before the executor has reported the
    deferral (apache/airflow#72716): the first read waits first_read_after, the later ones
    poll_interval. Asserted on when the emulator answered the reads."""
    spec = spec_of("flex-start")
    where = {"zone": spec.zone, "project_id": spec.project_id}
    first_read_after, poll_interval = 3.0, 0.2
    local_cloud.set_faults({"flex_start_wait": {"seconds": 4}})  # RUNNING 4 s after the insert
    try:
        operation = hook.start_insert_instance(body=spec.instance_body(), **where)
        local_cloud.clear_requests()
        started = time.time()
        trigger = queued_trigger(spec, operation, poll_interval=poll_interval, first_read_after=first_read_after)
        assert trigger.serialize()[1]["first_read_after"] == first_read_after  # kept across a triggerer restart
        event = first_event(trigger)
        reads = [datetime.fromisoformat(r["time"]).timestamp() for r in local_cloud.requests()
                 if r["method"] == "GET" and r["path"].endswith(f"/instances/{spec.vm_name}")]
    finally:
        local_cloud.set_faults({})
        hook.delete_instance(resource_id=spec.vm_name, request_id=None, **where)
    assert event["status"] == "running", event
    assert reads and reads[0] >= started + first_read_after - 0.001, (reads, started)  # the log keeps ms
    # Read again every poll_interval until RUNNING, not every first_read_after.
    assert len(reads) >= 2 and max(b - a for a, b in zip(reads, reads[1:])) < first_read_after, reads


def test_an_expired_flex_start_request_ends_with_its_operations_error(hook, local_cloud):
    spec = spec_of("flex-start")
    where = {"zone": spec.zone, "project_id": spec.project_id}
    local_cloud.set_faults({"flex_start_wait": {"seconds": 2, "expires": True}})
    try:
        operation = hook.start_insert_instance(body=spec.instance_body(), **where)
        event = queued_event(spec, operation)
    finally:
        local_cloud.set_faults({})
    assert event["status"] == "ended" and event["instance_status"] is None, event
    assert event["operation"]["error"]["errors"][0]["code"] == "ZONE_RESOURCE_POOL_EXHAUSTED"
    with pytest.raises(NotFound):
        hook.get_instance(resource_id=spec.vm_name, **where)
