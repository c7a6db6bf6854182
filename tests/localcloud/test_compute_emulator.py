"""The Compute Engine emulator, through the clients the project uses, and its sshd VMs."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import re
import shlex
import signal
import socket
import time
import uuid
import zlib
from pathlib import Path

import paramiko
import pytest
from google.api_core import exceptions as gexc
from google.cloud import compute_v1
from googleapiclient.errors import HttpError

from localcloud.cloud import LocalCloud, LocalCloudError
from localcloud.compute.vm import pids_in_namespace

from localcloud.compute.testing import TUTORIAL_IMAGE_KEY, discovery_client, instance_body, wait_operation
from tests.conftest import poll
from tests.gcloud import gcloud_runner

# The project and zone the conftest fixtures use.
PROJECT = "lc-test-project"
ZONE = "us-east5-b"

REPO = Path(__file__).resolve().parents[2]
# What gcloud 528 sends for the tutorial's create and delete commands (captured against a local
# endpoint); kept in the repository so a user's clone runs every test.
REFERENCE = REPO / "tests/fixtures/gcloud-tutorial-requests.json"


def error_of(exc: HttpError) -> dict:
    return json.loads(exc.content)["error"]


def ssh_keys_line(user: str, key: paramiko.PKey) -> str:
    return f"{user}:{key.get_name()} {key.get_base64()} {user}"


def ssh(ip: str, user: str, key: paramiko.PKey, host_keys: paramiko.HostKeys | None = None) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    if host_keys is None:
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    else:
        for hostname, keys in host_keys.items():
            for key_type, host_key in keys.items():
                client.get_host_keys().add(hostname, key_type, host_key)
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(ip, 22, username=user, pkey=key, look_for_keys=False, allow_agent=False, timeout=10, auth_timeout=10)
    return client


def run(client: paramiko.SSHClient, command: str) -> str:
    _, stdout, stderr = client.exec_command(command, timeout=20)
    out = stdout.read().decode()
    status = stdout.channel.recv_exit_status()
    assert status == 0, f"{command!r} exited {status}: {stderr.read().decode()}"
    return out


def port_open(ip: str, port: int = 22) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1):
            return True
    except OSError:
        return False


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def detached_sleepers(pidns: str, timeout: float = 10) -> list[int]:
    """Host pids of the VM's detached `sleep 1000`, once it runs: it is exec'd a moment after
    the SSH command that started it returned (longer on a loaded machine)."""

    def found() -> list[int]:
        pids = []
        for pid in pids_in_namespace(pidns):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x001000\x00":
                    pids.append(pid)
            except OSError:
                pass  # exited meanwhile
        return pids

    return poll(found, timeout)


def body_for(name: str, **kwargs) -> dict:
    return instance_body(name, zone=ZONE, **kwargs)


def wait(discovery, operation) -> dict:
    return wait_operation(discovery, operation, project=PROJECT, zone=ZONE)


def delete_and_wait(discovery, name: str) -> dict:
    return wait(discovery, discovery.instances().delete(project=PROJECT, zone=ZONE, instance=name).execute())


# ----- API through the client libraries ---------------------------------------------------


def test_instances_client_lifecycle(compute_cloud, compute_instances_client, compute_discovery):
    client, discovery = compute_instances_client, compute_discovery
    name = "lc-api-1"
    body = body_for(name, labels={"run": "r-1", "team": "ml"})
    request_id = str(uuid.uuid4())
    insert_request = compute_v1.InsertInstanceRequest(
        project=PROJECT, zone=ZONE, instance_resource=compute_v1.Instance.from_json(json.dumps(body)), request_id=request_id
    )
    operation = client.insert(request=insert_request)
    # The work is asynchronous: the insert answers before the VM is up.
    assert operation.name.startswith("operation-")
    assert operation.status != compute_v1.Operation.Status.DONE

    # A retry with the same requestId is the same operation, not a 409.
    again = client.insert(request=insert_request)
    assert again.name == operation.name

    op = wait(discovery, operation.name)
    assert "error" not in op
    assert op["operationType"] == "insert" and op["progress"] == 100
    assert op["targetLink"] == f"{compute_cloud.compute_endpoint}projects/{PROJECT}/zones/{ZONE}/instances/{name}"
    for stamp in ("insertTime", "startTime", "endTime"):
        dt.datetime.fromisoformat(op[stamp])

    instance = client.get(project=PROJECT, zone=ZONE, instance=name)
    assert instance.status == "RUNNING"
    nic = instance.network_interfaces[0]
    assert re.fullmatch(r"127\.0\.0\.\d+", nic.network_i_p) and nic.network_i_p != "127.0.0.1"
    assert nic.access_configs[0].nat_i_p == nic.network_i_p
    assert port_open(nic.network_i_p)

    raw = discovery.instances().get(project=PROJECT, zone=ZONE, instance=name).execute()
    assert raw["kind"] == "compute#instance" and raw["id"].isdigit()
    assert raw["selfLink"] == op["targetLink"] and raw["id"] == op["targetId"]
    assert raw["machineType"] == f"{compute_cloud.compute_endpoint}projects/{PROJECT}/zones/{ZONE}/machineTypes/ct6e-standard-8t"
    assert raw["labels"] == {"run": "r-1", "team": "ml"}
    assert raw["scheduling"]["onHostMaintenance"] == "TERMINATE"
    dt.datetime.fromisoformat(raw["creationTimestamp"])

    # list and aggregatedList with filters.
    def listed(flt):
        return [i.name for i in client.list(request={"project": PROJECT, "zone": ZONE, "filter": flt})]

    assert listed('labels.run = "r-1" AND status = RUNNING') == [name]
    assert listed(f'name = "{name}"') == [name]
    assert listed('labels.run = "other"') == []
    assert listed('labels.run = "r-1" AND status = TERMINATED') == []
    aggregated = discovery.instances().aggregatedList(project=PROJECT, filter='labels.team = "ml"').execute()
    assert [i["name"] for i in aggregated["items"][f"zones/{ZONE}"]["instances"]] == [name]
    pairs = client.aggregated_list(request={"project": PROJECT, "filter": 'labels.run = "r-1"'})
    assert [(zone, [i.name for i in scoped.instances]) for zone, scoped in pairs if scoped.instances] == [(f"zones/{ZONE}", [name])]

    # Same name, different requestId: 409.
    with pytest.raises(gexc.Conflict) as conflict:
        client.insert(project=PROJECT, zone=ZONE, instance_resource=compute_v1.Instance.from_json(json.dumps(body)))
    assert conflict.value.errors[0]["reason"] == "alreadyExists"

    # Guest attributes were not enabled on this instance.
    with pytest.raises(HttpError) as disabled:
        discovery.instances().getGuestAttributes(project=PROJECT, zone=ZONE, instance=name, queryPath="hostkeys/").execute()
    assert disabled.value.resp.status == 400

    deleted = delete_and_wait(discovery, name)
    assert deleted["operationType"] == "delete" and "error" not in deleted
    with pytest.raises(gexc.NotFound) as missing:
        client.get(project=PROJECT, zone=ZONE, instance=name)
    assert missing.value.message.endswith(f"The resource 'projects/{PROJECT}/zones/{ZONE}/instances/{name}' was not found")
    assert not port_open(nic.network_i_p)

    logged = [
        r
        for r in compute_cloud.requests()
        if r["method"] == "POST" and r["path"].endswith("/instances") and (r["body"] or {}).get("name") == name
    ]
    assert [r["status"] for r in logged] == [200, 200, 409]
    assert logged[0]["body"]["labels"] == {"run": "r-1", "team": "ml"}
    assert logged[0]["query"]["requestId"] == request_id


def test_bad_bodies_are_rejected(compute_discovery):
    instances = compute_discovery.instances()

    def rejected(body) -> tuple[int, dict]:
        with pytest.raises(HttpError) as exc:
            instances.insert(project=PROJECT, zone=ZONE, body=body).execute()
        return exc.value.resp.status, error_of(exc.value)

    body = body_for("lc-bad-1")
    body["bogusField"] = 1
    status, error = rejected(body)
    assert status == 400 and '"bogusField"' in error["message"]

    body = body_for("lc-bad-1")
    body["disks"][0]["initializeParams"]["diskSizeGbs"] = "1"
    status, error = rejected(body)
    assert status == 400 and "diskSizeGbs" in error["message"] and "disks[0].initialize_params" in error["message"]

    body = body_for("lc-bad-1")
    body["canIpForward"] = "yes"
    status, error = rejected(body)
    assert status == 400 and "can_ip_forward" in error["message"]

    status, error = rejected(body_for("Bad_Name"))
    assert status == 400 and "resource.name" in error["message"]

    status, error = rejected(body_for("lc-bad-1", labels={"run": "manual__2026-11-29T22:29:25+00:00"}))
    assert status == 400 and error["errors"][0]["reason"] == "invalid"

    body = body_for("lc-bad-1")
    del body["machineType"]
    status, error = rejected(body)
    assert status == 400 and "machineType" in error["message"]

    body = body_for("lc-bad-1")
    body["disks"][0]["initializeParams"]["sourceImage"] = "projects/ubuntu-os-cloud/global/images/family/no-such-family"
    status, error = rejected(body)
    assert status == 404 and error["errors"][0]["reason"] == "notFound"
    assert error["message"] == "The resource 'projects/ubuntu-os-cloud/global/images/family/no-such-family' was not found"

    with pytest.raises(HttpError) as exc:
        instances.get(project=PROJECT, zone=ZONE, instance="lc-bad-1").execute()
    assert exc.value.resp.status == 404


# ----- gcloud ---------------------------------------------------------------------------------


@pytest.fixture
def gcloud(tmp_path):
    """Runs a gcloud command line offline (its own config, a fixed token); see tests/gcloud.py."""
    return gcloud_runner(tmp_path / "gcloud-config")


def test_gcloud_tutorial_commands_match_reference(compute_cloud, gcloud):
    reference = json.loads(REFERENCE.read_text())
    gcloud(f"gcloud config set api_endpoint_overrides/compute {compute_cloud.compute_endpoint}")
    compute_cloud.add_reservation("my-reservation", 1, project="my-project", zone=ZONE)  # the tutorial's
    compute_cloud.clear_requests()
    created = gcloud(reference["create_command"])
    assert "my-tpu" in created.stdout and "RUNNING" in created.stdout

    # Everything gcloud sent, compared with the capture (URLs after the endpoint prefix).
    reference_prefix = re.match(r"https?://[^/]+/compute/v1/", reference["requests"][2]["body"]["machineType"]).group(0)
    logged = compute_cloud.requests()
    sent = json.loads(json.dumps([r["body"] for r in logged if r["method"] == "POST" and r["path"].endswith("/instances")]).replace(compute_cloud.compute_endpoint, reference_prefix))
    expected_post = next(r for r in reference["requests"] if r["method"] == "POST")
    assert sent == [expected_post["body"]]
    create_refs = [(r["method"], r["path"].split("?")[0]) for r in reference["requests"] if r["method"] != "DELETE"]
    seen = [(r["method"], r["path"]) for r in logged]
    assert [s for s in seen if s in create_refs] == create_refs
    assert all(r["status"] == 200 for r in logged)

    vm = next(v for v in compute_cloud.vms() if v["name"] == "my-tpu")
    assert port_open(vm["ip"])

    compute_cloud.clear_requests()
    gcloud(reference["delete_command"])
    deletes = [(r["method"], r["path"]) for r in compute_cloud.requests() if r["method"] == "DELETE"]
    assert deletes == [("DELETE", next(r["path"].split("?")[0] for r in reference["requests"] if r["method"] == "DELETE"))]
    assert not any(v["name"] == "my-tpu" for v in compute_cloud.vms())
    assert not port_open(vm["ip"])
    assert compute_cloud.deleted_manifest("my-tpu") is not None


def test_gcloud_reports_instance_creation_errors_as_the_cloud_does(compute_cloud, gcloud):
    """The tutorial's create through gcloud: a full reservation fails on the operation, a missing
    permission synchronously, and gcloud prints each the way public reports of the real API show
    it ("Could not fetch resource: - Required 'compute.instances.create' permission for ...")."""
    reference = json.loads(REFERENCE.read_text())
    gcloud(f"gcloud config set api_endpoint_overrides/compute {compute_cloud.compute_endpoint}")
    compute_cloud.add_reservation("my-reservation", 1, project="my-project", zone=ZONE)
    try:
        compute_cloud.set_faults({"operation_errors": {"operation": "insert", "preset": "reservation_full"}})
        full = gcloud(reference["create_command"], fails=True)
        compute_cloud.set_faults({"insert_rejected": {"preset": "permission_denied"}})
        denied = gcloud(reference["create_command"], fails=True)
    finally:
        compute_cloud.set_faults({})
    assert full.returncode != 0
    assert "Specified reservation 'my-reservation' does not have available resources for the request." in full.stderr
    assert denied.returncode != 0
    assert (
        "Could not fetch resource:\n - Required 'compute.instances.create' permission for "
        f"'projects/my-project/zones/{ZONE}/instances/my-tpu'"
    ) in denied.stderr, denied.stderr
    assert not any(v["name"] == "my-tpu" for v in compute_cloud.vms())


def test_gcloud_describes_and_lists_reservations(compute_cloud, gcloud):
    compute_cloud.add_reservation("local-reservation", 8, zone=ZONE, project="local-project")
    env = {"CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": compute_cloud.compute_endpoint}
    described = json.loads(
        gcloud(
            "gcloud compute reservations describe local-reservation --zone us-east5-b --project local-project "
            "--format=json",
            env,
        ).stdout
    )
    assert described["name"] == "local-reservation" and described["status"] == "READY"
    assert described["zone"] == f"{compute_cloud.compute_endpoint}projects/local-project/zones/{ZONE}"
    assert described["specificReservation"] == {
        "count": "8",
        "inUseCount": "0",
        "instanceProperties": {"machineType": "ct6e-standard-8t"},
    }
    listed = gcloud("gcloud compute reservations list --project local-project --format=value(name)", env)
    assert listed.stdout.split() == ["local-reservation"]


def gcloud_create(name: str, flags: str, *, zone: str = ZONE, project: str = PROJECT) -> str:
    """`gcloud compute instances create` of the tutorial's image with `flags` added."""
    image_project, family = TUTORIAL_IMAGE_KEY.split("/", 1)
    return (
        f"gcloud compute instances create {name} --zone={zone} --project={project} --network=default "
        f"--image-project={image_project} --image-family={family} --boot-disk-size=200GB {flags}"
    )


def test_gcloud_insert_refused_as_compute_engine_refuses(compute_cloud, gcloud, compute_vm, compute_discovery):
    env = {"CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": compute_cloud.compute_endpoint}
    compute_cloud.add_reservation("lc-refuse-resv", 1, zone=ZONE, project=PROJECT)
    machine_url = f"{compute_cloud.compute_endpoint}projects/{PROJECT}/zones/{ZONE}/machineTypes/ct6e-standard-99t"
    rb = "--provisioning-model=RESERVATION_BOUND --instance-termination-action=DELETE"
    cases = [
        (
            "--machine-type=ct6e-standard-99t --maintenance-policy=TERMINATE",
            ZONE,
            f"Invalid value for field 'resource.machineType': '{machine_url}'. "
            f"Machine type with name 'ct6e-standard-99t' does not exist in zone '{ZONE}'.",
        ),
        # ct5p (v5p) is not offered in us-east1-d, ct6e is.
        (
            "--machine-type=ct5p-hightpu-4t --maintenance-policy=TERMINATE",
            "us-east1-d",
            "Machine type with name 'ct5p-hightpu-4t' does not exist in zone 'us-east1-d'.",
        ),
        ("--machine-type=ct6e-standard-8t --maintenance-policy=TERMINATE", "us-east5-q",
         "Invalid value for field 'zone': 'us-east5-q'. Unknown zone."),
        *(
            (
                f"--machine-type=ct6e-standard-8t --maintenance-policy=TERMINATE {rb} {affinity}",
                ZONE,
                "Invalid value for field 'resource.scheduling.provisioningModel': 'RESERVATION_BOUND'. "
                "Instances with provisioningModel RESERVATION_BOUND must consume a specific reservation.",
            )
            for affinity in ("", "--reservation-affinity=any", "--reservation-affinity=none")
        ),
        (
            "--machine-type=ct6e-standard-8t --maintenance-policy=MIGRATE",
            ZONE,
            "Invalid value for field 'resource.scheduling.onHostMaintenance': 'MIGRATE'. Scheduling must have "
            "onHostMaintenance be one of the following valid types: [TERMINATE]. But was MIGRATE",
        ),
        # Without --maintenance-policy gcloud sends none: the default, MIGRATE, is refused.
        ("--machine-type=ct6e-standard-8t", ZONE, "Instances with guest accelerators do not support live migration."),
    ]
    compute_cloud.clear_requests()
    for i, (flags, zone, message) in enumerate(cases):
        refused = gcloud(gcloud_create(f"lc-refused-{i}", flags, zone=zone), env, fails=True)
        assert message in refused.stderr, (flags, refused.stderr)
    # gcloud recognises the machine type error and points at machine-types list.
    assert "gcloud compute machine-types list" in gcloud(gcloud_create("lc-refused-x", cases[0][0]), env, fails=True).stderr
    inserts = [r for r in compute_cloud.requests() if r["method"] == "POST" and r["path"].endswith("/instances")]
    assert [r["status"] for r in inserts] == [400] * (len(cases) + 1)
    assert not [v for v in compute_cloud.vms() if v["name"].startswith("lc-refused")]

    # The same refusals through the Python client, with the API's error bodies.
    instances = compute_discovery.instances()

    def refused(call) -> tuple[int, list]:
        with pytest.raises(HttpError) as exc:
            call.execute()
        return exc.value.resp.status, error_of(exc.value)["errors"]

    def invalid(message: str) -> tuple[int, list]:
        return 400, [{"message": message, "domain": "global", "reason": "invalid"}]

    body = body_for("lc-refused-py", machine_type="ct6e-standard-99t")
    assert refused(instances.insert(project=PROJECT, zone=ZONE, body=body)) == invalid(
        f"Invalid value for field 'resource.machineType': 'zones/{ZONE}/machineTypes/ct6e-standard-99t'. "
        f"Machine type with name 'ct6e-standard-99t' does not exist in zone '{ZONE}'."
    )
    unknown_zone = invalid("Invalid value for field 'zone': 'us-east5-q'. Unknown zone.")
    assert refused(instances.insert(project=PROJECT, zone="us-east5-q", body=body_for("lc-refused-py"))) == unknown_zone
    assert refused(instances.list(project=PROJECT, zone="us-east5-q")) == unknown_zone
    assert refused(compute_discovery.zones().get(project=PROJECT, zone="us-east5-q")) == (
        404,
        [{"message": f"The resource 'projects/{PROJECT}/zones/us-east5-q' was not found", "domain": "global",
          "reason": "notFound"}],
    )
    body = body_for("lc-refused-py", scheduling={"onHostMaintenance": None})
    assert refused(instances.insert(project=PROJECT, zone=ZONE, body=body)) == (
        400, [{"message": "Instances with guest accelerators do not support live migration.", "domain": "global",
               "reason": "badRequest"}],
    )
    # The tutorial's RESERVATION_BOUND with its specific reservation passes these checks (the
    # tutorial test inserts it), and so does a general-purpose VM that may live-migrate.
    general = compute_vm("lc-general-n2", machine_type="n2-standard-8", scheduling={"onHostMaintenance": "MIGRATE"})
    assert (general["status"], general["scheduling"]["onHostMaintenance"]) == ("RUNNING", "MIGRATE")


def test_gcloud_vm_without_external_ip_is_reached_at_its_internal_ip(
    compute_cloud, gcloud, compute_vm, compute_discovery, monkeypatch
):
    """--no-address: no accessConfigs, so no natIP; the product's internal-IP path (the hook's
    get_instance_address with use_internal_ip) reaches the VM. Also: what instances.get returns
    (no input-only fields) and each VM's own hostname."""
    from airflow.exceptions import AirflowException

    from localcloud.connections import airflow_connection_env, generate_ssh_private_key
    from maxtext_sft.cloud.compute import ComputeEngineEndpointHook

    env = {"CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": compute_cloud.compute_endpoint}
    key = paramiko.ECDSAKey.generate()
    name = "lc-gcloud-internal"
    compute_cloud.clear_requests()
    flags = f"--machine-type=ct6e-standard-4t --maintenance-policy=TERMINATE --no-address --metadata=ssh-keys={shlex.quote(ssh_keys_line('maxtext', key))}"
    gcloud(gcloud_create(name, flags), env)
    try:
        sent = next(r["body"] for r in compute_cloud.requests() if r["method"] == "POST" and r["path"].endswith("/instances"))
        assert "accessConfigs" not in sent["networkInterfaces"][0]
        assert sent["disks"][0]["initializeParams"]["diskSizeGb"] == "200"

        described = json.loads(
            gcloud(f"gcloud compute instances describe {name} --zone={ZONE} --project={PROJECT} --format=json", env).stdout
        )
        nic = described["networkInterfaces"][0]
        assert "accessConfigs" not in nic and re.fullmatch(r"127\.0\.0\.\d+", nic["networkIP"])
        # initializeParams is input-only: not returned; the disk it made is.
        [disk] = described["disks"]
        assert "initializeParams" not in disk and "forceAttach" not in disk
        assert (disk["diskSizeGb"], disk["source"]) == ("200", f"{compute_cloud.compute_endpoint}projects/{PROJECT}/zones/{ZONE}/disks/{name}")
        assert "hostname" not in described  # only when the insert set one

        monkeypatch.setenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", airflow_connection_env(
            compute_cloud, generate_ssh_private_key(), "hf_unused"
        )["AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT"])
        hook = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
        where = {"zone": ZONE, "resource_id": name, "project_id": PROJECT}
        address = hook.get_instance_address(use_internal_ip=True, **where)
        assert address == nic["networkIP"]
        with pytest.raises(AirflowException, match="does not have external IP"):
            hook.get_instance_address(**where)

        other = compute_vm("lc-hostname-2", metadata={"ssh-keys": ssh_keys_line("maxtext", key)})
        for vm_name, ip in ((name, address), ("lc-hostname-2", other["networkInterfaces"][0]["networkIP"])):
            with ssh(ip, "maxtext", key) as client:
                # GCE's default: hostname NAME, FQDN NAME.ZONE.c.PROJECT.internal (zonal DNS).
                assert run(client, "hostname; hostname -f").split() == [vm_name, f"{vm_name}.{ZONE}.c.{PROJECT}.internal"]
        assert socket.gethostname() not in (name, "lc-hostname-2")  # the host's own name is untouched
    finally:
        gcloud(f"gcloud compute instances delete {name} --zone={ZONE} --project={PROJECT} --quiet", env)


def test_gcloud_lists_operations(compute_cloud, gcloud, compute_vm, compute_discovery):
    env = {"CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": compute_cloud.compute_endpoint}
    compute_vm("lc-ops-1")
    compute_vm("lc-ops-2")
    target = f"{compute_cloud.compute_endpoint}projects/{PROJECT}/zones/{ZONE}/instances/lc-ops-1"

    def inserts_of_ops_1(command: str) -> list[dict]:
        listed = json.loads(gcloud(command, env).stdout)
        return [op for op in listed if op["targetLink"] == target]

    # What gcloud asks: globalOperations.aggregatedList; with --zones, zoneOperations.list.
    everywhere = inserts_of_ops_1(f"gcloud compute operations list --project={PROJECT} --format=json")
    assert [(op["operationType"], op["status"]) for op in everywhere] == [("insert", "DONE")]
    assert inserts_of_ops_1(f"gcloud compute operations list --project={PROJECT} --zones={ZONE} --format=json") == everywhere
    assert inserts_of_ops_1(f"gcloud compute operations list --project={PROJECT} --zones=us-east5-a --format=json") == []
    # --filter on the zone is sent to the API (a legacy regex filter).
    compute_cloud.clear_requests()
    filtered = inserts_of_ops_1(f"gcloud compute operations list --project={PROJECT} --filter=zone:{ZONE} --format=json")
    assert filtered == everywhere
    assert any("filter" in r["query"] for r in compute_cloud.requests() if r["path"].endswith("/aggregated/operations"))

    # The Python client: filter and paging as in instances.list.
    operations = compute_discovery.zoneOperations()
    seen, token = [], None
    while True:
        page = operations.list(
            project=PROJECT, zone=ZONE, filter='operationType = "insert"', maxResults=1, pageToken=token
        ).execute()
        assert len(page.get("items", [])) <= 1
        seen += page.get("items", [])
        token = page.get("nextPageToken")
        if not token:
            break
    names = [op["name"] for op in seen]
    assert len(names) >= 2 and names == sorted(set(names)) and {op["operationType"] for op in seen} == {"insert"}
    assert everywhere[0]["name"] in names


OS_LOGIN_PROJECT = "lc-oslogin-project"


def test_os_login_makes_the_guest_agent_ignore_ssh_keys(compute_cloud, gcloud, compute_discovery):
    env = {"CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": compute_cloud.compute_endpoint}
    key = paramiko.ECDSAKey.generate()
    where = {"project": OS_LOGIN_PROJECT, "zone": ZONE}
    instances = compute_discovery.instances()

    # What `gcloud compute project-info add-metadata` sends: projects.get, then
    # projects.setCommonInstanceMetadata (a global operation it waits for).
    gcloud(f"gcloud compute project-info add-metadata --project={OS_LOGIN_PROJECT} --metadata=enable-oslogin=TRUE", env)
    project = compute_discovery.projects().get(project=OS_LOGIN_PROJECT).execute()
    assert project["commonInstanceMetadata"]["items"] == [{"key": "enable-oslogin", "value": "TRUE"}]
    stale = {"fingerprint": "localcloud0=", "items": []}
    with pytest.raises(HttpError) as exc:
        compute_discovery.projects().setCommonInstanceMetadata(project=OS_LOGIN_PROJECT, body=stale).execute()
    assert exc.value.resp.status == 412 and error_of(exc.value)["errors"][0]["reason"] == "conditionNotMet"

    names = {"lc-oslogin-on": {}, "lc-oslogin-off": {"enable-oslogin": "FALSE"}}
    ips = {}
    try:
        for name, extra in names.items():
            body = instance_body(name, zone=ZONE, metadata={"ssh-keys": ssh_keys_line("maxtext", key), **extra})
            done = wait_operation(compute_discovery, instances.insert(body=body, **where).execute(), **where)
            assert "error" not in done, done
            ips[name] = instances.get(instance=name, **where).execute()["networkInterfaces"][0]["networkIP"]
        # Project OS Login on: the guest agent made no user from ssh-keys; sshd refuses the key.
        with pytest.raises(paramiko.AuthenticationException):
            ssh(ips["lc-oslogin-on"], "maxtext", key)
        # The instance's own enable-oslogin=FALSE wins over the project's.
        with ssh(ips["lc-oslogin-off"], "maxtext", key) as client:
            assert run(client, "id -un").strip() == "maxtext"

        # Off again for the project (the same REST call, through LocalCloud): the key logs in.
        metadata = compute_cloud.set_project_metadata(OS_LOGIN_PROJECT, {"enable-oslogin": "FALSE"})
        assert metadata["items"] == [{"key": "enable-oslogin", "value": "FALSE"}]
        with ssh(ips["lc-oslogin-on"], "maxtext", key) as client:
            assert run(client, "id -un").strip() == "maxtext"
    finally:
        compute_cloud.set_project_metadata(OS_LOGIN_PROJECT, {"enable-oslogin": None})
        for name in names:
            try:
                wait_operation(compute_discovery, instances.delete(instance=name, **where).execute(), **where)
            except HttpError as exc:
                if exc.resp.status != 404:
                    raise


# ----- the VMs ----------------------------------------------------------------------------------


def host_keys_from_guest_attributes(discovery, name: str, ip: str) -> paramiko.HostKeys:
    result = discovery.instances().getGuestAttributes(project=PROJECT, zone=ZONE, instance=name, queryPath="hostkeys/").execute()
    host_keys = paramiko.HostKeys()
    for item in result["queryValue"]["items"]:
        assert item["namespace"] == "hostkeys"
        host_keys.add(ip, item["key"], paramiko.PKey.from_type_string(item["key"], base64.b64decode(item["value"])))
    return host_keys


def test_ssh_login_guest_attributes_and_isolation(compute_cloud, compute_vm, compute_discovery):
    key = paramiko.RSAKey.generate(2048)
    name = "lc-ssh-1"
    ssh_keys = ssh_keys_line("maxtext", key) + "\n" + ssh_keys_line("root", key)
    instance = compute_vm(name, metadata={"ssh-keys": ssh_keys, "enable-guest-attributes": "TRUE"})
    ip = instance["networkInterfaces"][0]["networkIP"]

    # Host keys published in guest attributes are the ones the server presents, per type.
    host_keys = host_keys_from_guest_attributes(compute_discovery, name, ip)
    assert set(host_keys[ip].keys()) == {"ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa"}
    for key_type, published in host_keys[ip].items():
        transport = paramiko.Transport((ip, 22))
        try:
            # Ask the server for exactly this host key type (RSA is negotiated as rsa-sha2-*).
            transport.get_security_options().key_types = ["rsa-sha2-512"] if key_type == "ssh-rsa" else [key_type]
            transport.start_client(timeout=10)
            assert transport.get_remote_server_key().get_base64() == published.get_base64()
        finally:
            transport.close()

    with ssh(ip, "maxtext", key, host_keys) as client:
        assert run(client, "id -un; echo $HOME; id -u").split() == ["maxtext", "/home/maxtext", "1001"]
        # The image's skel was copied, symlinks kept as symlinks.
        assert run(client, "readlink ~/skel-link; cat ~/.profile_localcloud") == ".profile_localcloud\nexport LOCALCLOUD_SKEL=1\n"
        assert run(client, "stat -c %a ~/.ssh ~/.ssh/authorized_keys").split() == ["700", "600"]
        # sshd is PID 1 of the VM's PID namespace.
        assert run(client, "cat /proc/1/comm").strip() == "sshd"
        # The guest agent puts ssh-keys users in google-sudoers (passwordless sudo on Compute Engine).
        assert "google-sudoers" in run(client, "id -Gn").split()
        # /dev/shm, /tmp and /home are the VM's own.
        marker = f"lc-marker-{uuid.uuid4().hex}"
        run(client, f"echo vm > /dev/shm/{marker}; echo vm > /tmp/{marker}")
        assert not Path(f"/dev/shm/{marker}").exists() and not Path(f"/tmp/{marker}").exists()
        assert (compute_cloud.state_dir / "vms" / name / "shm" / marker).read_text() == "vm\n"
        assert run(client, "ls /home").split() == ["maxtext"]
        # Files the tests drop in vm-etc show up read-only at /run/localcloud.
        compute_cloud.set_vm_file("maxtext-faults.json", '{"fail_at_step": 3}')
        assert run(client, "cat /run/localcloud/maxtext-faults.json") == '{"fail_at_step": 3}'
        _, out, _ = client.exec_command("touch /run/localcloud/x")
        assert out.channel.recv_exit_status() != 0
        # VM users never touch the host's account files.
        assert "maxtext" not in Path("/etc/passwd").read_text()
        assert run(client, "getent passwd maxtext").startswith("maxtext:x:1001:1001::/home/maxtext:/bin/bash")

    # Compute Engine images refuse root, even with its key installed (as the guest agent
    # does for a `root:` line): it is sshd's policy that refuses, and the host's /root is
    # untouched.
    vm_dir = compute_cloud.state_dir / "vms" / name
    assert (vm_dir / "root/.ssh/authorized_keys").read_text().split() == f"{key.get_name()} {key.get_base64()} root".split()
    with pytest.raises(paramiko.AuthenticationException):
        ssh(ip, "root", key)
    assert "ROOT LOGIN REFUSED" in (vm_dir / "sshd.log").read_text()
    host_root_keys = Path("/root/.ssh/authorized_keys")
    assert not host_root_keys.exists() or key.get_base64() not in host_root_keys.read_text()


def test_set_metadata_users_and_fingerprint(compute_cloud, compute_vm, compute_discovery):
    instances = compute_discovery.instances()
    maxtext_key, alice_key = paramiko.RSAKey.generate(2048), paramiko.ECDSAKey.generate()
    name = "lc-meta-1"
    instance = compute_vm(name, metadata={"ssh-keys": ssh_keys_line("maxtext", maxtext_key)})
    ip = instance["networkInterfaces"][0]["networkIP"]
    stale = instance["metadata"]["fingerprint"]

    with pytest.raises(paramiko.AuthenticationException):
        ssh(ip, "alice", alice_key)

    items = [{"key": "ssh-keys", "value": ssh_keys_line("maxtext", maxtext_key) + "\n" + ssh_keys_line("alice", alice_key)}]
    op = instances.setMetadata(project=PROJECT, zone=ZONE, instance=name, body={"fingerprint": stale, "items": items}).execute()
    assert op["operationType"] == "setMetadata"
    assert "error" not in wait(compute_discovery, op)

    # The old fingerprint is stale now: 412 conditionNotMet.
    with pytest.raises(HttpError) as exc:
        instances.setMetadata(project=PROJECT, zone=ZONE, instance=name, body={"fingerprint": stale, "items": []}).execute()
    assert exc.value.resp.status == 412 and error_of(exc.value)["errors"][0]["reason"] == "conditionNotMet"

    with ssh(ip, "alice", alice_key) as client:
        assert run(client, "id -un; id -u").split() == ["alice", "1002"]
    with ssh(ip, "maxtext", maxtext_key) as client:
        assert run(client, "id -un").strip() == "maxtext"
    vm = next(v for v in compute_cloud.vms() if v["name"] == name)
    assert vm["users"] == ["alice", "maxtext"]

    # Keys removed from the metadata are removed from the VM.
    current = instances.get(project=PROJECT, zone=ZONE, instance=name).execute()["metadata"]["fingerprint"]
    items = [{"key": "ssh-keys", "value": ssh_keys_line("alice", alice_key)}]
    op = instances.setMetadata(project=PROJECT, zone=ZONE, instance=name, body={"fingerprint": current, "items": items}).execute()
    wait(compute_discovery, op)
    with pytest.raises(paramiko.AuthenticationException):
        ssh(ip, "maxtext", maxtext_key)
    with ssh(ip, "alice", alice_key) as client:
        run(client, "true")


def test_delete_kills_detached_processes_and_keeps_a_manifest(compute_cloud, compute_vm, compute_discovery):
    key = paramiko.RSAKey.generate(2048)
    name = "lc-del-1"
    instance = compute_vm(name, metadata={"ssh-keys": ssh_keys_line("maxtext", key)})
    ip = instance["networkInterfaces"][0]["networkIP"]
    with ssh(ip, "maxtext", key) as client:
        run(client, "mkdir -p /dev/shm/ckpt && head -c 1234 /dev/zero > /dev/shm/ckpt/data.bin && echo x > ~/train.log")
        run(client, "setsid nohup sleep 1000 > /dev/null 2>&1 < /dev/null &")
    vm = next(v for v in compute_cloud.vms() if v["name"] == name)
    pidns = os.readlink(f"/proc/{vm['sshd_pid']}/ns/pid")
    sleepers = detached_sleepers(pidns)
    assert len(sleepers) == 1, "the detached process should run on the VM after the session ended"

    op = delete_and_wait(compute_discovery, name)
    assert "error" not in op
    assert not running(sleepers[0]) and not running(vm["pid"]) and not running(vm["sshd_pid"])
    assert pids_in_namespace(pidns) == []
    assert not (compute_cloud.state_dir / "vms" / name).exists()
    assert not port_open(ip)
    manifest = compute_cloud.deleted_manifest(name)
    files = {entry["path"]: entry for entry in manifest}
    assert files["dev/shm/ckpt/data.bin"]["size"] == 1234
    assert files["home/maxtext/train.log"]["size"] == 2
    # When each file was last written (the bench times the training by its marker files).
    assert 0 < files["home/maxtext/train.log"]["mtime"] <= time.time()


def test_insert_fails_after_accept(compute_cloud, compute_instances_client, compute_discovery):
    with pytest.raises(LocalCloudError, match="Unknown fault"):
        compute_cloud.set_faults({"no_such_fault": {}})
    compute_cloud.set_faults(
        {"insert_fails_after_accept": {"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "message": "no capacity here", "leave_instance": True}}
    )
    name = "lc-fault-1"
    try:
        operation = compute_instances_client.insert(
            project=PROJECT, zone=ZONE, instance_resource=compute_v1.Instance.from_json(json.dumps(body_for(name)))
        )
    finally:
        compute_cloud.set_faults({})
    op = wait(compute_discovery, operation.name)
    assert op["error"] == {"errors": [{"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "message": "no capacity here"}]}
    assert (op["httpErrorStatusCode"], op["httpErrorMessage"]) == (503, "SERVICE UNAVAILABLE")

    # The instance record stays (TERMINATED, no VM) until deleted.
    instance = compute_discovery.instances().get(project=PROJECT, zone=ZONE, instance=name).execute()
    assert instance["status"] == "TERMINATED"
    assert not any(v["name"] == name for v in compute_cloud.vms())
    assert "error" not in delete_and_wait(compute_discovery, name)
    with pytest.raises(HttpError) as exc:
        compute_discovery.instances().get(project=PROJECT, zone=ZONE, instance=name).execute()
    assert exc.value.resp.status == 404


# ----- the launcher ---------------------------------------------------------------------------


def test_localcloud_restarts_clean_after_emulator_sigkill(tmp_path, compute_image_dir):
    state = tmp_path / "state"
    images = {TUTORIAL_IMAGE_KEY: compute_image_dir}
    first = LocalCloud(state, images=images).start()
    try:
        discovery = discovery_client(first.compute_endpoint)
        op = discovery.instances().insert(project=PROJECT, zone=ZONE, body=body_for("lc-crash-1")).execute()
        assert "error" not in wait(discovery, op)
        old = next(v for v in first.vms() if v["name"] == "lc-crash-1")

        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while first.running:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # Nothing cleaned up: the VM outlived its emulator.
        assert running(old["pid"]) and port_open(old["ip"])

        with LocalCloud(state, images=images) as second:
            assert not running(old["pid"]) and not running(old["sshd_pid"])
            assert not port_open(old["ip"])
            assert second.vms() == [] and not (state / "vms" / "lc-crash-1").exists()
            discovery = discovery_client(second.compute_endpoint)
            op = discovery.instances().insert(project=PROJECT, zone=ZONE, body=body_for("lc-crash-1")).execute()
            assert "error" not in wait(discovery, op)
            new = next(v for v in second.vms() if v["name"] == "lc-crash-1")
            # The new VM answers on its own address (the old one goes to the back of the queue).
            assert port_open(new["ip"]) and new["sshd_pid"] != old["sshd_pid"]
            proc = second._proc
        # A clean stop: exit 0 and the VM gone.
        assert proc.returncode == 0
        assert not running(new["pid"]) and not port_open(new["ip"])
        assert list((state / "vms").iterdir()) == []
        second.stop()  # idempotent
    finally:
        first.stop()
        first.stop()


def test_list_paging_and_filter_syntax(compute_cloud, compute_instances_client, compute_discovery):
    # Instance records without VMs (insert failed after accept, instance left): cheap to make.
    compute_cloud.set_faults({"insert_fails_after_accept": {"leave_instance": True}})
    names = ["lc-page-a", "lc-page-b", "lc-page-c"]
    try:
        for i, name in enumerate(names):
            body = body_for(name, labels={"batch": "paging", "index": str(i)})
            op = compute_discovery.instances().insert(project=PROJECT, zone=ZONE, body=body).execute()
            done = wait(compute_discovery, op)
            assert done["error"]["errors"][0]["code"] == "ZONE_RESOURCE_POOL_EXHAUSTED"
    finally:
        compute_cloud.set_faults({})
    try:
        compute_cloud.clear_requests()
        pager = compute_instances_client.list(
            request={"project": PROJECT, "zone": ZONE, "filter": 'labels.batch = "paging"', "max_results": 2}
        )
        assert [i.name for i in pager] == names
        assert len([r for r in compute_cloud.requests() if r["path"].endswith("/instances")]) == 2

        def listed(flt):
            result = compute_discovery.instances().list(project=PROJECT, zone=ZONE, filter=flt).execute()
            return [i["name"] for i in result.get("items", [])]

        assert listed('(labels.batch = "paging") (labels.index = "1")') == ["lc-page-b"]
        assert listed('labels.batch = paging AND (labels.index = 0 OR labels.index = 2)') == ["lc-page-a", "lc-page-c"]
        assert listed('labels.batch = "paging" AND NOT labels.index = "0"') == ["lc-page-b", "lc-page-c"]
        assert listed('labels.batch = "paging" AND name != "lc-page-a" AND status = TERMINATED') == ["lc-page-b", "lc-page-c"]
        assert listed('labels.batch:* AND name = "lc-page-*"') == names
        assert listed("name eq lc-page-[ab]") == ["lc-page-a", "lc-page-b"]
        with pytest.raises(HttpError) as exc:
            listed('name = "unterminated')
        assert exc.value.resp.status == 400
    finally:
        for name in names:
            delete_and_wait(compute_discovery, name)


# ----- time limits (scheduling.maxRunDuration / terminationTime) ------------------------------


def when(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).timestamp()


def stamp(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def instance_or_none(discovery, name: str) -> dict | None:
    try:
        return discovery.instances().get(project=PROJECT, zone=ZONE, instance=name).execute()
    except HttpError as exc:
        if exc.resp.status == 404:
            return None
        raise


def test_time_limits_are_validated_like_the_api(compute_cloud, compute_discovery):
    instances = compute_discovery.instances()
    name = "lc-limit-bad"
    in_a_minute, in_ten_seconds = stamp(time.time() + 60), stamp(time.time() + 10)
    cases = [
        ({"maxRunDuration": {"seconds": 29}, "instanceTerminationAction": "DELETE"},
         "resource.scheduling.maxRunDuration.seconds", "between 30 seconds and 120 days"),
        ({"maxRunDuration": {"seconds": "10368001"}, "instanceTerminationAction": "DELETE"},
         "resource.scheduling.maxRunDuration.seconds", "between 30 seconds and 120 days"),
        ({"maxRunDuration": {"seconds": 60}},
         "resource.scheduling.instanceTerminationAction", "must be specified with maxRunDuration or terminationTime"),
        ({"maxRunDuration": {"seconds": 60}, "instanceTerminationAction": "INSTANCE_TERMINATION_ACTION_UNSPECIFIED"},
         "resource.scheduling.instanceTerminationAction", "must be specified with maxRunDuration or terminationTime"),
        ({"terminationTime": in_a_minute},
         "resource.scheduling.instanceTerminationAction", "must be specified with maxRunDuration or terminationTime"),
        ({"maxRunDuration": {"seconds": 60}, "terminationTime": in_a_minute, "instanceTerminationAction": "STOP"},
         "resource.scheduling.terminationTime", "Only one of maxRunDuration and terminationTime"),
        ({"terminationTime": in_ten_seconds, "instanceTerminationAction": "STOP"},
         "resource.scheduling.terminationTime", "between 30 seconds and 120 days from now"),
        ({"terminationTime": "tomorrow noon", "instanceTerminationAction": "STOP"},
         "resource.scheduling.terminationTime", "RFC 3339"),
        ({"instanceTerminationAction": "DELETE"},
         "resource.scheduling.instanceTerminationAction", "You cannot specify a termination action for a VM instance "
         "that has the standard provisioning model (default)."),
    ]
    for scheduling, field, why in cases:
        with pytest.raises(HttpError) as exc:
            instances.insert(project=PROJECT, zone=ZONE, body=body_for(name, scheduling=scheduling)).execute()
        error = error_of(exc.value)
        assert (exc.value.resp.status, error["errors"][0]["reason"]) == (400, "invalid"), scheduling
        assert error["message"].startswith(f"Invalid value for field '{field}': "), (scheduling, error["message"])
        assert why in error["message"], (scheduling, error["message"])
    assert instance_or_none(compute_discovery, name) is None

    # Accepted: the tutorial's RESERVATION_BOUND + DELETE without a limit, and the longest limit.
    # (Instance records without VMs: the inserts fail after being accepted.)
    compute_cloud.add_reservation("lc-limit-resv", 1, zone=ZONE, project=PROJECT)  # RESERVATION_BOUND needs one
    compute_cloud.set_faults({"insert_fails_after_accept": {"leave_instance": True, "count": 2}})
    names = ["lc-limit-ok-1", "lc-limit-ok-2"]
    try:
        bodies = [
            body_for(
                names[0],
                reservation="lc-limit-resv",
                scheduling={"provisioningModel": "RESERVATION_BOUND", "instanceTerminationAction": "DELETE"},
            ),
            body_for(names[1], scheduling={"maxRunDuration": {"seconds": "10368000", "nanos": 0}, "instanceTerminationAction": "STOP"}),
        ]
        for body in bodies:
            wait(compute_discovery, instances.insert(project=PROJECT, zone=ZONE, body=body).execute())
        stored = instance_or_none(compute_discovery, names[1])
        assert stored["scheduling"]["maxRunDuration"] == {"seconds": "10368000"}
        assert stored["scheduling"]["instanceTerminationAction"] == "STOP"
        assert "terminationTimestamp" not in (stored.get("resourceStatus") or {}).get("scheduling", {})  # never ran
    finally:
        compute_cloud.set_faults({})
        for done in names:
            if instance_or_none(compute_discovery, done):
                delete_and_wait(compute_discovery, done)


def test_a_released_address_goes_to_the_back_of_the_queue(tmp_path, monkeypatch):
    """Another emulator on the machine (an xdist worker's) does not take the address a VM gave up
    a moment ago while older free ones exist: a check that the deleted VM no longer answers on
    its address must not meet a newer VM there."""
    from localcloud.compute import leases
    from localcloud.compute.emulator import ComputeEmulator

    monkeypatch.setattr(leases, "LEASE_DIR", tmp_path / "leases")
    first = ComputeEmulator(tmp_path / "first")
    second = ComputeEmulator(tmp_path / "second")
    try:
        deleted = first.leases.allocate()
        kept = second.leases.allocate()
        assert deleted != kept
        first.leases.release(deleted)
        newer = [second.leases.allocate() for _ in range(3)]
        assert deleted not in newer and kept not in newer and len(set(newer)) == 3
        # Among released addresses, the one released longest ago comes first.
        second.leases.release(kept)
        assert leases.released_at(deleted) < leases.released_at(kept)
    finally:
        for emulator in (first, second):
            emulator.shutdown()
            for ip in list(emulator.leases.held):
                emulator.leases.release(ip)


def test_the_addresses_tests_use_for_nobody_are_never_a_vms(tmp_path, monkeypatch):
    """Tests point a login at NEVER_LEASED to meet a refused connection; an emulator that ran out
    of other addresses must answer 503, not hand one of those out to a VM."""
    from localcloud.compute import leases
    from localcloud.compute.emulator import ComputeEmulator
    from localcloud.compute.errors import ApiError

    monkeypatch.setattr(leases, "LEASE_DIR", tmp_path / "leases")
    emulator = ComputeEmulator(tmp_path / "emulator")
    try:
        with pytest.raises(ApiError) as exhausted:
            while True:
                emulator.leases.allocate()
        assert exhausted.value.code == 503
        assert emulator.leases.held and not set(emulator.leases.held) & set(leases.NEVER_LEASED)
    finally:
        emulator.shutdown()
        for ip in list(emulator.leases.held):
            emulator.leases.release(ip)


def test_time_limits_delete_or_stop_the_vm_counted_from_running(compute_cloud, compute_vm, compute_discovery):
    key = paramiko.ECDSAKey.generate()
    deleted = compute_vm(
        "lc-limit-delete",
        metadata={"ssh-keys": ssh_keys_line("maxtext", key)},
        scheduling={"maxRunDuration": {"seconds": 30}, "instanceTerminationAction": "DELETE"},
    )
    stopped = compute_vm("lc-limit-stop", scheduling={"maxRunDuration": {"seconds": "30"}, "instanceTerminationAction": "STOP"})
    termination_time = time.time() + 32
    timed = compute_vm(
        "lc-limit-time", scheduling={"terminationTime": stamp(termination_time), "instanceTerminationAction": "DELETE"}
    )

    # The resource reports the limit, and the planned termination counted from RUNNING.
    for instance, action in ((deleted, "DELETE"), (stopped, "STOP")):
        assert instance["scheduling"]["maxRunDuration"] == {"seconds": "30"}
        assert instance["scheduling"]["instanceTerminationAction"] == action
        planned = when(instance["resourceStatus"]["scheduling"]["terminationTimestamp"])
        assert abs(planned - (when(instance["lastStartTimestamp"]) + 30)) < 0.002
    assert abs(when(timed["resourceStatus"]["scheduling"]["terminationTimestamp"]) - termination_time) < 0.002
    assert when(timed["scheduling"]["terminationTime"]) == pytest.approx(termination_time, abs=0.002)

    ip = deleted["networkInterfaces"][0]["networkIP"]
    with ssh(ip, "maxtext", key) as client:
        run(client, "setsid nohup sleep 1000 > /dev/null 2>&1 < /dev/null &")
    vm = next(v for v in compute_cloud.vms() if v["name"] == "lc-limit-delete")
    # Its processes by pid: a PID namespace's inode number is soon reused by another VM's.
    pidns = os.readlink(f"/proc/{vm['sshd_pid']}/ns/pid")
    vm_pids = detached_sleepers(pidns) + pids_in_namespace(pidns)

    # Poll the API until the three have ended; note when each was last seen RUNNING and first seen ended.
    started = {i["name"]: when(i["lastStartTimestamp"]) for i in (deleted, stopped, timed)}
    last_running: dict[str, float] = {}
    ended: dict[str, tuple[float, dict | None]] = {}
    deadline = time.monotonic() + 45
    while len(ended) < 3 and time.monotonic() < deadline:
        for name in started:
            if name in ended:
                continue
            instance = instance_or_none(compute_discovery, name)
            seen = time.time()
            if instance is not None and instance["status"] == "RUNNING":
                last_running[name] = seen
            elif instance is None or instance["status"] == "TERMINATED":
                ended[name] = (seen, instance)
        time.sleep(0.1)
    assert set(ended) == set(started), f"still there after 45 s: {set(started) - set(ended)}"

    for name, limit in (("lc-limit-delete", started["lc-limit-delete"] + 30),
                        ("lc-limit-stop", started["lc-limit-stop"] + 30),
                        ("lc-limit-time", termination_time)):
        seen, _ = ended[name]
        # Not before the limit (last seen running just before it), and promptly after it.
        assert last_running[name] > limit - 1.5, (name, last_running[name] - limit)
        assert limit <= seen < limit + 3, (name, seen - limit)

    # DELETE: gone like an API delete (404), its processes killed, port 22 closed, manifest kept.
    assert ended["lc-limit-delete"][1] is None and ended["lc-limit-time"][1] is None
    assert not any(running(p) for p in vm_pids)
    assert not running(vm["pid"]) and not running(vm["sshd_pid"]) and not port_open(ip)
    assert compute_cloud.deleted_manifest("lc-limit-delete") is not None
    # STOP: TERMINATED, its VM down, no external IP, no planned termination any more.
    stopped_now = ended["lc-limit-stop"][1]
    assert stopped_now["status"] == "TERMINATED"
    assert "natIP" not in stopped_now["networkInterfaces"][0]["accessConfigs"][0]
    assert "terminationTimestamp" not in stopped_now["resourceStatus"]["scheduling"]
    assert not port_open(stopped_now["networkInterfaces"][0]["networkIP"])
    assert [v["name"] for v in compute_cloud.vms() if v["name"].startswith("lc-limit-")] == []
    # The cloud acted on its own: nobody called instances.delete.
    ended_by_the_cloud = ("/instances/lc-limit-delete", "/instances/lc-limit-time", "/instances/lc-limit-stop")
    assert not [r for r in compute_cloud.requests() if r["method"] == "DELETE" and r["path"].endswith(ended_by_the_cloud)]
    assert "error" not in delete_and_wait(compute_discovery, "lc-limit-stop")


# ----- the cloud ending VMs by itself -----------------------------------------------------------


def test_terminate_vm_like_the_cloud(compute_cloud, compute_vm, compute_discovery):
    key = paramiko.ECDSAKey.generate()
    doomed = compute_vm("lc-term-delete", metadata={"ssh-keys": ssh_keys_line("maxtext", key)})
    stopping = compute_vm("lc-term-stop")
    ip = doomed["networkInterfaces"][0]["networkIP"]
    with ssh(ip, "maxtext", key) as client:
        run(client, "setsid nohup sleep 1000 > /dev/null 2>&1 < /dev/null &")
    vm = next(v for v in compute_cloud.vms() if v["name"] == "lc-term-delete")
    pidns = os.readlink(f"/proc/{vm['sshd_pid']}/ns/pid")
    vm_pids = detached_sleepers(pidns) + pids_in_namespace(pidns)  # the detached sleep, sshd, ...

    compute_cloud.clear_requests()
    assert compute_cloud.terminate_vm("lc-term-delete", "DELETE")["status"] == "DELETED"
    assert not any(running(p) for p in vm_pids) and not running(vm["pid"]) and not port_open(ip)
    assert instance_or_none(compute_discovery, "lc-term-delete") is None
    assert compute_cloud.deleted_manifest("lc-term-delete") is not None

    assert compute_cloud.terminate_vm("lc-term-stop", "STOP", project=PROJECT, zone=ZONE)["status"] == "TERMINATED"
    instance = instance_or_none(compute_discovery, "lc-term-stop")
    assert instance["status"] == "TERMINATED" and "natIP" not in instance["networkInterfaces"][0]["accessConfigs"][0]
    assert not port_open(stopping["networkInterfaces"][0]["networkIP"])
    assert not any(v["name"].startswith("lc-term-") for v in compute_cloud.vms())

    with pytest.raises(LocalCloudError, match="404"):
        compute_cloud.terminate_vm("lc-term-delete")
    with pytest.raises(LocalCloudError, match="(?s)400.*only a RUNNING instance stops"):
        compute_cloud.terminate_vm("lc-term-stop", "STOP")
    with pytest.raises(LocalCloudError, match="(?s)400.*DELETE or STOP"):
        compute_cloud.terminate_vm("lc-term-stop", "SUSPEND")
    # No API request and no operation: only the GETs of this test are logged.
    assert {r["method"] for r in compute_cloud.requests()} == {"GET"}
    assert "error" not in delete_and_wait(compute_discovery, "lc-term-stop")


# ----- fault injection ------------------------------------------------------------------------


def test_fault_settings_are_validated(compute_cloud):
    bad = [
        {"no_such_fault": {}},
        {"http_errors": [{"status": 200}]},
        {"http_errors": [{"status": 503, "path_regex": "("}]},
        {"http_errors": {"status": 503, "bogus": 1}},
        {"http_errors": [{"status": 429, "retry_after": "soon"}]},
        {"insert_rejected": {}},
        {"insert_rejected": {"preset": "no_such_preset"}},
        {"operation_errors": {"operation": "setMetadata"}},
        {"operation_errors": {"operation": "delete", "leave_instance": True}},
        {"operation_errors": {"operation": "delete", "preset": "reservation_full"}},
        {"insert_fails_after_accept": {"preset": "no_such_preset"}},
        {"operation_hangs": {"operation": "insert", "seconds": -1}},
        {"ssh_refused": {}},
        {"ssh_refused": [1]},
        {"ssh_banner_timeout": {"seconds": 5, "count": 0}},
    ]
    try:
        kept = compute_cloud.set_faults({"ssh_refused": {"seconds": 5, "name_regex": "^nothing-here$"}})
        assert kept == {"ssh_refused": {"seconds": 5, "name_regex": "^nothing-here$", "count": 1}}
        for faults in bad:
            with pytest.raises(LocalCloudError, match="faults: 400"):
                compute_cloud.set_faults(faults)
        assert compute_cloud.get_faults() == kept  # a refused POST changes nothing
    finally:
        assert compute_cloud.set_faults({}) == {}


def test_http_errors_answer_in_the_api_error_shape(compute_cloud, compute_instances_client, compute_discovery):
    missing = "lc-http-missing"  # no such instance: a request that gets through answers 404
    compute_cloud.set_faults(
        {
            "http_errors": [
                {"method": "GET", "path_regex": f"/instances/{missing}$", "status": 429, "count": 2},
                {"method": "POST", "path_regex": "/instances$", "status": 503},
                {"method": "DELETE", "path_regex": f"/instances/{missing}$", "status": 500, "message": "boom",
                 "retry_after": 7},
            ]
        }
    )
    try:
        with pytest.raises(HttpError) as exc:
            compute_discovery.instances().get(project=PROJECT, zone=ZONE, instance=missing).execute()
        assert exc.value.resp.status == 429 and exc.value.resp["retry-after"] == "1"
        error = error_of(exc.value)
        assert (error["code"], error["status"]) == (429, "RESOURCE_EXHAUSTED")
        assert error["errors"] == [{"message": error["message"], "domain": "usageLimits", "reason": "rateLimitExceeded"}]
        assert error["message"].startswith("Quota exceeded for quota metric 'Queries' and limit 'Queries per minute'")

        with pytest.raises(gexc.TooManyRequests) as too_many:
            compute_instances_client.get(project=PROJECT, zone=ZONE, instance=missing)
        assert too_many.value.errors[0]["reason"] == "rateLimitExceeded"
        with pytest.raises(gexc.NotFound):  # the rule's count ran out
            compute_instances_client.get(project=PROJECT, zone=ZONE, instance=missing)

        with pytest.raises(HttpError) as exc:
            compute_discovery.instances().insert(project=PROJECT, zone=ZONE, body=body_for("lc-http-1")).execute()
        error = error_of(exc.value)
        assert (exc.value.resp.status, error["status"], error["errors"][0]["reason"]) == (503, "UNAVAILABLE", "backendError")
        assert error["message"] == "The service is currently unavailable."
        assert instance_or_none(compute_discovery, "lc-http-1") is None  # nothing was created

        with pytest.raises(HttpError) as exc:
            compute_discovery.instances().delete(project=PROJECT, zone=ZONE, instance=missing).execute()
        assert exc.value.resp.status == 500 and exc.value.resp["retry-after"] == "7"
        assert error_of(exc.value)["errors"] == [{"message": "boom", "domain": "global", "reason": "backendError"}]
        assert compute_cloud.get_faults() == {}  # every rule used up
    finally:
        compute_cloud.set_faults({})
    logged = [r["status"] for r in compute_cloud.requests() if "lc-http-" in r["path"] or (r["body"] or {}).get("name") == "lc-http-1"]
    assert logged == [429, 429, 404, 503, 404, 500]


def test_insert_rejected_synchronously(compute_cloud, compute_discovery):
    instances = compute_discovery.instances()

    # Room for both inserts that pass: a fault is taken before the reservation is looked at.
    compute_cloud.add_reservation("my-reservation", 2, project=PROJECT, zone=ZONE)

    def body(name):
        scheduling = {"provisioningModel": "RESERVATION_BOUND", "instanceTerminationAction": "DELETE"}
        return body_for(name, scheduling=scheduling, reservation="my-reservation")

    zone_message = (
        f"The zone 'projects/{PROJECT}/zones/{ZONE}' does not have enough resources available to fulfill the "
        "request.  Try a different zone, or try again later."
    )
    project_number = zlib.crc32(PROJECT.encode()) + 10**11
    condition = (412, "conditionNotMet", "global")
    cases = [
        ({"preset": "reservation_full"}, *condition,
         "Specified reservation 'my-reservation' does not have available resources for the request."),
        ({"preset": "reservation_not_found"}, *condition, "Specified reservation 'my-reservation' does not exist."),
        ({"preset": "reservation_incompatible"}, *condition,
         "No available resources in specified reservations 'my-reservation'"),
        ({"preset": "org_policy"}, *condition,
         "Instance 'lc-rej-1' creation failed: Constraint constraints/compute.vmExternalIpAccess violated for "
         f"project {project_number}."),
        ({"preset": "unsupported_tpu_configuration"}, *condition, "Unsupported TPU configuration"),
        ({"preset": "quota_exceeded"}, 403, "quotaExceeded", "usageLimits",
         "Quota 'CPUS' exceeded.  Limit: 0.0 in region us-east5."),
        ({"preset": "permission_denied"}, 403, "forbidden", "global",
         f"Required 'compute.instances.create' permission for 'projects/{PROJECT}/zones/{ZONE}/instances/lc-rej-1'"),
        ({"preset": "zone_resource_pool_exhausted"}, 503, "ZONE_RESOURCE_POOL_EXHAUSTED", "global", zone_message),
        ({"reason": "quotaExceeded", "status": 403, "message": "Quota 'TPUS' exceeded."}, 403, "quotaExceeded",
         "global", "Quota 'TPUS' exceeded."),
    ]
    try:
        for fault, status, reason, domain, message in cases:
            compute_cloud.set_faults({"insert_rejected": fault})
            with pytest.raises(HttpError) as exc:
                instances.insert(project=PROJECT, zone=ZONE, body=body("lc-rej-1")).execute()
            error = error_of(exc.value)
            assert (exc.value.resp.status, error["code"]) == (status, status), fault
            assert error["errors"] == [{"message": message, "domain": domain, "reason": reason}], fault
            assert compute_cloud.get_faults() == {}  # once by default
            assert instance_or_none(compute_discovery, "lc-rej-1") is None

        # count and name_regex; accepted inserts fail after the accept and leave records without VMs.
        compute_cloud.set_faults(
            {
                "insert_rejected": {"preset": "quota_exceeded", "count": 2, "name_regex": "^lc-rej-a"},
                "insert_fails_after_accept": {"leave_instance": True},
            }
        )
        outcomes = {}
        for name in ("lc-rej-b", "lc-rej-a1", "lc-rej-a2", "lc-rej-a3"):
            try:
                wait(compute_discovery, instances.insert(project=PROJECT, zone=ZONE, body=body(name)).execute())
                outcomes[name] = "accepted"
            except HttpError as exc:
                outcomes[name] = exc.resp.status
        assert outcomes == {"lc-rej-b": "accepted", "lc-rej-a1": 403, "lc-rej-a2": 403, "lc-rej-a3": "accepted"}
    finally:
        compute_cloud.set_faults({})
        for name in ("lc-rej-b", "lc-rej-a3"):
            if instance_or_none(compute_discovery, name):
                delete_and_wait(compute_discovery, name)


def reservation_of(discovery, name: str, zone: str = ZONE) -> dict:
    return discovery.reservations().get(project=PROJECT, zone=zone, reservation=name).execute()


def test_reservations_are_read_through_the_api(compute_cloud, compute_discovery):
    created = compute_cloud.add_reservation("lc-resv-read", 3, zone=ZONE, project=PROJECT)
    raw = reservation_of(compute_discovery, "lc-resv-read")
    assert raw == created
    base = f"{compute_cloud.compute_endpoint}projects/{PROJECT}/zones/{ZONE}"
    assert (raw["kind"], raw["name"], raw["zone"], raw["selfLink"]) == (
        "compute#reservation", "lc-resv-read", base, f"{base}/reservations/lc-resv-read",
    )
    assert raw["status"] == "READY" and raw["specificReservationRequired"] is True and raw["id"].isdigit()
    assert raw["specificReservation"] == {
        "count": "3", "inUseCount": "0", "instanceProperties": {"machineType": "ct6e-standard-8t"},
    }

    # Changing it through the control API keeps its identity.
    changed = compute_cloud.add_reservation("lc-resv-read", 5, "ct5lp-hightpu-4t", zone=ZONE, project=PROJECT)
    assert changed["id"] == raw["id"] and changed["specificReservation"]["count"] == "5"
    assert changed["specificReservation"]["instanceProperties"]["machineType"] == "ct5lp-hightpu-4t"

    # The client library parses it (int64 counts sent as strings).
    from google.auth.credentials import AnonymousCredentials

    client = compute_v1.ReservationsClient(
        credentials=AnonymousCredentials(), client_options={"api_endpoint": compute_cloud.base_url}
    )
    parsed = client.get(project=PROJECT, zone=ZONE, reservation="lc-resv-read")
    assert (parsed.specific_reservation.count, parsed.specific_reservation.in_use_count) == (5, 0)
    assert "lc-resv-read" in [r.name for r in client.list(project=PROJECT, zone=ZONE)]
    assert [r.name for r in client.list(project=PROJECT, zone="us-east5-a")] == []

    with pytest.raises(HttpError) as missing:
        reservation_of(compute_discovery, "lc-resv-read", zone="us-east5-a")
    assert missing.value.resp.status == 404
    assert error_of(missing.value)["errors"] == [
        {
            "message": f"The resource 'projects/{PROJECT}/zones/us-east5-a/reservations/lc-resv-read' was not found",
            "domain": "global",
            "reason": "notFound",
        }
    ]
    for bad in (
        {"name": "lc-resv-bad", "count": 0},
        {"name": "Bad_Name", "count": 1},
        {"name": "lc-resv-bad", "count": "1"},
    ):
        with pytest.raises(LocalCloudError, match="reservations: 400"):
            compute_cloud.add_reservation(bad["name"], bad["count"], zone=ZONE, project=PROJECT)
    with pytest.raises(HttpError):
        reservation_of(compute_discovery, "lc-resv-bad")


def test_instances_consume_a_specific_reservation_until_gone(compute_cloud, compute_vm, compute_discovery):
    compute_cloud.add_reservation("lc-resv-one", 1, zone=ZONE, project=PROJECT)
    compute_cloud.add_reservation("lc-resv-elsewhere", 1, zone="us-east5-a", project=PROJECT)

    def in_use() -> str:
        return reservation_of(compute_discovery, "lc-resv-one")["specificReservation"]["inUseCount"]

    def refused(name: str, **kwargs) -> dict:
        """The insert is accepted and its operation fails; no instance is left."""
        op = compute_discovery.instances().insert(project=PROJECT, zone=ZONE, body=body_for(name, **kwargs)).execute()
        done = wait(compute_discovery, op)
        assert (done["httpErrorStatusCode"], done["httpErrorMessage"]) == (412, "PRECONDITION FAILED")
        assert instance_or_none(compute_discovery, name) is None
        return done["error"]

    def condition_not_met(message: str) -> dict:
        return {"errors": [{"code": "CONDITION_NOT_MET", "message": message}]}

    not_found = "Specified reservation '{}' does not exist."
    assert refused("lc-resv-x1", reservation="lc-resv-none") == condition_not_met(not_found.format("lc-resv-none"))
    # A reservation is zonal: one of that name in another zone does not count.
    assert refused("lc-resv-x2", reservation="lc-resv-elsewhere") == condition_not_met(
        not_found.format("lc-resv-elsewhere")
    )
    assert refused("lc-resv-x3", reservation="lc-resv-one", machine_type="ct5lp-hightpu-4t") == condition_not_met(
        "No available resources in specified reservations 'lc-resv-one'"
    )
    assert in_use() == "0"

    compute_vm("lc-resv-a", reservation="lc-resv-one")
    assert in_use() == "1"
    full = condition_not_met("Specified reservation 'lc-resv-one' does not have available resources for the request.")
    # Also when named the way a shared reservation is (projects/P/reservations/NAME).
    assert refused("lc-resv-b", reservation=f"projects/{PROJECT}/reservations/lc-resv-one") == full
    # Instances that target no reservation by name are not held back by it.
    compute_vm("lc-resv-free")

    # Each way an instance goes gives the unit back: instances.delete, the cloud deleting or
    # stopping it (terminate_vm; a time limit ends the same way).
    delete_and_wait(compute_discovery, "lc-resv-a")
    assert in_use() == "0"
    compute_vm("lc-resv-b", reservation=f"projects/{PROJECT}/reservations/lc-resv-one")
    assert in_use() == "1"
    assert refused("lc-resv-c", reservation="lc-resv-one") == full
    compute_cloud.terminate_vm("lc-resv-b", "DELETE")
    assert in_use() == "0"
    compute_vm("lc-resv-c", reservation="lc-resv-one")
    compute_cloud.terminate_vm("lc-resv-c", "STOP")
    assert compute_discovery.instances().get(project=PROJECT, zone=ZONE, instance="lc-resv-c").execute()["status"] == "TERMINATED"
    assert in_use() == "0"  # a stopped instance holds no reservation
    compute_vm("lc-resv-d", reservation="lc-resv-one")
    assert in_use() == "1"


def test_operation_errors_and_hangs(compute_cloud, compute_vm, compute_discovery):
    instances = compute_discovery.instances()

    def operation(op):
        return compute_discovery.zoneOperations().get(project=PROJECT, zone=ZONE, operation=op["name"]).execute()

    try:
        # insert: accepted, then DONE with the given error; nothing left behind.
        compute_cloud.set_faults({"operation_errors": {"operation": "insert", "code": "QUOTA_EXCEEDED"}})
        done = wait(compute_discovery, instances.insert(project=PROJECT, zone=ZONE, body=body_for("lc-op-1")).execute())
        assert done["error"] == {
            "errors": [{"code": "QUOTA_EXCEEDED", "message": "Quota 'CPUS' exceeded.  Limit: 0.0 in region us-east5."}]
        }
        assert (done["httpErrorStatusCode"], done["httpErrorMessage"]) == (403, "FORBIDDEN")
        assert instance_or_none(compute_discovery, "lc-op-1") is None

        # Presets: each class in its operation shape (code, message, httpErrorStatusCode).
        presets = {
            "reservation_full": ("CONDITION_NOT_MET", 412,
                                 "Specified reservation '-' does not have available resources for the request."),
            "org_policy": ("CONDITION_NOT_MET", 412,
                           "Instance 'lc-op-1' creation failed: Constraint constraints/compute.vmExternalIpAccess "
                           f"violated for project {zlib.crc32(PROJECT.encode()) + 10**11}."),
            "unsupported_tpu_configuration": ("CONDITION_NOT_MET", 412, "Unsupported TPU configuration"),
            "permission_denied": ("PERMISSIONS_ERROR", 403, f"Required 'compute.instances.create' permission for "
                                  f"'projects/{PROJECT}/zones/{ZONE}/instances/lc-op-1'"),
            "quota_exceeded": ("QUOTA_EXCEEDED", 403, "Quota 'CPUS' exceeded.  Limit: 0.0 in region us-east5."),
        }
        for preset, (code, status, message) in presets.items():
            kind = "insert_fails_after_accept" if preset == "quota_exceeded" else "operation_errors"
            rule = {"preset": preset, "count": 1, **({"operation": "insert"} if kind == "operation_errors" else {})}
            compute_cloud.set_faults({kind: rule})
            done = wait(compute_discovery, instances.insert(project=PROJECT, zone=ZONE, body=body_for("lc-op-1")).execute())
            assert done["error"] == {"errors": [{"code": code, "message": message}]}, preset
            assert done["httpErrorStatusCode"] == status, preset
            assert instance_or_none(compute_discovery, "lc-op-1") is None

        # delete: DONE with an error; the instance and its VM stay up.
        instance = compute_vm("lc-op-2")
        ip = instance["networkInterfaces"][0]["networkIP"]
        compute_cloud.set_faults({"operation_errors": {"operation": "delete", "name_regex": "^lc-op-2$"}})
        done = delete_and_wait(compute_discovery, "lc-op-2")
        [error] = done["error"]["errors"]
        assert error["code"] == "INTERNAL_ERROR"
        assert re.fullmatch(r"Internal error\. Please try again or contact Google Support\. \(Code: '-?\d+'\)", error["message"])
        assert (done["httpErrorStatusCode"], done["httpErrorMessage"]) == (500, "INTERNAL SERVER ERROR")
        assert instance_or_none(compute_discovery, "lc-op-2")["status"] == "RUNNING" and port_open(ip)

        # delete hanging 2 s: the operation RUNNING, the instance STOPPING with its VM up; then deleted.
        compute_cloud.set_faults({"operation_hangs": {"operation": "delete", "seconds": 2}})
        begun = time.monotonic()
        op = instances.delete(project=PROJECT, zone=ZONE, instance="lc-op-2").execute()
        assert operation(op)["status"] == "RUNNING"
        assert instance_or_none(compute_discovery, "lc-op-2")["status"] == "STOPPING" and port_open(ip)
        done = wait(compute_discovery, op)
        assert "error" not in done and time.monotonic() - begun >= 2
        assert instance_or_none(compute_discovery, "lc-op-2") is None and not port_open(ip)

        # insert hanging until the fault is cleared (then failing after the accept, as also set).
        compute_cloud.set_faults(
            {"operation_hangs": {"operation": "insert"}, "insert_fails_after_accept": {"leave_instance": True, "count": 1}}
        )
        op = instances.insert(project=PROJECT, zone=ZONE, body=body_for("lc-op-3")).execute()
        held_until = time.monotonic() + 1.5
        while time.monotonic() < held_until:  # it stays RUNNING, the instance PROVISIONING
            assert operation(op)["status"] == "RUNNING"
            assert instance_or_none(compute_discovery, "lc-op-3")["status"] == "PROVISIONING"
            time.sleep(0.1)
        compute_cloud.set_faults({})
        released = time.monotonic()
        done = wait(compute_discovery, op)
        assert time.monotonic() - released < 2
        assert done["error"]["errors"][0]["code"] == "ZONE_RESOURCE_POOL_EXHAUSTED"
        assert instance_or_none(compute_discovery, "lc-op-3")["status"] == "TERMINATED"
    finally:
        compute_cloud.set_faults({})
        if instance_or_none(compute_discovery, "lc-op-3"):
            delete_and_wait(compute_discovery, "lc-op-3")


def test_ssh_refused_until_sshd_starts_late(compute_cloud, compute_vm):
    key = paramiko.ECDSAKey.generate()
    compute_cloud.set_faults({"ssh_refused": {"seconds": 4, "name_regex": "^lc-late-sshd$"}})
    try:
        instance = compute_vm("lc-late-sshd", metadata={"ssh-keys": ssh_keys_line("maxtext", key)})
    finally:
        compute_cloud.set_faults({})
    started = when(instance["lastStartTimestamp"])
    ip = instance["networkInterfaces"][0]["networkIP"]
    assert instance["status"] == "RUNNING"
    # A running VM (it counts as one), whose port 22 refuses connections for now.
    assert next(v for v in compute_cloud.vms() if v["name"] == "lc-late-sshd")["sshd_pid"] is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((ip, 22), timeout=2).close()
    with pytest.raises(paramiko.ssh_exception.NoValidConnectionsError):
        ssh(ip, "maxtext", key)
    opened = poll(lambda: port_open(ip) and time.time(), timeout=20)
    assert 4 <= opened - started < 12, opened - started
    with ssh(ip, "maxtext", key) as client:
        assert run(client, "id -un").strip() == "maxtext"


def test_ssh_banner_timeout_of_a_hung_sshd(compute_cloud, compute_vm):
    key = paramiko.ECDSAKey.generate()
    compute_cloud.set_faults({"ssh_banner_timeout": {"seconds": 4}})
    try:
        instance = compute_vm("lc-hung-sshd", metadata={"ssh-keys": ssh_keys_line("maxtext", key)})
    finally:
        compute_cloud.set_faults({})
    started = when(instance["lastStartTimestamp"])
    ip = instance["networkInterfaces"][0]["networkIP"]

    # TCP is accepted, no banner comes.
    with socket.create_connection((ip, 22), timeout=2) as sock:
        sock.settimeout(1)
        with pytest.raises(socket.timeout):
            sock.recv(64)
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    with pytest.raises(paramiko.SSHException, match="banner"):
        client.connect(ip, 22, username="maxtext", pkey=key, look_for_keys=False, allow_agent=False,
                       timeout=2, banner_timeout=1, auth_timeout=2)
    client.close()

    def banner() -> float | None:
        with socket.create_connection((ip, 22), timeout=2) as sock:
            sock.settimeout(0.5)
            try:
                return time.time() if sock.recv(64).startswith(b"SSH-") else None
            except socket.timeout:
                return None

    served = poll(banner, timeout=20, interval=0)
    assert 4 <= served - started < 12, served - started
    with ssh(ip, "maxtext", key) as client:
        assert run(client, "id -un").strip() == "maxtext"


def test_sshd_of_a_running_vm_paused_and_resumed(compute_cloud, compute_vm):
    key = paramiko.ECDSAKey.generate()
    instance = compute_vm("lc-paused-sshd", metadata={"ssh-keys": ssh_keys_line("maxtext", key)})
    ip = instance["networkInterfaces"][0]["networkIP"]
    with ssh(ip, "maxtext", key) as client:
        assert run(client, "id -un").strip() == "maxtext"

    compute_cloud.set_sshd_paused("lc-paused-sshd", True)
    with socket.create_connection((ip, 22), timeout=2) as held:  # queued by the kernel, unanswered
        held.settimeout(1)
        with pytest.raises(socket.timeout):
            held.recv(64)
        compute_cloud.set_sshd_paused("lc-paused-sshd", False)
        held.settimeout(10)
        assert held.recv(64).startswith(b"SSH-")  # the queued connection is served once resumed
    with pytest.raises(LocalCloudError, match="404"):
        compute_cloud.set_sshd_paused("lc-no-such-vm", True)


# ----- images from a boot disk -----------------------------------------------------------------


def test_gcloud_bakes_an_image_from_a_stopped_vms_disk(compute_cloud, gcloud, compute_vm, compute_discovery):
    """instances.stop, images.insert with sourceDisk and a family, getFromFamily, boot from the
    family, images.delete, through gcloud: the image holds the disk (a home kept for its user, a
    new user's home from skel), a running VM's disk is refused without --force, a name is taken once."""
    key = paramiko.ECDSAKey.generate()
    source = compute_vm("lc-bake-source", metadata={"ssh-keys": ssh_keys_line("maxtext", key)})
    with ssh(source["networkInterfaces"][0]["networkIP"], "maxtext", key) as client:
        run(client, "mkdir ~/maxtext_venv && echo 0.2.2 > ~/maxtext_venv/version; echo gone > /tmp/scratch")
        run(client, "setsid nohup sleep 1000 > /dev/null 2>&1 < /dev/null &")
    gcloud(f"gcloud config set api_endpoint_overrides/compute {compute_cloud.compute_endpoint}")
    where = f"--project={PROJECT}"
    disk = f"--source-disk=lc-bake-source --source-disk-zone={ZONE}"

    refused = gcloud(f"gcloud compute images create lc-baked-1 {disk} --family=lc-baked {where}", fails=True)
    assert (
        "The disk resource 'projects/lc-test-project/zones/us-east5-b/disks/lc-bake-source' is already being used by "
        "'projects/lc-test-project/zones/us-east5-b/instances/lc-bake-source'" in refused.stderr
    )
    gcloud(f"gcloud compute instances stop lc-bake-source --zone={ZONE} {where}")
    stopped = compute_discovery.instances().get(project=PROJECT, zone=ZONE, instance="lc-bake-source").execute()
    assert stopped["status"] == "TERMINATED" and "natIP" not in stopped["networkInterfaces"][0]["accessConfigs"][0]
    assert not any(v["name"] == "lc-bake-source" for v in compute_cloud.vms())  # its processes are gone

    gcloud(f"gcloud compute images create lc-baked-1 {disk} --family=lc-baked --labels=maxtext-version=0-2-2 {where}")
    images = compute_discovery.images()
    source_disk = f"zones/{ZONE}/disks/lc-bake-source"
    with pytest.raises(HttpError) as again:
        images.insert(project=PROJECT, body={"name": "lc-baked-1", "sourceDisk": source_disk}).execute()
    assert error_of(again.value)["errors"][0]["reason"] == "alreadyExists"
    with pytest.raises(HttpError) as bad:
        images.insert(project=PROJECT, body={"name": "lc-baked-2", "sourceDisk": source_disk, "family": "Bad_Family"}).execute()
    assert "'resource.family': 'Bad_Family'" in error_of(bad.value)["message"]
    family = json.loads(gcloud(f"gcloud compute images describe-from-family lc-baked {where} --format=json").stdout)
    assert family["name"] == "lc-baked-1" and family["status"] == "READY" and family["labels"] == {"maxtext-version": "0-2-2"}
    assert family["sourceDisk"].endswith(f"projects/{PROJECT}/zones/{ZONE}/disks/lc-bake-source")
    assert family["diskSizeGb"] == "200" and family["sourceType"] == "RAW"
    assert "error" not in delete_and_wait(compute_discovery, "lc-bake-source")  # the image outlives its disk

    other = paramiko.ECDSAKey.generate()
    keys = ssh_keys_line("maxtext", key) + "\n" + ssh_keys_line("someone", other)
    body = instance_body("lc-from-baked", zone=ZONE, metadata={"ssh-keys": keys})
    body["disks"][0]["initializeParams"]["sourceImage"] = f"projects/{PROJECT}/zones/-/imageFamilyViews/lc-baked"
    op = compute_discovery.instances().insert(project=PROJECT, zone=ZONE, body=body).execute()
    assert "error" not in wait_operation(compute_discovery, op, project=PROJECT, zone=ZONE)
    ip = compute_discovery.instances().get(project=PROJECT, zone=ZONE, instance="lc-from-baked").execute()[
        "networkInterfaces"][0]["networkIP"]
    try:
        with ssh(ip, "maxtext", key) as client:  # the baked user: its home as it was, same uid
            assert run(client, "cat ~/maxtext_venv/version; id -u; ls /tmp; pgrep sleep || true").split() == ["0.2.2", "1001"]
        with ssh(ip, "someone", other) as client:  # a user the image never saw: a home from skel
            assert run(client, "ls -A ~ | sort").split() == [".profile_localcloud", ".ssh", "skel-link"]
    finally:
        assert "error" not in delete_and_wait(compute_discovery, "lc-from-baked")

    op = images.delete(project=PROJECT, image="lc-baked-1").execute()
    while op["status"] != "DONE":
        op = compute_discovery.globalOperations().wait(project=PROJECT, operation=op["name"]).execute()
    assert "error" not in op
    with pytest.raises(HttpError) as gone:
        images.getFromFamily(project=PROJECT, family="lc-baked").execute()
    assert error_of(gone.value)["message"] == "The resource 'projects/lc-test-project/global/images/family/lc-baked' was not found"


# ----- a power-off from inside the VM --------------------------------------------------------


def exec_status(client: paramiko.SSHClient, command: str) -> tuple[int, str]:
    _, stdout, stderr = client.exec_command(command, timeout=20)
    out = stdout.read().decode() + stderr.read().decode()
    return stdout.channel.recv_exit_status(), out


def test_a_guest_shutdown_by_a_sudoer_stops_the_instance(
    compute_cloud, compute_vm, compute_discovery, compute_instances_client
):
    """`sudo -n shutdown -h now` inside the VM: STOPPING, then TERMINATED as by instances.stop
    (processes gone, files kept, lastStopTimestamp, no external IP, the reservation unit free).
    A user outside google-sudoers is refused, by sudo and by shutdown, and the VM keeps running."""
    name, reservation = "lc-guest-off", "lc-guest-off-resv"
    compute_cloud.add_reservation(reservation, 1, zone=ZONE, project=PROJECT)
    key = paramiko.ECDSAKey.generate()
    instance = compute_vm(
        name,
        metadata={"ssh-keys": ssh_keys_line("maxtext", key) + "\n" + ssh_keys_line("visitor", key)},
        reservation=reservation,
    )
    ip = instance["networkInterfaces"][0]["networkIP"]
    assert instance["networkInterfaces"][0]["accessConfigs"][0].get("natIP")

    def in_use() -> int:
        got = compute_discovery.reservations().get(project=PROJECT, zone=ZONE, reservation=reservation).execute()
        return int(got["specificReservation"].get("inUseCount", 0))

    assert in_use() == 1
    # `visitor` loses sudo, as an OS Login user without roles/compute.osAdminLogin has none (the
    # VM's /etc/group, edited in place: it is bind-mounted into the VM).
    group_file = compute_cloud.state_dir / "vms" / name / "etc" / "group"
    text = group_file.read_text()
    assert re.search(r"^google-sudoers:x:\d+:maxtext,visitor$", text, re.M), text
    with open(group_file, "r+") as f:
        f.write(re.sub(r"^(google-sudoers:x:\d+:)maxtext,visitor$", r"\1maxtext", text, flags=re.M))
        f.truncate()

    with ssh(ip, "visitor", key) as client:
        assert "google-sudoers" not in run(client, "id -Gn").split()
        # Debian's real sudo: the VM's /etc/sudoers.d names only google-sudoers.
        assert exec_status(client, "sudo -n shutdown -h now") == (1, "sudo: a password is required\n")
        assert exec_status(client, "/usr/sbin/shutdown -h now") == (1, "shutdown: must be superuser.\n")
        # Going around the program does not convince the emulator: it checks the caller's uid
        # itself (SO_PEERCRED), whatever the caller says.
        ask = ("import socket; s = socket.socket(socket.AF_UNIX); "
               "s.connect('\\0' + open('/run/localcloud/guest-bin/power-socket').read().strip()); "
               "s.sendall(b'poweroff\\n'); print(s.makefile().readline().strip())")
        assert run(client, f"SUDO_UID=0 python3 -c {shlex.quote(ask)}") == "must be superuser.\n"
    assert compute_instances_client.get(project=PROJECT, zone=ZONE, instance=name).status == "RUNNING"

    with ssh(ip, "maxtext", key) as client:
        assert "google-sudoers" in run(client, "id -Gn").split()
        # Real root through real sudo, with its defaults: env_reset drops what the caller exported
        # (sudo keeps TERM, set to "unknown" when the caller had none), PATH is secure_path, and
        # what root runs of apt and shutdown is the VM's own (first_boot.py, guest_power.py).
        assert run(client, "command -v sudo; sudo -n id -u") == "/usr/bin/sudo\n0\n"
        env = dict(line.split("=", 1) for line in run(client, "DEBIAN_FRONTEND=noninteractive sudo -n env").splitlines())
        assert "DEBIAN_FRONTEND" not in env and env["SUDO_USER"] == "maxtext"
        assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        assert run(client, "sudo -n sh -c 'command -v shutdown; command -v apt-get'") == "/usr/sbin/shutdown\n/usr/bin/apt-get\n"
        assert "localcloud: nothing fetched" in run(client, "sudo -n apt-get update")
        assert run(client, "sudo -n cat /etc/sudoers.d/google_sudoers") == "%google-sudoers ALL=(ALL:ALL) NOPASSWD:ALL\n"
        run(client, "echo kept > ~/marker; setsid nohup sleep 1000 > /dev/null 2>&1 < /dev/null &")
        vm = next(v for v in compute_cloud.vms() if v["name"] == name)
        pidns = os.readlink(f"/proc/{vm['sshd_pid']}/ns/pid")
        vm_pids = detached_sleepers(pidns) + pids_in_namespace(pidns)
        asked = time.monotonic()
        _, stdout, _ = client.exec_command("sudo -n shutdown -h now", timeout=20)
        # 0, or -1 when the power-off cut the session before its exit status was sent.
        assert stdout.channel.recv_exit_status() in (0, -1)

    def stopped():
        got = compute_instances_client.get(project=PROJECT, zone=ZONE, instance=name)
        assert got.status in ("RUNNING", "STOPPING", "TERMINATED"), got.status
        return got if got.status == "TERMINATED" else None

    got = poll(stopped, 10)
    assert time.monotonic() - asked < 5
    assert got.last_stop_timestamp and when(got.last_stop_timestamp) >= when(instance["lastStartTimestamp"])
    assert not got.network_interfaces[0].access_configs[0].nat_i_p
    assert not any(Path(f"/proc/{pid}").exists() and pid in pids_in_namespace(pidns) for pid in vm_pids)
    assert in_use() == 0
    # A stopped instance keeps its disk: the user's files are still there.
    assert (compute_cloud.state_dir / "vms" / name / "home" / "maxtext" / "marker").read_text() == "kept\n"
