"""IAM in the Compute Engine and Cloud Storage emulators, driven by the real clients with a
service account's credentials (its key's token_uri the local token endpoint): a bound account
may do what its permissions allow and is refused the rest with each API's 403; an account no
binding names is not checked. localcloud/compute/iam.py and localcloud/storage/iam.py name the
sources."""

from __future__ import annotations

import pytest

from google.api_core.exceptions import Forbidden
from google.cloud import storage
from google.oauth2 import service_account
from googleapiclient.errors import HttpError

from localcloud.compute import testing
from tests.localcloud.conftest import COMPUTE_PROJECT, COMPUTE_ZONE

SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
ACCOUNT = "limited@lc-test-project.iam.gserviceaccount.com"
MEMBER = f"serviceAccount:{ACCOUNT}"


@pytest.fixture
def credentials(compute_cloud):
    key = compute_cloud.add_service_account(ACCOUNT)
    yield service_account.Credentials.from_service_account_info(key, scopes=SCOPES)
    compute_cloud.bind_role(MEMBER, None)


def test_compute_refuses_what_the_bound_role_lacks_naming_the_permission_and_the_resource(compute_cloud, credentials):
    compute = testing.discovery_client(compute_cloud.compute_endpoint, credentials=credentials)
    where = {"project": COMPUTE_PROJECT, "zone": COMPUTE_ZONE}
    body = testing.instance_body("iam-denied", zone=COMPUTE_ZONE)
    compute_cloud.bind_role(MEMBER, ["compute.instances.create", "compute.instances.get"])
    with pytest.raises(HttpError) as refused:  # the body's boot disk needs compute.disks.create too
        compute.instances().insert(body=body, **where).execute()
    assert refused.value.resp.status == 403
    assert refused.value.reason == (
        f"Required 'compute.disks.create' permission for 'projects/{COMPUTE_PROJECT}/zones/{COMPUTE_ZONE}/instances/iam-denied'")
    with pytest.raises(HttpError) as missing:  # allowed: the API's own answer
        compute.instances().get(instance="iam-denied", **where).execute()
    assert missing.value.resp.status == 404
    compute_cloud.bind_role(MEMBER, None)  # no binding: not checked
    with pytest.raises(HttpError) as missing:
        compute.zones().get(project=COMPUTE_PROJECT, zone="no-such-zone1-a").execute()
    assert missing.value.resp.status in (400, 404)


def test_storage_refuses_what_the_bound_role_lacks(compute_cloud, credentials):
    compute_cloud.create_bucket("iam-bucket", exist_ok=True)
    client = storage.Client(project=COMPUTE_PROJECT, credentials=credentials,
                            client_options={"api_endpoint": compute_cloud.storage_url})
    bucket = client.bucket("iam-bucket")
    compute_cloud.bind_role(MEMBER, ["storage.objects.list", "storage.objects.get"])
    assert list(client.list_blobs("iam-bucket")) == []
    with pytest.raises(Forbidden, match=rf"{ACCOUNT} does not have storage.objects.create access"):
        bucket.blob("denied.txt").upload_from_string(b"x")
    compute_cloud.bind_role(MEMBER, ["storage.objects.list", "storage.objects.get", "storage.objects.create"])
    bucket.blob("allowed.txt").upload_from_string(b"x")
    assert bucket.blob("allowed.txt").download_as_bytes() == b"x"
    with pytest.raises(Forbidden, match="storage.objects.delete"):
        bucket.blob("allowed.txt").delete()


def test_the_vms_account_holds_storage_object_user_as_the_local_cloud_prepares_it(compute_cloud, tmp_path):
    """The VMs' gcloud (their token, storage_env) under roles/storage.objectUser: objects written,
    listed, read and deleted; the bucket's own metadata refused, as that role has no
    storage.buckets.get."""
    import subprocess

    from localcloud.cloud import VM_ACCESS_TOKEN, VM_SERVICE_ACCOUNT_EMAIL, storage_env
    from localcloud.storage.iam import STORAGE_OBJECT_USER

    compute_cloud.create_bucket("vm-role-bucket", exist_ok=True)
    member = f"serviceAccount:{VM_SERVICE_ACCOUNT_EMAIL}"
    compute_cloud.bind_role(member, list(STORAGE_OBJECT_USER), token=VM_ACCESS_TOKEN)
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(tmp_path), **storage_env(compute_cloud.storage_url)}

    def gcloud(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["gcloud", "storage", *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)

    try:
        (tmp_path / "step.txt").write_text("1")
        assert gcloud("cp", "step.txt", "gs://vm-role-bucket/run/step.txt").returncode == 0
        listed = gcloud("ls", "gs://vm-role-bucket/run/")
        assert listed.stdout.split() == ["gs://vm-role-bucket/run/step.txt"], listed.stderr
        assert gcloud("cat", "gs://vm-role-bucket/run/step.txt").stdout == "1"
        refused = gcloud("buckets", "describe", "gs://vm-role-bucket")
        assert refused.returncode != 0
        assert f"{VM_SERVICE_ACCOUNT_EMAIL} does not have storage.buckets.get access" in refused.stderr, refused.stderr
        assert gcloud("rm", "gs://vm-role-bucket/run/step.txt").returncode == 0
    finally:
        compute_cloud.bind_role(member, None)
