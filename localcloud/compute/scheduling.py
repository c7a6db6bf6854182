"""A new instance's `scheduling`: the API's checks of its time limit (maxRunDuration or
terminationTime, with an instanceTerminationAction), of host maintenance for TPU VMs and of the
reservation-bound provisioning model, and the stored field with its defaults.

Owns: stored_scheduling, check_host_maintenance, check_reservation_bound, check_capacity_model,
refuse_run_duration,
request_valid_for, is_spot, MIN_RUN_SECONDS, MAX_RUN_SECONDS, FLEX_START_MIN_RUN_SECONDS,
FLEX_START_MAX_RUN_SECONDS, FLEX_START_MAX_WAIT_SECONDS, FLEX_START_MIN_PENDING_SECONDS. Imports
catalog, errors, resources and reservations (RESERVATION_NAME_KEY); no state.
"""

from __future__ import annotations

import copy
import time

from . import catalog, errors
from .error_catalog import RUN_DURATION_NOT_SUPPORTED, duration_value
from .errors import ApiError
from .reservations import RESERVATION_NAME_KEY
from .resources import parse_rfc3339

# Compute Engine's bounds for a VM's time limit (scheduling.maxRunDuration / terminationTime).
MIN_RUN_SECONDS = 30
MAX_RUN_SECONDS = 120 * 24 * 3600

# Flex-start (provisioningModel FLEX_START), from Google's "Create an AI-optimized instance with A4
# or A3 Ultra" page (ai-hypercomputer/docs/create/create-vm, the flex-start REST tab):
# MAX_RUN_DURATION "must be between 10 minutes and seven days"; REQUEST_VALID_FOR_DURATION (the
# insert's params.requestValidForDuration) "between 90 seconds (90) and two hours (7200)", or 0:
# "Compute Engine only allocates resources if they are immediately available". The instance
# life-cycle page (compute/docs/instances/instance-lifecycle): only "with a wait time
# (requestValidForDuration) that is 90 seconds or longer" does the VM go PENDING.
FLEX_START_MIN_RUN_SECONDS = 10 * 60
FLEX_START_MAX_RUN_SECONDS = 7 * 24 * 3600
FLEX_START_MAX_WAIT_SECONDS = 2 * 3600
FLEX_START_MIN_PENDING_SECONDS = 90


def is_spot(scheduling: dict) -> bool:
    """A Spot VM, or a legacy preemptible one (Spot VMs are the preemptible ones of today)."""
    return scheduling.get("preemptible") is True or scheduling.get("provisioningModel") == "SPOT"


def stored_scheduling(requested: dict) -> dict:
    """The stored `scheduling` of a new instance, after the API's checks of its time limit.

    Compute Engine accepts a time limit (maxRunDuration, or terminationTime) only with an
    instanceTerminationAction, never both kinds, and only between 30 seconds and 120 days;
    a termination action without a time limit only with the Spot, Reservation-Bound or
    Flex Start provisioning model.
    """
    # The discovery document's Scheduling.onHostMaintenance: "For standard instances, the
    # default behavior is MIGRATE. For preemptible instances, the default and only possible
    # behavior is TERMINATE" (Spot VMs are the preemptible ones of today).
    spot = is_spot(requested)
    scheduling = {
        "onHostMaintenance": "TERMINATE" if spot else "MIGRATE",
        # Scheduling.automaticRestart: "Preemptible instances cannot be automatically restarted."
        "automaticRestart": not spot,
        "preemptible": False,
        "provisioningModel": "STANDARD",
        **{k: copy.deepcopy(v) for k, v in requested.items() if v is not None},
    }
    field = "resource.scheduling"
    action = scheduling.get("instanceTerminationAction")
    if action == "INSTANCE_TERMINATION_ACTION_UNSPECIFIED":
        del scheduling["instanceTerminationAction"]
        action = None
    duration = scheduling.get("maxRunDuration")
    termination_time = scheduling.get("terminationTime")
    if duration is not None:
        seconds, nanos = int(duration.get("seconds") or 0), int(duration.get("nanos") or 0)
        if not 0 <= nanos <= 999_999_999:
            raise errors.invalid_field_value(
                f"{field}.maxRunDuration.nanos", nanos, "Must be from 0 to 999,999,999 inclusive."
            )
        if not MIN_RUN_SECONDS <= seconds + nanos / 1e9 <= MAX_RUN_SECONDS:
            raise errors.invalid_field_value(
                f"{field}.maxRunDuration.seconds",
                duration.get("seconds"),
                "The max run duration must be between 30 seconds and 120 days.",
            )
        # Stored like the API returns a Duration: int64 seconds as a string, nanos if any.
        scheduling["maxRunDuration"] = {"seconds": str(seconds), **({"nanos": nanos} if nanos else {})}
    if termination_time is not None:
        when = parse_rfc3339(termination_time)
        if when is None:
            raise errors.invalid_field_value(
                f"{field}.terminationTime", termination_time, "Must be a timestamp in RFC 3339 format."
            )
        if not MIN_RUN_SECONDS <= when - time.time() <= MAX_RUN_SECONDS:
            raise errors.invalid_field_value(
                f"{field}.terminationTime",
                termination_time,
                "The termination time must be between 30 seconds and 120 days from now.",
            )
    if duration is not None and termination_time is not None:
        raise errors.invalid_field_value(
            f"{field}.terminationTime",
            termination_time,
            "Only one of maxRunDuration and terminationTime can be specified.",
        )
    if (duration is not None or termination_time is not None) and action is None:
        raise errors.invalid_field_value(
            f"{field}.instanceTerminationAction",
            "",
            "An instance termination action (STOP or DELETE) must be specified with "
            "maxRunDuration or terminationTime.",
        )
    if (
        action is not None
        and duration is None
        and termination_time is None
        and scheduling["provisioningModel"] == "STANDARD"
    ):
        raise errors.invalid_field_value(
            f"{field}.instanceTerminationAction",
            action,
            "You cannot specify a termination action for a VM instance that has the standard "
            "provisioning model (default). To use instance termination action, the VM instance must "
            "use the Spot, Reservation-Bound or Flex Start provisioning model.",
        )
    return scheduling


def check_host_maintenance(machine_name: str, requested: dict, scheduling: dict) -> None:
    """TPU VMs cannot live-migrate ("VMs with GPUs or TPUs do not support live migration",
    cloud.google.com/docs/get-started/consider-resource-maintenance): onHostMaintenance must
    be TERMINATE. The API's two refusals, as reported for accelerator machine types:
    - MIGRATE asked for: "Invalid value for field 'resource.scheduling.onHostMaintenance':
      'MIGRATE'. Scheduling must have onHostMaintenance be one of the following valid types:
      [TERMINATE]. But was MIGRATE" (a3-highgpu-1g, aerospike-community/aerolab#503);
    - none given, so the default MIGRATE applies: "Instances with guest accelerators do not
      support live migration.", 400 badRequest (gcloud without --maintenance-policy for
      g2-standard-4, loft-sh/devpod#973; juju/juju#20464).
    """
    if not catalog.is_tpu(machine_name) or scheduling.get("onHostMaintenance") != "MIGRATE":
        return
    if requested.get("onHostMaintenance") == "MIGRATE":
        raise errors.invalid_field_value(
            "resource.scheduling.onHostMaintenance",
            "MIGRATE",
            "Scheduling must have onHostMaintenance be one of the following valid types: [TERMINATE]. "
            "But was MIGRATE",
        )
    raise ApiError(400, "badRequest", "Instances with guest accelerators do not support live migration.")


def check_reservation_bound(scheduling: dict, affinity: dict) -> None:
    """The reservation-bound provisioning model only with an instance that targets a specific
    reservation by name (cloud.google.com/compute/docs/instances/about-reservation-bound-vms,
    "VM creation requirements": the VM must specifically target the reservation; gcloud's
    own --provisioning-model help says the same and gcloud checks nothing itself).

    No public capture of the API's message for this case was found. The shape is the one the
    API uses for the converse rule, a STANDARD instance consuming a DENSE reservation
    ("Invalid value for field 'resource.scheduling.provisioningModel': 'STANDARD'. Instances
    consuming DENSE reservations must use provisioningModel RESERVATION_BOUND.", 400,
    skypilot-org/skypilot#9771); the sentence after the value is this emulator's.
    """
    if scheduling.get("provisioningModel") != "RESERVATION_BOUND":
        return
    if (
        affinity.get("consumeReservationType") == "SPECIFIC_RESERVATION"
        and affinity.get("key") == RESERVATION_NAME_KEY
        and affinity.get("values")
    ):
        return
    raise errors.invalid_field_value(
        "resource.scheduling.provisioningModel",
        "RESERVATION_BOUND",
        "Instances with provisioningModel RESERVATION_BOUND must consume a specific reservation.",
    )


def _duration_seconds(duration: dict | None) -> float | None:
    if duration is None:
        return None
    return int(duration.get("seconds") or 0) + int(duration.get("nanos") or 0) / 1e9


def request_valid_for(body: dict) -> float | None:
    """The insert's params.requestValidForDuration in seconds (None when not given)."""
    return _duration_seconds((body.get("params") or {}).get("requestValidForDuration"))


def check_capacity_model(requested: dict, scheduling: dict, affinity: dict, body: dict) -> None:
    """What the API refuses of a Spot (or preemptible) and a flex-start instance.

    Spot / preemptible, with the API's own words (public reports of real refusals):
    - preemptible with another provisioning model: "Invalid value for field
      'resource.scheduling.provisioningModel': 'STANDARD'. For preemptible, only allowed
      provisioning_model value is SPOT" (skypilot-org/skypilot#3235);
    - preemptible with automaticRestart true: "Invalid value for field
      'resource.scheduling.preemptible': 'true'. Scheduling must have preemptible be false when
      AutomaticRestart is true." (percona/mongo_terraform_ansible#34, elasticluster/elasticluster#568);
    - a specific reservation: reservations cannot be consumed by Spot or preemptible VMs (Compute
      Engine's reservations overview and "consume reservations" pages; skypilot-org/skypilot#2393,
      "The reservation pool is not available for the spot VMs"). No public capture of the API's
      message was found: the shape is the one of the reservation-bound refusal (see
      check_reservation_bound), the sentence after the value is this emulator's.

    Flex-start (FLEX_START_* above for the bounds' source):
    - maxRunDuration is required ("Flex-start VMs run for up to seven days"; the create pages give
      it in every request). Shape: the API's "Required field 'resource.requestedRunDuration' not
      specified", its refusal of a flex-start (DWS) resize request without a run duration (see
      errors.py); here for the instance's field;
    - maxRunDuration between 10 minutes and 7 days: the shape of the API's general bound ("The max
      run duration must be between 30 seconds and 120 days.", stored_scheduling); the flex-start
      bounds' sentence is this emulator's;
    - a specific reservation: every documented flex-start body has reservationAffinity
      NO_RESERVATION (the create pages; GoogleCloudPlatform/cluster-toolkit#2874), and gcloud's
      --provisioning-model help reserves consuming a specific reservation to RESERVATION_BOUND.
      Shape as for Spot above; the sentence is this emulator's;
    - params.requestValidForDuration over two hours (the documented range); the sentence is this
      emulator's, in the shape of the time-limit refusals.
    Flex-start with instanceTerminationAction STOP is accepted: the create page's
    TERMINATION_ACTION is "whether Compute Engine stops (STOP) or deletes (DELETE) the VM at the
    end of its run duration".
    """
    model = scheduling.get("provisioningModel")
    specific = affinity.get("consumeReservationType") == "SPECIFIC_RESERVATION"
    if requested.get("preemptible") is True:
        if requested.get("provisioningModel") not in (None, "SPOT"):
            raise errors.invalid_field_value(
                "resource.scheduling.provisioningModel",
                requested["provisioningModel"],
                "For preemptible, only allowed provisioning_model value is SPOT",
            )
        if requested.get("automaticRestart") is True:
            raise errors.invalid_field_value(
                "resource.scheduling.preemptible",
                "true",
                "Scheduling must have preemptible be false when AutomaticRestart is true.",
            )
    if is_spot(scheduling) and specific:
        field, value = (
            ("provisioningModel", "SPOT") if model == "SPOT" else ("preemptible", "true")
        )
        raise errors.invalid_field_value(
            f"resource.scheduling.{field}",
            value,
            "Spot and preemptible instances cannot consume a specific reservation.",
        )
    if model != "FLEX_START":
        return
    duration = _duration_seconds(scheduling.get("maxRunDuration"))
    if duration is None:
        raise errors.required_field("resource.scheduling.maxRunDuration")
    if not FLEX_START_MIN_RUN_SECONDS <= duration <= FLEX_START_MAX_RUN_SECONDS:
        raise errors.invalid_field_value(
            "resource.scheduling.maxRunDuration.seconds",
            scheduling["maxRunDuration"]["seconds"],
            "The max run duration of a FLEX_START instance must be between 10 minutes and 7 days.",
        )
    if specific:
        raise errors.invalid_field_value(
            "resource.scheduling.provisioningModel",
            "FLEX_START",
            "Instances with provisioningModel FLEX_START cannot consume a specific reservation.",
        )
    wait = request_valid_for(body)
    if wait is not None and not 0 <= wait <= FLEX_START_MAX_WAIT_SECONDS:
        raise errors.invalid_field_value(
            "resource.params.requestValidForDuration.seconds",
            body["params"]["requestValidForDuration"].get("seconds"),
            "The request valid for duration must be between 0 seconds and 2 hours.",
        )


def refuse_run_duration(requested: dict, models: list[str], field: str = "resource.scheduling") -> None:
    """The refusal of a time limit with a provisioning model in `models` (Faults
    `max_run_duration_refused`: a test's switch, not a rule of the API's that a source shows; the
    shape and its source: error_catalog.RUN_DURATION_NOT_SUPPORTED). A body without one passes."""
    duration = requested.get("maxRunDuration")
    if duration is None or requested.get("provisioningModel", "STANDARD") not in models:
        return
    raise errors.invalid_field_value(f"{field}.maxRunDuration", duration_value(duration), RUN_DURATION_NOT_SUPPORTED)
