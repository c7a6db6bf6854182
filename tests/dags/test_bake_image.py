"""maxtext_sft_bake_image: MaxText installed on the bare image, baked into a family; a second bake
skips; a fine-tune booting the family skips the install; bad input fails before any VM."""

from __future__ import annotations

import re
import sys

import pytest

from localcloud.compute.testing import discovery_client
from localcloud.connections import BARE_IMAGE_CONF, BAKED_IMAGE_CONF, LOCAL_PROJECT, LOCAL_ZONE
from tests.conftest import REPO
from tests.dags.conftest import _Tee, collect

BAKE_CONF = {
    "project_id": LOCAL_PROJECT,
    "source_image_project": BARE_IMAGE_CONF["image_project"],
    "source_image_family": BARE_IMAGE_CONF["image_family"],
    "image_family": BAKED_IMAGE_CONF["image_family"],
}


@pytest.fixture(scope="module")
def bake(airflow_db, pipeline_connections, local_cloud):
    """bake(conf) runs the bake DAG once with dag.test(); returns the run with its log."""
    from airflow.dag_processing.dagbag import DagBag

    def run(conf: dict):
        bag = DagBag(str(REPO / "dags"))
        assert bag.import_errors == {}
        local_cloud.clear_requests()
        tee = _Tee(sys.stdout)
        try:
            sys.stdout = tee
            result = collect(bag.dags["maxtext_sft_bake_image"].test(run_conf=conf))
        finally:
            sys.stdout = tee.passthrough
        result.log = tee.kept.getvalue()
        return result

    return run


def instances(local_cloud) -> list[str]:
    listed = discovery_client(local_cloud.compute_endpoint).instances().list(project=LOCAL_PROJECT, zone=LOCAL_ZONE)
    return [item["name"] for item in listed.execute().get("items", [])]


def test_bad_input_fails_before_any_vm(bake, local_cloud):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match="work_dir"):  # the venv must be in the VM user's home
        bake({**BAKE_CONF, "work_dir": "/opt/maxtext"})
    run = bake({**BAKE_CONF, "machine_type": "ct6e-standard-8t"})
    assert run.state == "failed" and run.task_states["plan"] == "failed"
    assert "'ct6e-standard-8t' is an accelerator machine; the install is CPU work" in run.log
    assert [r for r in local_cloud.requests() if r["method"] != "GET"] == []  # nothing inserted

    run = bake({**BAKE_CONF, "source_image_family": "no-such-family"})
    assert run.state == "failed" and "has no image: no VM was created" in run.log
    assert [r for r in local_cloud.requests() if r["method"] != "GET"] == []


# The bake's VM boots as a fresh Ubuntu image does: cloud-init runs 6 s and unattended-upgrades
# holds dpkg's lock 25 s. The install waits for cloud-init first, so its first dpkg call comes 6 s
# or more after the boot, when the lock still has up to 19 s to go (without a first boot the whole
# bake took 8 s here, its install's first apt call 3-4 s after the boot): the install must wait for
# the lock (the old script failed there at once). The test's wall time grows by that wait, ~20 s.
BAKE_FIRST_BOOT = (6, 25)


def test_bake_then_skip_then_a_run_on_the_family_skips_the_install(bake, run_pipeline, local_cloud, first_boot):
    watch = first_boot(*BAKE_FIRST_BOOT)
    baked = bake(BAKE_CONF)
    assert baked.state == "success", baked.task_states
    assert set(baked.task_states.values()) == {"success"}
    assert "Installing MaxText 0.2.2 into" in baked.log and "MaxText 0.2.2 installed in" in baked.log
    # It met the first boot's lock, waited for it through apt (no error), then installed.
    assert re.search(r"Waiting for cache lock: Could not get lock /var/lib/dpkg/lock-frontend\. It is held by process"
                     r" \d+ \(unattended-upgr\)", baked.log), baked.log[-3000:]
    assert "E: " not in baked.log and "giving up" not in baked.log
    assert any(state["dpkg_lock_holder"] for _, _, state in watch.samples), watch.samples
    image = baked.xcoms["create_image.return_value"]
    assert image["status"] == "READY" and image["family"] == "maxtext-sft"
    assert image["labels"]["maxtext-version"] == "0-2-2" and image["labels"]["maxtext-vm-user"] == "maxtext"
    methods = [(r["method"], r["path"].rsplit("/", 1)[-1]) for r in local_cloud.requests() if r["method"] != "GET"]
    assert ("POST", "stop") in methods and ("POST", "images") in methods
    assert methods.index(("POST", "stop")) < methods.index(("POST", "images"))  # imaged once stopped
    assert instances(local_cloud) == [] and local_cloud.vms() == []  # the bake's VM is gone

    again = bake(BAKE_CONF)  # safe to run twice: nothing to bake, no VM
    assert again.state == "success"
    assert again.task_states["needs_bake"] == "success" and again.task_states["create_vm"] == "skipped"
    assert f"already has READY image {image['name']}" in again.log
    assert [r for r in local_cloud.requests() if r["method"] != "GET"] == []

    run = run_pipeline(BAKED_IMAGE_CONF)
    assert run.state == "success", run.report()
    assert "MaxText 0.2.2 is already installed in /home/maxtext/maxtext_venv; nothing to do" in run.log
    assert "Installing MaxText" not in run.log
    assert run.xcoms["collect_outputs.return_value"]["final_step"] == 30  # the baked venv trained
    assert instances(local_cloud) == [] and local_cloud.vms() == []
