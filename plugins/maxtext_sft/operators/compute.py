"""The provider's Compute Engine insert and delete operators, on the endpoint-aware hook.

Each `execute` keeps the provider's flow; what changes is the hook (so the connection can name a
private API endpoint) and, for delete, the outcome the teardown needs: an instance that is
already gone is success, and success means it is really gone.
"""

from __future__ import annotations

from google.api_core.exceptions import NotFound
from google.cloud.compute_v1.types import Instance

from airflow.providers.google.cloud.operators.compute import (
    ComputeEngineDeleteInstanceOperator,
    ComputeEngineInsertInstanceOperator,
)
from airflow.sdk.exceptions import AirflowException
from maxtext_sft.hooks.compute import ComputeEngineEndpointHook


def _hook(operator) -> ComputeEngineEndpointHook:
    return ComputeEngineEndpointHook(
        gcp_conn_id=operator.gcp_conn_id,
        api_version=operator.api_version,
        impersonation_chain=operator.impersonation_chain,
    )


class CreateVmOperator(ComputeEngineInsertInstanceOperator):
    """Create the instance unless it exists: a retry adopts the VM this run already asked for."""

    def execute(self, context) -> dict:
        if "name" in self.body:
            self.resource_id = self.body["name"]
        self._validate_inputs()
        self._validate_all_body_fields()
        self.check_body_fields()
        hook = _hook(self)
        try:
            existing = hook.get_instance(resource_id=self.resource_id, project_id=self.project_id, zone=self.zone)
        except NotFound:
            return self._create_instance(hook, context)
        self.log.info("Instance %s already exists (an earlier try created it); adopting it", self.resource_id)
        return Instance.to_dict(existing)


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
