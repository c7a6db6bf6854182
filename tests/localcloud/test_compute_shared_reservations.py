"""A reservation shared from its owner project: gcloud's `--reservation=projects/OWNER/reservations/
NAME` consumes it from a project it is shared with (counted in the owner's reservation), and a
project it is not shared with is refused on the operation, as for a reservation it cannot see."""

from __future__ import annotations

import pytest

from localcloud.compute.testing import TUTORIAL_IMAGE_KEY
from tests.gcloud import gcloud_runner
from tests.localcloud.conftest import COMPUTE_PROJECT, COMPUTE_ZONE

OWNER = "lc-capacity-owner"
STRANGER = "lc-not-shared"


@pytest.fixture(scope="module")
def shared(compute_cloud):
    reservation = compute_cloud.add_reservation(
        "lc-shared-resv", 2, zone=COMPUTE_ZONE, project=OWNER, shared_with=(COMPUTE_PROJECT,)
    )
    return f"projects/{OWNER}/reservations/{reservation['name']}"


def create(name: str, project: str, reservation: str) -> str:
    """The tutorial's create in `project`, on `reservation` (gcloud sends it as given)."""
    image_project, family = TUTORIAL_IMAGE_KEY.split("/", 1)
    return (
        f"gcloud compute instances create {name} --zone={COMPUTE_ZONE} --project={project} "
        f"--machine-type=ct6e-standard-8t --image-project={image_project} --image-family={family} "
        f"--reservation-affinity=specific --reservation={reservation} --provisioning-model=RESERVATION_BOUND "
        "--instance-termination-action=DELETE --maintenance-policy=TERMINATE --no-address"
    )


def test_a_shared_reservation_is_read_in_its_owner_project(compute_discovery, shared):
    read = compute_discovery.reservations().get(project=OWNER, zone=COMPUTE_ZONE, reservation="lc-shared-resv").execute()
    assert read["shareSettings"] == {
        "shareType": "SPECIFIC_PROJECTS",
        "projectMap": {COMPUTE_PROJECT: {"projectId": COMPUTE_PROJECT}},
    }


def test_gcloud_consumes_it_from_a_project_it_is_shared_with_and_not_from_another(
    compute_cloud, compute_discovery, shared, tmp_path
):
    gcloud = gcloud_runner(tmp_path / "gcloud-config", compute_cloud.compute_endpoint)
    gcloud(create("lc-shared-vm", COMPUTE_PROJECT, shared))
    try:
        read = compute_discovery.reservations().get(
            project=OWNER, zone=COMPUTE_ZONE, reservation="lc-shared-resv"
        ).execute()
        assert read["specificReservation"]["inUseCount"] == "1"  # counted where it lives
        [insert] = [
            r for r in compute_cloud.requests()
            if r["method"] == "POST" and f"/projects/{COMPUTE_PROJECT}/zones/" in r["path"]
            and (r["body"] or {}).get("name") == "lc-shared-vm"
        ]
        assert insert["body"]["reservationAffinity"]["values"] == [shared]
        refused = gcloud(create("lc-stranger-vm", STRANGER, shared), fails=True)
        assert "Specified reservation 'lc-shared-resv' does not exist." in refused.stderr, refused.stderr
        assert not [vm for vm in compute_cloud.vms() if vm["name"] == "lc-stranger-vm"]
    finally:
        gcloud(f"gcloud compute instances delete lc-shared-vm --zone={COMPUTE_ZONE} --project={COMPUTE_PROJECT} --quiet")
