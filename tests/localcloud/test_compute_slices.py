"""Multi-host TPU slices in the compute emulator (issue 21): resource policies, instance templates
and managed instance groups through google-cloud-compute and gcloud; the group's VMs."""

from __future__ import annotations

import json
import re

import paramiko
import pytest
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from localcloud.cloud import LocalCloudError
from localcloud.compute.testing import TUTORIAL_IMAGE_KEY
from tests.conftest import poll
from tests.gcloud import gcloud_runner
from tests.localcloud import slice_capture
from tests.localcloud.test_compute_emulator import port_open, run, ssh, ssh_keys_line

PROJECT = "lc-test-project"
ZONE = "us-east5-b"
REGION = "us-east5"


def clients(cloud) -> dict:
    where = {"credentials": AnonymousCredentials(), "client_options": {"api_endpoint": cloud.base_url}}
    return {
        "policies": compute_v1.ResourcePoliciesClient(**where),
        "templates": compute_v1.InstanceTemplatesClient(**where),
        "groups": compute_v1.InstanceGroupManagersClient(**where),
        "instances": compute_v1.InstancesClient(**where),
        "reservations": compute_v1.ReservationsClient(**where),
    }


@pytest.fixture(scope="module")
def api(compute_cloud):
    return clients(compute_cloud)


def wait(discovery, operation, *, region: str | None = None, zone: str | None = None) -> dict:
    """operations.wait (regional, zonal or global) until DONE; the client's `.result()` would poll
    the real API."""
    if region:
        call = lambda: discovery.regionOperations().wait(project=PROJECT, region=region, operation=operation.name)
    elif zone:
        call = lambda: discovery.zoneOperations().wait(project=PROJECT, zone=zone, operation=operation.name)
    else:
        call = lambda: discovery.globalOperations().wait(project=PROJECT, operation=operation.name)
    return poll(lambda: (op := call().execute())["status"] == "DONE" and op, 60, f"operation {operation.name}")


def template_body(name: str, *, reservation: str, ssh_keys: str = "", labels: dict | None = None) -> dict:
    """An instance template as gcloud's `instance-templates create` makes it for a slice host
    (see tests/fixtures/gcloud-slice-requests.json), with metadata and labels added."""
    image_project, family = TUTORIAL_IMAGE_KEY.split("/", 1)
    properties = {
        "machineType": "ct6e-standard-4t",
        "disks": [
            {
                "boot": True,
                "autoDelete": True,
                "initializeParams": {
                    "sourceImage": f"projects/{image_project}/global/images/family/{family}",
                    "diskSizeGb": "200",
                },
            }
        ],
        "networkInterfaces": [{"network": "global/networks/default", "accessConfigs": [{"type": "ONE_TO_ONE_NAT"}]}],
        "scheduling": {
            "onHostMaintenance": "TERMINATE",
            "automaticRestart": False,
            "provisioningModel": "RESERVATION_BOUND",
            "instanceTerminationAction": "DELETE",
        },
        "reservationAffinity": {
            "consumeReservationType": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name",
            "values": [reservation],
        },
        "labels": labels or {},
    }
    if ssh_keys:
        properties["metadata"] = {"items": [{"key": "ssh-keys", "value": ssh_keys}]}
    return {"name": name, "properties": properties}


def make_slice(api, discovery, name: str, *, size: int, reservation: str, ssh_keys: str = "", labels=None) -> None:
    """A policy, a template and a group of `size` hosts named after `name` (operations DONE)."""
    policy = compute_v1.ResourcePolicy(
        name=f"{name}-policy",
        workload_policy=compute_v1.ResourcePolicyWorkloadPolicy(type_="HIGH_THROUGHPUT", accelerator_topology="4x4"),
    )
    done = wait(discovery, api["policies"].insert(project=PROJECT, region=REGION, resource_policy_resource=policy), region=REGION)
    assert "error" not in done, done
    template = compute_v1.InstanceTemplate.from_json(
        json.dumps(template_body(f"{name}-template", reservation=reservation, ssh_keys=ssh_keys, labels=labels))
    )
    done = wait(discovery, api["templates"].insert(project=PROJECT, instance_template_resource=template))
    assert "error" not in done, done
    group = compute_v1.InstanceGroupManager(
        name=name,
        base_instance_name=name,
        instance_template=f"projects/{PROJECT}/global/instanceTemplates/{name}-template",
        target_size=size,
        resource_policies=compute_v1.InstanceGroupManagerResourcePolicies(
            workload_policy=f"projects/{PROJECT}/regions/{REGION}/resourcePolicies/{name}-policy"
        ),
    )
    done = wait(discovery, api["groups"].insert(project=PROJECT, zone=ZONE, instance_group_manager_resource=group), zone=ZONE)
    assert "error" not in done, done


def delete_slice(api, discovery, name: str) -> None:
    """Delete the group (if any), then its template and policy; each operation DONE."""
    try:
        done = wait(discovery, api["groups"].delete(project=PROJECT, zone=ZONE, instance_group_manager=name), zone=ZONE)
        assert "error" not in done, done
    except gexc.NotFound:
        pass
    for call, kwargs, where in (
        (api["templates"].delete, {"instance_template": f"{name}-template"}, {}),
        (api["policies"].delete, {"region": REGION, "resource_policy": f"{name}-policy"}, {"region": REGION}),
    ):
        try:
            assert "error" not in wait(discovery, call(project=PROJECT, **kwargs), **where)
        except gexc.NotFound:
            pass


def managed(api, name: str) -> list[compute_v1.ManagedInstance]:
    return list(api["groups"].list_managed_instances(project=PROJECT, zone=ZONE, instance_group_manager=name))


def in_use(api, reservation: str) -> int:
    return int(api["reservations"].get(project=PROJECT, zone=ZONE, reservation=reservation).specific_reservation.in_use_count)


def test_slice_of_four_hosts_lifecycle(compute_cloud, compute_discovery, api):
    compute_cloud.add_reservation("slice-res-a", 4, "ct6e-standard-4t", project=PROJECT, zone=ZONE)
    key = paramiko.ECDSAKey.generate()
    name = "slice-a"
    try:
        make_slice(
            api, compute_discovery, name, size=4, reservation="slice-res-a",
            ssh_keys=ssh_keys_line("trainer", key), labels={"slice": name},
        )
        policy = api["policies"].get(project=PROJECT, region=REGION, resource_policy=f"{name}-policy")
        assert policy.status == "READY"
        assert (policy.workload_policy.type_, policy.workload_policy.accelerator_topology) == ("HIGH_THROUGHPUT", "4x4")
        template = api["templates"].get(project=PROJECT, instance_template=f"{name}-template")
        assert template.properties.machine_type == "ct6e-standard-4t"
        assert template.self_link == f"{compute_cloud.compute_endpoint}projects/{PROJECT}/global/instanceTemplates/{name}-template"

        members = poll(lambda: (m := managed(api, name)) and all(i.current_action == "NONE" for i in m) and m, 60, "4 hosts up")
        assert len(members) == 4
        names = [m.name for m in members]
        assert all(re.fullmatch(rf"{name}-[a-z0-9]{{4}}", n) for n in names) and len(set(names)) == 4
        assert {m.instance_status for m in members} == {"RUNNING"}

        group = api["groups"].get(project=PROJECT, zone=ZONE, instance_group_manager=name)
        assert group.target_size == 4 and group.status.is_stable and group.current_actions.none == 4
        assert group.resource_policies.workload_policy.endswith(f"projects/{PROJECT}/regions/{REGION}/resourcePolicies/{name}-policy")

        # The members are ordinary instances: get/list, the template's labels, machine type and
        # reservation (one unit per host), each a reachable sshd with the template's key.
        listed = {i.name: i for i in api["instances"].list(project=PROJECT, zone=ZONE) if i.name in names}
        assert set(listed) == set(names)
        assert all(i.labels == {"slice": name} and i.machine_type.endswith("/ct6e-standard-4t") for i in listed.values())
        assert in_use(api, "slice-res-a") == 4
        ips = [i.network_interfaces[0].network_i_p for i in listed.values()]
        assert len(set(ips)) == 4 and all(port_open(ip) for ip in ips)
        client = ssh(ips[0], "trainer", key)
        try:
            assert run(client, "hostname").strip() in names
        finally:
            client.close()

        # Deleting the group deletes every instance before its operation is DONE.
        done = wait(compute_discovery, api["groups"].delete(project=PROJECT, zone=ZONE, instance_group_manager=name), zone=ZONE)
        assert "error" not in done and done["operationType"] == "delete"
        remaining = {i.name for i in api["instances"].list(project=PROJECT, zone=ZONE)}
        assert not remaining & set(names)
        assert not any(v["name"] in names for v in compute_cloud.vms())
        assert not any(port_open(ip) for ip in ips)
        assert in_use(api, "slice-res-a") == 0
        with pytest.raises(gexc.NotFound):
            api["groups"].get(project=PROJECT, zone=ZONE, instance_group_manager=name)
    finally:
        delete_slice(api, compute_discovery, name)
    with pytest.raises(gexc.NotFound):
        api["templates"].get(project=PROJECT, instance_template=f"{name}-template")
    with pytest.raises(gexc.NotFound):
        api["policies"].get(project=PROJECT, region=REGION, resource_policy=f"{name}-policy")


def test_hosts_the_reservation_cannot_hold_stay_creating_until_it_can(compute_cloud, compute_discovery, api):
    compute_cloud.add_reservation("slice-res-b", 2, "ct6e-standard-4t", project=PROJECT, zone=ZONE)
    name = "slice-b"
    try:
        make_slice(api, compute_discovery, name, size=4, reservation="slice-res-b")

        def settled():
            members = managed(api, name)
            waiting = [m for m in members if m.last_attempt.errors.errors]
            return len(members) == 4 and sum(m.current_action == "NONE" for m in members) == 2 and len(waiting) == 2 and members

        members = poll(settled, 60, "2 hosts up, 2 refused by the reservation")
        refused = [m for m in members if m.current_action != "NONE"]
        assert {m.current_action for m in refused} == {"CREATING"}
        for m in refused:
            (error,) = m.last_attempt.errors.errors
            assert error.code == "CONDITION_NOT_MET"
            assert error.message == "Specified reservation 'slice-res-b' does not have available resources for the request."
        assert not api["groups"].get(project=PROJECT, zone=ZONE, instance_group_manager=name).status.is_stable
        assert in_use(api, "slice-res-b") == 2

        # The group keeps trying: once the reservation holds 4, every host comes up.
        compute_cloud.add_reservation("slice-res-b", 4, "ct6e-standard-4t", project=PROJECT, zone=ZONE)
        poll(lambda: all(m.current_action == "NONE" for m in managed(api, name)), 60, "all 4 hosts up")
        assert in_use(api, "slice-res-b") == 4
    finally:
        delete_slice(api, compute_discovery, name)
    assert in_use(api, "slice-res-b") == 0


def test_recreate_instances_and_the_repair_of_a_lost_host_keep_each_name(compute_cloud, compute_discovery, api):
    """recreateInstances: the operation DONE once flagged, the member RECREATING (the group not
    stable) until a new instance of the same name runs; a host that stops running by no act of
    the group (TERMINATED, as Compute Engine itself ends a VM: LocalCloud.terminate_vm) is
    repaired the same way, the reservation holding one unit per host throughout."""
    compute_cloud.add_reservation("slice-res-r", 2, "ct6e-standard-4t", project=PROJECT, zone=ZONE)
    name = "slice-r"
    try:
        make_slice(api, compute_discovery, name, size=2, reservation="slice-res-r")
        members = poll(lambda: (m := managed(api, name)) and all(i.current_action == "NONE" for i in m) and m, 60, "2 hosts up")
        first = {m.name: m.id for m in members}
        recreated, other = sorted(first)

        op = api["groups"].recreate_instances(
            project=PROJECT, zone=ZONE, instance_group_manager=name,
            instance_group_managers_recreate_instances_request_resource=compute_v1.InstanceGroupManagersRecreateInstancesRequest(
                instances=[f"zones/{ZONE}/instances/{recreated}"]),
        )
        done = wait(compute_discovery, op, zone=ZONE)
        assert "error" not in done and done["operationType"] == "recreateInstances", done
        group = api["groups"].get(project=PROJECT, zone=ZONE, instance_group_manager=name)
        actions = {m.name: m.current_action for m in managed(api, name)}
        if actions[recreated] == "RECREATING":  # the new instance may already run on a quick machine
            assert not group.status.is_stable and group.current_actions.recreating == 1
        assert actions[other] == "NONE"
        back = poll(lambda: (m := {i.name: i for i in managed(api, name)}) and all(
            i.current_action == "NONE" and i.instance_status == "RUNNING" for i in m.values()) and m, 60, "recreated")
        assert set(back) == set(first)
        assert back[recreated].id != first[recreated] and back[other].id == first[other]
        assert api["groups"].get(project=PROJECT, zone=ZONE, instance_group_manager=name).status.is_stable

        # The other host's host fails (TERMINATED, not by the group): repaired under its name, both
        # recorded in the zone's operations as Compute Engine records them.
        compute_cloud.host_event(other, "compute.instances.hostError", project=PROJECT, zone=ZONE)
        repaired = poll(lambda: (m := {i.name: i for i in managed(api, name)}) and m[other].id != first[other] and all(
            i.current_action == "NONE" and i.instance_status == "RUNNING" for i in m.values()) and m, 60, "repaired")
        assert set(repaired) == set(first)
        assert in_use(api, "slice-res-r") == 2
        events = [op for op in compute_discovery.zoneOperations().list(project=PROJECT, zone=ZONE).execute()["items"]
                  if op.get("targetId") == str(first[other])]
        by_type = {op["operationType"]: op for op in events}
        assert {kind: (by_type[kind]["status"], by_type[kind]["user"]) for kind in (
            "compute.instances.hostError", "compute.instances.repair.recreateInstance")} == {
            "compute.instances.hostError": ("DONE", "system"),
            "compute.instances.repair.recreateInstance": ("DONE", "system"),
        }, events
        assert by_type["delete"]["status"] == "DONE"  # the group's deletion of the failed instance
        with pytest.raises(LocalCloudError, match="Unknown host event"):
            compute_cloud.host_event(recreated, "compute.instances.noSuchEvent", project=PROJECT, zone=ZONE)

        # A name that is not the group's is refused, with nothing flagged.
        with pytest.raises(gexc.BadRequest):
            api["groups"].recreate_instances(
                project=PROJECT, zone=ZONE, instance_group_manager=name,
                instance_group_managers_recreate_instances_request_resource=compute_v1.InstanceGroupManagersRecreateInstancesRequest(
                    instances=[f"zones/{ZONE}/instances/not-a-member"]),
            )
        assert {m.current_action for m in managed(api, name)} == {"NONE"}
    finally:
        delete_slice(api, compute_discovery, name)


def error_of(exc: gexc.GoogleAPICallError) -> tuple[int, str, str]:
    return exc.code, exc.errors[0]["reason"] if exc.errors else None, exc.message


def test_errors_in_the_apis_shapes(compute_cloud, compute_discovery, api):
    compute_cloud.add_reservation("slice-res-c", 1, "ct6e-standard-4t", project=PROJECT, zone=ZONE)
    name = "slice-c"
    base = f"projects/{PROJECT}"
    try:
        make_slice(api, compute_discovery, name, size=1, reservation="slice-res-c")

        # 409 alreadyExists for each collection.
        policy = compute_v1.ResourcePolicy(name=f"{name}-policy", workload_policy={"type_": "HIGH_THROUGHPUT"})
        with pytest.raises(gexc.Conflict) as exc:
            api["policies"].insert(project=PROJECT, region=REGION, resource_policy_resource=policy)
        assert error_of(exc.value)[1] == "alreadyExists"
        assert f"The resource '{base}/regions/{REGION}/resourcePolicies/{name}-policy' already exists" in exc.value.message
        template = compute_v1.InstanceTemplate.from_json(json.dumps(template_body(f"{name}-template", reservation="x")))
        with pytest.raises(gexc.Conflict):
            api["templates"].insert(project=PROJECT, instance_template_resource=template)
        group = compute_v1.InstanceGroupManager(
            name=name, base_instance_name=name, target_size=1,
            instance_template=f"{base}/global/instanceTemplates/{name}-template",
        )
        with pytest.raises(gexc.Conflict):
            api["groups"].insert(project=PROJECT, zone=ZONE, instance_group_manager_resource=group)

        # 400 resourceInUseByAnotherResource: the template and the policy while the group uses them.
        user = f"{base}/zones/{ZONE}/instanceGroupManagers/{name}"
        with pytest.raises(gexc.BadRequest) as exc:
            api["templates"].delete(project=PROJECT, instance_template=f"{name}-template")
        assert error_of(exc.value)[1] == "resourceInUseByAnotherResource"
        assert (
            f"The instance_template resource '{base}/global/instanceTemplates/{name}-template' is already being used by '{user}'"
        ) in exc.value.message
        with pytest.raises(gexc.BadRequest) as exc:
            api["policies"].delete(project=PROJECT, region=REGION, resource_policy=f"{name}-policy")
        assert error_of(exc.value)[1] == "resourceInUseByAnotherResource"

        # 404 notFound: a group naming a template or policy that does not exist, and gets.
        missing = compute_v1.InstanceGroupManager(
            name=f"{name}-x", base_instance_name=name, target_size=1,
            instance_template=f"{base}/global/instanceTemplates/no-such-template",
        )
        with pytest.raises(gexc.NotFound) as exc:
            api["groups"].insert(project=PROJECT, zone=ZONE, instance_group_manager_resource=missing)
        assert f"The resource '{base}/global/instanceTemplates/no-such-template' was not found" in exc.value.message
        missing.instance_template = f"{base}/global/instanceTemplates/{name}-template"
        missing.resource_policies = compute_v1.InstanceGroupManagerResourcePolicies(
            workload_policy=f"regions/{REGION}/resourcePolicies/no-such-policy"
        )
        with pytest.raises(gexc.NotFound):
            api["groups"].insert(project=PROJECT, zone=ZONE, instance_group_manager_resource=missing)
        for call in (
            lambda: api["groups"].get(project=PROJECT, zone=ZONE, instance_group_manager="no-such-group"),
            lambda: api["groups"].list_managed_instances(project=PROJECT, zone=ZONE, instance_group_manager="no-such-group"),
            lambda: api["groups"].delete(project=PROJECT, zone=ZONE, instance_group_manager="no-such-group"),
            lambda: api["policies"].get(project=PROJECT, region=REGION, resource_policy="no-such-policy"),
            lambda: api["templates"].delete(project=PROJECT, instance_template="no-such-template"),
        ):
            with pytest.raises(gexc.NotFound):
                call()

    finally:
        delete_slice(api, compute_discovery, name)


def test_bodies_are_checked_against_the_discovery_document(compute_discovery):
    from googleapiclient.errors import HttpError

    with pytest.raises(HttpError) as exc:
        compute_discovery.resourcePolicies().insert(
            project=PROJECT, region=REGION, body={"name": "bad-policy", "workloadPolicy": {"type": "FASTEST"}}
        ).execute()
    assert exc.value.resp.status == 400
    assert "workload_policy.type" in json.loads(exc.value.content)["error"]["message"]
    with pytest.raises(HttpError) as exc:
        compute_discovery.instanceGroupManagers().insert(
            project=PROJECT, zone=ZONE, body={"name": "bad-group", "hosts": 4}
        ).execute()
    assert exc.value.resp.status == 400 and 'Unknown name "hosts"' in json.loads(exc.value.content)["error"]["message"]


def test_gcloud_slice_commands_match_the_capture(compute_cloud, tmp_path):
    """gcloud 528's documented slice commands through the emulator (create, wait until stable,
    list the hosts, delete) send exactly the requests of the checked-in capture."""
    gcloud = gcloud_runner(tmp_path / "gcloud-config", compute_cloud.compute_endpoint)
    expected = json.loads(slice_capture.FIXTURE.read_text())
    got = slice_capture.capture(compute_cloud, gcloud)
    assert got == expected
    assert not any(v["name"].startswith("my-slice-") for v in compute_cloud.vms())
