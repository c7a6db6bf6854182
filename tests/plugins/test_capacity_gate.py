"""CreateVmOperator's capacity gate against the local cloud: no insert while the reservation is
full, a refused insert goes back to waiting, the wait is bounded, and a retry adopts its VM without
being gated. Through `dag.test()` (the worker's path: its trigger runs in-process); under
Airflow's real scheduler and triggerer, where each try starts on the triggerer
(CreateVmStartTrigger), in tests/dags/test_pipeline_capacity.py."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest

from airflow.providers.ssh.hooks.ssh import SSHHook
from google.api_core.exceptions import NotFound

from localcloud.connections import LOCAL_RUN_CONF, LOCAL_ZONE
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.tasks.outcome import FAILURE_KEY
from maxtext_sft.run.spec import RunSpec, build_run_spec

pytestmark = pytest.mark.e2e
DAG_ID = "capacity_gate_test"
BUNDLE = Path(__file__).parent / "capacity_gate_dags"
GATE_BUNDLE = {
    "name": "capacity-gate-tests",
    "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
    "kwargs": {"path": str(BUNDLE)},
}
# Airflow's DAGs folder and the gate's bundle: for the dag.test() runs here and for the capacity
# file's Airflow (tests/dags/test_pipeline_capacity.py).
BUNDLE_CONFIG_LIST = json.dumps([
    {"name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle", "kwargs": {}},
    GATE_BUNDLE,
])


@pytest.fixture
def gate_dag(airflow_db, pipeline_connections, monkeypatch):
    """The one-task DAG, from a DAG bundle of its own (dag.test() runs only DAGs in a bundle)."""
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", BUNDLE_CONFIG_LIST)
    bag = DagBag(str(BUNDLE))
    assert bag.import_errors == {}
    return bag.dags[DAG_ID]


@pytest.fixture
def compute(pipeline_connections):
    return ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")


@pytest.fixture
def names(local_cloud, compute):
    """A fresh reservation name and spec factory per test; every VM they made is deleted after."""
    suffix = uuid.uuid4().hex[:8]
    made: list[RunSpec] = []

    def spec(reservation: str) -> RunSpec:
        key = SSHHook(ssh_conn_id="maxtext_sft_vm_ssh", remote_host="not-connected")
        made.append(
            build_run_spec(
                {**LOCAL_RUN_CONF, "reservation": reservation},
                dag_id=DAG_ID,
                run_id=f"gate-{uuid.uuid4().hex[:8]}",
                generation=0,
                started=datetime.now(timezone.utc),
                default_project_id=None,
                ssh_user=key.username,
                ssh_public_key=f"{key.pkey.get_name()} {key.pkey.get_base64()}",
            )
        )
        return made[-1]

    yield f"gate-{suffix}", spec
    local_cloud.set_faults({})
    for made_spec in made:
        try:
            compute.delete_instance(
                resource_id=made_spec.vm_name, project_id=made_spec.project_id, zone=made_spec.zone, request_id=None
            )
        except NotFound:
            pass


def add_reservation(cloud, name: str, count: int = 1) -> None:
    cloud.add_reservation(name, count, zone=LOCAL_ZONE, project=LOCAL_RUN_CONF["project_id"])


def create(compute, spec: RunSpec) -> None:
    """Insert `spec`'s VM directly (what another run, or an earlier try of this one, did)."""
    compute.insert_instance(body=spec.instance_body(), zone=spec.zone, project_id=spec.project_id)


def run_conf(spec: RunSpec, max_wait: float = 5) -> dict:
    return {
        "project_id": spec.project_id,
        "zone": spec.zone,
        "vm_name": spec.vm_name,
        "request_id": spec.request_id,
        "body": spec.instance_body(),
        "lifetime_minutes": spec.max_run_duration_minutes,
        "reservation": spec.reservation,
        "max_capacity_wait_minutes": max_wait,
    }


def inserts_of(requests: list[dict], vm_name: str) -> list[dict]:
    return [
        r for r in requests
        if r["method"] == "POST" and r["path"].endswith("/instances") and (r["body"] or {}).get("name") == vm_name
    ]


def is_read_of(request: dict, reservation: str) -> bool:
    return request["method"] == "GET" and request["path"].endswith(f"/reservations/{reservation}")


def task_instance(dag_run):
    from airflow.models import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        ti = session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == dag_run.run_id, TaskInstance.task_id == "create_vm"
            )
        ).one()
        failure = session.scalars(
            select(XComModel).where(
                XComModel.dag_id == DAG_ID, XComModel.run_id == dag_run.run_id, XComModel.key == FAILURE_KEY
            )
        ).one_or_none()
        return str(ti.state), ti.try_number, failure and XComModel.deserialize_value(failure)


def test_a_full_reservation_holds_the_create_until_a_machine_is_given_back(gate_dag, names, local_cloud, compute):
    reservation, spec_for = names
    add_reservation(local_cloud, reservation)
    other_run, ours = spec_for(reservation), spec_for(reservation)
    create(compute, other_run)
    seen_while_full: list[list[dict]] = []
    failures: list[BaseException] = []

    def give_back_when_waiting():
        """Once create_vm read the reservation and its trigger did twice, delete the other VM."""
        try:
            until = time.monotonic() + 60
            while sum(is_read_of(r, reservation) for r in local_cloud.requests()) < 3:
                assert time.monotonic() < until, "create_vm never waited on the reservation"
                time.sleep(0.1)  # polling interval of this check
            seen_while_full.append(local_cloud.requests())
            compute.delete_instance(
                resource_id=other_run.vm_name, project_id=other_run.project_id, zone=other_run.zone, request_id=None
            )
        except BaseException as error:  # noqa: BLE001 - raised again in the test's thread
            failures.append(error)

    helper = threading.Thread(target=give_back_when_waiting, daemon=True)
    helper.start()
    dag_run = gate_dag.test(run_conf=run_conf(ours))
    helper.join(timeout=60)

    assert failures == []
    assert task_instance(dag_run)[:2] == ("success", 1)
    assert inserts_of(seen_while_full[0], ours.vm_name) == []  # nothing asked while it was full
    requests = local_cloud.requests()
    [insert] = inserts_of(requests, ours.vm_name)
    assert insert["status"] == 200
    deleted_at = next(
        i for i, r in enumerate(requests) if r["method"] == "DELETE" and r["path"].endswith(f"/{other_run.vm_name}")
    )
    assert requests.index(insert) > deleted_at
    assert compute.get_instance(resource_id=ours.vm_name, project_id=ours.project_id, zone=ours.zone).status == "RUNNING"


# Where Compute Engine says a reservation is full: on the insert's operation (the shape the
# sources show, and the emulator's own answer for a real full reservation), or, injectable,
# synchronously (412 conditionNotMet).
REFUSED_FOR_CAPACITY = {
    "on the operation": ("operation_errors", {"operation": "insert"}, 200),
    "synchronously": ("insert_rejected", {}, 412),
}


@pytest.mark.parametrize("where", sorted(REFUSED_FOR_CAPACITY))
def test_an_insert_refused_for_capacity_goes_back_to_waiting(where, gate_dag, names, local_cloud, compute):
    """The reservation reads free, but the cloud refuses the insert twice (another run got there
    first): each refusal sends create_vm back to the trigger, and the third insert succeeds."""
    kind, rule, refused_status = REFUSED_FOR_CAPACITY[where]
    reservation, spec_for = names
    add_reservation(local_cloud, reservation)
    ours = spec_for(reservation)
    local_cloud.set_faults(
        {kind: {**rule, "preset": "reservation_full", "name_regex": f"^{ours.vm_name}$", "count": 2}}
    )

    dag_run = gate_dag.test(run_conf=run_conf(ours))

    assert task_instance(dag_run)[:2] == ("success", 1)  # no task retry: the gate waited
    requests = local_cloud.requests()
    inserts = inserts_of(requests, ours.vm_name)
    assert [r["status"] for r in inserts] == [refused_status, refused_status, 200]
    assert len({r["query"]["requestId"] for r in inserts}) == 3  # a refused request's id is not reused
    for refused, following in zip(inserts, inserts[1:]):
        between = requests[requests.index(refused) + 1 : requests.index(following)]
        # The trigger's read, then create_vm's own before it inserts again.
        assert sum(is_read_of(r, reservation) for r in between) >= 2, between


def test_a_refusal_that_cannot_pass_fails_at_once_naming_it(gate_dag, names, local_cloud, compute):
    """An insert whose operation fails for a reason no wait or retry changes (here: no such
    reservation, as the cloud sees it) fails the try without retries, naming code and message."""
    reservation, spec_for = names
    add_reservation(local_cloud, reservation)
    ours = spec_for(reservation)
    local_cloud.set_faults({"operation_errors": {"operation": "insert", "preset": "reservation_not_found"}})

    dag_run = gate_dag.test(run_conf=run_conf(ours))

    state, try_number, failure = task_instance(dag_run)
    assert (state, try_number) == ("failed", 1)
    assert (
        f"reservation not found (CONDITION_NOT_MET: Specified reservation '{reservation}' does not exist.)" in failure
    ), failure
    assert len(inserts_of(local_cloud.requests(), ours.vm_name)) == 1


def test_the_wait_is_bounded_and_then_fails_naming_the_reservation(gate_dag, names, local_cloud, compute):
    reservation, spec_for = names
    add_reservation(local_cloud, reservation)
    other_run, ours = spec_for(reservation), spec_for(reservation)
    create(compute, other_run)
    started = time.monotonic()

    dag_run = gate_dag.test(run_conf=run_conf(ours, max_wait=0.05))  # 3 s

    assert time.monotonic() - started >= 3
    state, try_number, failure = task_instance(dag_run)
    assert (state, try_number) == ("failed", 1)  # not retried: a retry would wait all over again
    assert re.search(rf"no free capacity in reservation {reservation} \(count 1\) for [3-9] seconds", failure), failure
    assert "max_capacity_wait_minutes=0.05" in failure
    requests = local_cloud.requests()
    assert inserts_of(requests, ours.vm_name) == []
    assert sum(is_read_of(r, reservation) for r in requests) >= 3  # it waited, reading, until the deadline


def test_a_retry_adopts_its_vm_without_asking_the_reservation(gate_dag, names, local_cloud, compute):
    """The run's VM already exists (an earlier try created it) and holds the reservation's only
    machine: the create adopts it, and neither reads the reservation nor inserts."""
    reservation, spec_for = names
    add_reservation(local_cloud, reservation)
    ours = spec_for(reservation)
    create(compute, ours)
    local_cloud.clear_requests()

    dag_run = gate_dag.test(run_conf=run_conf(ours))

    assert task_instance(dag_run)[:2] == ("success", 1)
    requests = local_cloud.requests()
    assert inserts_of(requests, ours.vm_name) == []
    assert not any(is_read_of(r, reservation) for r in requests)


def test_with_the_gate_preflight_lets_a_full_reservation_wait(names, local_cloud, compute):
    """A full reservation fails the preflight unless create_vm's gate will wait for a machine."""
    from maxtext_sft.tasks.preflight import PreflightFailed, check_reservation

    reservation, spec_for = names
    add_reservation(local_cloud, reservation)
    create(compute, spec_for(reservation))
    ours = spec_for(reservation)

    found = check_reservation(compute, ours, capacity_gate=True)
    assert "all 1 ct6e-standard-8t machines in use; create_vm waits up to 720 minutes for one" in found
    with pytest.raises(PreflightFailed, match="has no free capacity: 1 of 1 machines in use"):
        check_reservation(compute, ours)
    no_wait = RunSpec.from_dict({**ours.to_dict(), "max_capacity_wait_minutes": 0})
    with pytest.raises(PreflightFailed, match="has no free capacity"):
        check_reservation(compute, no_wait, capacity_gate=True)
