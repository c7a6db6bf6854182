"""Compute Engine's own wording of the errors it gives when it refuses to create an instance or an
operation fails, with the source of each: what the faults inject (faults.py) and what a real
reservation's refusal says (reservations.py), on an operation or synchronously.

Owns: INSTANCE_ERRORS (the presets), the operation and HTTP error tables, fill, error_values.
Imports resources (region_of) only.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import zlib

from .resources import region_of

# Operation error code → (httpErrorStatusCode) as the real API reports it. CONDITION_NOT_MET:
# 412 "PRECONDITION FAILED", as in cluster-autoscaler's autoscaling_gce_client_test.go
# (`operationDoneResponseError`); PERMISSIONS_ERROR: 403, Google's Compute Engine error catalog
# (cloud.google.com/compute/docs/reference/rest/v1/errors).
OPERATION_ERROR_STATUS = {
    "CONDITION_NOT_MET": 412,
    "PERMISSIONS_ERROR": 403,
    "ZONE_RESOURCE_POOL_EXHAUSTED": 503,
    "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS": 503,
    "REGION_RESOURCE_POOL_EXHAUSTED": 503,
    "QUOTA_EXCEEDED": 403,
    "RESOURCE_NOT_FOUND": 404,
    "INTERNAL_ERROR": 500,
}


# ----- error catalog -----------------------------------------------------------------------------
# Compute Engine's own wording of the errors the faults inject, and where each was seen:
# - zone exhausted, quota: public reports of real errors (gcloud and Terraform output; the double
#   spaces are theirs), Google's troubleshooting pages (compute/docs/troubleshooting/
#   troubleshooting-resource-availability: the zone message; troubleshooting-bulk-vm-creation:
#   synchronous HTTP 403 `quotaExceeded`), SkyPilot's sky/provision/gcp/instance_utils.py
#   (`_handle_http_error`: the synchronous quota error's domain `usageLimits`);
# - the reservation, organisation-policy and TPU-configuration errors: Kubernetes
#   cluster-autoscaler's GCE client (cluster-autoscaler/cloudprovider/gce/autoscaling_gce_client.go,
#   `GetErrorInfo` and its `is*` helpers; the exact messages from autoscaling_gce_client_test.go,
#   `TestErrors`), which reads them as `{code, message}` errors of instance-creation attempts
#   (CONDITION_NOT_MET), i.e. on the operation, HTTP 412 (`operationDoneResponseError` there). No
#   source shows them as a synchronous insert error, so the operation is where the emulator gives
#   them for a real reservation; `insert_rejected` can still give them synchronously (412
#   `conditionNotMet`, the reason the API gives a 412, see errors.fingerprint_mismatch);
# - permission: Google's Compute Engine error catalog (compute/docs/reference/rest/v1/errors:
#   PERMISSIONS_ERROR, 403, "Required '{permission}' permission for '{resource}'"); gcloud prints
#   it as a synchronous error ("Could not fetch resource: - Required 'compute.instances.create'
#   permission for 'projects/P/zones/Z/instances/NAME'"), Terraform with the reason `forbidden`;
# - the internal-error format: public reports of real operation errors.
# Earlier versions of this emulator answered a full reservation with an invented "Reservation R
# does not have sufficient capacity ..." (400); no source shows that wording.
# `{project}`, `{project_number}`, `{zone}`, `{region}`, `{name}` and `{reservation}` are filled
# in from the request.

_ZONE_EXHAUSTED = (
    "The zone 'projects/{project}/zones/{zone}' does not have enough resources available to fulfill "
    "the request.  Try a different zone, or try again later."
)
_ZONE_EXHAUSTED_WITH_DETAILS = (
    "The zone 'projects/{project}/zones/{zone}' does not have enough resources available to fulfill "
    "the request.  '(resource type:compute)'."
)
_QUOTA = "Quota 'CPUS' exceeded.  Limit: 0.0 in region {region}."
# Spot and flex-start TPU VMs count against the preemptible TPU quota, metric
# compute.googleapis.com/PREEMPTIBLE_TPU_V6E for v6e (Google's flex-start VMs announcement: they
# "consume preemptible quota"; the metric's name as public TPU setup guides and scripts quote it,
# e.g. the Cloud Console quota link metric=compute.googleapis.com%2Fpreemptible_tpu_v6e); the
# message is the quota error's own shape (_QUOTA above) with that metric.
_PREEMPTIBLE_TPU_QUOTA = "Quota 'PREEMPTIBLE_TPU_V6E' exceeded.  Limit: 0.0 in region {region}."
_INTERNAL = "Internal error. Please try again or contact Google Support. (Code: '{support_code}')"
_PERMISSION = "Required 'compute.instances.create' permission for 'projects/{project}/zones/{zone}/instances/{name}'"


@dataclasses.dataclass(frozen=True)
class InstanceError:
    """One way Compute Engine refuses to create an instance, in both places it says so: on the
    insert's operation (`error.errors[] = [{code, message}]`, httpErrorStatusCode `status`) or
    synchronously (HTTP `status`, `errors[] = [{message, domain, reason}]`)."""

    code: str
    message: str
    status: int
    reason: str
    domain: str = "global"


# The presets of insert_rejected (synchronous), insert_fails_after_accept and operation_errors (on
# the operation); sources above.
INSTANCE_ERRORS = {
    # CA isReservationCapacityExceeded / TestErrors
    "reservation_full": InstanceError(
        "CONDITION_NOT_MET",
        "Specified reservation '{reservation}' does not have available resources for the request.",
        412,
        "conditionNotMet",
    ),
    # CA isReservationNotFound / TestErrors
    "reservation_not_found": InstanceError(
        "CONDITION_NOT_MET", "Specified reservation '{reservation}' does not exist.", 412, "conditionNotMet"
    ),
    # CA isReservationIncompatible / TestErrors: the instance's properties (here its machine type)
    # are not the reservation's.
    "reservation_incompatible": InstanceError(
        "CONDITION_NOT_MET", "No available resources in specified reservations '{reservation}'", 412, "conditionNotMet"
    ),
    # CA isVmExternalIpAccessPolicyConstraintError / TestErrors
    "org_policy": InstanceError(
        "CONDITION_NOT_MET",
        "Instance '{name}' creation failed: Constraint constraints/compute.vmExternalIpAccess violated for "
        "project {project_number}.",
        412,
        "conditionNotMet",
    ),
    # CA isTpuConfigurationInvalidError / TestErrors (the whole message there)
    "unsupported_tpu_configuration": InstanceError(
        "CONDITION_NOT_MET", "Unsupported TPU configuration", 412, "conditionNotMet"
    ),
    # Google's resource-availability page; the synchronous reason is the code, as public reports show
    "zone_resource_pool_exhausted": InstanceError(
        "ZONE_RESOURCE_POOL_EXHAUSTED", _ZONE_EXHAUSTED, 503, "ZONE_RESOURCE_POOL_EXHAUSTED"
    ),
    "zone_resource_pool_exhausted_with_details": InstanceError(
        "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
        _ZONE_EXHAUSTED_WITH_DETAILS,
        503,
        "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
    ),
    # CA isQuotaExceededErrorCode (operation); Google's bulk-creation page and SkyPilot (synchronous)
    "quota_exceeded": InstanceError("QUOTA_EXCEEDED", _QUOTA, 403, "quotaExceeded", "usageLimits"),
    "preemptible_tpu_quota_exceeded": InstanceError(
        "QUOTA_EXCEEDED", _PREEMPTIBLE_TPU_QUOTA, 403, "quotaExceeded", "usageLimits"
    ),
    # CA isPermissionsError (operation); Google's error catalog, gcloud and Terraform (synchronous)
    "permission_denied": InstanceError("PERMISSIONS_ERROR", _PERMISSION, 403, "forbidden"),
}

# Operation error code → the message a failed operation carries when the fault names none.
OPERATION_ERROR_MESSAGES = {
    **{
        error.code: error.message
        for name, error in INSTANCE_ERRORS.items()
        if error.code != "CONDITION_NOT_MET" and name != "preemptible_tpu_quota_exceeded"
    },
    "RESOURCE_NOT_FOUND": "The resource 'projects/{project}/zones/{zone}/instances/{name}' was not found",
    "INTERNAL_ERROR": _INTERNAL,
}

# http_errors: the reason (and for some, the canonical status and error domain) an injected HTTP
# error carries when the rule names none.
HTTP_ERROR_REASONS = {
    400: "badRequest", 401: "authError", 403: "forbidden", 404: "notFound", 409: "conflict",
    412: "conditionNotMet", 429: "rateLimitExceeded",
}
HTTP_ERROR_MESSAGES = {
    429: (
        "Quota exceeded for quota metric 'Queries' and limit 'Queries per minute' of service "
        "'compute.googleapis.com' for consumer 'project_number:{project_number}'."
    ),
    500: _INTERNAL,
    503: "The service is currently unavailable.",
}
HTTP_ERROR_STATUS = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


# A time limit (scheduling.maxRunDuration) the API does not take with the instance's provisioning
# model: 400 `invalid` (the "Invalid value for field" family, errors.invalid_field_value), in the
# words of a real refusal a public Cloud Batch runbook quotes (its GCE_BAD_REQUEST for a FLEX_START
# instance template, "Reproduced 2026-08-10"): "googleapi: Error 400: Invalid value for field
# 'resource.properties.scheduling.maxRunDuration': '{ "seconds": "604800"}'. max-run-duration for
# given provisioning model is not supported without an instance termination action". The value is
# echoed as there (the Duration's JSON, a space after the opening brace; nanos, which that capture
# lacks, in the same style); the sentence ends before "without ...", the clause naming what that
# request lacked (a reservation-bound VM has its termination action). Given only when a test
# switches it on (Faults `max_run_duration_refused`): no source says whether the API takes the
# limit with RESERVATION_BOUND (docs/request-fields.md).
RUN_DURATION_NOT_SUPPORTED = "max-run-duration for given provisioning model is not supported"


def duration_value(duration: dict) -> str:
    """A Duration as the API echoes it in that refusal: '{ "seconds": "604800"}'."""
    shown = f'{{ "seconds": "{duration.get("seconds", 0)}"'
    if duration.get("nanos"):
        shown += f', "nanos": {duration["nanos"]}'
    return shown + "}"


def fill(template: str, **values: object) -> str:
    """`template` with the {placeholders} it names filled in (unknown ones left as they are)."""
    values.setdefault("support_code", str(-secrets.randbelow(2**63)))
    return re.sub(r"\{(\w+)\}", lambda m: str(values.get(m.group(1), m.group(0))), template)


def error_values(project: str, zone: str, body: dict) -> dict:
    """The placeholders of an error message, from an insert's body (or the instance's resource)."""
    values = (body.get("reservationAffinity") or {}).get("values") or ["-"]
    return {
        "project": project,
        "project_number": zlib.crc32(project.encode()) + 10**11,  # the id get_project answers
        "zone": zone,
        "region": region_of(zone),
        "name": body["name"],
        "reservation": values[0].rsplit("/", 1)[-1],
    }
