"""Helpers for code that drives the compute emulator in tests (clients, bodies, waits)."""

from __future__ import annotations

import time

import httplib2

# The image family the tutorial boots (the key in an images mapping).
TUTORIAL_IMAGE_KEY = "ubuntu-os-accelerator-images/ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e"


def discovery_client(compute_endpoint: str, credentials=None):
    """`googleapiclient.discovery.build("compute", "v1")` pointed at the emulator, no auth (with
    `credentials`: theirs, each request carrying their token)."""
    from googleapiclient.discovery import build

    # Longer than the emulator's 120 s operations.wait.
    http = httplib2.Http(timeout=130, proxy_info=None)
    if credentials is not None:
        import google_auth_httplib2

        http = google_auth_httplib2.AuthorizedHttp(credentials, http=http)
    return build("compute", "v1", client_options={"api_endpoint": compute_endpoint}, http=http, static_discovery=True)


def wait_operation(discovery, operation: dict | str, *, project: str, zone: str, timeout: float = 60.0) -> dict:
    """Poll zoneOperations.get until DONE, bounded by `timeout`; returns the operation."""
    name = operation if isinstance(operation, str) else operation["name"]
    deadline = time.monotonic() + timeout
    while True:
        op = discovery.zoneOperations().get(project=project, zone=zone, operation=name).execute()
        if op["status"] == "DONE":
            return op
        if time.monotonic() > deadline:
            raise TimeoutError(f"operation {name} not DONE after {timeout}s: {op}")
        time.sleep(0.05)


def instance_body(
    name: str,
    *,
    zone: str,
    image_key: str = TUTORIAL_IMAGE_KEY,
    machine_type: str = "ct6e-standard-8t",
    metadata: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    scheduling: dict | None = None,
    reservation: str | None = None,
) -> dict:
    """An instances.insert body (REST JSON) that boots `image_key` ("PROJECT/FAMILY");
    `scheduling` adds to (or overrides) its scheduling, e.g. a time limit:
    {"maxRunDuration": {"seconds": 30}, "instanceTerminationAction": "DELETE"};
    `reservation` makes it consume that reservation (by name, as gcloud's --reservation sends it)."""
    image_project, family = image_key.split("/", 1)
    body = {
        "name": name,
        "machineType": f"zones/{zone}/machineTypes/{machine_type}",
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
        "networkInterfaces": [
            {"network": "global/networks/default", "accessConfigs": [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]}
        ],
        "scheduling": {"onHostMaintenance": "TERMINATE", "automaticRestart": False, **(scheduling or {})},
    }
    if metadata:
        body["metadata"] = {"items": [{"key": k, "value": v} for k, v in metadata.items()]}
    if labels:
        body["labels"] = labels
    if reservation:
        body["reservationAffinity"] = {
            "consumeReservationType": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name",
            "values": [reservation],
        }
    return body
