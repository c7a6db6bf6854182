"""What the create and the recovery of a run's VM both decide about its instance: the label that
says when it should be gone, and which instance already holding its name to adopt.

Below the operators and the training sensor, which both create the VM (CreateVmOperator, then
VmRecovery after a loss); the janitor reads the same label.
"""

from __future__ import annotations

import time
import uuid

from google.api_core.exceptions import NotFound
from google.cloud.compute_v1.types import Instance

from maxtext_sft.cloud.compute import ComputeEngineEndpointHook

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
