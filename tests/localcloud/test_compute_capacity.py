"""The capacity choices in the compute emulator (issue 31): Spot, flex-start and on-demand VMs next
to reservation-bound ones. What the API refuses of them (through the real gcloud and the Python
client), a flex-start VM's wait for capacity, the preemption of a Spot VM, a Spot stockout, and
the insert bodies gcloud sends for each (tests/fixtures/gcloud-capacity-requests.json)."""

from __future__ import annotations

import json

import pytest
from googleapiclient.errors import HttpError

from localcloud.cloud import LocalCloudError
from localcloud.compute.testing import instance_body, wait_operation
from tests.conftest import poll
from tests.gcloud import gcloud_runner
from tests.localcloud import capacity_capture
from tests.localcloud.test_compute_emulator import error_of, gcloud_create, port_open

PROJECT = "lc-test-project"
ZONE = "us-east5-b"
WHERE = {"project": PROJECT, "zone": ZONE}
SPOT = "--provisioning-model=SPOT --instance-termination-action=DELETE --maintenance-policy=TERMINATE"
FLEX = (
    "--provisioning-model=FLEX_START --instance-termination-action=DELETE --maintenance-policy=TERMINATE "
    "--reservation-affinity=none"
)


@pytest.fixture
def gcloud(tmp_path, compute_cloud):
    return gcloud_runner(tmp_path / "gcloud-config", compute_cloud.compute_endpoint)


def flex_body(name: str, *, run_seconds: int = 600, wait_seconds: int | None = None, **kwargs) -> dict:
    """A flex-start insert body as the create pages show it (REST tab), with the tutorial's image."""
    body = instance_body(
        name,
        zone=ZONE,
        scheduling={
            "provisioningModel": "FLEX_START",
            "maxRunDuration": {"seconds": str(run_seconds)},
            "instanceTerminationAction": "DELETE",
        },
        **kwargs,
    )
    body["reservationAffinity"] = {"consumeReservationType": "NO_RESERVATION"}
    if wait_seconds is not None:
        body["params"] = {"requestValidForDuration": {"seconds": str(wait_seconds)}}
    return body


def refused(call) -> tuple[int, str]:
    with pytest.raises(HttpError) as exc:
        call.execute()
    [error] = error_of(exc.value)["errors"]
    return exc.value.resp.status, error["message"]


def instance_or_none(discovery, name: str) -> dict | None:
    try:
        return discovery.instances().get(instance=name, **WHERE).execute()
    except HttpError as exc:
        if exc.resp.status == 404:
            return None
        raise


def delete(discovery, name: str) -> None:
    try:
        op = discovery.instances().delete(instance=name, **WHERE).execute()
    except HttpError as exc:
        if exc.resp.status == 404:
            return
        raise
    wait_operation(discovery, op, **WHERE)


# ----- what the API refuses ------------------------------------------------------------------


def test_gcloud_spot_and_flex_start_refused_as_the_api_refuses(compute_cloud, gcloud, compute_discovery):
    compute_cloud.add_reservation("lc-capacity-resv", 2, zone=ZONE, project=PROJECT)
    specific = "--reservation-affinity=specific --reservation=lc-capacity-resv"
    alpha = lambda name, flags: gcloud_create(name, flags).replace("gcloud compute", "gcloud alpha compute")
    tpu = "--machine-type=ct6e-standard-8t"
    cases = [
        (
            gcloud_create("lc-cap-0", f"{tpu} {SPOT} {specific}"),
            "Invalid value for field 'resource.scheduling.provisioningModel': 'SPOT'. "
            "Spot and preemptible instances cannot consume a specific reservation.",
        ),
        # gcloud 528 has FLEX_START only in alpha; without --max-run-duration it sends none.
        (alpha("lc-cap-1", f"{tpu} {FLEX}"), "Required field 'resource.scheduling.maxRunDuration' not specified"),
        (
            alpha("lc-cap-2", f"{tpu} {FLEX} --max-run-duration=8d"),
            "Invalid value for field 'resource.scheduling.maxRunDuration.seconds': '691200'. "
            "The max run duration of a FLEX_START instance must be between 10 minutes and 7 days.",
        ),
        (
            alpha("lc-cap-3", f"{tpu} {FLEX} --max-run-duration=5m"),
            "Invalid value for field 'resource.scheduling.maxRunDuration.seconds': '300'. "
            "The max run duration of a FLEX_START instance must be between 10 minutes and 7 days.",
        ),
        (
            alpha("lc-cap-4", f"{tpu} {FLEX.replace('--reservation-affinity=none', specific)} --max-run-duration=1h"),
            "Invalid value for field 'resource.scheduling.provisioningModel': 'FLEX_START'. "
            "Instances with provisioningModel FLEX_START cannot consume a specific reservation.",
        ),
    ]
    compute_cloud.clear_requests()
    for command, message in cases:
        assert message in gcloud(command, fails=True).stderr, command
    inserts = [r for r in compute_cloud.requests() if r["method"] == "POST" and r["path"].endswith("/instances")]
    assert [r["status"] for r in inserts] == [400] * len(cases)
    assert not [v for v in compute_cloud.vms() if v["name"].startswith("lc-cap-")]

    # The same rules through the Python client, and those gcloud cannot send.
    insert = lambda body: compute_discovery.instances().insert(body=body, **WHERE)
    spot = {"provisioningModel": "SPOT", "instanceTerminationAction": "STOP"}
    assert refused(insert(instance_body("lc-cap-py", zone=ZONE, scheduling=spot, reservation="lc-capacity-resv"))) == (
        400,
        cases[0][1],
    )
    legacy = {"preemptible": True}
    assert refused(insert(instance_body("lc-cap-py", zone=ZONE, scheduling=legacy, reservation="lc-capacity-resv"))) == (
        400,
        "Invalid value for field 'resource.scheduling.preemptible': 'true'. "
        "Spot and preemptible instances cannot consume a specific reservation.",
    )
    # skypilot-org/skypilot#3235 and percona/mongo_terraform_ansible#34 quote these two.
    assert refused(
        insert(instance_body("lc-cap-py", zone=ZONE, scheduling={"preemptible": True, "provisioningModel": "STANDARD"}))
    ) == (
        400,
        "Invalid value for field 'resource.scheduling.provisioningModel': 'STANDARD'. "
        "For preemptible, only allowed provisioning_model value is SPOT",
    )
    assert refused(
        insert(instance_body("lc-cap-py", zone=ZONE, scheduling={"preemptible": True, "automaticRestart": True}))
    ) == (
        400,
        "Invalid value for field 'resource.scheduling.preemptible': 'true'. "
        "Scheduling must have preemptible be false when AutomaticRestart is true.",
    )
    no_limit = flex_body("lc-cap-py")
    del no_limit["scheduling"]["maxRunDuration"]
    assert refused(insert(no_limit)) == (400, cases[1][1])
    assert refused(insert(flex_body("lc-cap-py", run_seconds=7 * 24 * 3600 + 1))) == (
        400,
        cases[2][1].replace("691200", str(7 * 24 * 3600 + 1)),
    )
    assert refused(insert(flex_body("lc-cap-py", wait_seconds=7201))) == (
        400,
        "Invalid value for field 'resource.params.requestValidForDuration.seconds': '7201'. "
        "The request valid for duration must be between 0 seconds and 2 hours.",
    )
    assert compute_cloud.add_reservation("lc-capacity-resv", 2, zone=ZONE, project=PROJECT)["specificReservation"][
        "inUseCount"
    ] == "0"


# ----- flex-start: waiting for capacity --------------------------------------------------------


def test_flex_start_vm_waits_pending_for_capacity_then_runs(compute_cloud, compute_discovery):
    name = "lc-flex-wait"
    compute_cloud.set_faults({"flex_start_wait": {"seconds": 2, "name_regex": "^lc-flex-wait$"}})
    try:
        op = compute_discovery.instances().insert(body=flex_body(name, wait_seconds=90), **WHERE).execute()
        pending = compute_discovery.instances().get(instance=name, **WHERE).execute()
        # PENDING, no VM; the insert's operation RUNNING until capacity comes.
        assert pending["status"] == "PENDING"
        assert "params" not in pending  # input only
        assert not [v for v in compute_cloud.vms() if v["name"] == name]
        assert compute_discovery.zoneOperations().get(operation=op["name"], **WHERE).execute()["status"] == "RUNNING"
        done = wait_operation(compute_discovery, op, **WHERE)
        assert "error" not in done, done
        running = compute_discovery.instances().get(instance=name, **WHERE).execute()
        assert running["status"] == "RUNNING"
        assert running["scheduling"]["provisioningModel"] == "FLEX_START"
        assert "terminationTimestamp" in running["resourceStatus"]["scheduling"]
        assert port_open(running["networkInterfaces"][0]["networkIP"])
    finally:
        compute_cloud.set_faults({})
        delete(compute_discovery, name)


def test_flex_start_without_a_wait_fails_at_once_when_no_capacity(compute_cloud, compute_discovery):
    """Without requestValidForDuration (gcloud 528 cannot send it) or under 90 s, capacity must be
    there at once: the operation fails with the zone's stockout and the instance is gone."""
    compute_cloud.set_faults({"flex_start_wait": [{"seconds": 1, "name_regex": "^lc-flex-now"}] * 2})
    try:
        for name, wait in (("lc-flex-now-1", None), ("lc-flex-now-2", 60)):
            op = compute_discovery.instances().insert(body=flex_body(name, wait_seconds=wait), **WHERE).execute()
            done = wait_operation(compute_discovery, op, **WHERE)
            assert done["httpErrorStatusCode"] == 503
            [error] = done["error"]["errors"]
            assert error["code"] == "ZONE_RESOURCE_POOL_EXHAUSTED"
            assert error["message"].startswith(f"The zone 'projects/{PROJECT}/zones/{ZONE}' does not have enough")
            assert instance_or_none(compute_discovery, name) is None
        assert compute_cloud.get_faults() == {}
    finally:
        compute_cloud.set_faults({})


def test_flex_start_request_expires_while_pending(tmp_path, monkeypatch, compute_image_dir):
    """A flex-start VM still PENDING at the end of its requestValidForDuration is deleted and its
    insert fails (the instance life-cycle page). The documented minimum wait is 90 s: this test
    runs an emulator in process with the PENDING threshold lowered to 1 s to see it quickly."""
    from localcloud.compute import instances, leases, lifecycle
    from localcloud.compute.emulator import ComputeEmulator
    from localcloud.compute.resources import Request
    from localcloud.compute.testing import TUTORIAL_IMAGE_KEY

    monkeypatch.setattr(leases, "LEASE_DIR", tmp_path / "leases")
    monkeypatch.setattr(instances, "FLEX_START_MIN_PENDING_SECONDS", 1)
    monkeypatch.setattr(lifecycle, "FLEX_START_MIN_PENDING_SECONDS", 1)
    emulator = ComputeEmulator(tmp_path / "emulator", {TUTORIAL_IMAGE_KEY: compute_image_dir})
    try:
        emulator.set_faults({"flex_start_wait": {"seconds": 60}})
        base = "http://127.0.0.1:1/compute/v1/"
        op = emulator.insert_instance(PROJECT, ZONE, Request({}, flex_body("lc-flex-expiry", wait_seconds=1), base))
        assert emulator.instances[(PROJECT, ZONE, "lc-flex-expiry")].status == "PENDING"
        with emulator.changed:
            stored = emulator.operations[(PROJECT, ZONE, op["name"])]
            assert emulator.changed.wait_for(lambda: stored["status"] == "DONE", 20)
        assert stored["error"]["errors"][0]["code"] == "ZONE_RESOURCE_POOL_EXHAUSTED"
        assert (PROJECT, ZONE, "lc-flex-expiry") not in emulator.instances
    finally:
        emulator.shutdown()
        for ip in list(emulator.leases.held):
            emulator.leases.release(ip)


def test_fault_flex_start_wait_is_validated(compute_cloud):
    for bad in ({}, {"seconds": 0}, {"seconds": 5, "when": 1}, {"seconds": 5, "name_regex": "("}):
        with pytest.raises(LocalCloudError, match="400"):
            compute_cloud.set_faults({"flex_start_wait": bad})
    assert compute_cloud.set_faults({"flex_start_wait": {"seconds": 5}}) == {"flex_start_wait": {"seconds": 5, "count": 1}}
    compute_cloud.set_faults({})


# ----- Spot: preemption and stockouts ---------------------------------------------------------


def test_preempted_spot_vm_is_reported_and_terminated(compute_cloud, compute_vm, compute_discovery, gcloud):
    stop = compute_vm("lc-spot-stop", scheduling={"provisioningModel": "SPOT", "instanceTerminationAction": "STOP"})
    gone = compute_vm("lc-spot-delete", scheduling={"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE"})
    compute_vm("lc-not-spot")
    assert stop["scheduling"]["automaticRestart"] is False and stop["scheduling"]["onHostMaintenance"] == "TERMINATE"

    with pytest.raises(LocalCloudError, match="(?s)400.*only a Spot or preemptible instance is preempted"):
        compute_cloud.preempt_vm("lc-not-spot")
    # The guest's soft off: the instance STOPPING, its processes still up, until it ends.
    preempted = compute_cloud.preempt_vm("lc-spot-stop", soft_off_seconds=60)
    assert (preempted["action"], preempted["status"]) == ("STOP", "STOPPING")
    assert instance_or_none(compute_discovery, "lc-spot-stop")["status"] == "STOPPING"
    [vm] = [v for v in compute_cloud.vms() if v["name"] == "lc-spot-stop"]
    assert vm["preempted"] and vm["status"] == "STOPPING" and port_open(vm["ip"])
    with pytest.raises(LocalCloudError, match="(?s)400.*only a RUNNING instance is preempted"):
        compute_cloud.preempt_vm("lc-spot-stop")
    compute_cloud.preempt_vm("lc-spot-delete", project=PROJECT, zone=ZONE, soft_off_seconds=0.5)
    poll(lambda: instance_or_none(compute_discovery, "lc-spot-delete") is None, 20, "preempted VM deleted")
    assert not port_open(gone["networkInterfaces"][0]["networkIP"])

    # The operations, as zoneOperations.list finds them (Python client, filters of the API).
    ops = compute_discovery.zoneOperations().list(
        filter='operationType = "compute.instances.preempted"', **WHERE
    ).execute()["items"]
    target = f"{compute_cloud.compute_endpoint}projects/{PROJECT}/zones/{ZONE}/instances/lc-spot-stop"
    [op] = [o for o in ops if o["targetLink"] == target]
    assert op["name"] == preempted["operation"] and op["name"].startswith("systemevent-")
    assert {k: op[k] for k in ("kind", "operationType", "status", "progress", "user", "statusMessage", "targetId")} == {
        "kind": "compute#operation",
        "operationType": "compute.instances.preempted",
        "status": "DONE",
        "progress": 100,
        "user": "system",
        "statusMessage": "Instance was preempted.",
        "targetId": stop["id"],
    }
    assert op["insertTime"] == op["startTime"] == op["endTime"]
    assert "error" not in op and "clientOperationId" not in op
    by_target = compute_discovery.zoneOperations().list(
        filter=f'(operationType = "compute.instances.preempted") AND (targetLink = "{target}")', **WHERE
    ).execute()["items"]
    assert [o["name"] for o in by_target] == [op["name"]]

    # gcloud compute operations list --filter, as preemption guides use it.
    listed = json.loads(
        gcloud(
            f"gcloud compute operations list --project={PROJECT} "
            "--filter=operationType=compute.instances.preempted --format=json"
        ).stdout
    )
    assert {o["targetLink"].rsplit("/", 1)[1] for o in listed} >= {"lc-spot-stop", "lc-spot-delete"}
    assert {o["user"] for o in listed} == {"system"}



def test_spot_soft_off_ends_in_terminated(compute_cloud, compute_vm, compute_discovery):
    vm = compute_vm("lc-spot-term", scheduling={"provisioningModel": "SPOT", "instanceTerminationAction": "STOP"})
    compute_cloud.preempt_vm("lc-spot-term", soft_off_seconds=1)
    stopped = poll(
        lambda: (i := instance_or_none(compute_discovery, "lc-spot-term"))["status"] == "TERMINATED" and i,
        20,
        "preempted VM TERMINATED",
    )
    assert "lastStopTimestamp" in stopped and "natIP" not in stopped["networkInterfaces"][0]["accessConfigs"][0]
    assert not port_open(vm["networkInterfaces"][0]["networkIP"])
    assert not [v for v in compute_cloud.vms() if v["name"] == "lc-spot-term"]


def test_gcloud_spot_create_meets_a_stockout_and_the_preemptible_quota(compute_cloud, gcloud):
    create = gcloud_create("lc-spot-out", f"--machine-type=ct6e-standard-8t {SPOT}")
    try:
        compute_cloud.set_faults(
            {"operation_errors": {"operation": "insert", "preset": "zone_resource_pool_exhausted", "name_regex": "^lc-spot-out$"}}
        )
        out = gcloud(create, fails=True).stderr
        # gcloud prints an operation's error as YAML, its message folded over lines.
        assert "code: ZONE_RESOURCE_POOL_EXHAUSTED" in out, out
        assert (
            f"The zone 'projects/{PROJECT}/zones/{ZONE}' does not have enough resources available to fulfill the "
            "request. Try a different zone, or try again later."
        ) in " ".join(out.split()), out
        compute_cloud.set_faults({"insert_rejected": {"preset": "preemptible_tpu_quota_exceeded"}})
        quota = gcloud(create, fails=True)
        assert "Quota 'PREEMPTIBLE_TPU_V6E' exceeded.  Limit: 0.0 in region us-east5." in quota.stderr, quota.stderr
        compute_cloud.set_faults({"operation_errors": {"operation": "insert", "preset": "preemptible_tpu_quota_exceeded"}})
        assert "Quota 'PREEMPTIBLE_TPU_V6E' exceeded." in gcloud(create, fails=True).stderr
    finally:
        compute_cloud.set_faults({})
    assert not [v for v in compute_cloud.vms() if v["name"] == "lc-spot-out"]


# ----- what gcloud sends ------------------------------------------------------------------------


def test_gcloud_capacity_commands_match_the_capture(compute_cloud, tmp_path):
    """gcloud 528's insert bodies for the tutorial's create as Spot, on-demand and flex-start
    (tests/fixtures/gcloud-capacity-requests.json, made by tests/localcloud/capacity_capture.py)."""
    fresh = capacity_capture.capture(compute_cloud, gcloud_runner(tmp_path / "gcloud", compute_cloud.compute_endpoint))
    assert fresh == json.loads(capacity_capture.FIXTURE.read_text())
