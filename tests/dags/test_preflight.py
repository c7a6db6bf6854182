"""Each preflight failure stops the run before a VM exists, naming what is wrong."""

from __future__ import annotations

import dataclasses
import json
import secrets
import subprocess
import tempfile

import pytest

from localcloud.connections import LOCAL_HUB_USER, LOCAL_PROJECT
from tests.dags import fault_tally

pytestmark = pytest.mark.e2e
ZONE = "us-east5-b"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    conf: dict = dataclasses.field(default_factory=dict)
    token: str | None = None  # "invalid": unknown to the Hub; "no-licence": a user without the model's grant;
    # "read-only": a read token of the team that holds the licence (it may read all but not publish)
    cause: str = ""
    small_tmpdir: bool = False  # the worker's temporary folder on a 1 MB file system


CASES = [
    Case("invalid token", token="invalid", cause="the Hugging Face token is invalid or expired"),
    Case(
        "token without the gated model's licence",
        token="no-licence",
        cause="has no access to the gated model google/gemma-3-4b-it",
    ),
    Case(
        "read-only token, with a repo to publish to",
        {"hub_repo_id": f"{LOCAL_HUB_USER}/preflight-read-only"},
        token="read-only",
        cause=(
            f"Hub publishing: Param hub_repo_id {LOCAL_HUB_USER}/preflight-read-only: the Hugging Face token "
            f"(of {LOCAL_HUB_USER}) is read-only, so publish_to_hub would fail after the training. Put a token "
            f"with write access to {LOCAL_HUB_USER} in the Hugging Face connection"
        ),
    ),
    Case("model revision missing", {"model_revision": "no-such-revision"}, cause="has no revision 'no-such-revision'"),
    Case(
        "dataset missing",
        {"dataset_name": f"{LOCAL_HUB_USER}/no-such-dataset"},
        cause=f"dataset {LOCAL_HUB_USER}/no-such-dataset does not exist",
    ),
    Case("dataset revision missing", {"dataset_revision": "no-such-revision"}, cause="has no revision 'no-such-revision'"),
    Case(
        "held-out split missing from the pinned snapshot",
        {"eval_split": "validation"},
        cause="has no files data/validation-*.parquet to evaluate on (Param eval_split",
    ),
    Case("reservation missing", {"reservation": "no-such-reservation"}, cause="no-such-reservation in local-project/us-east5-b does not exist"),
    Case(
        "reservation full, no wait allowed",
        {"reservation": "preflight-full", "max_capacity_wait_minutes": 0},
        cause="has no free capacity: 1 of 1 machines in use",
    ),
    Case("reservation of another machine type", {"reservation": "preflight-v5e"}, cause="holds ct5lp-hightpu-8t machines"),
    Case(
        "reservation of another project not shared with the run's",
        {"reservation": "projects/preflight-owner/reservations/preflight-private"},
        cause="reservation preflight-private in preflight-owner/us-east5-b is not shared with project local-project",
    ),
    Case(
        "custom-mode network without a subnetwork",
        {"network": "preflight-vpc"},
        cause="network preflight-vpc in project local-project is a custom-mode network: name one of its subnetworks",
    ),
    Case(
        "subnetwork missing",
        {"network": "preflight-vpc", "subnetwork": "no-such-subnet"},
        cause="subnetwork no-such-subnet does not exist in us-east5 of project local-project",
    ),
    Case(
        "subnetwork of another network",
        {"network": "preflight-vpc", "subnetwork": "default"},
        cause="subnetwork default in us-east5 belongs to network default, not preflight-vpc",
    ),
    Case("network missing", {"network": "no-such-vpc"}, cause="network no-such-vpc in project local-project does not exist"),
    Case("output location not writable", {"output_location": "gs://no-such-bucket/runs"}, cause="is not writable"),
    Case(
        "worker's temporary folder too small for the export's largest file, with a repo to publish to",
        {"hub_repo_id": f"{LOCAL_HUB_USER}/preflight-small-tmp"},
        small_tmpdir=True,
        cause="of the export's largest file, which publish_to_hub fetches there before uploading it",
    ),
    Case(
        "SSH through IAP, the connection's account without the tunnel role",
        {"ssh_via_iap": True},
        cause="may not tunnel to VMs of project local-project: it needs the IAP-secured Tunnel User",
    ),
    Case(
        "no room for a real gemma3-4b on the boot disk and in /dev/shm",
        {"boot_disk_size_gb": 40, "checkpoint_period": 10, "steps": 1000},
        cause="room: the boot disk of 40 GB cannot hold 50.6 GB",
    ),
]


@pytest.fixture(scope="module")
def reservations(local_cloud, pipeline_connections):
    """A reservation whose one machine is taken, one of another machine type, and a custom-mode
    network (its one subnetwork in us-east5), and another project's reservation shared with none."""
    from maxtext_sft.cloud.compute import ComputeEngineEndpointHook

    where = {"zone": ZONE, "project": LOCAL_PROJECT}
    local_cloud.add_reservation("preflight-full", 1, **where)
    local_cloud.add_reservation("preflight-v5e", 4, machine_type="ct5lp-hightpu-8t", **where)
    local_cloud.add_reservation("preflight-private", 1, zone=ZONE, project="preflight-owner")  # shared with none
    local_cloud.add_network("preflight-vpc", project=LOCAL_PROJECT, subnetworks={"preflight-subnet": "10.30.0.0/24"})
    compute = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    where = {"zone": ZONE, "project_id": LOCAL_PROJECT}
    body = {
        "name": "preflight-holder",
        "machine_type": f"zones/{ZONE}/machineTypes/ct6e-standard-8t",
        "disks": [{"boot": True, "auto_delete": True, "initialize_params": {
            "source_image": "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e"
        }}],
        "network_interfaces": [{"network": "global/networks/default"}],
        "scheduling": {"on_host_maintenance": "TERMINATE"},  # a TPU VM cannot live-migrate
        "reservation_affinity": {
            "consume_reservation_type": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name",
            "values": ["preflight-full"],
        },
    }
    compute.insert_instance(body=body, **where)
    yield
    compute.delete_instance(resource_id="preflight-holder", **where)


@pytest.fixture
def small_tmpdir(tmp_path, monkeypatch):
    """Python's temporary folder (tempfile.tempdir) on a 1 MB tmpfs, as a worker with little room."""
    folder = tmp_path / "small-tmp"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], check=True)
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_preflight_stops_the_run_before_any_vm(case, reservations, run_pipeline, local_cloud, monkeypatch, request):
    if case.small_tmpdir:
        request.getfixturevalue("small_tmpdir")
    if case.token:
        token = f"hf_preflight{secrets.token_hex(12)}"
        if case.token == "no-licence":
            local_cloud.hub.add_user(f"user-{token[-8:]}", token, role="read")
        if case.token == "read-only":
            local_cloud.hub.add_user(LOCAL_HUB_USER, token, role="read")
        connection = {"conn_type": "generic", "password": token, "extra": {"endpoint": local_cloud.hub.endpoint}}
        monkeypatch.setenv("AIRFLOW_CONN_HUGGINGFACE_DEFAULT", json.dumps(connection))
    fault_tally.fault_injected()
    run = run_pipeline(case.conf)
    leaked = [vm for vm in local_cloud.vms() if vm["name"] != "preflight-holder"]
    fault_tally.vms_left(leaked)
    assert leaked == []
    assert [r for r in local_cloud.requests() if r["method"] == "POST"] == []  # no insert, nothing written
    assert run.state == "failed"
    assert run.task_states["preflight"] == "failed", run.report()
    assert run.task_states["create_vm"] in ("upstream_failed", "skipped", None), run.report()
    error = run.log[run.log.rindex("Preflight failed, no VM was created") :][:3000]
    fault_tally.failed_run(error, case.cause)
    assert case.cause in error, error


def test_every_failure_is_named_at_once(reservations, run_pipeline, local_cloud):
    run = run_pipeline({"dataset_name": f"{LOCAL_HUB_USER}/no-such-dataset", "reservation": "no-such-reservation"})
    error = run.log[run.log.rindex("Preflight failed") :][:2000]
    assert "dataset: dataset" in error and "reservation: reservation no-such-reservation" in error
    assert [r for r in local_cloud.requests() if r["method"] == "POST"] == []
