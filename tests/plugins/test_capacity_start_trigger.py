"""CreateVmStartTrigger, create_vm's try started on the triggerer, against the compute emulator: it
waits while the reservation is full and inserts the VM itself once a machine is free (expiry
label, a request id per insert), goes back to waiting when the cloud refuses the insert for
capacity, hands the try to the worker for anything it does not judge, times out at its deadline,
and survives serialization. The operator starts on the triggerer only with its values as XComArgs."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from localcloud.compute import testing
from localcloud.connections import LOCAL_PROJECT, LOCAL_ZONE
from maxtext_sft.cloud.instances import EXPIRY_LABEL
from maxtext_sft.cloud.capacity import CreateVmStartTrigger

pytestmark = pytest.mark.e2e
WHERE = {"project": LOCAL_PROJECT, "zone": LOCAL_ZONE}


@pytest.fixture
def names(local_cloud, pipeline_connections):
    """A reservation of one machine and two VM names (another run's, ours); both VMs deleted after."""
    suffix = uuid.uuid4().hex[:8]
    reservation, other, ours = f"start-{suffix}", f"start-other-{suffix}", f"start-ours-{suffix}"
    local_cloud.add_reservation(reservation, 1, **WHERE)
    yield reservation, other, ours
    local_cloud.set_faults({})
    for name in (other, ours):
        if any(vm["name"] == name for vm in local_cloud.vms()):
            delete(local_cloud, name)


def insert(cloud, name: str, reservation: str) -> None:
    compute = testing.discovery_client(cloud.compute_endpoint)
    op = compute.instances().insert(body=testing.instance_body(name, zone=LOCAL_ZONE, reservation=reservation), **WHERE).execute()
    assert "error" not in testing.wait_operation(compute, op, **WHERE)


def delete(cloud, name: str) -> None:
    compute = testing.discovery_client(cloud.compute_endpoint)
    op = compute.instances().delete(instance=name, **WHERE).execute()
    assert "error" not in testing.wait_operation(compute, op, **WHERE)


def provider_body(rest_body: dict) -> dict:
    """A REST insert body in the form the provider's insert takes (google-cloud-compute's field
    names), as plan_run hands the pipeline's over."""
    from google.cloud.compute_v1.types import Instance

    return Instance.to_dict(Instance.from_json(json.dumps(rest_body)))


def start_trigger(name: str, reservation: str | None, max_wait_minutes: float = 2, **options) -> CreateVmStartTrigger:
    """The trigger as the triggerer has it after rendering: each field plan_run's XCom as JSON text."""
    values = {
        "project_id": LOCAL_PROJECT,
        "zone": LOCAL_ZONE,
        "resource_id": name,
        "request_id": f"req-{name}",
        "body": provider_body(testing.instance_body(name, zone=LOCAL_ZONE, reservation=reservation)),
        "lifetime_minutes": 90,
        "reservation": reservation,
        "max_capacity_wait_minutes": max_wait_minutes,
    }
    return CreateVmStartTrigger(**{key: json.dumps(value) for key, value in values.items()}, poll_interval=0.2, **options)


def inserts_of(cloud, name: str) -> list[dict]:
    return [
        r for r in cloud.requests()
        if r["method"] == "POST" and r["path"].endswith("/instances") and (r["body"] or {}).get("name") == name
    ]


def reads_of(cloud, reservation: str) -> int:
    return sum(r["method"] == "GET" and r["path"].endswith(f"/reservations/{reservation}") for r in cloud.requests())


async def first_event(trigger: CreateVmStartTrigger, timeout: float = 60) -> dict:
    return (await asyncio.wait_for(anext(trigger.run()), timeout)).payload


def test_waits_while_full_then_inserts_the_vm_itself(names, local_cloud):
    reservation, other, ours = names
    insert(local_cloud, other, reservation)
    local_cloud.clear_requests()

    async def scenario():
        started = time.time()
        waiting = asyncio.create_task(first_event(start_trigger(ours, reservation)))
        until = time.monotonic() + 30
        while reads_of(local_cloud, reservation) < 3:
            assert time.monotonic() < until, "the trigger never read the reservation"
            assert not waiting.done(), waiting.result()  # it ended while nothing was free
            await asyncio.sleep(0.05)
        assert inserts_of(local_cloud, ours) == []
        await asyncio.to_thread(delete, local_cloud, other)
        return started, await waiting

    started, event = asyncio.run(scenario())

    assert event["status"] == "created", event
    assert started + 120 <= event["deadline"] <= time.time() + 120
    [request] = inserts_of(local_cloud, ours)
    assert request["status"] == 200
    # The expiry label counts from the insert, not from the plan.
    expires = int(request["body"]["labels"][EXPIRY_LABEL])
    assert int(started) + 90 * 60 <= expires <= time.time() + 90 * 60  # whole seconds
    assert request["query"]["requestId"] not in ("", f"req-{ours}")
    [vm] = [vm for vm in local_cloud.vms() if vm["name"] == ours]
    assert vm["status"] == "RUNNING"


def test_an_insert_refused_for_capacity_goes_back_to_waiting(names, local_cloud):
    """The reservation reads free but the insert's operation fails for capacity (another run got
    there first): the trigger waits and inserts again, with a new request id."""
    reservation, _, ours = names
    local_cloud.set_faults(
        {"operation_errors": {"operation": "insert", "preset": "reservation_full", "name_regex": f"^{ours}$", "count": 2}}
    )

    event = asyncio.run(first_event(start_trigger(ours, reservation)))

    assert event["status"] == "created", event
    inserts = inserts_of(local_cloud, ours)
    assert len(inserts) == 3 and len({r["query"]["requestId"] for r in inserts}) == 3


@pytest.mark.parametrize("fault, named", [
    ({"operation_errors": {"operation": "insert", "preset": "reservation_not_found"}}, "does not exist"),
    # A stockout is the task's retries' (with backoff), not a wait on the reservation.
    ({"insert_fails_after_accept": {"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "count": 1}}, "ZONE_RESOURCE_POOL_EXHAUSTED"),
], ids=["a refusal for good", "a stockout"])
def test_an_insert_failure_other_than_capacity_hands_the_try_to_the_worker(fault, named, names, local_cloud):
    reservation, _, ours = names
    local_cloud.set_faults(fault)

    event = asyncio.run(first_event(start_trigger(ours, reservation)))

    assert event["status"] == "go"
    assert named in event["reason"], event
    assert len(inserts_of(local_cloud, ours)) == 1


@pytest.mark.parametrize("case", ["the instance exists", "no reservation", "a missing reservation"])
def test_hands_the_try_to_the_worker_without_inserting(case, names, local_cloud):
    reservation, other, ours = names
    if case == "the instance exists":
        insert(local_cloud, ours, reservation)  # an earlier try's VM, holding the only machine
    local_cloud.clear_requests()
    asked = {"no reservation": None, "a missing reservation": f"{reservation}-gone"}.get(case, reservation)

    event = asyncio.run(first_event(start_trigger(ours, asked)))

    assert event["status"] == "go", event
    assert inserts_of(local_cloud, ours) == []


def test_times_out_at_the_deadline_naming_the_count(names, local_cloud):
    reservation, other, ours = names
    insert(local_cloud, other, reservation)
    started = time.time()

    event = asyncio.run(first_event(start_trigger(ours, reservation, max_wait_minutes=0.03)))  # 1.8 s

    assert time.time() >= started + 1.8
    assert (event["status"], event["count"]) == ("timeout", 1)
    assert inserts_of(local_cloud, ours) == []


def test_serialize_round_trips_through_airflow_serde():
    from airflow.sdk.module_loading import import_string
    from airflow.sdk.serde import deserialize, serialize

    trigger = start_trigger("vm-1", "r-1", gcp_conn_id="gcp", impersonation_chain=["a@p-1.iam.gserviceaccount.com"])
    classpath, kwargs = trigger.serialize()

    assert classpath == "maxtext_sft.cloud.capacity.CreateVmStartTrigger"
    rebuilt = import_string(classpath)(**deserialize(serialize(kwargs)))
    assert rebuilt.serialize() == (classpath, kwargs)


def test_create_vm_starts_on_the_triggerer_only_with_xcom_values():
    """Every field the trigger needs is plan_run's XCom, as a template the triggerer renders (each
    a template field of the task); values written into the DAG, or no reservation, start on the worker."""
    from airflow.sdk import DAG, task
    from maxtext_sft.tasks.compute import CreateVmOperator

    with DAG("create_vm_start", schedule=None):
        @task(multiple_outputs=True)
        def plan_run():
            return {}

        run = plan_run()
        fields = {name: run[name] for name in ("project_id", "zone", "resource_id", "request_id", "body",
                                                 "lifetime_minutes", "max_capacity_wait_minutes")}
        started = CreateVmOperator(task_id="a", reservation=run["reservation"], gcp_conn_id="gcp", **fields)
        no_reservation = CreateVmOperator(task_id="b", gcp_conn_id="gcp", **fields)
        written = CreateVmOperator(task_id="c", reservation=run["reservation"], gcp_conn_id="gcp",
                                   **{**fields, "zone": "us-east5-b"})
    assert started.start_from_trigger is True
    args = started.start_trigger_args
    assert args.trigger_cls == "maxtext_sft.cloud.capacity.CreateVmStartTrigger"
    assert args.next_method == "resume_after_start" and args.timeout is None
    assert args.trigger_kwargs["zone"] == "{{ ti.xcom_pull(task_ids='plan_run', key='zone', map_indexes=-1) | tojson }}"
    rendered = set(CreateVmStartTrigger.RENDERED)
    assert rendered <= set(started.template_fields)  # the triggerer renders only the task's template fields
    assert not no_reservation.start_from_trigger and not written.start_from_trigger
