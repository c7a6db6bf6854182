"""The provider's Compute Engine insert and delete operators, on the endpoint-aware hook.

Each `execute` keeps the provider's flow; what changes is the hook (so the connection can name a
private API endpoint) and, for delete, the outcome the teardown needs: an instance that is
already gone is success, and success means it is really gone.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from google.api_core.exceptions import NotFound
from google.cloud.compute_v1.types import Instance

from airflow.providers.google.cloud.operators.compute import (
    ComputeEngineDeleteInstanceOperator,
    ComputeEngineInsertInstanceOperator,
)
from airflow.sdk.exceptions import AirflowException
from maxtext_sft.hooks.compute import ComputeEngineEndpointHook
from maxtext_sft.janitor import EXPIRY_LABEL  # the epoch second after which the VM has outlived its lifetime


def _hook(operator) -> ComputeEngineEndpointHook:
    return ComputeEngineEndpointHook(
        gcp_conn_id=operator.gcp_conn_id,
        api_version=operator.api_version,
        impersonation_chain=operator.impersonation_chain,
    )


def with_expiry_label(body: dict, lifetime_minutes: int) -> dict:
    """The insert body, labelled with when this VM should be gone: the janitor deletes it after
    that, Airflow or not."""
    expires = int(time.time()) + lifetime_minutes * 60
    return {**body, "labels": {**body.get("labels", {}), EXPIRY_LABEL: str(expires)}}


# States of an instance that is, or is becoming, the running VM a retry can adopt.
LIVE_STATUSES = frozenset({"PROVISIONING", "STAGING", "RUNNING"})


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


class CreateVmOperator(ComputeEngineInsertInstanceOperator):
    """Create the instance unless it exists: a retry adopts the VM this run already asked for.

    An instance left by a create that failed after the API accepted it (TERMINATED, say) is not
    adopted: it is deleted and created again. The insert's request id is made per try: the API
    answers a repeated request id with the first request's operation, failed ones included.
    """

    template_fields: Sequence[str] = (*ComputeEngineInsertInstanceOperator.template_fields, "lifetime_minutes")

    def __init__(self, *, lifetime_minutes=None, **kwargs):
        super().__init__(**kwargs)
        self.lifetime_minutes = lifetime_minutes

    def execute(self, context) -> dict:
        if self.lifetime_minutes:
            self.body = with_expiry_label(self.body, int(self.lifetime_minutes))
        if "name" in self.body:
            self.resource_id = self.body["name"]
        if self.request_id:
            self.request_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{self.request_id}/{context['ti'].try_number}"))
        self._validate_inputs()
        self._validate_all_body_fields()
        self.check_body_fields()
        hook = _hook(self)
        where = {"resource_id": self.resource_id, "project_id": self.project_id, "zone": self.zone}
        existing = adoptable_instance(hook, where, self.log)
        if existing is not None:
            return Instance.to_dict(existing)
        return self._create_instance(hook, context)


class DeleteVmOperator(ComputeEngineDeleteInstanceOperator):
    """Delete the instance and confirm it is gone; an instance that is already gone is success."""

    def execute(self, context) -> None:
        self._validate_inputs()
        hook = _hook(self)
        try:
            hook.get_instance(resource_id=self.resource_id, project_id=self.project_id, zone=self.zone)
            self.log.info("Deleting instance %s", self.resource_id)
            hook.delete_instance(
                resource_id=self.resource_id,
                project_id=self.project_id,
                request_id=self.request_id,
                zone=self.zone,
            )
        except NotFound:
            self.log.info("Instance %s does not exist (never created or already deleted)", self.resource_id)
            return
        try:
            hook.get_instance(resource_id=self.resource_id, project_id=self.project_id, zone=self.zone)
        except NotFound:
            self.log.info("Instance %s is deleted", self.resource_id)
            return
        raise AirflowException(f"Instance {self.resource_id} still exists after its delete operation finished")
