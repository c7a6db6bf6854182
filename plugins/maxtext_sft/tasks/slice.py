"""The provider's instance template and instance group manager operators, on the endpoint-aware
hook, and the workload policy the provider has no operator for: what makes and unmakes a run's
multi-host TPU slice (run/slice_body.py has the requests).

Create, in order: the workload policy, the template, the group (behind the capacity gate: the
reservation must have a machine free for every host), then one deferred wait until every host
is RUNNING. Delete, in every outcome and in the reverse order (Compute Engine refuses to delete
a template or a policy a group still uses): the group with its hosts, the template, the policy.
Every create adopts what an earlier try of the same run made; every delete takes "already gone"
as success and confirms the resource is gone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from google.api_core.exceptions import NotFound

from airflow.providers.google.cloud.operators.compute import (
    ComputeEngineDeleteInstanceGroupManagerOperator,
    ComputeEngineDeleteInstanceTemplateOperator,
    ComputeEngineInsertInstanceGroupManagerOperator,
    ComputeEngineInsertInstanceTemplateOperator,
)
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from maxtext_sft.cloud.errors import Action, classify
from maxtext_sft.cloud.compute import ComputeEngineEndpointHook, endpoint_hook_for
from maxtext_sft.cloud.instances import insert_request_id, with_expiry_label
from maxtext_sft.cloud.capacity import CAPACITY_FIRST_READ_SECONDS, CAPACITY_POLL_SECONDS, ReservationCapacityTrigger
from maxtext_sft.cloud.slice_group import SliceHostsTrigger


def _request_id(context, key: str) -> str:
    """A request id per resource and try: the API answers a repeated one with the first outcome."""
    return insert_request_id(key, context["ti"].try_number)


def _refused(what: str, error: Exception) -> Exception:
    """A create the cloud refused: for a cause retrying cannot change (quota, permission, a bad
    request), a failure without retries naming it; else the error, for the task's retries."""
    verdict = classify(error)
    if verdict is None or verdict.action is Action.RETRY:
        return error
    return AirflowFailException(f"Compute Engine refused to create {what}: {verdict} (not retried)")


class CreateWorkloadPolicyOperator(BaseOperator):
    """resourcePolicies.insert of the slice's workload policy (HIGH_THROUGHPUT, its topology)."""

    template_fields: Sequence[str] = ("project_id", "region", "body")
    ui_color = "#e8eef8"

    def __init__(self, *, project_id: str, region: str, body: dict, gcp_conn_id: str, **kwargs):
        super().__init__(**kwargs)
        self.project_id = project_id
        self.region = region
        self.body = body
        self.gcp_conn_id = gcp_conn_id

    def execute(self, context) -> str:
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.gcp_conn_id)
        name, wanted = self.body["name"], self.body["workloadPolicy"]
        existing = hook.get_resource_policy(name=name, region=self.region, project_id=self.project_id)
        if existing is None:
            self.log.info("Creating workload policy %s: %s", name, wanted)
            try:
                hook.insert_resource_policy(
                    body=self.body, region=self.region, project_id=self.project_id,
                    request_id=_request_id(context, f"{self.project_id}/{self.region}/{name}"),
                )
            except Exception as error:
                raise _refused(f"workload policy {name}", error) from error
            existing = hook.get_resource_policy(name=name, region=self.region, project_id=self.project_id)
        elif existing.get("workloadPolicy") != wanted:
            raise AirflowFailException(
                f"Resource policy {name} exists with {existing.get('workloadPolicy')}, not {wanted}: not this run's"
            )
        else:
            self.log.info("Workload policy %s was made by an earlier try", name)
        return existing["selfLink"]


class CreateInstanceTemplateOperator(ComputeEngineInsertInstanceTemplateOperator):
    """The provider's template insert on the endpoint-aware hook; the hosts' expiry label counts
    from now (the janitor deletes a group whose hosts outlived it)."""

    template_fields: Sequence[str] = (*ComputeEngineInsertInstanceTemplateOperator.template_fields, "lifetime_minutes")
    operator_extra_links = ()  # the provider's link reads an XCom its execute writes, not this one

    def __init__(self, *, lifetime_minutes=None, **kwargs):
        # The provider's field validation spec for templates (GCE_INSTANCE_TEMPLATE_VALIDATION_
        # PATCH_SPECIFICATION) refuses any properties.tags ("Nested fields are specified in field
        # 'properties.tags' of type 'None'"): off; the API validates the body.
        kwargs.setdefault("validate_body", False)
        super().__init__(**kwargs)
        self.lifetime_minutes = lifetime_minutes

    def execute(self, context) -> str:
        if self.lifetime_minutes:
            self.body = {**self.body, "properties": with_expiry_label(self.body["properties"], int(self.lifetime_minutes))}
        self.resource_id = self.body["name"]
        self._validate_inputs()
        self._validate_all_body_fields()
        self.check_body_fields()
        hook = endpoint_hook_for(self)
        try:
            existing = hook.get_instance_template(resource_id=self.resource_id, project_id=self.project_id)
            self.log.info("Instance template %s was made by an earlier try", self.resource_id)
        except NotFound:
            self.log.info("Creating instance template %s", self.resource_id)
            try:
                hook.insert_instance_template(
                    body=self.body, project_id=self.project_id,
                    request_id=_request_id(context, f"{self.project_id}/{self.resource_id}"),
                )
            except Exception as error:
                raise _refused(f"instance template {self.resource_id}", error) from error
            existing = hook.get_instance_template(resource_id=self.resource_id, project_id=self.project_id)
        return existing.self_link


class CreateSliceOperator(ComputeEngineInsertInstanceGroupManagerOperator):
    """Create the slice's managed instance group (`hosts` VMs from the template, under the
    workload policy) once the reservation has a machine free for every host, then wait, deferred
    (no worker slot), until every host is RUNNING. Returns the hosts in worker order:
    [{"name", "ip", "id"}, ...] (what every step on the hosts reads).

    Capacity is waited for before the group exists (deferred, as CreateVmOperator does, up to
    `max_capacity_wait_minutes`), never after: once the group is made its hosts are paid for,
    so a host the cloud cannot create fails the task at once, naming the cloud's error (the
    teardown deletes the group and whatever hosts it made). The wait for RUNNING hosts is
    bounded by `ready_timeout_seconds`.
    """

    template_fields: Sequence[str] = (
        *ComputeEngineInsertInstanceGroupManagerOperator.template_fields,
        "hosts",
        "reservation",
        "max_capacity_wait_minutes",
        "ready_timeout_seconds",
    )
    operator_extra_links = ()  # as CreateInstanceTemplateOperator's

    def __init__(
        self,
        *,
        hosts,
        reservation,
        max_capacity_wait_minutes,
        ready_timeout_seconds,
        poll_seconds: float = 5,
        capacity_poll_seconds: float = CAPACITY_POLL_SECONDS,
        capacity_first_read_seconds: float = CAPACITY_FIRST_READ_SECONDS,
        **kwargs,
    ):
        # The provider validates a group's body against its template spec (see
        # CreateInstanceTemplateOperator): off; the API validates the body.
        kwargs.setdefault("validate_body", False)
        super().__init__(**kwargs)
        self.hosts = hosts
        self.reservation = reservation
        self.max_capacity_wait_minutes = max_capacity_wait_minutes
        self.ready_timeout_seconds = ready_timeout_seconds
        self.poll_seconds = poll_seconds
        self.capacity_poll_seconds = capacity_poll_seconds
        self.capacity_first_read_seconds = capacity_first_read_seconds

    def execute(self, context):
        return self._create(context, deadline=None)

    def resume_after_capacity_wait(self, context, event: dict):
        if event["status"] == "timeout":
            raise AirflowFailException(
                f"Gave up waiting for {self.hosts} free machines in reservation {self.reservation} "
                f"(count {event['count']}, {event['in_use']} in use; max_capacity_wait_minutes="
                f"{self.max_capacity_wait_minutes}): no slice was created"
            )
        if event["status"] != "free":
            raise AirflowException(f"Waiting for capacity in reservation {self.reservation} failed: {event['message']}")
        return self._create(context, deadline=event["deadline"])

    def _create(self, context, *, deadline: float | None):
        self.resource_id = self.body["name"]
        self._validate_inputs()
        self._validate_all_body_fields()
        self.check_body_fields()
        hook = endpoint_hook_for(self)
        hosts = int(self.hosts)
        try:
            hook.get_instance_group_manager(resource_id=self.resource_id, project_id=self.project_id, zone=self.zone)
            self.log.info("Instance group %s was made by an earlier try; waiting for its hosts", self.resource_id)
        except NotFound:
            count, in_use = hook.reservation_capacity(
                name=self.reservation, zone=self.zone, project_id=self.project_id
            ) or (None, None)
            if count is None:
                raise AirflowFailException(
                    f"Reservation {self.reservation} does not exist in {self.project_id}/{self.zone}: no slice was created"
                )
            if count < hosts:
                raise AirflowFailException(
                    f"Reservation {self.reservation} holds {count} machines; the slice needs {hosts}: no slice was created"
                )
            if count - in_use < hosts:
                self._wait_for_capacity(deadline, count - in_use, count)
            self.log.info("Creating instance group %s: %d hosts", self.resource_id, hosts)
            try:
                hook.insert_instance_group_manager(
                    body=self.body, project_id=self.project_id, zone=self.zone,
                    request_id=_request_id(context, f"{self.project_id}/{self.zone}/{self.resource_id}"),
                )
            except Exception as error:
                raise _refused(f"instance group {self.resource_id}", error) from error
        self.defer(
            trigger=SliceHostsTrigger(
                project_id=self.project_id,
                zone=self.zone,
                group=self.resource_id,
                hosts=hosts,
                deadline=time.time() + float(self.ready_timeout_seconds),
                gcp_conn_id=self.gcp_conn_id,
                poll_interval=self.poll_seconds,
                impersonation_chain=self.impersonation_chain,
            ),
            method_name="resume_when_hosts_run",
        )

    def _wait_for_capacity(self, deadline: float | None, free: int, count: int) -> None:
        if deadline is None:
            deadline = time.time() + float(self.max_capacity_wait_minutes) * 60
        if time.time() >= deadline:
            raise AirflowFailException(
                f"Gave up waiting for {self.hosts} free machines in reservation {self.reservation} "
                f"({free} of {count} free; max_capacity_wait_minutes={self.max_capacity_wait_minutes}): "
                "no slice was created"
            )
        self.log.info(
            "Reservation %s: %d of %d machines free, the slice needs %s; waiting (deferred, no worker slot)",
            self.reservation, free, count, self.hosts,
        )
        self.defer(
            trigger=ReservationCapacityTrigger.for_operator(self, deadline, needed=int(self.hosts)),
            method_name="resume_after_capacity_wait",
        )

    def resume_when_hosts_run(self, context, event: dict) -> list[dict]:
        if event["status"] == "ready":
            self.log.info("Every host of %s is RUNNING: %s", self.body["name"], event["hosts"])
            return event["hosts"]
        if event["status"] == "timeout":
            raise AirflowFailException(
                f"The slice's hosts were not all RUNNING after {self.ready_timeout_seconds} s: {event['message']}"
            )
        raise AirflowFailException(f"The slice could not be made: {event['message']}")


class DeleteSliceOperator(ComputeEngineDeleteInstanceGroupManagerOperator):
    """Delete the group, and with it every host (the delete's operation ends when they are gone);
    a group that is already gone is success."""

    def execute(self, context) -> None:
        self._validate_inputs()
        hook = endpoint_hook_for(self)
        where = {"resource_id": self.resource_id, "project_id": self.project_id, "zone": self.zone}
        try:
            hook.get_instance_group_manager(**where)
        except NotFound:
            self.log.info("Instance group %s does not exist (never created or already deleted)", self.resource_id)
            return
        self.log.info("Deleting instance group %s and its hosts", self.resource_id)
        try:
            hook.delete_instance_group_manager(**where, request_id=self.request_id)
        except NotFound:
            return
        try:
            hook.get_instance_group_manager(**where)
        except NotFound:
            self.log.info("Instance group %s and its hosts are deleted", self.resource_id)
            return
        raise AirflowException(f"Instance group {self.resource_id} still exists after its delete operation finished")


class DeleteInstanceTemplateOperator(ComputeEngineDeleteInstanceTemplateOperator):
    """Delete the template; one that is already gone is success."""

    def execute(self, context) -> None:
        self._validate_inputs()
        hook = endpoint_hook_for(self)
        try:
            hook.delete_instance_template(resource_id=self.resource_id, project_id=self.project_id)
        except NotFound:
            self.log.info("Instance template %s does not exist (never created or already deleted)", self.resource_id)
            return
        self.log.info("Instance template %s is deleted", self.resource_id)


class DeleteWorkloadPolicyOperator(BaseOperator):
    """Delete the workload policy; one that is already gone is success."""

    template_fields: Sequence[str] = ("project_id", "region", "name")

    def __init__(self, *, project_id: str, region: str, name: str, gcp_conn_id: str, **kwargs):
        super().__init__(**kwargs)
        self.project_id = project_id
        self.region = region
        self.name = name
        self.gcp_conn_id = gcp_conn_id

    def execute(self, context) -> None:
        hook = ComputeEngineEndpointHook(gcp_conn_id=self.gcp_conn_id)
        if hook.delete_resource_policy(name=self.name, region=self.region, project_id=self.project_id):
            self.log.info("Workload policy %s is deleted", self.name)
        else:
            self.log.info("Workload policy %s does not exist (never created or already deleted)", self.name)
