"""What gcloud sends for a multi-host TPU slice's documented commands, normalised to compare.

`python -m tests.localcloud.slice_capture` starts a local cloud, runs COMMANDS through the real
gcloud against its compute emulator and writes FIXTURE; test_compute_slices.py runs the same
capture and asserts it equals the file, so the file is a checked artifact of gcloud 528.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from urllib.parse import urlencode

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gcloud-slice-requests.json"

PROJECT = "my-project"
ZONE = "us-east5-b"
REGION = "us-east5"
RESERVATION = "my-slice-reservation"
# The endpoint prefix written into the capture (the tutorial capture's), whatever port ran.
FIXED_PREFIX = "http://127.0.0.1:8999/compute/v1/"

_WHERE = f"--project={PROJECT}"
CREATE_COMMANDS = [
    f"gcloud compute resource-policies create workload-policy my-slice-policy --type=HIGH_THROUGHPUT "
    f"--accelerator-topology=4x4 --region={REGION} {_WHERE}",
    f"gcloud compute instance-templates create my-slice-template {_WHERE} --machine-type=ct6e-standard-4t "
    "--image-family=ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e --image-project=ubuntu-os-accelerator-images "
    f"--boot-disk-size=200GB --reservation-affinity=specific --reservation={RESERVATION} "
    "--provisioning-model=RESERVATION_BOUND --instance-termination-action=DELETE --maintenance-policy=TERMINATE",
    f"gcloud compute instance-groups managed create my-slice {_WHERE} --zone={ZONE} --template=my-slice-template "
    f"--size=4 --workload-policy=projects/{PROJECT}/regions/{REGION}/resourcePolicies/my-slice-policy",
]
# Between the two: `managed wait-until --stable` (not captured: how often it polls varies).
WAIT_COMMAND = f"gcloud compute instance-groups managed wait-until my-slice --stable {_WHERE} --zone={ZONE}"
LIST_COMMAND = f"gcloud compute instance-groups managed list-instances my-slice {_WHERE} --zone={ZONE} --format=json"
DELETE_COMMANDS = [
    f"gcloud compute instance-groups managed delete my-slice {_WHERE} --zone={ZONE} --quiet",
    f"gcloud compute instance-templates delete my-slice-template {_WHERE} --quiet",
    f"gcloud compute resource-policies delete my-slice-policy --region={REGION} {_WHERE} --quiet",
]


def normalised(logged: list[dict], endpoint: str) -> list[dict]:
    """The emulator's request log as the capture holds it: path with its query, the endpoint
    replaced by FIXED_PREFIX and operation names (random) by OPERATION."""
    text = json.dumps(
        [
            {
                "method": r["method"],
                "path": r["path"] + ("?" + urlencode(r["query"]) if r["query"] else ""),
                "body": r["body"],
                "status": r["status"],
            }
            for r in logged
        ]
    )
    text = text.replace(endpoint, FIXED_PREFIX)
    return json.loads(re.sub(r"operation-[0-9a-f-]+", "OPERATION", text))


def capture(cloud, gcloud) -> dict:
    """Run the commands through `gcloud` (tests/gcloud.py's runner, its compute endpoint the
    cloud's) against `cloud`; returns the capture. Leaves nothing behind in the cloud."""
    cloud.add_reservation(RESERVATION, 4, "ct6e-standard-4t", project=PROJECT, zone=ZONE)
    steps = []

    def step(command: str) -> str:
        cloud.clear_requests()
        out = gcloud(command).stdout
        steps.append({"command": command, "requests": normalised(cloud.requests(), cloud.compute_endpoint)})
        return out

    for command in CREATE_COMMANDS:
        step(command)
    gcloud(WAIT_COMMAND)
    listed = json.loads(step(LIST_COMMAND))
    assert [m["currentAction"] for m in listed] == ["NONE"] * 4, listed
    for command in DELETE_COMMANDS:
        step(command)
    return {
        "note": (
            "HTTP requests that gcloud (Google Cloud SDK 528.0.0) sends for a multi-host TPU slice's create, "
            "list and delete commands (issue 21), captured against the local compute emulator by "
            "tests/localcloud/slice_capture.py; endpoint shown as " + FIXED_PREFIX + ", operation names as OPERATION."
        ),
        "steps": steps,
    }


def write_fixture(capture_fn, fixture: Path) -> None:
    """Run `capture_fn(cloud, gcloud)` against a fresh local cloud (the tutorial's image family
    mapped to an empty image) and write what it returns to `fixture`."""
    from localcloud.cloud import LocalCloud
    from localcloud.compute import testing
    from tests.gcloud import gcloud_runner

    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "image"
        (image / "skel").mkdir(parents=True)
        with LocalCloud(Path(tmp) / "cloud", images={testing.TUTORIAL_IMAGE_KEY: image}) as cloud:
            result = capture_fn(cloud, gcloud_runner(Path(tmp) / "gcloud", cloud.compute_endpoint))
    fixture.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {fixture}")


def main() -> None:
    write_fixture(capture, FIXTURE)


if __name__ == "__main__":
    main()
