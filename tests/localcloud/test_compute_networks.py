"""The emulator's VPC networks, through gcloud and the discovery client: a custom-mode network
refuses an insert without a subnetwork, a Shared VPC's subnetwork in its host project is taken
(its network inferred), and a missing subnetwork or network is refused as the API words it."""

from __future__ import annotations

import json

import pytest
from googleapiclient.errors import HttpError

from localcloud.compute.testing import TUTORIAL_IMAGE_KEY, instance_body, wait_operation
from tests.gcloud import gcloud_runner
from tests.localcloud.conftest import COMPUTE_PROJECT, COMPUTE_ZONE

HOST = "lc-vpc-host"  # a Shared VPC's host project
REGION = COMPUTE_ZONE.rsplit("-", 1)[0]


@pytest.fixture(scope="module")
def networks(compute_cloud):
    """A custom-mode network in the test project, and a Shared VPC network in its host project."""
    compute_cloud.add_network("lc-custom", project=COMPUTE_PROJECT, subnetworks={"lc-custom-sub": "10.10.0.0/24"})
    compute_cloud.add_network("lc-shared", project=HOST, subnetworks={"lc-tpu": "10.20.0.0/24"})


def body_with(name: str, nic: dict) -> dict:
    body = instance_body(name, zone=COMPUTE_ZONE)
    body["networkInterfaces"] = [nic]
    return body


def refusal(discovery, body: dict) -> tuple[int, dict]:
    with pytest.raises(HttpError) as refused:
        discovery.instances().insert(project=COMPUTE_PROJECT, zone=COMPUTE_ZONE, body=body).execute()
    return refused.value.resp.status, json.loads(refused.value.content)["error"]


def test_gcloud_on_a_custom_mode_network_needs_a_subnetwork(compute_cloud, networks, tmp_path):
    gcloud = gcloud_runner(tmp_path / "gcloud-config", compute_cloud.compute_endpoint)
    image_project, family = TUTORIAL_IMAGE_KEY.split("/", 1)
    create = (
        f"gcloud compute instances create lc-net-gcloud --zone={COMPUTE_ZONE} --project={COMPUTE_PROJECT} "
        f"--machine-type=ct6e-standard-8t --image-project={image_project} --image-family={family} "
        "--maintenance-policy=TERMINATE --network=lc-custom --no-address"
    )
    refused = gcloud(create, fails=True)
    assert "Subnetwork should be specified for custom subnetmode network" in refused.stderr, refused.stderr
    assert not [vm for vm in compute_cloud.vms() if vm["name"] == "lc-net-gcloud"]


def test_a_shared_vpc_subnetwork_is_taken_and_its_network_inferred(compute_cloud, networks, compute_discovery):
    subnet = f"projects/{HOST}/regions/{REGION}/subnetworks/lc-tpu"
    op = compute_discovery.instances().insert(
        project=COMPUTE_PROJECT, zone=COMPUTE_ZONE, body=body_with("lc-net-shared", {"subnetwork": subnet})
    ).execute()
    try:
        assert "error" not in wait_operation(compute_discovery, op, project=COMPUTE_PROJECT, zone=COMPUTE_ZONE)
        instance = compute_discovery.instances().get(
            project=COMPUTE_PROJECT, zone=COMPUTE_ZONE, instance="lc-net-shared"
        ).execute()
        nic = instance["networkInterfaces"][0]
        assert nic["network"].endswith(f"/projects/{HOST}/global/networks/lc-shared"), nic
        assert nic["subnetwork"].endswith(f"/{subnet}"), nic
    finally:
        done = compute_discovery.instances().delete(
            project=COMPUTE_PROJECT, zone=COMPUTE_ZONE, instance="lc-net-shared"
        ).execute()
        wait_operation(compute_discovery, done, project=COMPUTE_PROJECT, zone=COMPUTE_ZONE)


def test_missing_subnetworks_and_networks_are_refused_as_the_api_words_it(compute_discovery, networks):
    missing_subnet = f"projects/{HOST}/regions/{REGION}/subnetworks/lc-nothing"
    status, error = refusal(compute_discovery, body_with("lc-net-x", {"subnetwork": missing_subnet}))
    assert (status, error["errors"][0]["reason"]) == (400, "invalid")
    assert error["message"] == (
        f"Invalid value for field 'resource.networkInterfaces[0].subnetwork': '{missing_subnet}'. "
        "The referenced subnetwork resource cannot be found."
    )
    status, error = refusal(compute_discovery, body_with("lc-net-x", {"network": "global/networks/lc-custom"}))
    assert (status, error["message"]) == (
        400,
        "Invalid value for field 'resource.networkInterfaces[0]': ''. Subnetwork should be specified for custom "
        "subnetmode network",
    )
    status, error = refusal(compute_discovery, body_with("lc-net-x", {"network": "global/networks/lc-nowhere"}))
    assert (status, error["errors"][0]["reason"]) == (404, "notFound")
    assert error["message"] == f"The resource 'projects/{COMPUTE_PROJECT}/global/networks/lc-nowhere' was not found"


def test_networks_and_subnetworks_read_as_the_api_returns_them(compute_discovery, networks):
    custom = compute_discovery.networks().get(project=COMPUTE_PROJECT, network="lc-custom").execute()
    assert custom["autoCreateSubnetworks"] is False
    assert [link.rsplit("/", 1)[1] for link in custom["subnetworks"]] == ["lc-custom-sub"]
    default = compute_discovery.networks().get(project=COMPUTE_PROJECT, network="default").execute()
    assert default["autoCreateSubnetworks"] is True
    subnet = compute_discovery.subnetworks().get(project=HOST, region=REGION, subnetwork="lc-tpu").execute()
    assert subnet["network"].endswith(f"/projects/{HOST}/global/networks/lc-shared")
    assert subnet["ipCidrRange"] == "10.20.0.0/24"
    with pytest.raises(HttpError) as missing:
        compute_discovery.subnetworks().get(project=HOST, region=REGION, subnetwork="lc-nothing").execute()
    assert missing.value.resp.status == 404
