"""What gcloud sends for the tutorial's create command under each capacity choice but the
reservation's (issue 31), normalised to compare.

`python -m tests.localcloud.capacity_capture` starts a local cloud, runs COMMANDS through the real
gcloud against its compute emulator and writes FIXTURE; test_compute_capacity.py runs the same
capture and asserts it equals the file, so the file is a checked artifact of gcloud 528.

gcloud 528 has --provisioning-model=FLEX_START only in `gcloud alpha compute instances create`.
The alpha command's API is compute/alpha, but with api_endpoint_overrides/compute set (here
CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE=http://127.0.0.1:PORT/compute/v1/) gcloud uses that
endpoint as given, version included: the alpha create is sent to /compute/v1/ and the emulator
checks its body against the v1 discovery document like any other (it has no alpha-only field).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.localcloud.slice_capture import FIXED_PREFIX, normalised, write_fixture

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gcloud-capacity-requests.json"
TUTORIAL = Path(__file__).resolve().parents[1] / "fixtures" / "gcloud-tutorial-requests.json"

# The tutorial's create command without its capacity flags (the reservation-bound ones).
_RESERVATION_FLAGS = (
    " --maintenance-policy=TERMINATE --instance-termination-action=DELETE --provisioning-model=RESERVATION_BOUND"
    " --reservation-affinity=specific --reservation=my-reservation"
)


def commands() -> dict[str, str]:
    """The tutorial's create command (tests/fixtures/gcloud-tutorial-requests.json) as Spot,
    on-demand (a STANDARD VM with a time limit) and flex-start."""
    tutorial = json.loads(TUTORIAL.read_text())["create_command"]
    assert tutorial.endswith(_RESERVATION_FLAGS), tutorial
    base = tutorial[: -len(_RESERVATION_FLAGS)]
    return {
        "spot": f"{base} --provisioning-model=SPOT --instance-termination-action=DELETE --maintenance-policy=TERMINATE",
        "on-demand": (
            f"{base} --provisioning-model=STANDARD --max-run-duration=86400s --instance-termination-action=DELETE "
            "--maintenance-policy=TERMINATE --reservation-affinity=none"
        ),
        "flex-start": (
            base.replace("gcloud compute ", "gcloud alpha compute ", 1)
            + " --provisioning-model=FLEX_START --max-run-duration=86400s --instance-termination-action=DELETE"
            " --maintenance-policy=TERMINATE --reservation-affinity=none"
        ),
    }


def capture(cloud, gcloud) -> dict:
    """Run each create (then delete the VM) through `gcloud` (tests/gcloud.py's runner, its
    compute endpoint the cloud's) against `cloud`; returns the capture. Leaves nothing behind."""
    steps = []
    for capacity, command in commands().items():
        cloud.clear_requests()
        out = gcloud(command)
        assert "RUNNING" in out.stdout, out.stdout
        steps.append(
            {"capacity": capacity, "command": command, "requests": normalised(cloud.requests(), cloud.compute_endpoint)}
        )
        gcloud("gcloud compute instances delete my-tpu --zone=us-east5-b --project=my-project --quiet")
    return {
        "note": (
            "HTTP requests that gcloud (Google Cloud SDK 528.0.0) sends for the tutorial's create command "
            "(tests/fixtures/gcloud-tutorial-requests.json) as a Spot, an on-demand and a flex-start VM (issue 31), "
            "captured against the local compute emulator by tests/localcloud/capacity_capture.py "
            "(python -m tests.localcloud.capacity_capture); endpoint shown as " + FIXED_PREFIX + ", operation names "
            "as OPERATION. The flex-start create is gcloud alpha's (528 has FLEX_START only there); with the compute "
            "endpoint override gcloud alpha sends it to the override as given, /compute/v1/."
        ),
        "steps": steps,
    }


def main() -> None:
    write_fixture(capture, FIXTURE)


if __name__ == "__main__":
    main()
