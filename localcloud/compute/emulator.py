"""Compute Engine REST API v1 emulator (the subset the project uses), over plain HTTP.

Resources live in memory; each instance's VM is a real sshd (see vm.py). Work is
asynchronous like the real API: mutating calls answer with a zonal Operation at once and a
worker thread carries it to DONE. Links in responses use the request's own scheme and host.

Emulator-only control paths are under /_localcloud/ (see `ControlApi`); nothing there is
part of the Compute Engine API.

Zones and machine types come from catalog.py: an unknown one is refused with the API's errors.
Projects carry commonInstanceMetadata (projects.get / setCommonInstanceMetadata, a global
operation); the guest-agent role reads it with each instance's metadata (OS Login, guest.py).

Reservations are read-only through the API (reservations.get and list); tests create them with
the control call POST /_localcloud/reservations. An insert that targets a reservation by name
(SPECIFIC_RESERVATION) fails on its operation, as Compute Engine reports it (CONDITION_NOT_MET),
when the reservation is missing from the zone, reserves another machine type or is fully used
(see the error catalog); otherwise the instance consumes
one unit of it until it is deleted or stopped (see `ComputeEmulator.reservation_in_use`).

instances.stop keeps a VM's files; images.insert with `sourceDisk` makes an image of a boot disk
(a global operation; the image READY when it is DONE), which instances boot from by name, family
(global/images/family/F) or family view (zones/-/imageFamilyViews/F); see the images section and
disk_images.py for what an image holds.

Multi-host TPU slices (resource policies, instance templates, managed instance groups whose
members are this module's instances) are served by groups.py, mixed into ComputeEmulator.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import datetime as dt
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
import traceback
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from .._daemon import RequestLog
from . import catalog, disk_images, errors, groups, guest_power
from .errors import ApiError
from .filters import parse_filter
from .guest import GuestAccounts, metadata_value
from .schema import BodyValidator
from .vm import SandboxVM, pid_namespace

log = logging.getLogger(__name__)

API_PREFIX = "/compute/v1/"
CONTROL_PREFIX = "/_localcloud/"
# Machine-wide leases of VM addresses, shared by all emulators (see _allocate_ip).
LEASE_DIR = Path("/tmp/localcloud-ip-leases")
# VMs get 127.0.0.2 to 127.0.0.249. The rest is never leased: a test that needs an address where
# nothing answers (port 22 refuses) takes one of these, and no other worker's VM can be there.
VM_ADDRESSES = tuple(f"127.0.0.{n}" for n in range(2, 250))
NEVER_LEASED = tuple(f"127.0.0.{n}" for n in range(250, 255))
OPERATION_USER = "localcloud-user@localcloud.invalid"

_NAME = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_KEY = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")
_URL_PREFIX = re.compile(r"^https?://[^/]+/compute/(?:v1|beta|alpha)/")

# Compute Engine's bounds for a VM's time limit (scheduling.maxRunDuration / terminationTime).
MIN_RUN_SECONDS = 30
MAX_RUN_SECONDS = 120 * 24 * 3600
# reservationAffinity.key that names a reservation (SPECIFIC_RESERVATION).
RESERVATION_NAME_KEY = "compute.googleapis.com/reservation-name"

# Operation error code → (httpErrorStatusCode) as the real API reports it. CONDITION_NOT_MET:
# 412 "PRECONDITION FAILED", as in cluster-autoscaler's autoscaling_gce_client_test.go
# (`operationDoneResponseError`); PERMISSIONS_ERROR: 403, Google's Compute Engine error catalog
# (cloud.google.com/compute/docs/reference/rest/v1/errors).
_OPERATION_ERROR_STATUS = {
    "CONDITION_NOT_MET": 412,
    "PERMISSIONS_ERROR": 403,
    "ZONE_RESOURCE_POOL_EXHAUSTED": 503,
    "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS": 503,
    "REGION_RESOURCE_POOL_EXHAUSTED": 503,
    "QUOTA_EXCEEDED": 403,
    "RESOURCE_NOT_FOUND": 404,
    "INTERNAL_ERROR": 500,
}


class Link:
    """A resource URL stored as a path; rendered with the base URL of each request."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def __deepcopy__(self, memo: dict) -> Link:
        return self  # immutable

    def __repr__(self) -> str:
        return f"Link({self.path!r})"


def render(value: object, base: str) -> object:
    """A JSON-ready deep copy with every Link turned into `base + path`."""
    if isinstance(value, Link):
        return base + value.path
    if isinstance(value, dict):
        return {k: render(v, base) for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, base) for v in value]
    return value


def now_rfc3339() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="milliseconds")


def rfc3339(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="milliseconds")


def parse_rfc3339(value: str) -> float | None:
    """Seconds since the epoch, or None unless `value` is an RFC 3339 timestamp with an offset."""
    if not re.fullmatch(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)", value):
        return None
    try:
        return dt.datetime.fromisoformat(value.upper().replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def new_id() -> str:
    # Compute Engine ids are unsigned 64-bit numbers, sent as decimal strings.
    return str(secrets.randbelow(2**63 - 10**18) + 10**18)


def new_fingerprint() -> str:
    return base64.b64encode(secrets.token_bytes(8)).decode()


def new_operation_name() -> str:
    ms = int(time.time() * 1000)
    return f"operation-{ms}-{secrets.token_hex(7)[:13]}-{secrets.token_hex(4)}-{secrets.token_hex(4)}"


def relative_url(value: str) -> str:
    """Strip `https://host/compute/v1/` from a resource URL (full or partial)."""
    return _URL_PREFIX.sub("", value).lstrip("/")


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


class Request:
    """What an API handler sees of one request."""

    def __init__(self, query: dict[str, list[str]], body: object, base: str) -> None:
        self.query = query
        self.body = body
        self.base = base  # "http://HOST:PORT/compute/v1/" as the client addressed us


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
    # CA isPermissionsError (operation); Google's error catalog, gcloud and Terraform (synchronous)
    "permission_denied": InstanceError("PERMISSIONS_ERROR", _PERMISSION, 403, "forbidden"),
}

# Operation error code → the message a failed operation carries when the fault names none.
_OPERATION_ERROR_MESSAGES = {
    **{error.code: error.message for error in INSTANCE_ERRORS.values() if error.code != "CONDITION_NOT_MET"},
    "RESOURCE_NOT_FOUND": "The resource 'projects/{project}/zones/{zone}/instances/{name}' was not found",
    "INTERNAL_ERROR": _INTERNAL,
}

# http_errors: the reason (and for some, the canonical status and error domain) an injected HTTP
# error carries when the rule names none.
_HTTP_ERROR_REASONS = {
    400: "badRequest", 401: "authError", 403: "forbidden", 404: "notFound", 409: "conflict",
    412: "conditionNotMet", 429: "rateLimitExceeded",
}
_HTTP_ERROR_MESSAGES = {
    429: (
        "Quota exceeded for quota metric 'Queries' and limit 'Queries per minute' of service "
        "'compute.googleapis.com' for consumer 'project_number:{project_number}'."
    ),
    500: _INTERNAL,
    503: "The service is currently unavailable.",
}
_HTTP_ERROR_STATUS = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


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


class ReservationRefused(Exception):
    """A specific reservation the insert names cannot take it: the INSTANCE_ERRORS preset to fail with."""

    def __init__(self, preset: str) -> None:
        super().__init__(preset)
        self.preset = preset


# ----- faults --------------------------------------------------------------------------------------


class Faults:
    """Fault switches, replaced as a whole by POST /_localcloud/faults (GET shows what is left).

    The body maps each fault kind to one rule (a JSON object) or a list of rules. A rule may
    carry `count`: it applies to the next N matching calls, then switches off; without `count`
    it applies once (except `insert_fails_after_accept`, which then stays on until replaced).
    Rules of the per-instance kinds may carry `name_regex`: they only apply to instances whose
    name it matches (re.search). Unknown kinds, unknown keys and bad values are refused (400).

    Kinds:

    Presets (`"preset"`, see INSTANCE_ERRORS, where each shape's source is named): every class
    of instance-creation error, in the shape of the place the fault injects it:
    reservation_full, reservation_not_found, reservation_incompatible, org_policy,
    unsupported_tpu_configuration (CONDITION_NOT_MET; synchronously 412 conditionNotMet),
    zone_resource_pool_exhausted[_with_details] (503), quota_exceeded (QUOTA_EXCEEDED;
    synchronously 403 quotaExceeded, domain usageLimits), permission_denied (PERMISSIONS_ERROR;
    synchronously 403 forbidden). Explicit code, reason, status or message override the preset's.

    insert_fails_after_accept  {"preset": "reservation_full"} or {"code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                                "message": ..., "http_status": 503, "leave_instance": false, "count": N}
        instances.insert answers with an operation as usual, which then ends DONE with this
        error (httpErrorStatusCode from the preset or code, or `http_status`); the instance is
        removed, or left TERMINATED with no VM (`leave_instance`).

    http_errors  [{"method": "GET", "path_regex": "/instances/vm-1$", "status": 429,
                   "reason": "rateLimitExceeded", "message": ..., "retry_after": 1, "count": N}]
        A Compute API request whose method and path (re.search on the URL path, query excluded)
        match gets this error instead of being served, in the API's error body; `status` is
        400-599; reason and message default from the status (429: rateLimitExceeded, status
        RESOURCE_EXHAUSTED, a per-minute quota message; 503: backendError, UNAVAILABLE). A 429
        carries `Retry-After` (`retry_after` seconds, default 1; any status may set it).

    insert_rejected  {"preset": "quota_exceeded"} or
                     {"reason": "quotaExceeded", "status": 403, "message": ..., "name_regex", "count"}
        instances.insert of a valid body fails synchronously with this error (no instance, no
        operation), the preset's status, reason, domain and message. Without a fault, a real
        reservation that is missing in the zone, of another machine type or fully used fails the
        insert on its operation (see `ComputeEmulator.reservation_to_consume`); a fault is taken
        first, so it wins.

    operation_errors  {"operation": "insert" | "delete", "preset" (insert only), "code": "INTERNAL_ERROR",
                       "message": ..., "http_status": 500, "leave_instance": false, "name_regex", "count"}
        The call is accepted (an operation is returned), then the operation ends DONE with this
        error. insert: as insert_fails_after_accept. delete: the instance is not deleted; it keeps
        its status and its VM keeps running. Default code: insert ZONE_RESOURCE_POOL_EXHAUSTED,
        delete INTERNAL_ERROR; the message defaults to the real API's wording for the code.

    operation_hangs  {"operation": "insert" | "delete", "seconds": 30, "name_regex", "count"}
        The operation stays RUNNING for `seconds` (without `seconds`: until a POST of faults
        without operation_hangs clears it; that also ends a hang early), then goes on as usual
        (an operation_errors rule taken by the same call still applies). A hanging insert leaves
        the instance PROVISIONING; a hanging delete leaves it STOPPING with its VM still running.

    ssh_refused  {"seconds": 10, "name_regex", "count"}
        The next VM(s) created start sshd `seconds` after the instance became RUNNING: until
        then port 22 refuses connections (the guest booted late).

    ssh_banner_timeout  {"seconds": 10, "name_regex", "count"}
        The next VM(s) created accept TCP connections on port 22 but send no SSH banner for
        `seconds` after becoming RUNNING (a hung sshd, frozen with SIGSTOP); then sshd serves
        the queued connections and new ones as usual.

    host_key_mismatch  {"name_regex", "count"}
        The next VM(s) created publish, in their guest attributes (hostkeys/), an Ed25519 host
        key that is not their sshd's: what a client sees when something else answers at the
        VM's address.
    """

    PER_INSTANCE = {
        "insert_rejected", "operation_errors", "operation_hangs", "ssh_refused", "ssh_banner_timeout", "host_key_mismatch"
    }
    OPERATIONS = ("insert", "delete")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: dict[str, list[dict]] = {}
        self._listed: set[str] = set()  # kinds given as a list of rules (shown back as a list)
        self._cleared: dict[str, int] = {}  # kind → how many POSTs came without it

    # -- validation, one rule at a time --

    @staticmethod
    def _keys(rule: dict, allowed: set[str]) -> None:
        unknown = set(rule) - allowed - {"count"}
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)} (allowed: {sorted(allowed | {'count'})})")

    @staticmethod
    def _str(rule: dict, key: str, required: bool = False) -> None:
        if key not in rule:
            if required:
                raise ValueError(f"'{key}' is required")
            return
        if not isinstance(rule[key], str) or not rule[key]:
            raise ValueError(f"'{key}' must be a non-empty string")

    @staticmethod
    def _status(rule: dict, key: str, required: bool = False) -> None:
        value = rule.get(key)
        if value is None:
            if required:
                raise ValueError(f"'{key}' is required")
            return
        if not isinstance(value, int) or isinstance(value, bool) or not 400 <= value <= 599:
            raise ValueError(f"'{key}' must be an HTTP error status (400-599)")

    @staticmethod
    def _seconds(rule: dict, required: bool) -> None:
        value = rule.get("seconds")
        if value is None:
            if required:
                raise ValueError("'seconds' is required")
            return
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 24 * 3600:
            raise ValueError("'seconds' must be a number of seconds (0 < seconds <= 86400)")

    @staticmethod
    def _regex(rule: dict, key: str) -> None:
        if key in rule:
            Faults._str(rule, key)
            try:
                re.compile(rule[key])
            except re.error as exc:
                raise ValueError(f"'{key}' is not a regular expression: {exc}") from None

    @staticmethod
    def _operation(rule: dict) -> None:
        if rule.get("operation") not in Faults.OPERATIONS:
            raise ValueError(f"'operation' must be one of {list(Faults.OPERATIONS)}")

    @staticmethod
    def _preset(rule: dict) -> None:
        if "preset" in rule and rule["preset"] not in INSTANCE_ERRORS:
            raise ValueError(f"'preset' must be one of {sorted(INSTANCE_ERRORS)}")

    @staticmethod
    def _check_insert_fails_after_accept(rule: dict) -> None:
        Faults._keys(rule, {"preset", "code", "message", "leave_instance", "http_status"})
        Faults._preset(rule)
        Faults._str(rule, "code")
        Faults._str(rule, "message")
        Faults._status(rule, "http_status")
        if "leave_instance" in rule and not isinstance(rule["leave_instance"], bool):
            raise ValueError("leave_instance must be a boolean")

    @staticmethod
    def _check_http_errors(rule: dict) -> None:
        Faults._keys(rule, {"method", "path_regex", "status", "reason", "message", "retry_after"})
        Faults._status(rule, "status", required=True)
        if "method" in rule and rule["method"] not in ("GET", "POST", "PUT", "PATCH", "DELETE"):
            raise ValueError("'method' must be GET, POST, PUT, PATCH or DELETE")
        Faults._regex(rule, "path_regex")
        Faults._str(rule, "reason")
        Faults._str(rule, "message")
        retry_after = rule.get("retry_after")
        if retry_after is not None and (
            not isinstance(retry_after, int) or isinstance(retry_after, bool) or retry_after < 0
        ):
            raise ValueError("'retry_after' must be a whole number of seconds")

    @staticmethod
    def _check_insert_rejected(rule: dict) -> None:
        Faults._keys(rule, {"preset", "reason", "status", "message", "name_regex"})
        Faults._preset(rule)
        if "preset" not in rule:
            Faults._str(rule, "reason", required=True)
        Faults._str(rule, "reason")
        Faults._str(rule, "message")
        Faults._status(rule, "status")
        Faults._regex(rule, "name_regex")

    @staticmethod
    def _check_operation_errors(rule: dict) -> None:
        Faults._keys(rule, {"operation", "preset", "code", "message", "http_status", "leave_instance", "name_regex"})
        Faults._operation(rule)
        Faults._preset(rule)
        if "preset" in rule and rule["operation"] != "insert":
            raise ValueError("'preset' only applies to insert")
        Faults._str(rule, "code")
        Faults._str(rule, "message")
        Faults._status(rule, "http_status")
        Faults._regex(rule, "name_regex")
        if "leave_instance" in rule:
            if rule["operation"] != "insert":
                raise ValueError("'leave_instance' only applies to insert")
            if not isinstance(rule["leave_instance"], bool):
                raise ValueError("leave_instance must be a boolean")

    @staticmethod
    def _check_operation_hangs(rule: dict) -> None:
        Faults._keys(rule, {"operation", "seconds", "name_regex"})
        Faults._operation(rule)
        Faults._seconds(rule, required=False)
        Faults._regex(rule, "name_regex")

    @staticmethod
    def _check_sshd(rule: dict) -> None:
        Faults._keys(rule, {"seconds", "name_regex"})
        Faults._seconds(rule, required=True)
        Faults._regex(rule, "name_regex")

    @staticmethod
    def _check_host_key_mismatch(rule: dict) -> None:
        Faults._keys(rule, {"name_regex"})
        Faults._regex(rule, "name_regex")

    KINDS = {
        "insert_fails_after_accept": _check_insert_fails_after_accept,
        "http_errors": _check_http_errors,
        "insert_rejected": _check_insert_rejected,
        "operation_errors": _check_operation_errors,
        "operation_hangs": _check_operation_hangs,
        "ssh_refused": _check_sshd,
        "ssh_banner_timeout": _check_sshd,
        "host_key_mismatch": _check_host_key_mismatch,
    }
    # Kinds whose rules without `count` stay on until replaced (kept as it always was).
    STICKY = {"insert_fails_after_accept"}

    def replace(self, settings: object) -> dict:
        if not isinstance(settings, dict):
            raise errors.invalid("Faults must be a JSON object.")
        rules: dict[str, list[dict]] = {}
        listed = set()
        for kind, value in settings.items():
            if kind not in self.KINDS:
                raise errors.invalid(f"Unknown fault '{kind}'. Known: {sorted(self.KINDS)}.")
            if isinstance(value, list):
                listed.add(kind)
            elif isinstance(value, dict):
                value = [value]
            else:
                raise errors.invalid(f"Fault '{kind}' must be a JSON object or a list of them.")
            rules[kind] = []
            for i, rule in enumerate(value):
                where = f"Fault '{kind}'" + (f" rule {i}" if kind in listed else "")
                if not isinstance(rule, dict):
                    raise errors.invalid(f"{where} must be a JSON object.")
                count = rule.get("count")
                if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
                    raise errors.invalid(f"{where}: count must be a positive integer.")
                try:
                    self.KINDS[kind](rule)
                except ValueError as exc:
                    raise errors.invalid(f"{where}: {exc}.") from None
                rule = copy.deepcopy(rule)
                if "count" not in rule and kind not in self.STICKY:
                    rule["count"] = 1
                rules[kind].append(rule)
            if not rules[kind]:
                del rules[kind]
        with self._lock:
            for kind in self.KINDS:
                if kind not in rules:
                    self._cleared[kind] = self._cleared.get(kind, 0) + 1
            self._rules = rules
            self._listed = listed
            return self._render()

    def _render(self) -> dict:
        return {
            kind: copy.deepcopy(rules if kind in self._listed else rules[0]) for kind, rules in self._rules.items()
        }

    def current(self) -> dict:
        with self._lock:
            return self._render()

    def cleared(self, kind: str) -> int:
        """How many times the faults were replaced by settings without `kind` (a hang ends then)."""
        with self._lock:
            return self._cleared.get(kind, 0)

    def take(self, kind: str, match=None, *, name: str | None = None, operation: str | None = None) -> dict | None:
        """The first rule of `kind` that applies, counting one use of it; None if none does.

        A rule applies if `match(rule)` (when given) is true, its `name_regex` finds `name` and
        its `operation` is `operation`.
        """
        with self._lock:
            rules = self._rules.get(kind) or []
            for rule in rules:
                if "operation" in rule and rule["operation"] != operation:
                    continue
                if "name_regex" in rule and (name is None or not re.search(rule["name_regex"], name)):
                    continue
                if match is not None and not match(rule):
                    continue
                taken = copy.deepcopy(rule)
                if "count" in rule:
                    rule["count"] -= 1
                    if rule["count"] <= 0:
                        rules.remove(rule)
                        if not rules:
                            del self._rules[kind]
                return taken
            return None


@dataclasses.dataclass
class InsertFaults:
    """The fault rules one instances.insert took (see Faults)."""

    hang: dict | None = None
    hang_epoch: int = 0
    fail: dict | None = None
    ssh_refused: dict | None = None
    ssh_banner_timeout: dict | None = None


def _unrelated_ed25519_key() -> str:
    """A fresh Ed25519 public key in the OpenSSH wire format, base64 (as guest attributes hold it)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    line = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
    return line.decode().split()[1]


class Instance:
    def __init__(self, project: str, zone: str, name: str, resource: dict, image_dir: Path | None) -> None:
        self.project, self.zone, self.name = project, zone, name
        self.resource = resource
        self.image_dir = image_dir
        self.ip: str | None = None
        self.vm: SandboxVM | None = None
        self.deleting = False
        # The time limit (scheduling.maxRunDuration or terminationTime) and what happens then.
        self.run_duration: float | None = None  # seconds from each start (RUNNING)
        self.termination_time: float | None = None  # epoch seconds
        self.termination_action: str | None = None  # "DELETE" | "STOP"
        self.terminate_at: float | None = None  # epoch seconds; set while RUNNING with a limit
        self.published_host_key: tuple[str, str] | None = None  # host_key_mismatch: (type, base64)
        self.reservation: tuple[str, str, str] | None = None  # (project, zone, name) it consumes
        self.boot_disk_id = new_id()  # the boot disk's own id (an image's sourceDiskId)
        # Serialises the VM-side work of insert, setMetadata and delete on this instance.
        self.work_lock = threading.Lock()

    @property
    def path(self) -> str:
        return f"projects/{self.project}/zones/{self.zone}/instances/{self.name}"

    @property
    def fqdn(self) -> str:
        """The hostname the metadata server gives the guest: the instance's `hostname` if it was
        set, else NAME.ZONE.c.PROJECT.internal (zonal DNS, the vmDnsSetting projects.get reports;
        the discovery document's description of Instance.hostname)."""
        return self.resource.get("hostname") or f"{self.name}.{self.zone}.c.{self.project}.internal"

    @property
    def status(self) -> str:
        return self.resource["status"]


@dataclasses.dataclass
class Reservation:
    """A specific reservation of `count` VMs of one machine type in one zone."""

    project: str
    zone: str
    name: str
    count: int
    machine_type: str  # a name, as the reservation's instanceProperties.machineType holds it
    id: str = dataclasses.field(default_factory=new_id)
    creation_timestamp: str = dataclasses.field(default_factory=now_rfc3339)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.project, self.zone, self.name)

    @property
    def path(self) -> str:
        return f"projects/{self.project}/zones/{self.zone}/reservations/{self.name}"


@dataclasses.dataclass
class CustomImage:
    """An image made by images.insert: its resource, and the folder a VM boots from once READY."""

    project: str
    resource: dict
    image_dir: Path
    sequence: int  # creation order: the newest of a family wins (creationTimestamp may tie)

    @property
    def name(self) -> str:
        return self.resource["name"]

    @property
    def usable(self) -> bool:
        """READY and not deprecated: what a family resolves to (images.getFromFamily)."""
        return self.resource["status"] == "READY" and "deprecated" not in self.resource


class ComputeEmulator(groups.SliceResources):
    def __init__(
        self,
        state_dir: Path,
        images: dict[str, Path] | None = None,
        *,
        operation_wait_timeout: float = 120.0,
        vm_ready_timeout: float = 30.0,
        keep_deleted_shm: bool = False,
        vm_env: dict[str, str] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.keep_deleted_shm = keep_deleted_shm
        self.vm_env = dict(vm_env or {})
        self.images = {k: Path(v) for k, v in (images or {}).items()}
        self.operation_wait_timeout = operation_wait_timeout
        self.vm_ready_timeout = vm_ready_timeout
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.instances: dict[tuple[str, str, str], Instance] = {}
        self.operations: dict[tuple[str, str, str], dict] = {}
        self.request_ids: dict[tuple[str, str], tuple[str, str, str]] = {}
        self.reservations: dict[tuple[str, str, str], Reservation] = {}
        self.project_metadata: dict[str, dict] = {}  # project → commonInstanceMetadata
        self.custom_images: dict[tuple[str, str], CustomImage] = {}  # (project, name) → image
        self.image_sequence = 0
        self.ip_leases: dict[str, int] = {}  # address -> fd holding its machine-wide flock
        self.faults = Faults()
        self.slices = groups.SliceState()  # resource policies, instance templates, MIGs
        self.request_log = RequestLog(state_dir / "compute-requests.jsonl")
        self.closing = False
        (state_dir / "vm-etc").mkdir(parents=True, exist_ok=True)
        (state_dir / "vms").mkdir(parents=True, exist_ok=True)
        (state_dir / "images").mkdir(parents=True, exist_ok=True)
        # Enforces VM time limits (scheduling.maxRunDuration / terminationTime).
        threading.Thread(target=self._time_limit_loop, name="time-limits", daemon=True).start()
        # A power-off from inside a VM (`sudo shutdown -h now`) stops its instance (guest_power.py).
        self.guest_power = guest_power.PowerListener(self._guest_power_off)
        guest_power.write_shims(state_dir / "vm-etc", self.guest_power.name)

    # ----- routing -------------------------------------------------------------------------

    ROUTES = [
        ("GET", r"projects/(?P<project>[^/]+)", "get_project"),
        ("POST", r"projects/(?P<project>[^/]+)/setCommonInstanceMetadata", "set_common_instance_metadata"),
        ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)", "get_zone"),
        ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances", "list_instances"),
        ("POST", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances", "insert_instance"),
        ("GET", r"projects/(?P<project>[^/]+)/aggregated/instances", "aggregated_list_instances"),
        ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)", "get_instance"),
        ("DELETE", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)", "delete_instance"),
        ("POST", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)/setMetadata", "set_metadata"),
        ("POST", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)/stop", "stop_instance"),
        ("GET", r"projects/(?P<project>[^/]+)/global/images", "list_images"),
        ("POST", r"projects/(?P<project>[^/]+)/global/images", "insert_image"),
        ("GET", r"projects/(?P<project>[^/]+)/global/images/family/(?P<family>[^/]+)", "get_image_from_family"),
        ("GET", r"projects/(?P<project>[^/]+)/global/images/(?P<image>[^/]+)", "get_image"),
        ("DELETE", r"projects/(?P<project>[^/]+)/global/images/(?P<image>[^/]+)", "delete_image"),
        (
            "GET",
            r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)/getGuestAttributes",
            "get_guest_attributes",
        ),
        ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/reservations", "list_reservations"),
        ("GET", r"projects/(?P<project>[^/]+)/aggregated/reservations", "aggregated_list_reservations"),
        (
            "GET",
            r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/reservations/(?P<reservation>[^/]+)",
            "get_reservation",
        ),
        ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/operations", "list_operations"),
        ("GET", r"projects/(?P<project>[^/]+)/aggregated/operations", "aggregated_list_operations"),
        ("GET", r"projects/(?P<project>[^/]+)/global/operations", "list_global_operations"),
        ("GET", r"projects/(?P<project>[^/]+)/global/operations/(?P<operation>[^/]+)", "get_global_operation"),
        ("POST", r"projects/(?P<project>[^/]+)/global/operations/(?P<operation>[^/]+)/wait", "wait_global_operation"),
        ("GET", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/operations/(?P<operation>[^/]+)", "get_operation"),
        ("POST", r"projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/operations/(?P<operation>[^/]+)/wait", "wait_operation"),
    ] + groups.ROUTES
    _COMPILED = [(m, re.compile(p), h) for m, p, h in ROUTES]

    def dispatch(self, method: str, path: str, req: Request) -> tuple[int, object]:
        """Route one /compute/v1/ request; returns (status, payload with Links)."""
        rest = path[len(API_PREFIX) :]
        for route_method, pattern, handler in self._COMPILED:
            m = pattern.fullmatch(rest)
            if m and route_method == method:
                params = {k: unquote(v) for k, v in m.groupdict().items()}
                if "zone" in params and handler != "get_zone" and not catalog.known_zone(params["zone"]):
                    raise errors.unknown_zone(params["zone"])
                return 200, getattr(self, handler)(req=req, **params)
        raise ApiError(404, "notFound", f"The requested URL {path} was not found on this server (localcloud).")

    # ----- projects and zones --------------------------------------------------------------

    def get_project(self, project: str, req: Request) -> dict:
        # No `defaultServiceAccount`: like a project whose Compute Engine default service
        # account was removed. gcloud then sends no serviceAccounts, matching the captured
        # reference requests of the tutorial.
        with self.lock:
            metadata = copy.deepcopy(self._project_metadata(project))
        return {
            "kind": "compute#project",
            "id": str(zlib.crc32(project.encode()) + 10**11),
            "creationTimestamp": "2024-01-01T00:00:00.000-00:00",
            "name": project,
            "commonInstanceMetadata": metadata,
            "quotas": [],
            "selfLink": Link(f"projects/{project}"),
            "xpnProjectStatus": "UNSPECIFIED_XPN_PROJECT_STATUS",
            "defaultNetworkTier": "PREMIUM",
            "vmDnsSetting": "ZONAL_ONLY",
        }

    def _project_metadata(self, project: str) -> dict:
        """A project's commonInstanceMetadata (under the lock); a new project has none."""
        return self.project_metadata.setdefault(project, {"kind": "compute#metadata", "fingerprint": "localcloud0="})

    def set_common_instance_metadata(self, project: str, req: Request) -> dict:
        """projects.setCommonInstanceMetadata, what `gcloud compute project-info add-metadata`
        sends (the whole item list with the fingerprint from projects.get): a global operation.
        The guest agent of every VM of the project then applies it (OS Login, see guest.py)."""
        body = _validated_body(req, "compute.projects.setCommonInstanceMetadata", "Metadata", "metadata_resource")
        request_id = _one(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            if body.get("fingerprint") != self._project_metadata(project)["fingerprint"]:
                raise errors.fingerprint_mismatch()
            self._check_metadata(body, "resource")
            self.project_metadata[project] = _stored_metadata(body)
            # A global operation; its operationType is named like the zonal ones are (the
            # method's name: "setMetadata" for instances.setMetadata).
            op = self._register_operation(
                project, None, "setCommonInstanceMetadata", f"projects/{project}",
                str(zlib.crc32(project.encode()) + 10**11), request_id,
            )
            instances = [i for i in self.instances.values() if i.project == project]
        threading.Thread(target=self._run_project_metadata, args=(instances, op), daemon=True).start()
        return copy.deepcopy(op)

    def _run_project_metadata(self, instances: list[Instance], op: dict) -> None:
        self._op_running(op)
        try:
            for inst in instances:
                self._apply_guest_accounts(inst)
        except Exception as exc:
            log.exception("applying project metadata failed")
            self._op_done(op, ("INTERNAL_ERROR", f"localcloud: {exc}"), 500)
            return
        self._op_done(op)

    def _apply_guest_accounts(self, inst: Instance) -> None:
        """The guest agent's account pass on `inst`'s VM, from its instance and project metadata.
        Also for a VM whose sshd has not started yet (ssh_refused) or that is stopped: the agent
        applies the keys when it runs."""
        with inst.work_lock:
            with self.lock:
                metadata = copy.deepcopy(inst.resource["metadata"])
                project_metadata = copy.deepcopy(self._project_metadata(inst.project))
            if inst.vm is not None and inst.vm.root.is_dir():
                GuestAccounts(inst.vm.root, _skel(inst.image_dir)).apply_metadata(metadata, project_metadata)

    def get_zone(self, project: str, zone: str, req: Request) -> dict:
        # zones.get of a zone that does not exist: 404 notFound (gke-terraform-generator#24),
        # while zonal methods answer 400 "Unknown zone." (see dispatch).
        if not catalog.known_zone(zone):
            raise errors.not_found(f"projects/{project}/zones/{zone}")
        return {
            "kind": "compute#zone",
            "id": str(2000 + sum(map(ord, zone))),
            "creationTimestamp": "1969-12-31T16:00:00.000-08:00",
            "name": zone,
            "description": zone,
            "status": "UP",
            "region": Link(f"projects/{project}/regions/{region_of(zone)}"),
            "selfLink": Link(f"projects/{project}/zones/{zone}"),
            "availableCpuPlatforms": ["Intel Emerald Rapids", "AMD Genoa"],
            "supportsPzs": False,
        }

    # ----- instances -----------------------------------------------------------------------

    def _instance(self, project: str, zone: str, name: str) -> Instance:
        inst = self.instances.get((project, zone, name))
        if inst is None:
            raise errors.not_found(f"projects/{project}/zones/{zone}/instances/{name}")
        return inst

    def _changeable_instance(self, project: str, zone: str, name: str) -> Instance:
        """The instance a mutating call acts on (under the lock): not one being deleted."""
        inst = self._instance(project, zone, name)
        if inst.deleting:
            raise errors.not_ready(inst.path)
        return inst

    def get_instance(self, project: str, zone: str, instance: str, req: Request) -> dict:
        with self.lock:
            return copy.deepcopy(self._instance(project, zone, instance).resource)

    def list_instances(self, project: str, zone: str, req: Request) -> dict:
        with self.lock:
            resources = [copy.deepcopy(i.resource) for i in self.instances.values() if (i.project, i.zone) == (project, zone)]
        return self._zonal_list("compute#instanceList", f"projects/{project}/zones/{zone}/instances", resources, req)

    def aggregated_list_instances(self, project: str, req: Request) -> dict:
        with self.lock:
            resources = [copy.deepcopy(i.resource) for i in self.instances.values() if i.project == project]
        return self._aggregated_list("compute#instanceAggregatedList", project, "instances", resources, req)

    def _zonal_list(self, kind: str, path: str, resources: list[dict], req: Request) -> dict:
        """One page of a zone's resources of one collection (a *List)."""
        page, token = self._page(resources, req)
        result = {"kind": kind, "id": path, "selfLink": Link(path)}
        if page:
            result["items"] = page
        if token:
            result["nextPageToken"] = token
        return result

    def _aggregated_list(self, kind: str, project: str, collection: str, resources: list[dict], req: Request) -> dict:
        """One page of a project's resources of one collection, grouped by zone (an *AggregatedList)."""
        page, token = self._page(resources, req)
        items: dict[str, dict] = {}
        for resource in page:
            zone, region = resource.get("zone"), resource.get("region")
            if zone:
                scope = f"zones/{zone.path.rsplit('/', 1)[1]}"
            else:
                scope = f"regions/{region.path.rsplit('/', 1)[1]}" if region else "global"
            items.setdefault(scope, {collection: []})[collection].append(resource)
        path = f"projects/{project}/aggregated/{collection}"
        result = {"kind": kind, "id": path, "items": items, "selfLink": Link(path)}
        if token:
            result["nextPageToken"] = token
        return result

    def _page(self, resources: list[dict], req: Request) -> tuple[list[dict], str | None]:
        """Filter, order and page a list; the filter sees rendered (URL) values."""
        query = req.query
        predicate = parse_filter(_one(query, "filter"))
        resources = [r for r in resources if predicate(render(r, req.base))]
        order = (_one(query, "orderBy") or "name").split()
        if order[0] not in ("name", "creationTimestamp") or len(order) > 2 or order[1:] not in ([], ["asc"], ["desc"]):
            raise errors.invalid(f"Invalid value for field 'orderBy': '{_one(query, 'orderBy')}'. Unsupported.")
        resources.sort(key=lambda r: r.get(order[0], ""), reverse=order[1:] == ["desc"])
        try:
            max_results = int(_one(query, "maxResults") or 500)
            offset = int(base64.urlsafe_b64decode(_one(query, "pageToken") or "MA==").decode())
        except ValueError:
            raise errors.invalid("Invalid value for field 'pageToken' or 'maxResults'.") from None
        max_results = max(0, min(max_results, 500)) or 500
        page = resources[offset : offset + max_results]
        more = offset + max_results < len(resources)
        token = base64.urlsafe_b64encode(str(offset + max_results).encode()).decode() if more else None
        return page, token

    def insert_instance(self, project: str, zone: str, req: Request) -> dict:
        body = _validated_body(req, "compute.instances.insert", "Instance", "instance_resource")
        request_id = _one(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            name = body["name"]
            path = f"projects/{project}/zones/{zone}/instances/{name}"
            if (project, zone, name) in self.instances:
                raise errors.already_exists(path)
            resource, image_dir = self._new_instance_resource(project, zone, body)
            scheduling = resource["scheduling"]
            if rejection := self.faults.take("insert_rejected", name=name):
                raise self._insert_rejection(rejection, project, zone, body)
            try:
                reservation, refused = self.reservation_to_consume(project, zone, body, resource), None
            except ReservationRefused as refusal:  # the insert is accepted; its operation fails
                reservation, refused = None, {"preset": refusal.preset}
            inst = Instance(project, zone, name, resource, image_dir)
            inst.reservation = reservation
            inst.termination_action = scheduling.get("instanceTerminationAction")
            if "maxRunDuration" in scheduling:
                duration = scheduling["maxRunDuration"]
                inst.run_duration = int(duration["seconds"]) + duration.get("nanos", 0) / 1e9
            if "terminationTime" in scheduling:
                inst.termination_time = parse_rfc3339(scheduling["terminationTime"])
            inst.ip = self._allocate_ip()
            nic = resource["networkInterfaces"][0]
            nic["networkIP"] = inst.ip
            if nic.get("accessConfigs"):
                nic["accessConfigs"][0]["natIP"] = inst.ip
            self.instances[(project, zone, name)] = inst
            op = self._new_operation(inst, "insert", request_id)
            faults = InsertFaults(
                hang=self.faults.take("operation_hangs", name=name, operation="insert"),
                hang_epoch=self.faults.cleared("operation_hangs"),
                fail=refused
                or self.faults.take("insert_fails_after_accept")
                or self.faults.take("operation_errors", name=name, operation="insert"),
            )
            if faults.fail is None:
                faults.ssh_refused = self.faults.take("ssh_refused", name=name)
                faults.ssh_banner_timeout = self.faults.take("ssh_banner_timeout", name=name)
                if self.faults.take("host_key_mismatch", name=name) is not None:
                    inst.published_host_key = ("ssh-ed25519", _unrelated_ed25519_key())
        self._spawn(self._run_insert, inst, op, faults)
        return copy.deepcopy(op)

    def _insert_rejection(self, rule: dict, project: str, zone: str, body: dict) -> ApiError:
        """insert_rejected's synchronous error: the preset's shape, with the rule's overrides."""
        preset = INSTANCE_ERRORS.get(rule.get("preset", ""))
        status = rule.get("status", preset.status if preset else 400)
        reason = rule.get("reason", preset.reason if preset else "invalid")
        message = rule.get("message") or (preset.message if preset else f"localcloud: injected insert rejection ({reason}).")
        return ApiError(
            status,
            reason,
            fill(message, **error_values(project, zone, body)),
            domain=preset.domain if preset and "reason" not in rule else None,
        )

    # ----- reservations ------------------------------------------------------------------------

    def reservation_in_use(self, reservation: Reservation) -> int:
        """How many instances consume `reservation` (under the lock): those not deleted and not
        stopped. A stopped (TERMINATED) instance gives its unit back on Compute Engine, and a
        restart consumes again; this emulator never restarts one, so it simply stops counting.
        An instance being deleted (STOPPING) still holds its unit until it is gone."""
        return sum(
            1 for inst in self.instances.values() if inst.reservation == reservation.key and inst.status != "TERMINATED"
        )

    def reservation_to_consume(
        self, project: str, zone: str, body: dict, resource: dict
    ) -> tuple[str, str, str] | None:
        """The reservation a new instance consumes (under the lock), or ReservationRefused naming
        the INSTANCE_ERRORS preset the insert's operation then fails with (see the error catalog:
        the sources show these errors on the operation).

        Only affinity SPECIFIC_RESERVATION by name (key compute.googleapis.com/reservation-name)
        is enforced; its value is a reservation of the instance's project, or
        "projects/OTHER/reservations/NAME" (a shared reservation), always in the instance's zone.
        Other affinities (any reservation, none, by label) consume nothing here.
        """
        affinity = body.get("reservationAffinity") or {}
        if affinity.get("consumeReservationType") != "SPECIFIC_RESERVATION":
            return None
        if affinity.get("key") != RESERVATION_NAME_KEY:
            return None
        values = affinity.get("values") or []
        if not values:
            raise errors.required_field("resource.reservationAffinity.values")
        m = re.fullmatch(r"(?:projects/(?P<project>[^/]+)/reservations/)?(?P<name>[^/]+)", relative_url(values[0]))
        key = (m.group("project") or project, zone, m.group("name")) if m else None
        reservation = self.reservations.get(key) if key else None
        if reservation is None:
            raise ReservationRefused("reservation_not_found")
        if resource["machineType"].path.rsplit("/", 1)[1] != reservation.machine_type:
            raise ReservationRefused("reservation_incompatible")
        if self.reservation_in_use(reservation) >= reservation.count:
            raise ReservationRefused("reservation_full")
        return reservation.key

    def _reservation_resource(self, reservation: Reservation) -> dict:
        """compute#reservation as the API returns it (under the lock); int64 counts are strings."""
        base = f"projects/{reservation.project}/zones/{reservation.zone}"
        return {
            "kind": "compute#reservation",
            "id": reservation.id,
            "creationTimestamp": reservation.creation_timestamp,
            "name": reservation.name,
            "zone": Link(base),
            "selfLink": Link(reservation.path),
            "status": "READY",
            "specificReservationRequired": True,
            "shareSettings": {"shareType": "LOCAL"},
            "specificReservation": {
                "count": str(reservation.count),
                "inUseCount": str(self.reservation_in_use(reservation)),
                "instanceProperties": {"machineType": reservation.machine_type},
            },
        }

    def get_reservation(self, project: str, zone: str, reservation: str, req: Request) -> dict:
        with self.lock:
            found = self.reservations.get((project, zone, reservation))
            if found is None:
                raise errors.not_found(f"projects/{project}/zones/{zone}/reservations/{reservation}")
            return self._reservation_resource(found)

    def list_reservations(self, project: str, zone: str, req: Request) -> dict:
        with self.lock:
            resources = [
                self._reservation_resource(r) for r in self.reservations.values() if (r.project, r.zone) == (project, zone)
            ]
        return self._zonal_list("compute#reservationList", f"projects/{project}/zones/{zone}/reservations", resources, req)

    def aggregated_list_reservations(self, project: str, req: Request) -> dict:
        """What `gcloud compute reservations list` asks: every zone's, grouped by zone."""
        with self.lock:
            resources = [self._reservation_resource(r) for r in self.reservations.values() if r.project == project]
        return self._aggregated_list("compute#reservationAggregatedList", project, "reservations", resources, req)

    def set_reservation(self, settings: object) -> dict:
        """Create a reservation, or change the count and machine type of an existing one (the
        control call; Compute Engine's own insert and resize are not emulated)."""
        expected = "Expected {\"project\", \"zone\", \"name\", \"count\": N >= 1, \"machine_type\"}."
        if not isinstance(settings, dict) or set(settings) != {"project", "zone", "name", "count", "machine_type"}:
            raise errors.invalid(expected)
        project, zone, name = settings["project"], settings["zone"], settings["name"]
        count, machine_type = settings["count"], settings["machine_type"]
        if not all(isinstance(v, str) and v for v in (project, machine_type)):
            raise errors.invalid(expected)
        if not isinstance(zone, str) or not catalog.known_zone(zone):
            raise errors.unknown_zone(zone)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise errors.invalid_field_value("name", name, f"Must be a match of regex '{_NAME.pattern}'")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise errors.invalid(expected)
        with self.lock:
            reservation = self.reservations.get((project, zone, name))
            if reservation is None:
                reservation = Reservation(project, zone, name, count, machine_type)
                self.reservations[reservation.key] = reservation
            else:
                reservation.count, reservation.machine_type = count, machine_type
            return self._reservation_resource(reservation)

    # ----- images ------------------------------------------------------------------------------
    # Custom images made from a boot disk (images.insert with sourceDisk), the way a team bakes a
    # VM with its software into an image family. Compute Engine v1's discovery document: images
    # are global resources; insert, delete (and deprecate, not emulated) answer with a global
    # operation; `status` is PENDING until the image is made, then READY ("An image can be used to
    # create other resources, such as instances, only after ... the status is set to READY");
    # getFromFamily "Returns the latest image that is part of an image family and is not
    # deprecated". Only the sourceDisk kind of source is emulated.

    def _newest_of_family(self, project: str, family: str) -> CustomImage | None:
        """The newest READY, not deprecated image of `family` in `project` (under the lock)."""
        found = [
            image for image in self.custom_images.values()
            if image.project == project and image.resource.get("family") == family and image.usable
        ]
        return max(found, key=lambda image: image.sequence, default=None)

    def _base_image_resource(self, project: str, family: str) -> dict | None:
        """A local base image (given to the emulator as PROJECT/FAMILY) as images.getFromFamily
        answers for it: READY, named after its family."""
        image_dir = self.images.get(f"{project}/{family}")
        if image_dir is None:
            return None
        path = f"projects/{project}/global/images/{family}"
        return {
            "kind": "compute#image",
            "id": str(zlib.crc32(path.encode()) + 10**18),
            "creationTimestamp": "2024-01-01T00:00:00.000-00:00",
            "name": family,
            "family": family,
            "sourceType": "RAW",
            "status": "READY",
            "selfLink": Link(path),
        }

    def list_images(self, project: str, req: Request) -> dict:
        with self.lock:
            resources = [copy.deepcopy(i.resource) for i in self.custom_images.values() if i.project == project]
        return self._zonal_list("compute#imageList", f"projects/{project}/global/images", resources, req)

    def get_image(self, project: str, image: str, req: Request) -> dict:
        with self.lock:
            found = self.custom_images.get((project, image))
            if found is None:
                raise errors.not_found(f"projects/{project}/global/images/{image}")
            return copy.deepcopy(found.resource)

    def get_image_from_family(self, project: str, family: str, req: Request) -> dict:
        with self.lock:
            found = self._newest_of_family(project, family)
            if found is not None:
                return copy.deepcopy(found.resource)
            base = self._base_image_resource(project, family)
            if base is None:
                raise errors.not_found(f"projects/{project}/global/images/family/{family}")
            return base

    def _source_disk(self, project: str, source: str) -> tuple[Instance, dict, str]:
        """The instance whose attached disk `source` names, that attached disk, and the disk's
        path (under the lock). A disk lives here only as an instance's disk: one that no instance
        holds (never made, or deleted with its auto-deleted instance) does not exist."""
        m = re.fullmatch(r"(?:projects/(?P<p>[^/]+)/)?zones/(?P<z>[^/]+)/disks/(?P<d>[^/]+)", relative_url(source))
        if not m:
            raise errors.invalid_field_value("resource.sourceDisk", source, "Must be a URL to a disk resource.")
        path = f"projects/{m.group('p') or project}/zones/{m.group('z')}/disks/{m.group('d')}"
        for inst in self.instances.values():
            for disk in inst.resource["disks"]:
                if isinstance(disk.get("source"), Link) and disk["source"].path == path and disk.get("boot"):
                    return inst, disk, path
        raise errors.not_found(path)

    def insert_image(self, project: str, req: Request) -> dict:
        body = _validated_body(req, "compute.images.insert", "Image", "image_resource")
        request_id = _one(req.query, "requestId")
        force = (_one(req.query, "forceCreate") or "false").lower() == "true"
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            name = body["name"]
            path = f"projects/{project}/global/images/{name}"
            sources = [k for k in ("sourceDisk", "sourceImage", "sourceSnapshot", "rawDisk") if body.get(k)]
            if len(sources) != 1:
                # "Invalid resource usage: 'Must specify exactly one source for an image.'", 400
                # (ansible-collections/google.cloud#378); the reason as for the API's other
                # "Invalid resource usage" errors (see delete_instance).
                raise ApiError(
                    400, "invalidResourceUsage", "Invalid resource usage: 'Must specify exactly one source for an image.'."
                )
            if sources != ["sourceDisk"]:
                raise errors.invalid(f"localcloud: images.insert from {sources[0]} is not emulated; use sourceDisk.")
            if (project, name) in self.custom_images:
                raise errors.already_exists(path)
            family = body.get("family")
            if family is not None and not _NAME.fullmatch(family):
                raise errors.invalid_field_value("resource.family", family, f"Must be a match of regex '{_NAME.pattern}'")
            self._check_labels(body.get("labels") or {}, "resource.labels")
            inst, disk, disk_path = self._source_disk(project, body["sourceDisk"])
            if inst.status != "TERMINATED" and not force:
                # The disk of a VM that runs (or is not yet stopped) is in use: "The disk resource
                # 'projects/P/zones/Z/disks/D' is already being used by 'projects/P/zones/Z/instances/I'",
                # 400 resourceInUseByAnotherResource (hashicorp/terraform#23698 gives the body;
                # ansible/ansible#61634 the same message from images.insert of an attached disk).
                # Compute Engine's docs: stop the VM first, or pass forceCreate.
                raise ApiError(
                    400,
                    "resourceInUseByAnotherResource",
                    f"The disk resource '{disk_path}' is already being used by '{inst.path}'",
                )
            self.image_sequence += 1
            resource = {
                **{k: copy.deepcopy(v) for k, v in body.items() if k != "params"},
                "kind": "compute#image",
                "id": new_id(),
                "creationTimestamp": now_rfc3339(),
                "name": name,
                "sourceDisk": Link(disk_path),
                "sourceDiskId": inst.boot_disk_id,
                "sourceType": "RAW",
                "status": "PENDING",
                "diskSizeGb": disk.get("diskSizeGb", "10"),
                "labelFingerprint": new_fingerprint(),
                # The default storage location is the multi-region of the disk's region.
                "storageLocations": [region_of(inst.zone).split("-", 1)[0]],
                "selfLink": Link(path),
            }
            image = CustomImage(
                project, resource, self.state_dir / "images" / project / f"{name}-{resource['id']}", self.image_sequence
            )
            self.custom_images[(project, name)] = image
            op = self._register_operation(project, None, "insert", path, resource["id"], request_id)
        threading.Thread(target=self._run_image_insert, args=(image, inst, op), daemon=True).start()
        return copy.deepcopy(op)

    def _run_image_insert(self, image: CustomImage, inst: Instance, op: dict) -> None:
        self._op_running(op)
        try:
            with inst.work_lock:  # the disk's files hold still while they are copied
                if inst.vm is None or not inst.vm.root.is_dir():
                    raise RuntimeError(f"the disk of {inst.path} has no files")
                size = disk_images.capture(inst.vm.root, inst.image_dir, image.image_dir)
        except Exception as exc:
            log.exception("image %s failed", image.name)
            with self.changed:
                image.resource["status"] = "FAILED"
            self._op_done(op, ("INTERNAL_ERROR", f"localcloud: {exc}"), 500)
            return
        with self.changed:
            image.resource["status"] = "READY"
            image.resource["archiveSizeBytes"] = str(size)
        self._op_done(op)

    def delete_image(self, project: str, image: str, req: Request) -> dict:
        request_id = _one(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            found = self.custom_images.get((project, image))
            if found is None:
                raise errors.not_found(f"projects/{project}/global/images/{image}")
            if found.resource["status"] == "PENDING":
                raise errors.not_ready(f"projects/{project}/global/images/{image}")
            found.resource["status"] = "DELETING"
            op = self._register_operation(
                project, None, "delete", f"projects/{project}/global/images/{image}", found.resource["id"], request_id
            )
        threading.Thread(target=self._run_image_delete, args=(found, op), daemon=True).start()
        return copy.deepcopy(op)

    def _run_image_delete(self, image: CustomImage, op: dict) -> None:
        self._op_running(op)
        with self.lock:
            if self.custom_images.get((image.project, image.name)) is image:
                del self.custom_images[(image.project, image.name)]
        # VMs booted from it hold copies of its files: removing the folder takes nothing from them.
        shutil.rmtree(image.image_dir, ignore_errors=True)
        self._op_done(op)

    def _new_instance_resource(self, project: str, zone: str, body: dict) -> tuple[dict, Path | None]:
        """Semantic checks of an insert body, and the stored resource with GCE's own fields."""
        name = body["name"]
        machine_type = body.get("machineType")
        if not machine_type:
            raise errors.required_field("resource.machineType")
        m = re.fullmatch(r"(?:projects/[^/]+/)?zones/([^/]+)/machineTypes/([^/]+)", relative_url(machine_type))
        if not m:
            raise errors.invalid_field_value("resource.machineType", machine_type, "Must be a URL to a machine type resource.")
        if m.group(1) != zone:
            raise errors.invalid_field_value(
                "resource.machineType", machine_type, f"Machine type must be in zone '{zone}' like the instance."
            )
        machine_name = m.group(2)
        if not catalog.offers(zone, machine_name):
            raise errors.unknown_machine_type(machine_type, machine_name, zone)
        disks = body.get("disks")
        if not disks:
            raise errors.required_field("resource.disks")
        nics = body.get("networkInterfaces")
        if not nics:
            raise errors.required_field("resource.networkInterfaces")
        self._check_labels(body.get("labels") or {}, "resource.labels")
        self._check_metadata(body.get("metadata") or {}, "resource.metadata")

        boot_index = next((i for i, d in enumerate(disks) if d.get("boot")), 0)
        image_dir = self._resolve_boot_image(project, disks[boot_index], f"resource.disks[{boot_index}]")

        resource = copy.deepcopy(body)
        resource.pop("params", None)
        base = f"projects/{project}/zones/{zone}"
        metadata = body.get("metadata") or {}
        resource.update(
            kind="compute#instance",
            id=new_id(),
            creationTimestamp=now_rfc3339(),
            name=name,
            zone=Link(base),
            machineType=Link(f"{base}/machineTypes/{m.group(2)}"),
            status="PROVISIONING",
            selfLink=Link(f"{base}/instances/{name}"),
            cpuPlatform="Unknown CPU Platform",
            canIpForward=body.get("canIpForward", False),
            deletionProtection=body.get("deletionProtection", False),
            startRestricted=False,
            fingerprint=new_fingerprint(),
            labelFingerprint=new_fingerprint(),
            metadata=_stored_metadata(metadata),
            tags={**(body.get("tags") or {}), "fingerprint": new_fingerprint()},
            scheduling=self._scheduling(body.get("scheduling") or {}),
            reservationAffinity=body.get("reservationAffinity") or {"consumeReservationType": "ANY_RESERVATION"},
        )
        self._check_host_maintenance(machine_name, body.get("scheduling") or {}, resource["scheduling"])
        self._check_reservation_bound(resource["scheduling"], body.get("reservationAffinity") or {})
        for i, nic in enumerate(resource["networkInterfaces"]):
            network = relative_url(nic.get("network") or "global/networks/default")
            if not network.startswith("projects/"):
                network = f"projects/{project}/{network}"
            net_name = network.rsplit("/", 1)[1]
            subnet = nic.get("subnetwork")
            subnet_path = relative_url(subnet) if subnet else f"regions/{region_of(zone)}/subnetworks/{net_name}"
            if not subnet_path.startswith("projects/"):
                subnet_path = f"projects/{project}/{subnet_path}"
            nic.update(
                kind="compute#networkInterface",
                name=f"nic{i}",
                network=Link(network),
                subnetwork=Link(subnet_path),
                fingerprint=new_fingerprint(),
                stackType=nic.get("stackType", "IPV4_ONLY"),
            )
            for access in nic.get("accessConfigs") or []:
                access.setdefault("type", "ONE_TO_ONE_NAT")
                access.setdefault("name", "External NAT")
                access.setdefault("networkTier", "PREMIUM")
                access["kind"] = "compute#accessConfig"
        for i, disk in enumerate(resource["disks"]):
            params = disk.get("initializeParams") or {}
            disk_name = params.get("diskName") or (name if i == boot_index else f"{name}-{i}")
            disk.update(
                kind="compute#attachedDisk",
                index=i,
                boot=i == boot_index,
                deviceName=disk.get("deviceName") or f"persistent-disk-{i}",
                source=Link(f"{base}/disks/{disk_name}") if not disk.get("source") else disk["source"],
                interface=disk.get("interface", "SCSI"),
                mode=disk.get("mode", "READ_WRITE"),
                type=disk.get("type", "PERSISTENT"),
                autoDelete=disk.get("autoDelete", False),
                diskSizeGb=str(params.get("diskSizeGb", "10")),
            )
            # Input-only fields are not returned (the discovery document marks AttachedDisk's
            # initializeParams and forceAttach "[Input Only]"; Instance.params likewise).
            disk.pop("initializeParams", None)
            disk.pop("forceAttach", None)
        return resource, image_dir

    def _resolve_boot_image(self, project: str, disk: dict, field: str) -> Path | None:
        if disk.get("source"):
            raise errors.not_found(relative_url(disk["source"]))
        source = (disk.get("initializeParams") or {}).get("sourceImage")
        if not source:
            raise errors.invalid_field_value(f"{field}.initializeParams.sourceImage", "", "Source image must be specified.")
        rel = relative_url(source)
        patterns = (
            r"projects/(?P<p>[^/]+)/global/images/family/(?P<f>[^/]+)",
            r"projects/(?P<p>[^/]+)/zones/[^/]+/imageFamilyViews/(?P<f>[^/]+)",
            r"projects/(?P<p>[^/]+)/global/images/(?P<f>[^/]+)",
            r"global/images/family/(?P<f>[^/]+)",
            r"global/images/(?P<f>[^/]+)",
        )
        for pattern in patterns:
            m = re.fullmatch(pattern, rel)
            if m:
                image_project = m.groupdict().get("p") or project
                family = m.group("f")
                by_family = "family" in pattern or "FamilyViews" in pattern
                # The project's own images (images.insert) first: by name, or the newest usable
                # one of a family; then the local base images this emulator was given.
                if by_family:
                    custom = self._newest_of_family(image_project, family)
                else:
                    custom = self.custom_images.get((image_project, family))
                    if custom is not None and not custom.usable:
                        raise errors.not_ready(f"projects/{image_project}/global/images/{family}")
                if custom is not None:
                    return custom.image_dir
                key = f"{image_project}/{family}"
                if key in self.images:
                    image_dir = self.images[key]
                    return image_dir if image_dir.is_dir() else None
                kind = "images/family" if "family" in pattern or "FamilyViews" in pattern else "images"
                raise errors.not_found(f"projects/{image_project}/global/{kind}/{family}")
        raise errors.invalid_field_value(f"{field}.initializeParams.sourceImage", source, "Invalid image URL.")

    @staticmethod
    def _scheduling(requested: dict) -> dict:
        """The stored `scheduling` of a new instance, after the API's checks of its time limit.

        Compute Engine accepts a time limit (maxRunDuration, or terminationTime) only with an
        instanceTerminationAction, never both kinds, and only between 30 seconds and 120 days;
        a termination action without a time limit only with the Spot, Reservation-Bound or
        Flex Start provisioning model.
        """
        # The discovery document's Scheduling.onHostMaintenance: "For standard instances, the
        # default behavior is MIGRATE. For preemptible instances, the default and only possible
        # behavior is TERMINATE" (Spot VMs are the preemptible ones of today).
        spot = requested.get("preemptible") is True or requested.get("provisioningModel") == "SPOT"
        scheduling = {
            "onHostMaintenance": "TERMINATE" if spot else "MIGRATE",
            "automaticRestart": True,
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

    @staticmethod
    def _check_host_maintenance(machine_name: str, requested: dict, scheduling: dict) -> None:
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

    @staticmethod
    def _check_reservation_bound(scheduling: dict, affinity: dict) -> None:
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

    @staticmethod
    def _check_labels(labels: dict, field: str) -> None:
        if len(labels) > 64:
            raise errors.invalid_field_value(field, "", "Too many labels: at most 64.")
        for key, value in labels.items():
            if not _LABEL_KEY.fullmatch(key):
                raise errors.invalid_field_value(
                    field,
                    "",
                    f"Label key '{key}' violates format constraints. The key must start with a "
                    "lowercase character, can only contain lowercase letters, numeric characters, "
                    "underscores and dashes. The key can be at most 63 characters long.",
                )
            if not _LABEL_VALUE.fullmatch(value):
                raise errors.invalid_field_value(
                    field,
                    "",
                    f"Label value '{value}' violates format constraints. The value can only contain "
                    "lowercase letters, numeric characters, underscores and dashes. The value can be "
                    "at most 63 characters long.",
                )

    @staticmethod
    def _check_metadata(metadata: dict, field: str) -> None:
        items = metadata.get("items") or []
        seen = set()
        total = 0
        for i, item in enumerate(items):
            key = item.get("key")
            if key is None:
                raise errors.required_field(f"{field}.items[{i}].key")
            if key in seen:
                raise errors.invalid_field_value(f"{field}.items[{i}].key", key, "Duplicate metadata key.")
            seen.add(key)
            total += len(key) + len(item.get("value") or "")
        if total > 512 * 1024:
            raise errors.invalid_field_value(field, "", "Metadata is larger than 512 KB.")

    def delete_instance(self, project: str, zone: str, instance: str, req: Request) -> dict:
        request_id = _one(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            inst = self._changeable_instance(project, zone, instance)
            if inst.resource.get("deletionProtection"):
                # "googleapi: Error 400: Invalid resource usage: 'Resource cannot be deleted if
                # it's protected against deletion.'., invalidResourceUsage"
                # (hashicorp/terraform-provider-google#1211).
                raise ApiError(
                    400,
                    "invalidResourceUsage",
                    "Invalid resource usage: 'Resource cannot be deleted if it's protected against deletion.'.",
                )
            previous_status = inst.status
            inst.deleting = True
            inst.resource["status"] = "STOPPING"
            op = self._new_operation(inst, "delete", request_id)
            hang = self.faults.take("operation_hangs", name=inst.name, operation="delete")
            hang_epoch = self.faults.cleared("operation_hangs")
            fail = self.faults.take("operation_errors", name=inst.name, operation="delete")
        self._spawn(self._run_delete, inst, op, hang, hang_epoch, fail, previous_status)
        return copy.deepcopy(op)

    def stop_instance(self, project: str, zone: str, instance: str, req: Request) -> dict:
        """instances.stop (discovery document: "Stops a running instance, shutting it down cleanly,
        and allows you to restart the instance at a later time"): a zonal operation; the instance
        goes STOPPING, then TERMINATED once its processes are gone. Its disk and files stay (an
        image can be made of them), its internal IP too; the ephemeral external IP is released and
        a reservation unit is given back. Stopping a stopped instance is a no-op operation."""
        request_id = _one(req.query, "requestId")
        with self.changed:
            if replayed := self._replayed(project, request_id):
                return replayed
            inst = self._changeable_instance(project, zone, instance)
            op = self._new_operation(inst, "stop", request_id)
            stopping = inst.status != "TERMINATED"
            if stopping:
                self._begin_termination(inst, "STOP")
        self._spawn(self._run_stop, inst, op, stopping)
        return copy.deepcopy(op)

    def _run_stop(self, inst: Instance, op: dict, stopping: bool) -> None:
        self._op_running(op)
        if stopping:
            self._finish_termination(inst, "STOP")
        self._op_done(op)

    def set_metadata(self, project: str, zone: str, instance: str, req: Request) -> dict:
        body = _validated_body(req, "compute.instances.setMetadata", "Metadata", "metadata_resource")
        request_id = _one(req.query, "requestId")
        with self.lock:
            if replayed := self._replayed(project, request_id):
                return replayed
            inst = self._changeable_instance(project, zone, instance)
            if body.get("fingerprint") != inst.resource["metadata"]["fingerprint"]:
                raise errors.fingerprint_mismatch()
            self._check_metadata(body, "resource")
            # The fingerprint changes at once, so a second writer with the old one gets 412.
            inst.resource["metadata"] = _stored_metadata(body)
            op = self._new_operation(inst, "setMetadata", request_id)
        self._spawn(self._run_set_metadata, inst, op)
        return copy.deepcopy(op)

    def get_guest_attributes(self, project: str, zone: str, instance: str, req: Request) -> dict:
        with self.lock:
            inst = self._instance(project, zone, instance)
            enabled = (metadata_value(inst.resource["metadata"], "enable-guest-attributes") or "").strip().lower()
            vm = inst.vm if inst.status == "RUNNING" else None
        if enabled not in ("true", "1", "yes"):
            raise ApiError(400, "badRequest", "Guest Attributes are not enabled.")
        # What the guest agent publishes once the VM booted: its sshd host keys.
        keys = ([inst.published_host_key] if inst.published_host_key else vm.host_keys()) if vm else []
        attributes = [("hostkeys", kind, blob) for kind, blob in keys]
        variable_key = _one(req.query, "variableKey")
        self_link = f"{inst.path}/guestAttributes/"
        if variable_key:
            for namespace, key, value in attributes:
                if f"{namespace}/{key}" == variable_key.strip("/"):
                    return {
                        "kind": "compute#guestAttributes",
                        "variableKey": variable_key,
                        "variableValue": value,
                        "selfLink": Link(self_link + variable_key),
                    }
            raise errors.ApiError(
                404, "notFound", f"The resource '{variable_key}' of type 'Guest Attribute' was not found."
            )
        query_path = _one(req.query, "queryPath") or ""
        parts = [p for p in query_path.split("/") if p]
        items = [
            {"namespace": ns, "key": key, "value": value}
            for ns, key, value in attributes
            if parts == [] or parts == [ns] or parts == [ns, key]
        ]
        if not items:
            raise errors.ApiError(
                404, "notFound", f"The resource '{query_path}' of type 'Guest Attribute' was not found."
            )
        return {
            "kind": "compute#guestAttributes",
            "queryPath": query_path,
            "queryValue": {"items": items},
            "selfLink": Link(self_link + query_path),
        }

    # ----- operations ----------------------------------------------------------------------

    def _replayed(self, project: str, request_id: str | None) -> dict | None:
        """The API answers a repeated requestId with the first request's operation."""
        if request_id and (project, request_id) in self.request_ids:
            return copy.deepcopy(self.operations[self.request_ids[(project, request_id)]])
        return None

    def _new_operation(self, inst: Instance, operation_type: str, request_id: str | None) -> dict:
        """A zonal operation on instance `inst` (under the lock)."""
        return self._register_operation(
            inst.project, inst.zone, operation_type, inst.path, inst.resource["id"], request_id
        )

    def _register_operation(
        self,
        project: str,
        zone: str | None,
        operation_type: str,
        target_path: str,
        target_id: str,
        request_id: str | None,
        *,
        region: str | None = None,
    ) -> dict:
        """A new PENDING operation (under the lock): zonal, regional when `region` is given (a
        `region` field instead of `zone`; stored under the key "regions/REGION", which no zone
        name can equal), or global when neither is (a global operation has no `zone` field)."""
        name = new_operation_name()
        if region:
            scope, zone = f"projects/{project}/regions/{region}", f"regions/{region}"
            located = {"region": Link(scope)}
        else:
            scope = f"projects/{project}/zones/{zone}" if zone else f"projects/{project}/global"
            located = {"zone": Link(scope)} if zone else {}
        op = {
            "kind": "compute#operation",
            "id": new_id(),
            "name": name,
            **located,
            "operationType": operation_type,
            "targetLink": Link(target_path),
            "targetId": target_id,
            "status": "PENDING",
            "user": OPERATION_USER,
            "progress": 0,
            "insertTime": now_rfc3339(),
            "selfLink": Link(f"{scope}/operations/{name}"),
        }
        if request_id:
            op["clientOperationId"] = request_id
            self.request_ids[(project, request_id)] = (project, zone, name)
        self.operations[(project, zone, name)] = op
        return op

    def _operation(self, project: str, zone: str | None, name: str) -> dict:
        op = self.operations.get((project, zone, name))
        if op is None:
            scope = (zone if zone.startswith("regions/") else f"zones/{zone}") if zone else "global"
            raise errors.not_found(f"projects/{project}/{scope}/operations/{name}")
        return op

    def get_operation(self, project: str, zone: str, operation: str, req: Request) -> dict:
        with self.lock:
            return copy.deepcopy(self._operation(project, zone, operation))

    def get_global_operation(self, project: str, operation: str, req: Request) -> dict:
        return self.get_operation(project, None, operation, req)

    def wait_operation(self, project: str, zone: str | None, operation: str, req: Request) -> dict:
        # Like the real `wait`: returns when DONE or after a bounded time (2 min there).
        with self.changed:
            op = self._operation(project, zone, operation)
            self.changed.wait_for(lambda: op["status"] == "DONE" or self.closing, self.operation_wait_timeout)
            return copy.deepcopy(op)

    def wait_global_operation(self, project: str, operation: str, req: Request) -> dict:
        return self.wait_operation(project, None, operation, req)

    def list_operations(self, project: str, zone: str, req: Request) -> dict:
        """zoneOperations.list: a zone's operations, with instances.list's filter and paging."""
        with self.lock:
            found = [copy.deepcopy(op) for (p, z, _), op in self.operations.items() if (p, z) == (project, zone)]
        return self._zonal_list("compute#operationList", f"projects/{project}/zones/{zone}/operations", found, req)

    def list_global_operations(self, project: str, req: Request) -> dict:
        with self.lock:
            found = [copy.deepcopy(op) for (p, z, _), op in self.operations.items() if p == project and z is None]
        return self._zonal_list("compute#operationList", f"projects/{project}/global/operations", found, req)

    def aggregated_list_operations(self, project: str, req: Request) -> dict:
        """globalOperations.aggregatedList, what `gcloud compute operations list` asks: every
        zone's operations and the global ones, grouped by scope ("zones/Z", "global")."""
        with self.lock:
            found = [copy.deepcopy(op) for (p, _, _), op in self.operations.items() if p == project]
        return self._aggregated_list("compute#operationAggregatedList", project, "operations", found, req)

    def _op_running(self, op: dict) -> None:
        with self.changed:
            op["status"] = "RUNNING"
            op["startTime"] = now_rfc3339()
            self.changed.notify_all()

    def _op_done(self, op: dict, error: tuple[str, str] | None = None, http_status: int | None = None) -> None:
        with self.changed:
            op["status"] = "DONE"
            op["progress"] = 100
            op["endTime"] = now_rfc3339()
            if error:
                code, message = error
                status = http_status or _OPERATION_ERROR_STATUS.get(code, 400)
                op["error"] = {"errors": [{"code": code, "message": message}]}
                op["httpErrorStatusCode"] = status
                op["httpErrorMessage"] = errors.http_reason(status)
            self.changed.notify_all()

    def _spawn(self, target, inst: Instance, op: dict, *args) -> None:
        threading.Thread(target=self._run_worker, args=(target, inst, op, args), daemon=True).start()

    def _run_worker(self, target, inst: Instance, op: dict, args: tuple) -> None:
        try:
            target(inst, op, *args)
        except Exception as exc:
            # Never leave an operation hanging: clients poll it until DONE.
            log.exception("%s of %s failed", op["operationType"], inst.path)
            if op["status"] != "DONE":
                self._op_done(op, ("INTERNAL_ERROR", f"localcloud: {exc}"), 500)

    def _run_insert(self, inst: Instance, op: dict, faults: InsertFaults) -> None:
        self._op_running(op)
        if faults.hang is not None:
            self._hang(faults.hang, faults.hang_epoch)
        if faults.fail is not None:
            fault = faults.fail
            preset = INSTANCE_ERRORS.get(fault.get("preset", ""))
            code = fault.get("code") or (preset.code if preset else "ZONE_RESOURCE_POOL_EXHAUSTED")
            if preset and preset.code != code:
                preset = None  # an explicit code overrides the preset's message and status too
            if message := fault.get("message") or (preset and preset.message):
                message = fill(message, **error_values(inst.project, inst.zone, inst.resource))
            else:
                message = self._operation_message(code, inst)
            with self.lock:
                if fault.get("leave_instance"):
                    # A stopped instance keeps its internal IP but loses its ephemeral external IP.
                    inst.resource["status"] = "TERMINATED"
                    for access in inst.resource["networkInterfaces"][0].get("accessConfigs") or []:
                        access.pop("natIP", None)
                else:
                    self.instances.pop((inst.project, inst.zone, inst.name), None)
                    self._release_ip(inst.ip)
            self._op_done(op, (code, message), fault.get("http_status") or (preset and preset.status))
            return
        refuse_for = faults.ssh_refused["seconds"] if faults.ssh_refused else None
        hang_for = faults.ssh_banner_timeout["seconds"] if faults.ssh_banner_timeout else None
        try:
            with inst.work_lock:
                with self.lock:
                    if inst.deleting or self.closing:
                        raise RuntimeError("instance deleted while being created")
                    inst.resource["status"] = "STAGING"
                    metadata = copy.deepcopy(inst.resource["metadata"])
                    project_metadata = copy.deepcopy(self._project_metadata(inst.project))
                # The image's own environment (its /etc/environment) over the cloud-wide one.
                env = {**self.vm_env, **disk_images.image_environment(inst.image_dir)}
                env["PATH"] = guest_power.session_path(env)  # the guest's sudo and shutdown first
                vm = SandboxVM(self.state_dir, inst.name, inst.ip, env=env, fqdn=inst.fqdn)
                inst.vm = vm
                vm.prepare()
                disk_images.restore(inst.image_dir, vm.root)  # what an image of a boot disk holds
                GuestAccounts(vm.root, _skel(inst.image_dir)).apply_metadata(metadata, project_metadata)
                if refuse_for is None:  # ssh_refused: sshd starts later (see _sshd_faults)
                    vm.start()
                    vm.wait_ready(self.vm_ready_timeout)
                    if hang_for is not None:
                        vm.pause_sshd()
                with self.changed:
                    running_since = self._mark_running(inst) if not inst.deleting else None
        except Exception as exc:
            log.exception("insert of %s failed", inst.path)
            with self.lock:
                if not inst.deleting:
                    inst.resource["status"] = "TERMINATED"
            if inst.vm is not None:
                try:
                    inst.vm.stop()
                except Exception:
                    log.exception("stopping failed VM %s", inst.name)
            self._op_done(op, ("INTERNAL_ERROR", f"localcloud: VM failed to start: {exc}"))
            return
        self._op_done(op)
        if running_since is not None and (refuse_for is not None or hang_for is not None):
            threading.Thread(
                target=self._sshd_faults, args=(inst, vm, refuse_for, hang_for, running_since), daemon=True
            ).start()

    def _mark_running(self, inst: Instance) -> float:
        """RUNNING from now (under the lock); arms the instance's time limit. Returns the time."""
        now = time.time()
        inst.resource["status"] = "RUNNING"
        inst.resource["lastStartTimestamp"] = rfc3339(now)
        inst.resource["cpuPlatform"] = "Intel Emerald Rapids"
        if inst.termination_action and (inst.run_duration is not None or inst.termination_time is not None):
            # Compute Engine counts a maxRunDuration from each start; it reports the planned time in
            # resourceStatus.scheduling.terminationTimestamp while the instance runs.
            inst.terminate_at = now + inst.run_duration if inst.run_duration is not None else inst.termination_time
            status = inst.resource.setdefault("resourceStatus", {}).setdefault("scheduling", {})
            status["terminationTimestamp"] = rfc3339(inst.terminate_at)
        self.changed.notify_all()
        return now

    def _operation_message(self, code: str, inst: Instance) -> str:
        template = _OPERATION_ERROR_MESSAGES.get(code, "localcloud: injected operation error {code}.")
        return fill(template, code=code, **error_values(inst.project, inst.zone, inst.resource))

    def _hang(self, rule: dict, epoch: int) -> None:
        """Keep the calling operation RUNNING for the rule's `seconds`, or until operation_hangs
        is cleared (a POST of faults without it), whichever comes first."""
        seconds = rule.get("seconds")
        deadline = None if seconds is None else time.monotonic() + seconds
        with self.changed:
            while not self.closing and self.faults.cleared("operation_hangs") == epoch:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self.changed.wait(left)

    def _current(self, inst: Instance, vm: SandboxVM) -> bool:
        """Whether `vm` is still the running VM of the live instance `inst` (under the lock)."""
        key = (inst.project, inst.zone, inst.name)
        return self.instances.get(key) is inst and inst.vm is vm and inst.status == "RUNNING" and not inst.deleting

    def _wait_while_current(self, inst: Instance, vm: SandboxVM, until: float) -> bool:
        with self.changed:
            while not self.closing and self._current(inst, vm):
                left = until - time.time()
                if left <= 0:
                    return True
                self.changed.wait(left)
            return False

    def _sshd_faults(
        self, inst: Instance, vm: SandboxVM, refuse_for: float | None, hang_for: float | None, since: float
    ) -> None:
        """ssh_refused: start sshd `refuse_for` seconds after RUNNING; ssh_banner_timeout: let a
        frozen sshd go on `hang_for` seconds after it became reachable."""
        try:
            if refuse_for is not None:
                if not self._wait_while_current(inst, vm, since + refuse_for):
                    return
                with inst.work_lock:
                    with self.lock:
                        if not self._current(inst, vm):
                            return
                    vm.start()
                    vm.wait_ready(self.vm_ready_timeout)
                    if hang_for is not None:
                        vm.pause_sshd()
                since = time.time()
            if hang_for is not None:
                self._wait_while_current(inst, vm, since + hang_for)
                with inst.work_lock:
                    vm.resume_sshd()  # a no-op once the VM is gone
        except Exception:
            log.exception("late sshd of %s failed", inst.path)

    def _run_delete(
        self,
        inst: Instance,
        op: dict,
        hang: dict | None = None,
        hang_epoch: int = 0,
        fail: dict | None = None,
        previous_status: str = "RUNNING",
    ) -> None:
        self._op_running(op)
        if hang is not None:
            self._hang(hang, hang_epoch)
        if fail is not None:
            # The delete failed: the instance stays as it was, its VM still running.
            code = fail.get("code", "INTERNAL_ERROR")
            with self.changed:
                inst.deleting = False
                if inst.status == "STOPPING":
                    inst.resource["status"] = previous_status
                self.changed.notify_all()
            self._op_done(op, (code, fail.get("message") or self._operation_message(code, inst)), fail.get("http_status"))
            return
        with inst.work_lock:
            if inst.vm is not None:
                inst.vm.destroy(self.state_dir / "deleted", keep_shm=self.keep_deleted_shm)
            inst.vm = None
        with self.lock:
            if self.instances.get((inst.project, inst.zone, inst.name)) is inst:
                self.instances.pop((inst.project, inst.zone, inst.name))
                self._release_ip(inst.ip)
        self._op_done(op)

    def _run_set_metadata(self, inst: Instance, op: dict) -> None:
        self._op_running(op)
        self._apply_guest_accounts(inst)
        self._op_done(op)

    # ----- time limits and the cloud's own terminations -------------------------------------

    def _time_limit_loop(self) -> None:
        """Carry out each RUNNING instance's termination action at its time limit, promptly
        (Compute Engine may take up to 30 s more; this acts within a fraction of a second)."""
        with self.changed:
            while not self.closing:
                now = time.time()
                soonest = None
                for inst in list(self.instances.values()):
                    if inst.terminate_at is None or inst.deleting or inst.status != "RUNNING":
                        continue
                    if inst.terminate_at <= now:
                        action = inst.termination_action or "STOP"
                        log.info("%s reached its time limit: %s", inst.path, action)
                        self._begin_termination(inst, action)
                        threading.Thread(target=self._finish_termination, args=(inst, action), daemon=True).start()
                    elif soonest is None or inst.terminate_at < soonest:
                        soonest = inst.terminate_at
                self.changed.wait(None if soonest is None else max(soonest - now, 0.01))

    def _begin_termination(self, inst: Instance, action: str) -> None:
        """The first half of a termination by the cloud (under the lock): STOPPING."""
        inst.terminate_at = None
        scheduling_status = (inst.resource.get("resourceStatus") or {}).get("scheduling") or {}
        scheduling_status.pop("terminationTimestamp", None)
        inst.resource["status"] = "STOPPING"
        if action == "DELETE":
            inst.deleting = True
        self.changed.notify_all()

    def _finish_termination(self, inst: Instance, action: str) -> None:
        """DELETE: the VM's processes die and the instance is gone, as by instances.delete.
        STOP: the VM's processes die, the instance stays TERMINATED (its files, internal IP and
        configuration kept; the ephemeral external IP released)."""
        try:
            with inst.work_lock:
                if action == "DELETE":
                    if inst.vm is not None:
                        inst.vm.destroy(self.state_dir / "deleted", keep_shm=self.keep_deleted_shm)
                    inst.vm = None
                elif inst.vm is not None:
                    inst.vm.stop()
        finally:
            with self.changed:
                key = (inst.project, inst.zone, inst.name)
                if action == "DELETE":
                    if self.instances.get(key) is inst:
                        self.instances.pop(key)
                        self._release_ip(inst.ip)
                elif not inst.deleting:
                    inst.resource["status"] = "TERMINATED"
                    inst.resource["lastStopTimestamp"] = now_rfc3339()
                    for access in inst.resource["networkInterfaces"][0].get("accessConfigs") or []:
                        access.pop("natIP", None)
                self.changed.notify_all()

    def _guest_power_off(self, pid: int, uid: int) -> tuple[str | None, object]:
        """A shutdown from inside a VM (guest_power.py): the caller's PID namespace names the VM;
        root or a google-sudoers member of that VM may power it off. On Compute Engine that stops
        the instance (STOPPING, then TERMINATED: files kept, external IP and reservation unit
        given back), whatever its instanceTerminationAction, which is for its time limit."""
        pidns = pid_namespace(pid)
        with self.changed:
            found = [i for i in self.instances.values() if i.vm is not None and pidns and i.vm.pidns == pidns]
            if not found:
                return "localcloud: the caller is in no VM of this emulator", None
            [inst] = found
            if not guest_power.may_power_off(inst.vm.root / "etc", uid):
                log.info("%s: power-off by uid %d refused (not root, not in google-sudoers)", inst.path, uid)
                return "must be superuser.", None
            if inst.deleting or inst.status != "RUNNING":
                return None, None  # already on its way down
            log.info("%s: powered off from the guest (uid %d): STOP", inst.path, uid)
            self._begin_termination(inst, "STOP")

        def finish() -> None:
            threading.Thread(target=self._finish_termination, args=(inst, "STOP"), daemon=True).start()

        return None, finish

    def terminate(self, name: str, action: str, project: str | None = None, zone: str | None = None) -> dict:
        """Terminate an instance the way the cloud itself does (preemption, its time limit):
        no API call, no operation; returns when done."""
        if action not in ("DELETE", "STOP"):
            raise errors.invalid(f"Unknown action '{action}': DELETE or STOP.")
        with self.changed:
            found = [
                i
                for i in self.instances.values()
                if i.name == name and project in (None, i.project) and zone in (None, i.zone)
            ]
            if not found:
                raise ApiError(404, "notFound", f"localcloud: no instance named '{name}'.")
            if len(found) > 1:
                raise errors.invalid(f"Several instances are named '{name}': give project and zone.")
            inst = found[0]
            if inst.deleting:
                raise errors.not_ready(inst.path)
            if action == "STOP" and inst.status != "RUNNING":
                raise errors.invalid(f"Instance '{inst.path}' is {inst.status}: only a RUNNING instance stops.")
            self._begin_termination(inst, action)
        self._finish_termination(inst, action)
        with self.lock:
            status = "DELETED" if action == "DELETE" else inst.status
        return {"name": inst.name, "project": inst.project, "zone": inst.zone, "action": action, "status": status}

    def pause_sshd(self, name: str, paused: bool) -> dict:
        """Freeze (SIGSTOP) or resume the sshd of a running VM: the ssh_banner_timeout fault, but
        from now on and until resumed, for tests that must hold an SSH connect at a chosen time."""
        with self.lock:
            found = [i for i in self.instances.values() if i.name == name and i.vm is not None and not i.deleting]
            if len(found) != 1:
                raise ApiError(404, "notFound", f"localcloud: no single running VM named '{name}'.")
            [inst] = found
        with inst.work_lock:
            done = inst.vm.pause_sshd() if paused else inst.vm.resume_sshd()
        if not done:
            raise ApiError(409, "conflict", f"localcloud: VM '{name}' has no sshd to signal.")
        return {"name": name, "paused": paused}

    def set_faults(self, settings: object) -> dict:
        current = self.faults.replace(settings if settings is not None else {})
        with self.changed:
            self.changed.notify_all()  # a hang may end (operation_hangs cleared)
        return current

    def http_fault(self, method: str, path: str) -> ApiError | None:
        """The error an http_errors rule injects into this API request, if one matches."""
        rule = self.faults.take(
            "http_errors",
            lambda r: r.get("method", method) == method and re.search(r.get("path_regex", ""), path) is not None,
        )
        if rule is None:
            return None
        status = rule["status"]
        reason = rule.get("reason") or _HTTP_ERROR_REASONS.get(status, "backendError" if status >= 500 else "invalid")
        project = re.search(r"/projects/([^/]+)", path)
        message = fill(
            rule.get("message") or _HTTP_ERROR_MESSAGES.get(status) or f"localcloud: injected HTTP {status} error.",
            project=project.group(1) if project else "-",
            project_number=zlib.crc32(project.group(1).encode()) + 10**11 if project else 0,
        )
        retry_after = rule.get("retry_after", 1 if status == 429 else None)
        return ApiError(
            status,
            reason,
            message,
            status=_HTTP_ERROR_STATUS.get(status),
            domain="usageLimits" if status == 429 else ("global" if status in _HTTP_ERROR_STATUS else None),
            headers={"Retry-After": str(retry_after)} if retry_after is not None else None,
        )

    def _allocate_ip(self) -> str:
        """A free 127.0.0.N (N >= 2), the one released longest ago: leased by no emulator on this
        machine, port 22 bindable.

        The lease is an flock on a file per address, shared by every emulator on the machine (a
        developer's and a CI run's, say): checking the port alone races with another emulator
        whose VM has the address but has not bound it yet. The kernel drops a dead emulator's
        leases with its file descriptors. A release writes its time into the file, and addresses
        are handed out oldest release first, never-used ones before all: an address a deleted VM
        just gave up is not at once another VM's, so a check that the deleted VM no longer
        answers there cannot meet a newer VM (Compute Engine documents no order for ephemeral
        internal addresses; not reusing the last one is the cautious reading).
        """
        LEASE_DIR.mkdir(parents=True, exist_ok=True)
        for ip in sorted(VM_ADDRESSES, key=_released_at):
            if ip in self.ip_leases:
                continue
            fd = os.open(LEASE_DIR / ip, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if not _port_free(ip, 22):
                os.close(fd)
                continue
            self.ip_leases[ip] = fd
            return ip
        raise ApiError(503, "backendError", "localcloud: no free loopback address for another VM.")

    def _release_ip(self, ip: str | None) -> None:
        fd = self.ip_leases.pop(ip, None) if ip else None
        if fd is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{time.time():.6f}".encode(), 0)
            os.close(fd)  # closing the descriptor drops the flock

    # ----- emulator control ----------------------------------------------------------------

    def vms(self) -> list[dict]:
        """The VMs that run: live sshd processes, and RUNNING instances whose sshd has not
        started yet (ssh_refused; their `pid` and `sshd_pid` are null)."""
        with self.lock:
            instances = [(inst, inst.vm, inst.status) for inst in self.instances.values()]
        result = []
        for inst, vm, status in instances:
            if vm is None or not (vm.alive() or (status == "RUNNING" and vm.proc is None)):
                continue
            users = GuestAccounts(vm.root, None).managed_users()
            result.append(
                {
                    "name": inst.name,
                    "project": inst.project,
                    "zone": inst.zone,
                    "ip": inst.ip,
                    "pid": vm.pid,
                    "sshd_pid": vm.ns_init_pid,
                    "status": inst.status,
                    "users": sorted(users),
                }
            )
        return result

    def shutdown(self) -> None:
        """Delete every VM (used on SIGTERM/SIGINT)."""
        self.guest_power.close()
        with self.changed:
            self.closing = True
            self.changed.notify_all()
            instances = list(self.instances.values())

        def destroy(inst: Instance) -> None:
            with inst.work_lock:
                if inst.vm is not None:
                    inst.vm.destroy(self.state_dir / "deleted", keep_shm=self.keep_deleted_shm)
                    inst.vm = None

        threads = [threading.Thread(target=destroy, args=(i,)) for i in instances]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self.lock:
            for inst in self.instances.values():
                self._release_ip(inst.ip)
            self.instances.clear()


def _validated_body(req: Request, method: str, schema: str, field: str) -> dict:
    """The request's JSON body, checked against the discovery document's schema for `method`."""
    if req.body is None:
        raise errors.required_field("resource")
    BodyValidator(method).check(schema, req.body, field)
    assert isinstance(req.body, dict)
    return req.body


def _stored_metadata(metadata: dict) -> dict:
    stored = {"kind": "compute#metadata", "fingerprint": new_fingerprint()}
    if metadata.get("items"):
        stored["items"] = copy.deepcopy(metadata["items"])
    return stored


def _skel(image_dir: Path | None) -> Path | None:
    return image_dir / "skel" if image_dir else None


def _one(query: dict, key: str) -> str | None:
    values = query.get(key)
    return values[-1] if values else None


def _released_at(ip: str) -> tuple[float, int]:
    """When `ip` was last released (0 if never), then its last octet: _allocate_ip's order."""
    try:
        stamp = float((LEASE_DIR / ip).read_text() or 0)
    except (OSError, ValueError):
        stamp = 0.0
    return stamp, int(ip.rsplit(".", 1)[1])


def _port_free(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True


# ----- HTTP ----------------------------------------------------------------------------------


class ControlApi:
    """/_localcloud/: the emulator's own controls (never part of the Compute Engine API)."""

    def __init__(self, emulator: ComputeEmulator) -> None:
        self.emulator = emulator

    def dispatch(self, method: str, path: str, body: object) -> tuple[int, object]:
        emulator = self.emulator
        what = path[len(CONTROL_PREFIX) :].rstrip("/")
        if what == "requests" and method == "GET":
            return 200, emulator.request_log.read()
        if what == "requests" and method == "DELETE":
            emulator.request_log.clear()
            return 200, {}
        if what == "faults" and method == "POST":
            return 200, emulator.set_faults(body)
        if what == "faults" and method == "GET":
            return 200, emulator.faults.current()
        if what == "vms" and method == "GET":
            return 200, emulator.vms()
        if (m := re.fullmatch(r"vms/([^/]+)/terminate", what)) and method == "POST":
            # {"action": "DELETE" | "STOP", "project"?: ..., "zone"?: ...}: as the cloud does it.
            body = body if body is not None else {}
            if not isinstance(body, dict) or set(body) - {"action", "project", "zone"}:
                raise ApiError(400, "invalid", 'Expected {"action": "DELETE" | "STOP", "project"?, "zone"?}.')
            name = unquote(m.group(1))
            return 200, emulator.terminate(name, body.get("action", "DELETE"), body.get("project"), body.get("zone"))
        if (m := re.fullmatch(r"vms/([^/]+)/sshd", what)) and method == "POST":
            # {"paused": true | false}: freeze a running VM's sshd (no banner) or let it go on.
            if not isinstance(body, dict) or set(body) != {"paused"} or not isinstance(body["paused"], bool):
                raise ApiError(400, "invalid", 'Expected {"paused": true | false}.')
            return 200, emulator.pause_sshd(unquote(m.group(1)), body["paused"])
        if what == "reservations" and method == "POST":
            # {"project", "zone", "name", "count", "machine_type"}: create or change a reservation.
            return 200, emulator.set_reservation(body)
        if what == "images" and method == "POST":  # {"PROJECT/FAMILY": "/abs/image/dir"}, merged
            if not isinstance(body, dict) or not all(isinstance(v, str) and v.startswith("/") for v in body.values()):
                raise ApiError(400, "invalid", "Expected {\"PROJECT/FAMILY\": \"/absolute/image/dir\"}.")
            with emulator.lock:
                emulator.images.update({key: Path(value) for key, value in body.items()})
                return 200, {key: str(value) for key, value in emulator.images.items()}
        raise ApiError(404, "notFound", f"No control endpoint {method} {path}.")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # see localcloud/storage/server.py
    server_version = "localcloud-compute/1"
    emulator: ComputeEmulator  # set on the subclass made by make_server
    control: ControlApi

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        path = url.path
        query = parse_qs(url.query, keep_blank_values=True)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        host = self.headers.get("Host") or "%s:%d" % self.server.server_address[:2]
        base = f"http://{host}{API_PREFIX}"
        body: object = None
        extra_headers: dict[str, str] = {}
        try:
            if raw.strip():
                try:
                    body = json.loads(raw)
                except ValueError as exc:
                    body = raw.decode(errors="replace")
                    raise errors.bad_payload(f"Invalid JSON payload received. {exc}.", "") from None
            if path.startswith(CONTROL_PREFIX):
                status, payload = self.control.dispatch(method, path, body)
            elif path.startswith(API_PREFIX):
                if fault := self.emulator.http_fault(method, path):
                    raise fault
                status, payload = self.emulator.dispatch(method, path, Request(query, body, base))
            else:
                raise ApiError(404, "notFound", f"The requested URL {path} was not found on this server.")
        except ApiError as exc:
            status, payload = exc.code, exc.body()
            extra_headers = exc.headers
        except Exception:
            log.error("unhandled error on %s %s:\n%s", method, self.path, traceback.format_exc())
            status, payload = 500, ApiError(500, "backendError", "Internal error (localcloud).").body()
        if not path.startswith(CONTROL_PREFIX):
            # Logged before answering: a client that got its answer finds its request logged.
            self.emulator.request_log.append(
                {
                    "time": now_rfc3339(),
                    "method": method,
                    "path": path,
                    "query": {k: v[0] if len(v) == 1 else v for k, v in query.items()},
                    "body": body,
                    "status": status,
                }
            )
        data = json.dumps(render(payload, base), indent=1).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        for name, value in extra_headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        log.debug("%s - %s", self.address_string(), format % args)


class EmulatorServer(ThreadingHTTPServer):
    daemon_threads = True
    # Do not join request threads on close: an operation `wait` may be parked for minutes.
    block_on_close = False


def make_server(emulator: ComputeEmulator, host: str = "127.0.0.1", port: int = 0) -> EmulatorServer:
    handler = type("BoundHandler", (Handler,), {"emulator": emulator, "control": ControlApi(emulator)})
    return EmulatorServer((host, port), handler)
