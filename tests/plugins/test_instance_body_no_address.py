"""A VM the workers reach inside the VPC or through IAP gets no external address, exactly as
`gcloud compute instances create --no-address` asks for it: both bodies go through the local
Compute API and are compared on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from tests.gcloud import gcloud_runner
from tests.plugins.test_spec import make_spec

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "gcloud-tutorial-requests.json"
PROJECT, ZONE = "my-project", "us-east5-b"

pytestmark = pytest.mark.e2e


def inserted_bodies(cloud) -> list[dict]:
    return [
        r["body"] for r in cloud.requests() if r["method"] == "POST" and r["path"].split("?")[0].endswith("/instances")
    ]


def network_interfaces(body: dict, cloud) -> list[dict]:
    """The body's networkInterfaces with resource URLs relative to the project."""
    text = json.dumps(body["networkInterfaces"])
    for prefix in (cloud.compute_endpoint, f"projects/{PROJECT}/"):
        text = text.replace(prefix, "")
    return json.loads(text)


@pytest.fixture(scope="module")
def gcloud_no_address_body(local_cloud, tmp_path_factory):
    local_cloud.add_reservation("my-reservation", 4, project=PROJECT, zone=ZONE)
    gcloud = gcloud_runner(tmp_path_factory.mktemp("gcloud"), local_cloud.compute_endpoint)
    command = json.loads(REFERENCE.read_text())["create_command"].replace("my-tpu", "no-address-gcloud")
    local_cloud.clear_requests()
    gcloud(f"{command} --no-address")
    (body,) = inserted_bodies(local_cloud)
    gcloud(f"gcloud compute instances delete no-address-gcloud --zone={ZONE} --project={PROJECT} --quiet")
    return body


@pytest.mark.parametrize("setting", ["use_internal_ip", "ssh_via_iap"])
def test_no_external_address_like_gclouds_no_address(setting, gcloud_no_address_body, local_cloud, pipeline_connections):
    assert "accessConfigs" not in gcloud_no_address_body["networkInterfaces"][0]  # what --no-address means
    spec = make_spec(**{setting: True}, project_id=PROJECT, vm_name_prefix=f"no-address-{setting.replace('_', '-')}")
    assert not spec.external_address
    hook = ComputeEngineEndpointHook(gcp_conn_id="google_cloud_default")
    local_cloud.clear_requests()
    hook.insert_instance(body=spec.instance_body(), zone=ZONE, project_id=PROJECT)
    try:
        (ours,) = inserted_bodies(local_cloud)
        assert network_interfaces(ours, local_cloud) == network_interfaces(gcloud_no_address_body, local_cloud)
        # The VM has an internal address only, and that is the one the SSH steps use.
        instance = hook.get_instance_info(zone=ZONE, resource_id=spec.vm_name, project_id=PROJECT)
        assert "accessConfigs" not in instance["networkInterfaces"][0]
        assert hook.get_instance_address(zone=ZONE, resource_id=spec.vm_name, project_id=PROJECT, use_internal_ip=True)
    finally:
        hook.delete_instance(resource_id=spec.vm_name, zone=ZONE, project_id=PROJECT)


def test_the_default_keeps_the_tutorials_external_address():
    spec = make_spec()
    assert spec.external_address
    assert spec.instance_body()["network_interfaces"][0]["access_configs"] == [
        {"name": "external-nat", "type_": "ONE_TO_ONE_NAT"}
    ]  # the whole tutorial body is compared with gcloud's in tests/dags/test_pipeline_e2e.py
