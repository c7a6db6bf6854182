"""Fixtures for the local cloud's tests. Compute Engine ones are prefixed `compute_`."""

from __future__ import annotations

from pathlib import Path

import pytest

from localcloud.cloud import LocalCloud
from localcloud.compute import testing

COMPUTE_PROJECT = "lc-test-project"
COMPUTE_ZONE = "us-east5-b"


@pytest.fixture(scope="session")
def compute_image_dir(tmp_path_factory) -> Path:
    """A tiny image: its skel/ has a file and a symlink (copied into new users' homes)."""
    image = tmp_path_factory.mktemp("compute-image")
    skel = image / "skel"
    skel.mkdir()
    (skel / ".profile_localcloud").write_text("export LOCALCLOUD_SKEL=1\n")
    (skel / "skel-link").symlink_to(".profile_localcloud")
    return image


@pytest.fixture(scope="session")
def compute_cloud(tmp_path_factory, compute_image_dir):
    """One compute emulator for the session; the tutorial's image family maps to
    `compute_image_dir`."""
    state = tmp_path_factory.mktemp("compute-state")
    with LocalCloud(state, images={testing.TUTORIAL_IMAGE_KEY: compute_image_dir}) as cloud:
        yield cloud


@pytest.fixture(scope="session")
def compute_instances_client(compute_cloud):
    """google-cloud-compute InstancesClient pointed at the emulator. Never call `.result()`
    on its operations: their polling ignores client_options and would go to the real API."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    return compute_v1.InstancesClient(
        credentials=AnonymousCredentials(), client_options={"api_endpoint": compute_cloud.base_url}
    )


@pytest.fixture(scope="session")
def compute_discovery(compute_cloud):
    """The discovery-based client (`build("compute", "v1")`) pointed at the emulator."""
    return testing.discovery_client(compute_cloud.compute_endpoint)


@pytest.fixture
def compute_vm(compute_cloud, compute_discovery):
    """Factory: `compute_vm(name, metadata=..., labels=...)` inserts an instance in
    COMPUTE_PROJECT/COMPUTE_ZONE, waits until RUNNING and returns it; all are deleted after."""
    from googleapiclient.errors import HttpError

    made = []
    where = {"project": COMPUTE_PROJECT, "zone": COMPUTE_ZONE}

    def create(name: str, **kwargs) -> dict:
        body = testing.instance_body(name, zone=COMPUTE_ZONE, **kwargs)
        op = compute_discovery.instances().insert(body=body, **where).execute()
        made.append(name)
        done = testing.wait_operation(compute_discovery, op, **where)
        assert "error" not in done, done
        return compute_discovery.instances().get(instance=name, **where).execute()

    yield create
    for name in made:
        try:
            op = compute_discovery.instances().delete(instance=name, **where).execute()
        except HttpError as exc:
            if exc.resp.status == 404:
                continue
            raise
        testing.wait_operation(compute_discovery, op, **where)
