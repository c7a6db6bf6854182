"""What the pipeline does about an error Compute Engine gives: one table, read as data.

Compute Engine reports a failed instance creation in one of two places:
- synchronously, as an HTTP error of instances.insert: `{"error": {"code": STATUS, "message",
  "errors": [{"message", "domain", "reason"}]}}` (google-cloud-compute raises a
  google.api_core GoogleAPICallError whose `.errors` is that list; the discovery client an
  HttpError whose content is that body);
- on the insert's operation: HTTP 200, then the operation ends DONE with
  `error.errors[] = [{"code", "message"}]` and `httpErrorStatusCode` (ComputeEngineEndpointHook
  raises OperationFailed with those).
`classify` reads both and returns the first row of RULES that matches one of the errors.

Where the codes and wordings come from (cited again per row):
- CA: Kubernetes cluster-autoscaler's GCE client,
  cluster-autoscaler/cloudprovider/gce/autoscaling_gce_client.go, `GetErrorInfo` and the `is*`
  helpers it calls, with the example errors of autoscaling_gce_client_test.go (`TestErrors`),
  which are `{code, message}` errors of instance-creation attempts;
- SkyPilot: sky/provision/gcp/instance_utils.py (`GCPComputeInstance._create_instances`,
  `_handle_http_error`: the synchronous 403 `quotaExceeded` with domain `usageLimits`;
  `wait_for_operation`: operation `error.errors`) and sky/backends/cloud_vm_ray_backend.py
  (`FailoverCloudErrorHandlerV2._gcp_handler`: which codes are a zone's stockout, which quota);
- Google's Compute Engine error catalog (cloud.google.com/compute/docs/reference/rest/v1/errors:
  PERMISSIONS_ERROR, 403, "Required '{permission}' permission for '{resource}'") and its bulk
  creation troubleshooting page (compute/docs/troubleshooting/troubleshooting-bulk-vm-creation:
  HTTP 403 `quotaExceeded`, 403 `rateLimitExceeded`, 503 `insufficientCapacity`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re

from google.api_core.exceptions import GoogleAPICallError
from googleapiclient.errors import HttpError

from airflow.sdk.exceptions import AirflowException


# The cause of a zone's (or region's) stockout: retried, or waited out by a run with no reservation.
STOCKOUT = "zone out of capacity (stockout)"
PREEMPTIBLE_QUOTA_IN_USE = "preemptible quota held by other VMs"


class Action(enum.Enum):
    WAIT_FOR_CAPACITY = "wait for capacity"  # the capacity gate: defer until the reservation has a machine free
    RETRY = "retry"  # the task's retries, with exponential backoff
    FAIL = "fail"  # at once, without retries, naming the cause


@dataclasses.dataclass(frozen=True)
class CloudError:
    """One error Compute Engine reported: an operation's `error.errors[]` item (code), or one of
    an HTTP error's `errors[]` (its `reason` as the code)."""

    code: str
    message: str
    http_status: int | None = None

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclasses.dataclass(frozen=True)
class Rule:
    cause: str  # what the run's error calls it
    action: Action
    code: str | None = None  # regex, searched in the code (case-sensitive); None: any code
    message: str | None = None  # regex, searched in the message; None: any message
    http_status: range | None = None  # the HTTP status (sync) or httpErrorStatusCode (operation)

    def matches(self, error: CloudError) -> bool:
        return (
            (self.code is None or re.search(self.code, error.code) is not None)
            and (self.message is None or re.search(self.message, error.message) is not None)
            and (self.http_status is None or error.http_status in self.http_status)
        )


# The operation's code for a failed precondition, and the reason a synchronous 412 carries.
CONDITION_NOT_MET = r"^(CONDITION_NOT_MET|conditionNotMet)$"

# First match wins. The reservation rows match the message whatever the code, as CA does (its
# examples carry CONDITION_NOT_MET).
RULES: tuple[Rule, ...] = (
    # CA `isReservationCapacityExceeded` (RESERVATION_CAPACITY_EXCEEDED); CA TestErrors:
    # CONDITION_NOT_MET "Specified reservation 'rsv-name' does not have available resources for the request."
    Rule(
        "reservation full",
        Action.WAIT_FOR_CAPACITY,
        message=r"Specified reservation .+ does not have available resources for the request",
    ),
    # CA `isReservationNotFound` (RESERVATION_NOT_FOUND); CA TestErrors: "Specified reservation
    # 'rsv-name' does not exist." and "Specified reservations [NAME] do not exist. (when acting as ..."
    Rule("reservation not found", Action.FAIL, message=r"Specified reservations? .* do(es)? not exist"),
    # CA `isReservationIncompatible` (RESERVATION_INCOMPATIBLE); CA TestErrors: CONDITION_NOT_MET
    # "No available resources in specified reservations 'rsv-name'"
    Rule("reservation incompatible", Action.FAIL, message=r"No available resources in specified reservations"),
    # CA `isInvalidReservationError` (`regexReservationErrors`, INVALID_RESERVATION): the
    # reservation exists but this instance may not use it. Only the wordings that concern a
    # specific reservation are taken; CA's list also holds a zone-capacity sentence, which is a
    # stockout here, not a bad reservation.
    Rule(
        "reservation invalid for this instance",
        Action.FAIL,
        message=(
            r"Could not find the given reservation with the following name"
            r"|Reservation .* is incorrect for the requested resources"
            r"|The reservation must exist in the same project as the instance"
            r"|must use ReservationAffinity of"
        ),
    ),
    # CA `isReservationNotReady` (RESERVATION_NOT_READY); CA TestErrors: CONDITION_NOT_MET "Cannot
    # insert instance to a reservation with status: CREATING, as it requires reservation to be in
    # READY state." A reservation being created becomes READY by itself: the retries wait for it.
    Rule("reservation not ready", Action.RETRY, message=r"requires reservation to be in READY state"),
    # CA `isVmExternalIpAccessPolicyConstraintError` (VM_EXTERNAL_IP_ACCESS_POLICY_CONSTRAINT);
    # CA TestErrors: CONDITION_NOT_MET "Instance 'myinst' creation failed: Constraint
    # constraints/compute.vmExternalIpAccess violated for project 1234567890." CA names only that
    # constraint; any constraint named in the same sentence is an organisation policy here too.
    Rule(
        "organisation policy",
        Action.FAIL,
        code=CONDITION_NOT_MET,
        message=r"Constraint constraints/\S+ violated for project",
    ),
    # CA `isTpuConfigurationInvalidError` (UNSUPPORTED_TPU_CONFIGURATION); CA TestErrors:
    # CONDITION_NOT_MET "Unsupported TPU configuration".
    Rule(
        "unsupported TPU configuration",
        Action.FAIL,
        code=CONDITION_NOT_MET,
        message=r"Unsupported TPU configuration",
    ),
    # Stockout: the zone's (or region's) hardware, not the reservation's count, so the gate would
    # not see it end; the retries' backoff spaces the attempts. CA `isResourcePoolExhaustedErrorCode`
    # (RESOURCE_POOL_EXHAUSTED, ZONE_RESOURCE_POOL_EXHAUSTED, ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS)
    # and `isInsufficientCapacityErrorCode` (INSUFFICIENT_CAPACITY); SkyPilot `_gcp_handler`
    # (ZONE_RESOURCE_POOL_EXHAUSTED[_WITH_DETAILS], `insufficientCapacity`); Google's bulk creation
    # page (HTTP 503 `insufficientCapacity`). REGION_RESOURCE_POOL_EXHAUSTED: the same family at
    # region scope, as the brief of this change lists it and other Compute clients retry it.
    Rule(
        STOCKOUT,
        Action.RETRY,
        code=r"^(ZONE_|REGION_)?RESOURCE_POOL_EXHAUSTED(_WITH_DETAILS)?$|^INSUFFICIENT_CAPACITY$|^insufficientCapacity$",
    ),
    # Spot and flex-start VMs use the preemptible quota (PREEMPTIBLE_TPU_V6E for v6e), which the
    # project's other Spot VMs hold too: with a limit above 0 it frees as they end, so a run with
    # no reservation waits it out like a stockout (waits_for_capacity); a limit of 0 is never
    # granted and falls to the next rule. The message is the quota error's own ("Quota 'CPUS'
    # exceeded.  Limit: 0.0 in region us-east5." in CA's TestErrors) with the metric's name.
    Rule(
        PREEMPTIBLE_QUOTA_IN_USE,
        Action.RETRY,
        code=r"(?i)quota",
        message=r"Quota 'PREEMPTIBLE_\w+' exceeded\.\s+Limit: (?!0(\.0+)?\s)\d+(\.\d+)?\s",
    ),
    # CA `isQuotaExceededErrorCode`: any code containing QUOTA (operation QUOTA_EXCEEDED); SkyPilot
    # `_gcp_handler` (QUOTA_EXCEEDED, and the synchronous reason quotaExceeded); Google's bulk
    # creation page (HTTP 403 `quotaExceeded`). A quota is raised by a person, not by waiting.
    Rule("quota exceeded", Action.FAIL, code=r"(?i)quota"),
    # Google's bulk creation page: HTTP 403 `rateLimitExceeded`, "wait until some requests
    # complete and try your request again". HTTP 429 is the API's throttling too.
    Rule("API rate limit", Action.RETRY, code=r"^rateLimitExceeded$"),
    Rule("API rate limit", Action.RETRY, http_status=range(429, 430)),
    # CA `isPermissionsError` (PERMISSIONS_ERROR); Google's error catalog: PERMISSIONS_ERROR, 403,
    # "Required '{permission}' permission for '{resource}'" (gcloud prints it as a synchronous
    # error, reason `forbidden`). Any other 403 is a refusal of the caller's rights as well.
    Rule("permission denied", Action.FAIL, code=r"PERMISSIONS_ERROR"),
    Rule("permission denied", Action.FAIL, http_status=range(403, 404)),
    # A server error passes (the provider's own retry reasons are 5xx and 429).
    Rule("server error", Action.RETRY, http_status=range(500, 600)),
)


@dataclasses.dataclass(frozen=True)
class Verdict:
    rule: Rule
    error: CloudError

    @property
    def action(self) -> Action:
        return self.rule.action

    def __str__(self) -> str:
        return f"{self.rule.cause} ({self.error})"


class OperationFailed(AirflowException):
    """A zonal or global operation ended DONE with errors: its `error.errors[]` as data.

    The class and text are the provider's (`ComputeEngineHook._wait_for_operation_to_complete`
    raises an AirflowException "HTTP_STATUS HTTP_MESSAGE: {'code': ..., 'message': ...}").
    """

    def __init__(self, operation: dict):
        self.operation = operation
        self.http_status: int | None = operation.get("httpErrorStatusCode")
        self.errors: list[dict] = list((operation.get("error") or {}).get("errors") or [])
        super().__init__(f"{self.http_status} {operation.get('httpErrorMessage')}: " + str(self.errors)[1:-1])


def cloud_errors(error: BaseException) -> list[CloudError]:
    """The errors Compute Engine reported in `error` (an operation's, or an HTTP error's), as data;
    empty for anything else (a network error, a bug)."""
    if isinstance(error, OperationFailed):
        return [
            CloudError(str(item.get("code", "")), str(item.get("message", "")), error.http_status)
            for item in error.errors
        ]
    if isinstance(error, GoogleAPICallError):
        # google.api_core's from_http_response: `.errors` is the body's error.errors list.
        return _http_errors(error.code, list(error.errors or []), error.message or "")
    if isinstance(error, HttpError):
        try:
            body = json.loads(error.content.decode("utf-8"))
        except (ValueError, AttributeError):
            body = {}
        payload = body.get("error") if isinstance(body, dict) else None
        items = payload.get("errors") if isinstance(payload, dict) else None
        return _http_errors(error.resp.status, items if isinstance(items, list) else [], error.reason or "")
    return []


def _http_errors(status: int | None, items: list, message: str) -> list[CloudError]:
    found = [
        CloudError(str(item.get("reason", "")), str(item.get("message", message)), status)
        for item in items
        if isinstance(item, dict)
    ]
    return found or [CloudError("", message, status)]


def classify(error: BaseException) -> Verdict | None:
    """The first rule that matches one of the errors in `error`, or None (not Compute Engine's
    verdict, or not in the table: the caller's retries take it)."""
    found = cloud_errors(error)
    for rule in RULES:
        for item in found:
            if rule.matches(item):
                return Verdict(rule, item)
    return None


def classify_items(items: list[dict]) -> Verdict | None:
    """`classify` for errors given as data: `{code, message}` items, as an operation's
    `error.errors[]` or a managed instance's `lastAttempt.errors.errors[]` hold them."""
    return classify(OperationFailed({"error": {"errors": items}})) if items else None


def waits_for_capacity(verdict: Verdict | None, *, waits_out_stockouts: bool) -> bool:
    """Whether a refused insert waits for capacity (deferred, up to max_capacity_wait_minutes):
    a full reservation always; a zone's stockout, or preemptible quota other VMs hold, when the
    run has no reservation to wait for (RunSpec.waits_out_stockouts), since the task's few retries
    would give up within minutes."""
    if verdict is None:
        return False
    return verdict.action is Action.WAIT_FOR_CAPACITY or (
        waits_out_stockouts and verdict.rule.cause in (STOCKOUT, PREEMPTIBLE_QUOTA_IN_USE)
    )
