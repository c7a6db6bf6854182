"""The error table: each class of Compute Engine's instance-creation errors, in each place the API
reports it (a finished operation's error.errors[], a synchronous HTTP error through either
client), gets the pipeline's action. The shapes are the emulator's presets (INSTANCE_ERRORS),
whose sources are named there; the HTTP errors are built by the clients' own parsers."""

from __future__ import annotations

import json

import httplib2
import pytest
import requests
from google.api_core import exceptions as gexc
from googleapiclient.errors import HttpError

from localcloud.compute.error_catalog import INSTANCE_ERRORS, error_values, fill
from maxtext_sft.cloud.errors import Action, OperationFailed, classify, waits_for_capacity

WHERE = error_values("p-1", "us-east5-b", {"name": "vm-1", "reservationAffinity": {"values": ["r-1"]}})

EXPECTED = {
    "reservation_full": ("reservation full", Action.WAIT_FOR_CAPACITY),
    "reservation_not_found": ("reservation not found", Action.FAIL),
    "reservation_incompatible": ("reservation incompatible", Action.FAIL),
    "org_policy": ("organisation policy", Action.FAIL),
    "unsupported_tpu_configuration": ("unsupported TPU configuration", Action.FAIL),
    "zone_resource_pool_exhausted": ("zone out of capacity (stockout)", Action.RETRY),
    "zone_resource_pool_exhausted_with_details": ("zone out of capacity (stockout)", Action.RETRY),
    "quota_exceeded": ("quota exceeded", Action.FAIL),
    "preemptible_tpu_quota_exceeded": ("quota exceeded", Action.FAIL),  # its limit is 0: never granted
    "permission_denied": ("permission denied", Action.FAIL),
}


def test_every_preset_of_the_emulator_is_in_the_table():
    assert set(EXPECTED) == set(INSTANCE_ERRORS)


def operation_failed(preset: str) -> OperationFailed:
    error = INSTANCE_ERRORS[preset]
    return OperationFailed(
        {
            "status": "DONE",
            "httpErrorStatusCode": error.status,
            "httpErrorMessage": "PRECONDITION FAILED",
            "error": {"errors": [{"code": error.code, "message": fill(error.message, **WHERE)}]},
        }
    )


def http_body(preset: str) -> bytes:
    error = INSTANCE_ERRORS[preset]
    message = fill(error.message, **WHERE)
    item = {"message": message, "domain": error.domain, "reason": error.reason}
    return json.dumps({"error": {"code": error.status, "message": message, "errors": [item]}}).encode()


def api_core_error(preset: str) -> gexc.GoogleAPICallError:
    """What google-cloud-compute raises: api_core's own parser of the HTTP response."""
    response = requests.Response()
    response.status_code = INSTANCE_ERRORS[preset].status
    response._content = http_body(preset)
    response.request = requests.Request("POST", "https://compute.googleapis.com/compute/v1/x").prepare()
    return gexc.from_http_response(response)


def discovery_error(preset: str) -> HttpError:
    return HttpError(httplib2.Response({"status": INSTANCE_ERRORS[preset].status}), http_body(preset))


@pytest.mark.parametrize("shape", [operation_failed, api_core_error, discovery_error])
@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_each_class_in_each_place(preset, shape):
    verdict = classify(shape(preset))
    assert verdict is not None
    assert (verdict.rule.cause, verdict.action) == EXPECTED[preset]
    # The verdict names the code (or reason) and the cloud's own message.
    assert fill(INSTANCE_ERRORS[preset].message, **WHERE) in str(verdict)


def test_the_provider_text_of_a_failed_operation_is_kept():
    assert str(operation_failed("quota_exceeded")) == (
        "403 PRECONDITION FAILED: {'code': 'QUOTA_EXCEEDED', 'message': \"Quota 'CPUS' exceeded.  Limit: 0.0 in "
        "region us-east5.\"}"
    )


@pytest.mark.parametrize(
    ("status", "reason", "action"),
    [
        (429, "rateLimitExceeded", Action.RETRY),
        (403, "rateLimitExceeded", Action.RETRY),  # Google's bulk-creation page: a 403 that passes
        (503, "backendError", Action.RETRY),
        (500, "backendError", Action.RETRY),
        (403, "forbidden", Action.FAIL),
        (400, "invalid", None),  # not in the table: the caller's retries take it
    ],
)
def test_passing_and_refusing_http_errors(status, reason, action):
    body = {"error": {"code": status, "message": "m", "errors": [{"message": "m", "domain": "global", "reason": reason}]}}
    verdict = classify(HttpError(httplib2.Response({"status": status}), json.dumps(body).encode()))
    assert (verdict and verdict.action) == action


def test_what_is_not_the_clouds_verdict_is_not_classified():
    assert classify(ValueError("bug")) is None
    assert classify(ConnectionResetError()) is None
    assert classify(OperationFailed({"status": "DONE", "error": {"errors": [{"code": "X", "message": "y"}]}})) is None


@pytest.mark.parametrize(
    ("limit", "cause", "waited_out"),
    [("64.0", "preemptible quota held by other VMs", True), ("8", "preemptible quota held by other VMs", True),
     ("0.0", "quota exceeded", False), ("0", "quota exceeded", False)],
)
def test_preemptible_quota_other_vms_hold_is_waited_out_by_a_run_without_a_reservation(limit, cause, waited_out):
    message = f"Quota 'PREEMPTIBLE_TPU_V6E' exceeded.  Limit: {limit} in region us-east5."
    verdict = classify(OperationFailed({"status": "DONE", "httpErrorStatusCode": 403,
                                        "error": {"errors": [{"code": "QUOTA_EXCEEDED", "message": message}]}}))
    assert verdict.rule.cause == cause
    assert waits_for_capacity(verdict, waits_out_stockouts=True) is waited_out
    assert waits_for_capacity(verdict, waits_out_stockouts=False) is False  # a reservation run: not its quota to wait for
    # Another quota with room is a person's to raise, not waited for.
    other = classify(OperationFailed({"error": {"errors": [{"code": "QUOTA_EXCEEDED", "message": message.replace("PREEMPTIBLE_TPU_V6E", "CPUS")}]}}))
    assert other.rule.cause == "quota exceeded"


def test_a_stockout_is_waited_out_only_without_a_reservation():
    verdict = classify(operation_failed("zone_resource_pool_exhausted"))
    assert waits_for_capacity(verdict, waits_out_stockouts=True) is True
    assert waits_for_capacity(verdict, waits_out_stockouts=False) is False
    assert waits_for_capacity(classify(operation_failed("reservation_full")), waits_out_stockouts=False) is True
    assert waits_for_capacity(None, waits_out_stockouts=True) is False
