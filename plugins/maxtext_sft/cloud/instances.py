"""What the create and the recovery of a run's VM both decide about its instance: the label that
says when it should be gone, which instance already holding its name to adopt, and the insert that
does without a field the cloud refused (UNSOURCED_FIELDS).

Below the operators and the training sensor, which both create the VM (CreateVmOperator, then
VmRecovery after a loss); the janitor reads the same label.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from google.api_core.exceptions import NotFound
from google.cloud.compute_v1.types import Instance

from maxtext_sft.cloud.compute import ComputeEngineEndpointHook
from maxtext_sft.cloud.errors import cloud_errors

# Label: the epoch second after which the VM has outlived its lifetime (the janitor deletes it).
EXPIRY_LABEL = "expires-at"
# States of an instance that is, or is becoming, the running VM a retry can adopt.
LIVE_STATUSES = frozenset({"PROVISIONING", "STAGING", "RUNNING"})


def with_expiry_label(body: dict, lifetime_minutes: int) -> dict:
    """The insert body, labelled with when this VM should be gone: the janitor deletes it after
    that, Airflow or not."""
    expires = int(time.time()) + lifetime_minutes * 60
    return {**body, "labels": {**body.get("labels", {}), EXPIRY_LABEL: str(expires)}}


def insert_request_id(base: str, try_number: int, key: str = "") -> str:
    """A request id per resource, try and (`key`) insert: the API answers a request id it has seen
    with that request's outcome, a refusal included."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{base}/{try_number}{key}"))


def adoptable_instance(hook: ComputeEngineEndpointHook, where: dict, log) -> Instance | None:
    """The live instance named in `where` that a create can adopt, or None if one must be created.

    An instance left by a create that failed after the API accepted it (TERMINATED, say) holds
    the name: it is deleted first.
    """
    try:
        existing = hook.get_instance(**where)
    except NotFound:
        return None
    if existing.status in LIVE_STATUSES:
        log.info("Instance %s already exists (%s): adopting it", where["resource_id"], existing.status)
        return existing
    log.warning(
        "Instance %s exists in state %s, left by a failed create: deleting it to create it again",
        where["resource_id"],
        existing.status,
    )
    hook.delete_instance(request_id=None, **where)
    return None


@dataclasses.dataclass(frozen=True)
class UnsourcedField:
    """A field the pipeline's insert body adds to the tutorial's gcloud request for which no public
    source says Compute Engine accepts it with `provisioning_models` (docs/request-fields.md)."""

    path: tuple[str, ...]  # in the body (google-cloud-compute's field names)
    api_name: str  # the REST field, as the API's refusal names it under 'resource.'
    provisioning_models: frozenset[str]
    what_it_does: str  # for the log and the run summary

    def refused_by(self, error: BaseException) -> bool:
        """Whether `error` is the API refusing this field: a 400 `Invalid value for field
        'resource.FIELD'` (an instance's; 'resource.properties.FIELD' a template's), synchronously
        or on the insert's operation (no code is known for the latter: the message decides)."""
        named = re.compile(r"Invalid value for field 'resource\.(?:properties\.)?" + re.escape(self.api_name) + "'")
        return any(
            item.http_status in (400, None) and named.search(item.message) for item in cloud_errors(error)
        )

    def carried_by(self, body: dict) -> bool:
        scheduling = body.get("scheduling") or {}
        return scheduling.get("provisioning_model") in self.provisioning_models and _at(body, self.path) is not None

    def without(self, body: dict) -> dict:
        """The body without the field (a copy). Only the field: a reservation-bound or Spot VM keeps
        its DELETE termination action, which gcloud sends for both without a time limit."""
        stripped = copy.deepcopy(body)
        parent = _at(stripped, self.path[:-1])
        parent.pop(self.path[-1], None)
        return stripped


# maxRunDuration (the cloud-enforced lifetime) on a reservation-bound VM: the tutorial's gcloud request
# has none, and neither Google's "Limit the run time of a VM" page, "About reservation-bound VMs",
# gcloud 528's flag help (which checks nothing of it) nor the v1 discovery document's
# Scheduling.maxRunDuration says the two go together. The API refuses a time limit per provisioning
# model ("max-run-duration for given provisioning model is not supported ...", a public Cloud Batch
# runbook quoting a real 400 for FLEX_START): if it refuses this one, the VM is made without it and
# its other bounds stay (the autostop watchdog, the janitor's expiry label, the teardown). A Spot
# VM's is no better sourced (public projects send it; no Google page names SPOT with it), and a
# Spot VM takes its DELETE action without one (tests/fixtures/gcloud-capacity-requests.json), so
# it falls back the same way. Not STANDARD (the "Limit the run time" page's own case; its action
# would have to go too) nor FLEX_START (which requires it).
CLOUD_LIFETIME = UnsourcedField(
    path=("scheduling", "max_run_duration"),
    api_name="scheduling.maxRunDuration",
    provisioning_models=frozenset({"RESERVATION_BOUND", "SPOT"}),
    what_it_does="cloud-enforced lifetime",
)
UNSOURCED_FIELDS: tuple[UnsourcedField, ...] = (CLOUD_LIFETIME,)

Result = TypeVar("Result")


def insert_with_fallback(
    insert: Callable[[dict, str | None], Result], body: dict, request_id: str | None, log, *, before_again=None
) -> tuple[Result, list[UnsourcedField]]:
    """`insert(body, request_id)`; when Compute Engine refuses it naming a field of UNSOURCED_FIELDS
    that the body carries with its provisioning model, once more without that field (a request id
    of its own: the API answers a seen one with its first outcome). `before_again()` runs before
    the second insert (an operation's refusal may have left an instance). Returns the result and
    the fields dropped; any other error, or a second refusal, is raised as it came."""
    try:
        return insert(body, request_id), []
    except Exception as error:
        refused = [field for field in UNSOURCED_FIELDS if field.carried_by(body) and field.refused_by(error)]
        if not refused:
            raise
        for field in refused:
            body = field.without(body)
        names = ", ".join(field.api_name for field in refused)
        log.warning(
            "Compute Engine refused %s with provisioning model %s (%s): inserting once more without it, so the VM "
            "has no %s; its other bounds stay (the VM's autostop, the janitor's expiry label, the teardown)",
            names, body["scheduling"].get("provisioning_model"), error, " nor ".join(f.what_it_does for f in refused),
        )
        if before_again is not None:
            before_again()
        again = request_id and str(uuid.uuid5(uuid.NAMESPACE_URL, f"{request_id}/without/{names}"))
        return insert(body, again), refused


def _at(body: dict, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(body, dict):
            return None
        body = body.get(part)
    return body
