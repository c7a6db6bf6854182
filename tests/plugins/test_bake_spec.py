"""build_bake_spec: what the bake's plan refuses before any VM, and the requests it derives."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from maxtext_sft.run.bake import baked_image, build_bake_spec
from maxtext_sft.run.params import SpecError

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGx0cmFpbmVkLWtleS1ub3QtcmVhbC1idXQtdmFsaWQ"


def spec(**params):
    return build_bake_spec(
        {"project_id": "team-project", **params},
        dag_id="maxtext_sft_bake_image",
        run_id="manual__1",
        started=datetime(2026, 1, 2, tzinfo=timezone.utc),
        default_project_id=None,
        ssh_user="maxtext",
        ssh_public_key=KEY,
    )


@pytest.mark.parametrize(
    "params, message",
    [
        ({"work_dir": "/opt/maxtext"}, "'work_dir': '/opt/maxtext' is not '~' or '~/...'"),
        ({"machine_type": "ct6e-standard-8t"}, "is an accelerator machine"),
        ({"image_family": "Bad_Family"}, "'image_family'"),
        ({"image_name": "x" * 64}, "'image_name'"),
        ({"maxtext_version": "latest"}, "'maxtext_version'"),
        ({"boot_disk_size_gb": 5}, "'boot_disk_size_gb'"),
    ],
)
def test_bad_params_are_refused(params, message):
    with pytest.raises(SpecError, match=message):
        spec(**params)


def test_an_on_demand_cpu_vm_that_cannot_outlive_the_bake_and_an_image_of_its_disk():
    bake = spec()
    body = bake.instance_body()
    assert body["machine_type"].endswith("/machineTypes/e2-standard-4") and "reservation_affinity" not in body
    assert body["scheduling"] == {
        "provisioning_model": "STANDARD",
        "instance_termination_action": "DELETE",
        "max_run_duration": {"seconds": (60 + 30) * 60},
    }
    assert body["disks"][0]["initialize_params"]["source_image"] == (
        "projects/ubuntu-os-accelerator-images/zones/-/imageFamilyViews/ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e"
    )
    image = bake.image_body()
    assert image["sourceDisk"] == f"projects/team-project/zones/us-east5-b/disks/{bake.vm_name}"
    assert image["name"].startswith("maxtext-0-2-2-") and image["family"] == "maxtext-sft"

    ready = {"name": "old", "family": "maxtext-sft", "status": "READY", "labels": bake.labels}
    assert baked_image([ready], bake) == ready
    assert baked_image([{**ready, "labels": {**bake.labels, "maxtext-vm-user": "other"}}], bake) is None
    assert baked_image([{**ready, "status": "PENDING"}], bake) is None
