"""ReservationCapacityTrigger against the compute emulator: it fires when a machine is given back,
times out at its deadline, reports a missing reservation, reads again after a passing failure
(but not after a refusal), and survives serialization."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import datetime, timezone

import pytest

from localcloud.compute import testing
from localcloud.connections import LOCAL_PROJECT, LOCAL_ZONE
from maxtext_sft.cloud.capacity import ReservationCapacityTrigger

pytestmark = pytest.mark.e2e
WHERE = {"project": LOCAL_PROJECT, "zone": LOCAL_ZONE}


@pytest.fixture
def full_reservation(local_cloud, pipeline_connections):
    """A reservation of one machine, taken by a running VM; returns (reservation, VM name)."""
    suffix = uuid.uuid4().hex[:8]
    reservation, holder = f"trigger-full-{suffix}", f"trigger-holder-{suffix}"
    local_cloud.add_reservation(reservation, 1, **WHERE)
    compute = testing.discovery_client(local_cloud.compute_endpoint)
    op = compute.instances().insert(
        body=testing.instance_body(holder, zone=LOCAL_ZONE, reservation=reservation), **WHERE
    ).execute()
    assert "error" not in testing.wait_operation(compute, op, **WHERE)
    yield reservation, holder
    if any(vm["name"] == holder for vm in local_cloud.vms()):
        delete(local_cloud, holder)


def delete(cloud, name: str) -> None:
    compute = testing.discovery_client(cloud.compute_endpoint)
    op = compute.instances().delete(instance=name, **WHERE).execute()
    assert "error" not in testing.wait_operation(compute, op, **WHERE)


def reservation_reads(cloud, reservation: str) -> list[dict]:
    return [r for r in cloud.requests() if r["method"] == "GET" and r["path"].endswith(f"/reservations/{reservation}")]


def reads_of(cloud, reservation: str) -> int:
    return len(reservation_reads(cloud, reservation))


def read_times(cloud, reservation: str) -> list[float]:
    """When the emulator answered each read of `reservation`, as epoch seconds, in order."""
    return [datetime.fromisoformat(r["time"]).timestamp() for r in reservation_reads(cloud, reservation)]


def trigger_for(
    reservation: str, deadline: float, poll_interval: float = 0.2, gcp_conn_id: str = "google_cloud_default", **options
) -> ReservationCapacityTrigger:
    return ReservationCapacityTrigger(
        project_id=LOCAL_PROJECT, zone=LOCAL_ZONE, reservation=reservation, deadline=deadline,
        poll_interval=poll_interval, gcp_conn_id=gcp_conn_id, **options,
    )


async def first_event(trigger: ReservationCapacityTrigger, timeout: float = 60):
    return await asyncio.wait_for(anext(trigger.run()), timeout)


def test_fires_free_once_a_machine_is_given_back(full_reservation, local_cloud):
    reservation, holder = full_reservation

    async def scenario():
        waiting = asyncio.create_task(first_event(trigger_for(reservation, time.time() + 120)))
        # Wait until the trigger has seen the reservation full a few times.
        until = time.monotonic() + 30
        while reads_of(local_cloud, reservation) < 3:
            assert time.monotonic() < until, "the trigger never read the reservation"
            assert not waiting.done(), waiting.result().payload  # fired while nothing was free
            await asyncio.sleep(0.05)
        assert not waiting.done()
        await asyncio.to_thread(delete, local_cloud, holder)
        return await waiting

    event = asyncio.run(scenario())

    assert event.payload["status"] == "free"
    assert (event.payload["free"], event.payload["count"]) == (1, 1)


def test_times_out_at_the_deadline_with_the_reservation_still_full(full_reservation, local_cloud):
    reservation, _ = full_reservation
    deadline = time.time() + 2

    event = asyncio.run(first_event(trigger_for(reservation, deadline, poll_interval=0.5)))

    assert time.time() >= deadline
    assert event.payload == {"status": "timeout", "count": 1, "in_use": 1, "deadline": deadline}
    # It kept looking until the deadline and read once more at it (how many reads fit before it
    # depends on how fast this machine is, so only their order is asserted).
    reads = read_times(local_cloud, reservation)
    assert reads and reads[-1] >= deadline - 0.001, (reads, deadline)  # the log keeps milliseconds
    assert all(t < deadline for t in reads[:-1]), (reads, deadline)


def test_the_first_read_waits_longer_than_the_later_ones(full_reservation, local_cloud):
    """The first read waits out the deferral's report to the scheduler (apache/airflow#72716);
    after it the reservation is read every poll_interval, so a freed machine is taken soon.

    Asserted on the gaps between reads, not on how many fit in a window: the first read also
    builds the Compute client, which under CI's load took longer than a whole window."""
    reservation, _ = full_reservation
    first_read_after = 3.0

    async def scenario() -> float:
        started = time.time()
        waiting = asyncio.create_task(
            first_event(trigger_for(reservation, started + 120, poll_interval=0.1, first_read_after=first_read_after))
        )
        until = time.monotonic() + 60
        while reads_of(local_cloud, reservation) < 3:
            assert time.monotonic() < until, read_times(local_cloud, reservation)
            assert not waiting.done(), waiting.result().payload  # the reservation is still full
            await asyncio.sleep(0.05)
        waiting.cancel()
        return started

    started = asyncio.run(scenario())

    first, second, third = read_times(local_cloud, reservation)[:3]
    assert first >= started + first_read_after - 0.001, (first, started)  # the log keeps milliseconds
    # With first_read_after as the interval the later reads would come 3 s apart, not 0.1 s.
    assert second - first < first_read_after and third - second < first_read_after, (first, second, third)


def test_a_missing_reservation_is_an_error(local_cloud, pipeline_connections):
    event = asyncio.run(first_event(trigger_for("no-such-reservation", time.time() + 60)))

    assert event.payload["status"] == "error"
    assert "reservation no-such-reservation in local-project/us-east5-b does not exist" in event.payload["message"]


@pytest.fixture
def conn_without_client_retries(pipeline_connections, monkeypatch) -> str:
    """The Google connection with the discovery client's own retries off (`num_retries` 0), so
    each failed read reaches the trigger at once instead of after the client's backoff."""
    google = json.loads(pipeline_connections["AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT"])
    google["extra"]["num_retries"] = 0
    monkeypatch.setenv("AIRFLOW_CONN_GCP_NO_CLIENT_RETRIES", json.dumps(google))
    return "gcp_no_client_retries"


@pytest.fixture
def free_reservation(local_cloud, pipeline_connections):
    name = f"trigger-free-{uuid.uuid4().hex[:8]}"
    local_cloud.add_reservation(name, 1, **WHERE)
    yield name
    local_cloud.set_faults({})


def failing_reads(reservation: str, status: int, count: int) -> dict:
    return {"http_errors": [{"method": "GET", "path_regex": f"/reservations/{reservation}$", "status": status, "count": count}]}


def test_passing_read_failures_do_not_end_the_wait(free_reservation, local_cloud, conn_without_client_retries):
    local_cloud.set_faults(failing_reads(free_reservation, 503, 3))
    local_cloud.clear_requests()

    event = asyncio.run(first_event(trigger_for(free_reservation, time.time() + 60, gcp_conn_id=conn_without_client_retries)))

    assert event.payload["status"] == "free", event.payload
    assert reads_of(local_cloud, free_reservation) == 4  # three 503s, then the read that found it free


def test_a_refused_read_ends_the_wait_at_once(free_reservation, local_cloud, conn_without_client_retries):
    local_cloud.set_faults(failing_reads(free_reservation, 403, 1))
    local_cloud.clear_requests()

    event = asyncio.run(first_event(trigger_for(free_reservation, time.time() + 60, gcp_conn_id=conn_without_client_retries)))

    assert event.payload["status"] == "error"
    assert "403" in event.payload["message"], event.payload
    assert reads_of(local_cloud, free_reservation) == 1


def test_only_failed_reads_until_the_deadline_is_an_error_naming_the_failure(
    free_reservation, local_cloud, conn_without_client_retries
):
    local_cloud.set_faults(failing_reads(free_reservation, 503, 1000))
    deadline = time.time() + 1.5

    event = asyncio.run(first_event(trigger_for(free_reservation, deadline, gcp_conn_id=conn_without_client_retries)))

    assert time.time() >= deadline
    assert event.payload["status"] == "error"
    assert "503" in event.payload["message"], event.payload


def test_serialize_round_trips_through_airflow_serde():
    from airflow.sdk.module_loading import import_string
    from airflow.sdk.serde import deserialize, serialize

    deadline = datetime(2030, 5, 17, 12, 30, tzinfo=timezone.utc)
    trigger = ReservationCapacityTrigger(
        project_id="p-1", zone="us-east5-b", reservation="r-1", deadline=deadline.isoformat(),
        gcp_conn_id="gcp", poll_interval=30, impersonation_chain=["a@p-1.iam.gserviceaccount.com"],
        first_read_after=90,
    )
    classpath, kwargs = trigger.serialize()

    assert kwargs["deadline"] == deadline.timestamp()
    # What the task runner stores and the triggerer rebuilds the trigger from.
    rebuilt = import_string(classpath)(**deserialize(serialize(kwargs)))
    assert type(rebuilt) is ReservationCapacityTrigger
    assert rebuilt.serialize() == (classpath, kwargs)
    assert ReservationCapacityTrigger(**{**kwargs, "deadline": deadline}).serialize() == (classpath, kwargs)
