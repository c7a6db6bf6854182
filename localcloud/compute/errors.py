"""Errors with the body shape of the Compute Engine v1 API.

Two families exist in the real API and clients parse both:
- resource errors from Compute Engine itself (`notFound`, `alreadyExists`, `invalid`, ...):
  `{"error": {"code", "message", "errors": [{"message", "domain": "global", "reason"}]}}`;
- request-decoding errors from Google's front end (unknown field, wrong JSON type), which
  also carry `status` and a `google.rpc.BadRequest` detail.
"""

from __future__ import annotations

from http import HTTPStatus


class ApiError(Exception):
    """An error answer: HTTP status plus the JSON body the real API would send."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        location: str | None = None,
        location_type: str | None = None,
        status: str | None = None,
        field: str | None = None,
        domain: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.location = location
        self.location_type = location_type
        self.status = status
        self.field = field
        self.domain = domain
        self.headers = dict(headers or {})  # extra response headers (Retry-After)

    def body(self) -> dict:
        item = {"message": self.message, "domain": self.domain or "global", "reason": self.reason}
        if self.location:
            item["location"] = self.location
            item["locationType"] = self.location_type or "parameter"
        error: dict = {"code": self.code, "message": self.message, "errors": [item]}
        if self.status:
            error["status"] = self.status
            if self.domain is None:
                item.pop("domain")
        if self.field:
            error["details"] = [
                {
                    "@type": "type.googleapis.com/google.rpc.BadRequest",
                    "fieldViolations": [{"field": self.field, "description": self.message}],
                }
            ]
        return {"error": error}


# Where each shape was seen (the real API's answers as public reports quote them):
# - notFound: "The resource 'projects/P/zones/us-east1-a' was not found", 404 notFound
#   (GoogleCloudPlatform/gke-terraform-generator#24, a zones.get; scylladb/scylla-cluster-tests#673,
#   an instances.delete, whose body shows domain "global").
# - alreadyExists: "The resource 'projects/P/global/firewalls/NAME' already exists", 409
#   alreadyExists (Terraform's "googleapi: Error 409: The resource ... already exists,
#   alreadyExists", quoted in many public repositories; gcloud's output in
#   zjuul/snowplow-gcloud-installer#1).
# - resourceNotReady: "The resource 'projects/P/global/addresses/NAME' is not ready", 400, the
#   body with domain "global" and reason "resourceNotReady" (opstrace/opstrace#976, #1218).
# - invalid: "Invalid value for field 'FIELD': 'VALUE'. WHY", 400 invalid, domain global
#   (inspec/inspec-gcp#301 shows the whole body; gruntwork-io/terratest#1132 the machineType one).
# - required: "Required field 'resource.requestedRunDuration' not specified" (quoted from the
#   API by public GKE TPU recipes, AI-Hypercomputer style); HTTP 400. The reason "required" is
#   the one Google's APIs use for a missing field; no public capture of a Compute body with it
#   was found.
# - Front-end decoding errors: "Invalid JSON payload received. Unknown name \"x\" at 'y':
#   Cannot find field." with status INVALID_ARGUMENT and a google.rpc.BadRequest fieldViolations
#   detail (the shape google-api-core's from_http_response parses into `details`).
# - conditionNotMet: "Supplied fingerprint does not match current metadata fingerprint.", 412
#   (terraform-provider-google's metadata retry, IsFingerprintError, matches exactly the code
#   and this message; the reason is the one HTTP 412 carries in Google's JSON errors). No
#   `location` is given: none was seen in a public capture of this Compute error.


def not_found(resource_path: str) -> ApiError:
    return ApiError(404, "notFound", f"The resource '{resource_path}' was not found")


def already_exists(resource_path: str) -> ApiError:
    return ApiError(409, "alreadyExists", f"The resource '{resource_path}' already exists")


def not_ready(resource_path: str) -> ApiError:
    return ApiError(400, "resourceNotReady", f"The resource '{resource_path}' is not ready")


def invalid(message: str) -> ApiError:
    return ApiError(400, "invalid", message)


def invalid_field_value(field: str, value: object, why: str) -> ApiError:
    shown = "" if value is None else value
    return invalid(f"Invalid value for field '{field}': '{shown}'. {why}")


def unknown_zone(zone: str) -> ApiError:
    """Any zonal call naming a zone that does not exist: 400, not 404 (inspec/inspec-gcp#301
    for a zonal get; hashicorp/consul#4214 for instances.list; gcloud prints the message)."""
    return invalid_field_value("zone", zone, "Unknown zone.")


def unknown_machine_type(value: str, name: str, zone: str) -> ApiError:
    """instances.insert with a machine type the zone does not offer: the value is echoed as
    sent ("Invalid value for field 'resource.machineType': 'zones/europe-west8-a/machineTypes/
    f1-micro'. Machine type with name 'f1-micro' does not exist in zone 'europe-west8-a'.",
    400 invalid: gruntwork-io/terratest#1132, taskcluster/community-tc-config#75). gcloud's
    own `compute instances create` (surface/compute/instances/create.py) matches this message
    with a regular expression and adds a hint to `gcloud compute machine-types list`."""
    return invalid_field_value(
        "resource.machineType", value, f"Machine type with name '{name}' does not exist in zone '{zone}'."
    )


def required_field(field: str) -> ApiError:
    return ApiError(400, "required", f"Required field '{field}' not specified")


def bad_payload(message: str, field: str) -> ApiError:
    """A request-decoding error as Google's front end words it."""
    return ApiError(400, "invalid", message, status="INVALID_ARGUMENT", field=field)


def fingerprint_mismatch() -> ApiError:
    return ApiError(
        412,
        "conditionNotMet",
        "Supplied fingerprint does not match current metadata fingerprint.",
    )


def http_reason(code: int) -> str:
    """Operation.httpErrorMessage is the upper-case reason phrase ("SERVICE UNAVAILABLE")."""
    try:
        return HTTPStatus(code).phrase.upper()
    except ValueError:
        return "ERROR"
