"""create_slice's capacity gate counts hosts: with fewer free machines than the slice has hosts it
waits (deferred, nothing created), and a reservation that can never hold the slice fails at once.
Against the local cloud's Compute API; the operator is called directly (no scheduler needed)."""

from __future__ import annotations

import types
import uuid

import pytest
from google.api_core.exceptions import NotFound

from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from localcloud.connections import LOCAL_PROJECT, LOCAL_ZONE
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.tasks.slice import CreateSliceOperator
from maxtext_sft.cloud.capacity import ReservationCapacityTrigger
from tests.plugins.test_slice_spec import make_slice_spec
from tests.plugins.test_spec import make_spec

pytestmark = pytest.mark.e2e


def create_slice(spec, reservation: str) -> CreateSliceOperator:
    return CreateSliceOperator(
        task_id=f"create_slice_{uuid.uuid4().hex[:6]}",
        project_id=LOCAL_PROJECT,
        zone=spec.zone,
        body=spec.group_body(),
        hosts=spec.hosts,
        reservation=reservation,
        max_capacity_wait_minutes=5,
        ready_timeout_seconds=60,
        gcp_conn_id="google_cloud_default",
    )


@pytest.fixture
def reservation(local_cloud, pipeline_connections):
    return f"slice-gate-{uuid.uuid4().hex[:8]}"


def test_fewer_free_machines_than_hosts_waits_deferred_without_creating_the_group(local_cloud, reservation):
    local_cloud.add_reservation(reservation, 4, "ct6e-standard-4t", zone=LOCAL_ZONE, project=LOCAL_PROJECT)
    hook = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    other = make_spec(project_id=LOCAL_PROJECT, reservation=reservation, machine_type="ct6e-standard-4t",
                      vm_name_prefix="slice-gate-other")
    hook.insert_instance(body=other.instance_body(), zone=LOCAL_ZONE, project_id=LOCAL_PROJECT)  # 3 of 4 free
    spec = make_slice_spec(project_id=LOCAL_PROJECT, reservation=reservation, vm_name_prefix="slice-gate")
    try:
        with pytest.raises(TaskDeferred) as deferred:
            create_slice(spec, reservation).execute({"ti": types.SimpleNamespace(try_number=1)})
        trigger = deferred.value.trigger
        assert isinstance(trigger, ReservationCapacityTrigger) and trigger.needed == 4
        assert deferred.value.method_name == "resume_after_capacity_wait"
        with pytest.raises(NotFound):  # nothing paid for while waiting
            hook.get_instance_group_manager(resource_id=spec.group_name, zone=LOCAL_ZONE, project_id=LOCAL_PROJECT)
    finally:
        hook.delete_instance(resource_id=other.vm_name, zone=LOCAL_ZONE, project_id=LOCAL_PROJECT)


def test_a_reservation_smaller_than_the_slice_fails_at_once(local_cloud, reservation):
    local_cloud.add_reservation(reservation, 3, "ct6e-standard-4t", zone=LOCAL_ZONE, project=LOCAL_PROJECT)
    spec = make_slice_spec(project_id=LOCAL_PROJECT, reservation=reservation, vm_name_prefix="slice-small")
    with pytest.raises(AirflowFailException, match="holds 3 machines; the slice needs 4: no slice was created"):
        create_slice(spec, reservation).execute({"ti": types.SimpleNamespace(try_number=1)})


def test_preflight_refuses_a_reservation_that_cannot_hold_every_host(local_cloud, reservation):
    """Before anything is paid for: the reservation must hold the slice's every host."""
    from maxtext_sft.tasks.preflight import PreflightFailed, check_reservation

    local_cloud.add_reservation(reservation, 3, "ct6e-standard-4t", zone=LOCAL_ZONE, project=LOCAL_PROJECT)
    spec = make_slice_spec(project_id=LOCAL_PROJECT, reservation=reservation)
    compute = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    with pytest.raises(PreflightFailed, match="holds 3 ct6e-standard-4t machines; the v6e-16 slice needs 4"):
        check_reservation(compute, spec, capacity_gate=True)
    local_cloud.add_reservation(reservation, 4, "ct6e-standard-4t", zone=LOCAL_ZONE, project=LOCAL_PROJECT)
    assert "4 of 4 ct6e-standard-4t free" in check_reservation(compute, spec, capacity_gate=True)
